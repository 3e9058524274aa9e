"""`deepspeed.compression.helper`: reach or replace a submodule by its dotted path."""

from __future__ import annotations

from functools import reduce

from torch import nn


def recursive_getattr(model: nn.Module, module_name: str) -> nn.Module:
    """The submodule of `model` at the dotted path `module_name` ("layers.0.mlp");
    AttributeError naming the missing step where the path leads nowhere."""
    return reduce(getattr, module_name.split("."), model)


def recursive_setattr(model: nn.Module, module_name: str, module: nn.Module) -> None:
    """Put `module` at the dotted path `module_name` of `model`, replacing what is there
    (its parent must exist)."""
    parent_path, _, leaf = module_name.rpartition(".")
    parent = recursive_getattr(model, parent_path) if parent_path else model
    setattr(parent, leaf, module)
