"""A Hugging Face Trainer `checkpoint-N` folder exported for the Trainer with `deepspeed=`.

A Trainer checkpoint (zero3.hf's or DeepSpeed's) is one folder: the engine's checkpoint
(`latest`, `global_stepN/`) beside the Trainer's own files. Resuming it with
`TrainingArguments(deepspeed=...)`, transformers 5 reads, besides DeepSpeed's files:

- `trainer_state.json`: the step, epoch and log history to continue from (required; the
  resume fails without it);
- `scheduler.pt`: the Trainer's scheduler when the DeepSpeed config has no `scheduler`
  section (required then: the Trainer loads it unconditionally);
- `rng_state_{process}.pth` (`rng_state.pth` on one process): the RNG of each process
  (optional: a process without its file keeps its own RNG, and the Trainer says so);
- `scaler.pt` when present.

The adapter or model files of `save_model`, `training_args.bin`, the tokenizer and the
model card are not read by the resume but are the checkpoint's weights and record for
anyone else. So the export carries every entry of the folder as it is, except the
engine's checkpoint (`latest`, the tag folders, hidden staging folders), which the
exporter writes in DeepSpeed's layout. Nothing here reads a file's contents.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from zero3.checkpoint import format as ckpt
from zero3.checkpoint.errors import CheckpointError
from zero3.checkpoint.files import fsync_dir

TRAINER_STATE = "trainer_state.json"
DEEPSPEED_STATE_SUFFIXES = ("model_states.pt", "optim_states.pt")


def is_trainer_checkpoint(folder: Path) -> bool:
    """`folder` is a Trainer `checkpoint-N` (it holds trainer_state.json)."""
    return (Path(folder) / TRAINER_STATE).is_file()


def _is_engine_entry(path: Path) -> bool:
    """The engine's checkpoint inside a Trainer folder: `latest`, hidden staging folders,
    and tag folders (zero3's or DeepSpeed's files)."""
    if path.name == ckpt.LATEST or path.name.startswith("."):
        return True
    if not path.is_dir() or path.is_symlink():
        return False
    return ckpt.looks_like_checkpoint(path) or any(p.name.endswith(DEEPSPEED_STATE_SUFFIXES) for p in path.iterdir())


def trainer_entries(src: Path) -> list[Path]:
    """The Trainer's entries of folder `src` (files and folders), sorted by name."""
    return [p for p in sorted(Path(src).iterdir()) if not _is_engine_entry(p)]


def refuse_existing(entries: list[Path], dst: Path) -> None:
    """CheckpointError when `dst` already holds one of the names to copy (nothing is overwritten)."""
    present = [p.name for p in entries if os.path.lexists(Path(dst) / p.name)]
    if present:
        raise CheckpointError(
            f"{dst} already holds the Trainer files {present}; export into a new checkpoint folder "
            "(nothing was written)")


def copy_entries(entries: list[Path], dst: Path) -> list[str]:
    """Copy `entries` into `dst`, each through a temporary name and a rename; returns the
    names copied. On failure the ones already copied are removed and the error is raised."""
    copied: list[str] = []
    try:
        for path in entries:
            target = Path(dst) / path.name
            tmp = target.with_name(target.name + ".tmp")
            if path.is_dir() and not path.is_symlink():
                shutil.copytree(path, tmp, symlinks=True)
            else:
                shutil.copy2(path, tmp, follow_symlinks=False)
            os.replace(tmp, target)
            copied.append(path.name)
    except BaseException:
        for name in copied + [p.name + ".tmp" for p in entries]:
            target = Path(dst) / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target, ignore_errors=True)
            elif os.path.lexists(target):
                target.unlink()
        raise
    fsync_dir(Path(dst))
    return copied


def rng_note(entries: list[Path], world_size: int) -> str | None:
    """What the DeepSpeed Trainer's processes will find of their RNG files, when not all
    of them find theirs (the export is for another world size than the run's)."""
    names = {p.name for p in entries}
    wanted = {"rng_state.pth"} if world_size == 1 else {f"rng_state_{r}.pth" for r in range(world_size)}
    missing = sorted(wanted - names)
    if not missing or not any(n.startswith("rng_state") for n in names):
        return None
    return (f"no {', '.join(missing)}: the run was saved on another number of processes, so those processes "
            "start from their own RNG state (the Trainer logs it); everything else resumes as saved")
