"""DeepSpeed's per-parameter attributes, read-only: `ds_id`, `ds_status`, `ds_shape`,
`ds_numel`, `ds_persist`, `ds_tensor`, and `ZeroParamStatus`.

Code written for DeepSpeed reads them on any parameter ZeRO-3 partitioned: built inside
`zero.Init` (`hasattr(p, "ds_id")` is how Transformers, PEFT and TRL recognise one) or
managed by an engine (TRL checks `ds_status` before it gathers a weight). Each such
`nn.Parameter` is given the class `ZeroParameter`, whose properties are computed from
zero3's own state: the engine's `ShardedParam` while an engine manages the parameter
(found through `ownership.py`; the owner answers `sharded(param)`), else its `InitShard`
(`init_shards.py`) while `zero.Init`'s partition waits for an engine. Nothing is stored on
the parameter and nothing can be set; its identity, data and autograd behaviour are
unchanged and `isinstance(p, nn.Parameter)` stays true. Parameters of other Parameter
subclasses keep their class. `ds_id` is the order in which this process first
partitioned the parameter (the same on every rank, as building is SPMD), kept in a weak
table.
"""

from __future__ import annotations

import enum
import itertools

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from zero3.params import ownership
from zero3.params.init_shards import init_shard_of
from zero3.params.partition import ParamState, ShardedParam
from zero3.params.released import is_released, plain_class, set_plain_class

_ids: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> ds_id
_next_id = itertools.count()


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's names: AVAILABLE (whole on this rank), NOT_AVAILABLE (only the shard),
    INFLIGHT (being gathered)."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


_STATUS = {ParamState.FULL: ZeroParamStatus.AVAILABLE, ParamState.SHARDED: ZeroParamStatus.NOT_AVAILABLE,
           ParamState.GATHERING: ZeroParamStatus.INFLIGHT}


def _sharded(param: nn.Parameter) -> ShardedParam | None:
    owner = ownership.owner_ref(param)
    return owner.sharded(param) if owner is not None else None


class ZeroParameter(nn.Parameter):
    """An nn.Parameter partitioned by zero3 (see the module docstring)."""

    @property
    def ds_id(self) -> int:
        return _ids[self]

    @property
    def ds_status(self) -> ZeroParamStatus:
        sharded = _sharded(self)
        if sharded is not None:
            return _STATUS[sharded.state]
        # zero.Init's partition (sealed until gathered), or an engine destroyed: whole again
        return ZeroParamStatus.NOT_AVAILABLE if is_released(self) else ZeroParamStatus.AVAILABLE

    @property
    def ds_shape(self) -> torch.Size:
        return self.shape

    @property
    def ds_numel(self) -> int:
        return self.numel()

    @property
    def ds_persist(self) -> bool:
        """Whether the parameter stays whole between steps (resident, DeepSpeed's persistent)."""
        sharded = _sharded(self)
        if sharded is not None:
            return sharded.persistent
        return init_shard_of(self) is None  # not adopted yet: partitioned; after destroy: whole

    @property
    def ds_tensor(self) -> torch.Tensor | None:
        """This rank's partition, flat and padded (the tensor zero3 keeps, not a copy; None
        once no engine or zero.Init holds one)."""
        sharded = _sharded(self)
        if sharded is not None:
            return sharded.shard
        record = init_shard_of(self)
        return record.shard if record is not None else None


def mark_zero_parameter(param: nn.Parameter) -> None:
    """Give a plain nn.Parameter the read-only DeepSpeed attributes (idempotent)."""
    if param not in _ids:
        _ids[param] = next(_next_id)
    if plain_class(param) is nn.Parameter:
        set_plain_class(param, ZeroParameter)
