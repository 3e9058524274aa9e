"""Loading DeepSpeed's checkpoint files without DeepSpeed and without running their code.

DeepSpeed writes its ZeRO-3 rank files with `torch.save`; besides tensors and plain
containers they hold three DeepSpeed objects (`ZeroStageEnum`, `LossScaler`,
`DynamicLossScaler`). Those are read here with `torch.load(weights_only=True)` and an
explicit allowlist that maps each DeepSpeed name to an *inert stand-in* defined below:
a class with data and no behaviour, so the file can only ever produce numbers, strings,
tensors and these records. Any other global in a file (a DeepSpeed class not listed, a
foreign pickle's `os.system`, ...) is refused before anything is unpickled, with an error
naming it.

The allowlist is installed with `torch.serialization.safe_globals` for the duration of
one `torch.load` only (nothing outlives the call; while it runs, a `torch.load` on
another thread of the same process would see it too). DeepSpeed is never imported.

Tensors are memory-mapped (`mmap=True`): reading every rank's file costs address space,
not memory, and only the slices a caller touches are read from disk.
"""

from __future__ import annotations

import enum
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch


class DeepSpeedCheckpointError(ValueError):
    """A DeepSpeed checkpoint folder zero3 cannot read: damaged, foreign or unsupported."""


class SavedZeroStage(enum.IntEnum):
    """Stand-in for deepspeed.runtime.zero.config.ZeroStageEnum (rebuilt from its value)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class SavedLossScaler:
    """Stand-in for DeepSpeed's static LossScaler: only its attributes (cur_scale, dynamic)."""

    cur_scale: float = 1.0
    dynamic: bool = False


class SavedDynamicLossScaler(SavedLossScaler):
    """Stand-in for DeepSpeed's DynamicLossScaler: only its attributes (cur_scale, cur_iter,
    last_overflow_iter, scale_factor, scale_window, min_scale, delayed_shift,
    cur_hysteresis, consecutive_hysteresis, raise_error_at_min_scale, dtype)."""

    dynamic: bool = True


STAND_INS: dict[str, type] = {
    "deepspeed.runtime.zero.config.ZeroStageEnum": SavedZeroStage,
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": SavedLossScaler,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": SavedDynamicLossScaler,
}


def _foreign_globals(path: Path) -> list[str]:
    """Globals in the file that neither torch's weights_only loader nor STAND_INS allow."""
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except (zipfile.BadZipFile, RuntimeError, EOFError, pickle.UnpicklingError, ValueError) as exc:
        raise DeepSpeedCheckpointError(
            f"{path}: unreadable ({type(exc).__name__}: {_first_line(exc)}); the file is truncated or "
            "is not a torch.save file. Copy it again from where the run saved it"
        ) from exc
    return sorted(name for name in unsafe if name not in STAND_INS)


def load_deepspeed_file(path: Path) -> Any:
    """The contents of one DeepSpeed checkpoint file, DeepSpeed objects as stand-ins.

    Raises DeepSpeedCheckpointError naming the file and what was wrong: unreadable
    (truncated, not a torch.save zip), or holding a global outside the allowlist."""
    path = Path(path)
    foreign = _foreign_globals(path)
    if foreign:
        raise DeepSpeedCheckpointError(
            f"{path}: refused: it holds {', '.join(foreign)}, which a DeepSpeed 0.19 ZeRO-3 checkpoint "
            f"does not; zero3 loads only tensors, plain values and {', '.join(sorted(STAND_INS))} "
            "(as inert records), never code"
        )
    allow = [(stand_in, name) for name, stand_in in STAND_INS.items()]
    try:
        with torch.serialization.safe_globals(allow):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - every failure is named and re-raised
        raise DeepSpeedCheckpointError(
            f"{path}: refused to load ({type(exc).__name__}: {_first_line(exc)}); only tensors, plain "
            "values and DeepSpeed's loss scaler and stage records are read (weights_only=True)"
        ) from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return re.sub(r"\s+", " ", line)[:300]
