"""DeepSpeed's per-parameter status, read-only, for client libraries that ask for it.

Libraries written for DeepSpeed read `param.ds_status` (TRL checks it before gathering a
weight it uses directly, on every SFT forward) and `ZeroParamStatus` from
`deepspeed.runtime.zero.partition_parameters`. zero3 keeps a parameter's state in its
own `ShardedParam` (partition.py); the engine gives each plain `nn.Parameter` it manages
the class `ZeroParameter`, whose `ds_status`, `ds_shape`, `ds_numel` and `ds_persist` are properties
computed from that state: nothing is stored on the parameter, and nothing can be set.
The parameter's identity, data and autograd behaviour are unchanged; `isinstance(p,
nn.Parameter)` stays true. Parameters of other Parameter subclasses keep their class.
"""

from __future__ import annotations

import enum

import torch
from torch import nn

from zero3.engine_parts.owner import owner_of
from zero3.params.partition import ParamState
from zero3.params.released import plain_class, set_plain_class


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's names: AVAILABLE (whole on this rank), NOT_AVAILABLE (only the shard),
    INFLIGHT (being gathered)."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


_STATUS = {ParamState.FULL: ZeroParamStatus.AVAILABLE, ParamState.SHARDED: ZeroParamStatus.NOT_AVAILABLE,
           ParamState.GATHERING: ZeroParamStatus.INFLIGHT}


class ZeroParameter(nn.Parameter):
    """An nn.Parameter managed by a zero3 engine (see the module docstring)."""

    @property
    def ds_status(self) -> ZeroParamStatus:
        owner = owner_of(self)
        if owner is None:  # the engine was destroyed: the parameter is whole again
            return ZeroParamStatus.AVAILABLE
        return _STATUS[owner.model.table[self].state]

    @property
    def ds_shape(self) -> torch.Size:
        return self.shape

    @property
    def ds_numel(self) -> int:
        return self.numel()

    @property
    def ds_persist(self) -> bool:
        """Whether the parameter stays whole between steps (resident, DeepSpeed's persistent)."""
        owner = owner_of(self)
        return owner is None or owner.model.table[self].persistent


def mark_managed(param: nn.Parameter) -> None:
    """Give a plain nn.Parameter the read-only DeepSpeed status properties."""
    if plain_class(param) is nn.Parameter:
        set_plain_class(param, ZeroParameter)
