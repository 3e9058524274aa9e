"""DeepSpeed's `torch_autocast` section: the forward under torch.autocast, and the dtype each
parameter's gradient is reduced in.

With `torch_autocast.enabled` the engine runs the model's forward inside
`torch.autocast(device_type, dtype)` (a surrounding autocast region of the user's is
overridden by the config's dtype, as DeepSpeed does). The parameters and masters keep the
dtype of the bf16/fp16 section (fp32 without one), so with fp32 parameters the masters are
the parameters themselves and autocast casts to the lower dtype inside each op.

Gradients, as DeepSpeed reduces them under autocast: a parameter owned directly
(`recurse=False`) by a module whose class is exactly one of `lower_precision_safe_modules`
(default: torch.nn.Linear, Conv1d, Conv2d, Conv3d) is reduced in the autocast dtype; every
other parameter (norms, embeddings, biases of other modules) in its own dtype. Gradient
shards accumulate in the master dtype either way (grads/sink.py).

Memory ownership: nothing here holds tensors; `param_reduce_dtypes` returns a plain dict the
reducer keeps.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zero3.config import PrecisionConfig
from zero3.params.partition import ShardedParam

DEFAULT_SAFE_MODULES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


class AutocastConfigError(ValueError):
    """torch_autocast.lower_precision_safe_modules names a class that cannot be imported."""


@dataclass(frozen=True)
class Autocast:
    """The forward's autocast region; `dtype` None: none (torch_autocast disabled)."""

    device_type: str
    dtype: torch.dtype | None = None

    def region(self) -> Any:
        """A context manager: torch.autocast with the config's dtype, or nothing."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)


def autocast_of(precision: PrecisionConfig, device: torch.device) -> Autocast:
    return Autocast(device.type, precision.autocast_dtype)


def safe_module_classes(names: tuple[str, ...] | None) -> tuple[type, ...]:
    """The classes `names` ("package.module.Class") denote, imported; DeepSpeed's default
    list when None. Raises AutocastConfigError naming the entry that fails (on every rank:
    each rank imports the same names)."""
    if names is None:
        return DEFAULT_SAFE_MODULES
    classes = []
    for name in names:
        package, _, attr = name.rpartition(".")
        try:
            found = getattr(importlib.import_module(package), attr)
        except (ImportError, AttributeError, ValueError) as error:
            raise AutocastConfigError(
                f"torch_autocast.lower_precision_safe_modules: cannot import {name!r} ({type(error).__name__}: "
                f"{error}); write the class's full path, e.g. \"torch.nn.Linear\" or "
                "\"transformers.pytorch_utils.Conv1D\"") from None
        if not isinstance(found, type):
            raise AutocastConfigError(
                f"torch_autocast.lower_precision_safe_modules: {name!r} is a {type(found).__name__}, not a class; "
                "name a module class such as \"torch.nn.Linear\"")
        classes.append(found)
    return tuple(classes)


def param_reduce_dtypes(module: nn.Module, table: dict[nn.Parameter, ShardedParam],
                        precision: PrecisionConfig) -> dict[int, torch.dtype]:
    """id(ShardedParam) -> the autocast dtype, for the trainable parameters of the
    lower-precision-safe modules (exact class match, own parameters only, as DeepSpeed);
    empty without torch_autocast."""
    if precision.autocast_dtype is None:
        return {}
    classes = safe_module_classes(precision.autocast_safe_modules)
    found: dict[int, torch.dtype] = {}
    for owner in module.modules():
        if type(owner) not in classes:
            continue
        for p in owner.parameters(recurse=False):
            sp = table.get(p)
            if sp is not None and sp.requires_grad:
                found[id(sp)] = precision.autocast_dtype
    return found
