"""In-place writes to a tensor, detected as DeepSpeed detects them inside
`GatheredParameters(..., modifier_rank=None)`: by autograd's version counter and the data
pointer, not by the values. Any in-place write through the tensor (`add_(0.0)` included)
or a new `.data` counts, even one that leaves the values equal; writes that bypass the
version counter (through `.data`, or zero3's own gathers, which preserve it) do not.

Nothing here holds memory: a mark is two integers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WriteMark:
    """A tensor's version counter and data pointer at one moment."""

    version: int
    data_ptr: int


def mark(tensor: torch.Tensor) -> WriteMark:
    return WriteMark(tensor._version, tensor.data_ptr())


def written_since(tensor: torch.Tensor, since: WriteMark) -> bool:
    """Whether `tensor` was written in place (or given new data) after `since` was taken."""
    return mark(tensor) != since
