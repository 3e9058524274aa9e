"""Which live engine manages a parameter, and what a holder of one reaches of it.

Code that is handed only an `nn.Parameter` (GatheredParameters, DeepSpeed's
`safe_get_full_*` accessors, `param.ds_status`, the leaf-module setters) finds here what
manages it. An engine registers its parameters once it is built and unregisters them
when destroyed.

Ownership and lifetime: the engine owns its `ParamOwner`; the registry
(`zero3.params.ownership`) holds it weakly, keyed weakly by the parameter, so an engine
that is dropped without `destroy()` leaves no entry behind once it is collected, and a
registered parameter is never kept alive by being registered.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from zero3.engine_parts.views import OptimizerAccess, ShardedModel
from zero3.params import ownership
from zero3.params.fetch import Fetcher
from zero3.params.partition import ShardedParam
from zero3.placement.devices import Placement


@dataclass(frozen=True, eq=False)
class ParamOwner:
    """What a holder of one managed parameter reaches of its engine.

    `fetcher` gathers and releases (holds taken through it are the caller's to drop);
    `flush_gradients` reduces every pending gradient into its shard, so `grad_shard`
    is complete; a gradient shard created from outside the step is fp32 on
    the device `placement` gives its optimizer side, where the reducer puts them."""

    model: ShardedModel
    optimizer: OptimizerAccess
    fetcher: Fetcher
    flush_gradients: Callable[[], None]
    placement: Placement

    def sharded(self, param: nn.Parameter) -> ShardedParam:
        """The engine's record of `param` (its shard and gather state); what
        `zero3.params.ownership` asks an owner for."""
        return self.model.table[param]


def register(owner: ParamOwner) -> None:
    """Every parameter in `owner`'s table is managed by it from now on."""
    ownership.register(owner.model.table, owner)


def unregister(owner: ParamOwner) -> None:
    """`owner`'s parameters are no longer managed (those another owner took are left)."""
    ownership.unregister(owner.model.table, owner)


def owner_of(param: nn.Parameter) -> ParamOwner | None:
    """The live owner of `param`, or None when no engine manages it."""
    owner = ownership.owner_ref(param)
    return owner if isinstance(owner, ParamOwner) else None
