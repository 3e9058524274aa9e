"""GatheredParameters and register_external_parameter (DeepSpeed's `deepspeed.zero.*`).

`GatheredParameters(params, modifier_rank=None)` is a collective: every rank enters it
with the same parameters. Inside, each parameter is FULL on every rank. On exit:
- `modifier_rank=r`: rank r's full values are broadcast and become everyone's shards
  (compute shard and fp32 master), so a modification made on rank r takes effect;
- `modifier_rank=None`: the values must be unchanged; a change made on any rank raises
  on every rank, because it would otherwise be silently lost.
Parameters not managed by an engine pass through untouched.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from .partition import ParamState, ShardedParam

if TYPE_CHECKING:
    from .engine import Engine

_engine_of: WeakIdKeyDictionary = WeakIdKeyDictionary()


class GatheredParametersError(RuntimeError):
    """A GatheredParameters context was misused."""


def register_engine(engine: "Engine") -> None:
    ref = weakref.ref(engine)
    for param in engine.table:
        _engine_of[param] = ref


def unregister_engine(engine: "Engine") -> None:
    for param in engine.table:
        ref = _engine_of.get(param)
        if ref is not None and ref() is engine:
            del _engine_of[param]


def engine_of(param: nn.Parameter) -> "Engine | None":
    ref = _engine_of.get(param)
    return ref() if ref is not None else None


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Accepted for DeepSpeed compatibility: access discovery finds external parameters."""
    if not isinstance(parameter, nn.Parameter):
        raise TypeError(f"register_external_parameter expects an nn.Parameter, got {type(parameter).__name__}")


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Accepted for DeepSpeed compatibility; nothing to undo."""


class GatheredParameters:
    """Context manager: the given parameters are whole on every rank inside it."""

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in (params or []) if isinstance(p, torch.Tensor)]
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._groups: list[tuple["Engine", list[ShardedParam]]] = []
        self._snapshots: list[torch.Tensor] = []

    def __enter__(self) -> "GatheredParameters":
        if not self.enabled:
            return self
        by_engine: dict[int, tuple["Engine", list[ShardedParam]]] = {}
        for p in self.params:
            engine = engine_of(p)
            if engine is not None:
                by_engine.setdefault(id(engine), (engine, []))[1].append(engine.table[p])
        self._groups = list(by_engine.values())
        for engine, sps in self._groups:
            if self.modifier_rank is not None and not 0 <= self.modifier_rank < engine.comm.world_size:
                raise GatheredParametersError(
                    f"modifier_rank={self.modifier_rank} is not a rank of this world of "
                    f"{engine.comm.world_size}; use 0..{engine.comm.world_size - 1} or None"
                )
            engine.fetcher.acquire(sps)
            if self.modifier_rank is None:
                self._snapshots.extend(_local_slice(sp).clone() for sp in sps)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.enabled:
            return
        snapshots = iter(self._snapshots)
        for engine, sps in self._groups:
            if self.modifier_rank is not None:
                _adopt_values_of(engine, sps, self.modifier_rank)
                engine.fetcher.drop(sps)
                continue
            changed = [sp.name for sp in sps if not torch.equal(_local_slice(sp), next(snapshots))]
            unchanged_everywhere = engine.comm.all_agree(not changed)
            engine.fetcher.drop(sps)
            if not unchanged_everywhere and exc_type is None:
                where = ", ".join(changed) if changed else "(changed on another rank)"
                raise GatheredParametersError(
                    f"parameters were modified inside GatheredParameters(modifier_rank=None): "
                    f"{where}; the change would be lost. Pass modifier_rank=<the rank whose "
                    "values should be kept> (e.g. 0) to keep it"
                )
        self._snapshots.clear()
        self._groups = []


def _local_slice(sp: ShardedParam) -> torch.Tensor:
    start, end = sp.range_of(sp.rank)
    return sp.param.detach().reshape(-1)[start:end]


def _adopt_values_of(engine: "Engine", sps: list[ShardedParam], src: int) -> None:
    """Broadcast rank `src`'s full values; every rank rebuilds its shard and master."""
    with torch.no_grad():
        for sp in sps:
            if sp.state is not ParamState.FULL or sp.numel == 0:
                continue
            engine.comm.broadcast(sp.param.data, src=src)
            start, end = sp.range_of(sp.rank)
            values = sp.param.detach().reshape(-1)[start:end]
            sp.shard[: end - start].copy_(values)
            master = engine.optimizer.master_of(sp) if engine.optimizer is not None else None
            if master is not None and master is not sp.shard:
                master[: end - start].copy_(values)
