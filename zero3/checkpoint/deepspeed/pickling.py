"""Writing DeepSpeed's three checkpoint objects without DeepSpeed: `torch.save` whose pickle
names the stand-ins of unpickle.py by DeepSpeed's own class paths.

DeepSpeed's loader unpickles its optimizer files with its classes importable, and uses
what it gets: the loss scaler object becomes the engine's loss scaler, so it must be
DeepSpeed's class with exactly the attributes DeepSpeed's `__init__` sets. A stand-in
instance is pickled as any object is (class, then its `__dict__`), only the class
reference is written as `deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler` etc.
Nothing is imported; every other object pickles as usual.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from zero3.checkpoint.deepspeed.unpickle import (
    STAND_INS,
    SavedDynamicLossScaler,
    SavedLossScaler,
    SavedZeroStage,
)

_DEEPSPEED_NAME = {stand_in: name.rpartition(".") for name, stand_in in STAND_INS.items()}


class _DeepSpeedNamesPickler(pickle._Pickler):  # the Python pickler: its save_global can be extended
    """Writes a stand-in class as a reference to the DeepSpeed class it stands for."""

    def save_global(self, obj: Any, name: str | None = None) -> None:
        target = _DEEPSPEED_NAME.get(obj)
        if target is None:
            super().save_global(obj, name)
            return
        module, _, qualname = target
        self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
        self.memoize(obj)


class _PickleModule:
    """What `torch.save(pickle_module=...)` needs: a Pickler (torch subclasses it)."""

    Pickler = _DeepSpeedNamesPickler
    __name__ = "zero3_deepspeed_pickle"


def save_with_deepspeed_names(value: Any, path: Path) -> None:
    """torch.save(value, path) with stand-ins written as DeepSpeed's classes."""
    torch.save(value, path, pickle_module=_PickleModule)


def zero_stage_3() -> SavedZeroStage:
    return SavedZeroStage.weights


def loss_scaler_object(state: dict[str, Any] | None, dtype: torch.dtype) -> SavedLossScaler:
    """DeepSpeed's loss scaler for zero3's LossScaler state (optim/loss_scaler.py): the
    attributes DeepSpeed 0.19's LossScaler / DynamicLossScaler set, nothing else. bf16 and
    fp32 runs (no state) get the static scaler of scale 1, as DeepSpeed gives them."""
    if state is None or not state.get("dynamic"):
        scaler = SavedLossScaler()
        scaler.__dict__.update(cur_scale=float(state["scale"]) if state else 1.0, dynamic=False)
        return scaler
    scaler = SavedDynamicLossScaler()
    scaler.__dict__.update(
        cur_scale=float(state["scale"]), dynamic=True, cur_iter=int(state["iteration"]),
        last_overflow_iter=int(state["last_overflow_iteration"]), scale_factor=float(state["factor"]),
        scale_window=int(state["window"]), min_scale=state["min_scale"], delayed_shift=int(state["hysteresis"]),
        cur_hysteresis=int(state["hysteresis_left"]), consecutive_hysteresis=bool(state["consecutive_hysteresis"]),
        raise_error_at_min_scale=True, dtype=dtype)
    return scaler
