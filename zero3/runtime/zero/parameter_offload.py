"""`deepspeed.runtime.zero.parameter_offload`: `ZeROOrderedDict` and `ensure_zero_ordered_dict`.

DeepSpeed replaces each module's `_parameters` with a ZeROOrderedDict, whose reads of a
parameter during forward register and gather it. zero3 does the same with its own dicts
(params/discovery.py: TrackedParameters, or ResidentParameters where nothing is ever
gathered), and `isinstance(module._parameters, ZeROOrderedDict)` is true for those, so code
that checks for DeepSpeed's dict finds an engine's modules converted.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from torch import nn

from zero3.params.discovery import PARAMETER_DICTS


class _ParameterDictType(type):
    """ZeROOrderedDict's class: its instances, and zero3's own parameter dicts, are instances."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return type.__instancecheck__(cls, instance) or isinstance(instance, PARAMETER_DICTS)


class ZeROOrderedDict(OrderedDict, metaclass=_ParameterDictType):
    """A module's `_parameters` built as DeepSpeed builds it (`parent_module` is the module).
    Outside an engine it holds parameters as a plain dict does; an engine's model gets
    zero3's own dicts at initialize, and a module attached later at the next forward."""

    def __init__(self, parent_module: nn.Module, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._parent_module = parent_module
        self._in_forward = False

    def __reduce__(self) -> tuple:
        """Copies and pickles rebuild it with its parent module (the default needs no argument)."""
        return type(self), (self._parent_module,), dict(vars(self)), None, iter(self.items())


def ensure_zero_ordered_dict(module: Any) -> None:
    """Give `module` a ZeROOrderedDict as `_parameters` if it has a plain dict there (the
    first container is kept as `_original_parameters`); nothing when its `_parameters` is
    one already (zero3's own included), missing, or not a dict."""
    params = getattr(module, "_parameters", None)
    if isinstance(params, ZeROOrderedDict) or not isinstance(params, dict):
        return
    if not hasattr(module, "_original_parameters"):
        module._original_parameters = params
    module._parameters = ZeROOrderedDict(module, params.items())


__all__ = ["ZeROOrderedDict", "ensure_zero_ordered_dict"]
