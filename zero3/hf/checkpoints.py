"""zero3's training state inside the Trainer's `checkpoint-N/` folders.

A Trainer checkpoint made with zero3 holds the Trainer's own files (trainer_state.json,
rng_state_*.pth, scheduler.pt, training_args.bin, the adapter or model files of
save_model) and the engine's checkpoint (`latest`, `global_stepN/` with its manifest),
the same layout DeepSpeed gives that folder. So `resume_from_checkpoint` reads either
kind: `Engine.load_checkpoint` recognizes a DeepSpeed ZeRO-3 folder as well as its own.

A PEFT model's frozen base weights are left out of the engine's checkpoint (as the
Trainer does with DeepSpeed); on load the model's own frozen weights stay.

With the config's checkpoint.async_save the engine's checkpoint of `checkpoint-N/` is still
being written when the Trainer goes on (the Trainer's own small files are written at
once). So `save_total_limit` is applied here (`rotate_checkpoints`), never deleting the
folder whose save is in flight nor the newest folder whose engine checkpoint is committed,
and the end of training waits for the last save (trainer.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers.trainer_utils import sort_checkpoints

if TYPE_CHECKING:
    from zero3.engine import Engine

logger = logging.getLogger("zero3")
SCHEDULER_FILE = "scheduler.pt"  # the Trainer's name for it


def save_training_state(engine: "Engine", folder: str, exclude_frozen: bool, writes_files: bool) -> None:
    """The engine's checkpoint in `folder` (a collective), and the Trainer's scheduler.pt
    (written by the rank that `writes_files`)."""
    engine.save_checkpoint(folder, exclude_frozen_parameters=exclude_frozen)
    if writes_files and isinstance(engine.lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns that the optimizer state is saved separately
            torch.save(engine.lr_scheduler.state_dict(), os.path.join(folder, SCHEDULER_FILE))


def load_training_state(engine: "Engine", folder: str, frozen_may_be_missing: bool) -> None:
    """Parameters, optimizer, scheduler, counters and RNG from `folder`'s engine checkpoint
    (zero3's or DeepSpeed's); then the Trainer's scheduler.pt where the scheduler is a torch
    one the checkpoint may not hold (a DeepSpeed run whose scheduler the Trainer made)."""
    if not os.path.isfile(os.path.join(folder, "latest")):
        committed = newest_committed(Path(folder).parent)
        hint = f"; the newest folder beside it with a committed one is {committed}" if committed else ""
        raise FileNotFoundError(
            f"{folder} holds no engine checkpoint (no 'latest' file): it was saved with save_only_model=True, "
            f"by a run without zero3 or DeepSpeed, or its save was interrupted{hint}; its contents: "
            f"{sorted(os.listdir(folder))[:12]}")
    engine.load_checkpoint(folder, load_module_strict=not frozen_may_be_missing)
    scheduler_file = os.path.join(folder, SCHEDULER_FILE)
    if os.path.isfile(scheduler_file) and isinstance(engine.lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
        engine.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))


def load_model_weights(engine: "Engine", folder: str, frozen_may_be_missing: bool) -> None:
    """The model's weights only (load_best_model_at_end), from `folder`'s engine checkpoint."""
    engine.load_checkpoint(folder, load_module_strict=not frozen_may_be_missing, load_optimizer_states=False,
                           load_lr_scheduler_states=False, load_module_only=True)


def gathered_16bit_state_dict(engine: "Engine", trainable_only: bool) -> dict[str, Any] | None:
    """The model's weights in the compute dtype on rank 0 (None elsewhere); a collective."""
    return engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=trainable_only)


def is_committed(folder: Path) -> bool:
    """Whether the Trainer folder `folder` holds a committed engine checkpoint (`latest`
    names a tag with a manifest: an asynchronous save writes `latest` after its commit)."""
    latest = folder / "latest"
    if not latest.is_file():
        return False
    tag = latest.read_text().strip()
    return bool(tag) and "/" not in tag and (folder / tag / "manifest.json").is_file()


def newest_committed(run_dir: Path) -> Path | None:
    """The newest `checkpoint-N` folder of `run_dir` with a committed engine checkpoint."""
    committed = [Path(p) for p in sort_checkpoints(str(run_dir)) if is_committed(Path(p))]
    return committed[-1] if committed else None


def rotate_checkpoints(run_dir: str, save_total_limit: int | None, best: str | None, writing: str | None) -> None:
    """The Trainer's save_total_limit (oldest folders deleted first), keeping the newest
    folder, `best`, the folder holding the save in flight (`writing`: its engine checkpoint's
    tag folder) and the newest folder whose engine checkpoint is committed."""
    if save_total_limit is None or save_total_limit <= 0:
        return
    folders = sort_checkpoints(run_dir, use_mtime=True)
    if len(folders) <= save_total_limit:
        return
    protected = {folders[-1]}
    committed = newest_committed(Path(run_dir))
    for kept in (best, None if writing is None else str(Path(writing).parent), committed):
        if kept is not None:
            protected.add(str(Path(kept)))
    remaining = len(folders)
    for folder in folders:
        if remaining <= max(save_total_limit, len(protected)):
            break
        if folder not in protected:
            shutil.rmtree(folder, ignore_errors=True)
            remaining -= 1
