"""DeepSpeed's per-parameter status for client libraries: `param.ds_status`, `ds_id`,
`ds_tensor`, ... and `ZeroParamStatus`, defined in `zero3/params/status.py` (zero.Init
gives them to the parameters it partitions, the engine to those it manages)."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from zero3.params.status import ZeroParameter, ZeroParamStatus, mark_zero_parameter

__all__ = ["ZeroParamStatus", "ZeroParameter", "mark_managed"]


def mark_managed(params: Iterable[nn.Parameter]) -> None:
    """Give the parameters the engine manages the read-only DeepSpeed status properties."""
    for param in params:
        mark_zero_parameter(param)
