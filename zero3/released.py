"""Released parameters: a parameter whose storage was freed while its shape stayed.

zero3 frees a sharded parameter's storage (`untyped_storage().resize_(0)`) and keeps its
shape, dtype and device. Many torch kernels do not check the storage size before they
read or write, so touching such a tensor's values outside zero3's control would read or
write freed memory (a segmentation fault at best). Every zero3 path that could touch a
released storage checks first, through `refuse_released`, and raises
`ReleasedParameterError` naming what was touched and how to reach the values instead.

Nothing here holds memory: the checks read metadata only.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

_state_dict_guarded: WeakIdKeyDictionary = WeakIdKeyDictionary()  # module -> hook handle

HOW_TO_REACH_VALUES = (
    "read or change its values inside `with zero3.GatheredParameters(params, modifier_rank=...)`, "
    "or through the engine (engine(...), engine.state_dict(), zero3.export.consolidated_state_dict)"
)


class ReleasedParameterError(RuntimeError):
    """The values of a parameter were touched while its storage is released (sharded)."""


def is_released(tensor: torch.Tensor) -> bool:
    """Whether `tensor` has elements but its storage cannot hold them (freed by zero3)."""
    if tensor.numel() == 0 or tensor.device.type == "meta":
        return False
    needed = (tensor.storage_offset() + tensor.numel()) * tensor.element_size()
    return tensor.untyped_storage().nbytes() < needed


def describe(tensor: torch.Tensor, name: str | None = None) -> str:
    shape = "x".join(str(s) for s in tensor.shape)
    return f"parameter {name!r} ({shape}, {tensor.dtype})" if name else f"a parameter of shape ({shape}, {tensor.dtype})"


def refuse_released(tensor: torch.Tensor, what: str, name: str | None = None, fix: str = HOW_TO_REACH_VALUES) -> None:
    """Raise ReleasedParameterError if `tensor` is released; `what` says who was about to touch it."""
    if is_released(tensor):
        raise ReleasedParameterError(
            f"{what}: {describe(tensor, name)} is sharded (its storage is released, "
            f"{tensor.untyped_storage().nbytes()} bytes held), so its values are not on this rank; {fix}"
        )


def guard_state_dict(module: nn.Module) -> None:
    """`module.state_dict()` gives, for each of its own parameters that is released, a
    tensor on the meta device of the same shape and dtype instead of the released one:
    names, shapes and dtypes stay, and any read of its values fails loudly ("Cannot copy
    out of meta tensor") instead of reading freed memory. Gathered (FULL) parameters are
    given as usual, so `with GatheredParameters(params): module.state_dict()` has the
    values. With keep_vars=True the parameters themselves are given. Idempotent."""
    if module not in _state_dict_guarded:
        _state_dict_guarded[module] = module.register_state_dict_post_hook(_meta_for_released)


def _meta_for_released(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    for name, param in module._parameters.items():
        key = prefix + name
        value = state_dict.get(key)
        if param is None or value is None or value is param or not is_released(value):
            continue
        state_dict[key] = torch.empty(value.shape, dtype=value.dtype, device="meta")
