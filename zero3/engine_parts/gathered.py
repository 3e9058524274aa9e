"""GatheredParameters and register_external_parameter (DeepSpeed's `deepspeed.zero.*`).

`GatheredParameters(params, modifier_rank=None)` is a collective: every rank enters it
with the same parameters. Inside, each parameter is FULL on every rank. On exit:
- `modifier_rank=r`: rank r's full values are broadcast and become everyone's values,
  shards and fp32 masters, so a modification made on rank r takes effect everywhere and
  in the training that follows;
- `modifier_rank=None`: the parameters must not be written; as DeepSpeed does, any
  in-place write on any rank (a change of the version counter or data pointer, even
  `add_(0.0)`, params/write_marks.py) is an error raised on every rank, after the
  parameters are partitioned again with their values from before the block (a write would
  otherwise be silently lost, or, for a resident parameter, kept on one rank only).
The engine that manages a parameter is found through engine_parts/owner.py; of it, the context
reads the table and process group, gathers and drops through its fetcher, and writes
the fp32 masters through its optimizer view. Parameters partitioned by `zero3.Init` and
not yet given to an engine are gathered the same way (init_gather.py). A parameter
whose storage is released but that neither an engine nor zero3.Init manages (its
engine was destroyed) is refused with `ReleasedParameterError`; other parameters pass
through untouched.

A tensor taken from a parameter inside the block (`p.detach().cpu()` on the CPU, `p.data`, a
NumPy view) keeps its values after it, as under DeepSpeed (params/released.py); it holds
the parameter's full-size memory as long as it lives.

Memory: with `modifier_rank=None` a copy of the values of the parameters that stay
gathered after the block (resident ones, or held by an enclosing context) is kept on their
device for the duration of the context, to undo a write to them; it is freed on exit.
"""

from __future__ import annotations

import torch
from torch import nn

from zero3.engine_parts.owner import ParamOwner, owner_of
from zero3.engine_parts.views import OptimizerAccess
from zero3.params.fetch import Fetcher
from zero3.params.init import Init, init_shard_of
from zero3.params.init_gather import InitGather
from zero3.params.partition import ParamState, ShardedParam
from zero3.params.released import refuse_released
from zero3.params.write_marks import WriteMark, mark, written_since
from zero3.platform.collectives import Communicator


class GatheredParametersError(RuntimeError):
    """A GatheredParameters context was misused (a RuntimeError, as DeepSpeed raises for an
    in-place modification under modifier_rank=None)."""


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
        self._groups: list[tuple[ParamOwner, list[ShardedParam]]] = []  # per managing engine
        self._init_gather: InitGather | None = None
        self._snapshots: dict[int, torch.Tensor] = {}  # id(sp) -> values on entry, of those that stay gathered
        self._marks: dict[int, WriteMark] = {}  # id(sp) -> write mark on entry

    def __enter__(self) -> "GatheredParameters":
        if not self.enabled:
            return self
        by_owner: dict[int, tuple[ParamOwner, list[ShardedParam]]] = {}
        init_params: list[torch.Tensor] = []
        for p in self.params:
            owner = owner_of(p)
            if owner is not None:
                sps = by_owner.setdefault(id(owner), (owner, []))[1]
                if all(owner.model.table[p] is not sp for sp in sps):
                    sps.append(owner.model.table[p])
            elif init_shard_of(p) is not None:
                if Init._active is not None:
                    continue  # inside the context, zero3.Init gathers a parameter on use itself
                if all(q is not p for q in init_params):
                    init_params.append(p)
            else:
                refuse_released(p, "GatheredParameters", fix="no engine or zero3.Init manages it any more "
                                "(was its engine destroyed?); gather it before engine.destroy()")
        self._groups = list(by_owner.values())
        self._enter_init_params(init_params)
        for owner, sps in self._groups:
            world = owner.model.comm.world_size
            if self.modifier_rank is not None and not 0 <= self.modifier_rank < world:
                raise GatheredParametersError(
                    f"modifier_rank={self.modifier_rank} is not a rank of this world of "
                    f"{world}; use 0..{world - 1} or None"
                )
            stay_gathered = [sp for sp in sps if sp.persistent or sp.holds > 0]
            owner.fetcher.acquire(sps)
            for sp in sps:
                refuse_released(sp.param, "GatheredParameters", sp.name, fix="something outside zero3 freed or "
                                "replaced its storage; leave a managed parameter's storage and `.data` to zero3")
            if self.modifier_rank is None:
                self._snapshots.update((id(sp), sp.param.detach().clone()) for sp in stay_gathered)
                self._marks.update((id(sp), mark(sp.param)) for sp in sps)
        return self

    def _enter_init_params(self, params: list[torch.Tensor]) -> None:
        if not params:
            return
        world = torch.distributed.get_world_size()
        if self.modifier_rank is not None and not 0 <= self.modifier_rank < world:
            raise GatheredParametersError(f"modifier_rank={self.modifier_rank} is not a rank of this world of "
                                          f"{world}; use 0..{world - 1} or None")
        self._init_gather = InitGather(params, self.modifier_rank)
        self._init_gather.enter()

    def __exit__(self, exc_type, exc, tb) -> None:
        """Collective on every path (an exception inside the context included)."""
        if not self.enabled:
            return
        try:
            for owner, sps in self._groups:
                owner.fetcher.guard.flush()
                if self.modifier_rank is not None:
                    _adopt_values_of(owner.model.comm, owner.optimizer, sps, self.modifier_rank)
                    owner.fetcher.drop(sps, keep_aliases=True)
                else:
                    self._refuse_changes(owner.model.comm, owner.fetcher, sps, raise_error=exc_type is None)
            self._exit_init_params(raise_error=exc_type is None)
        finally:
            self._snapshots.clear()
            self._marks.clear()
            self._groups = []
            self._init_gather = None

    def _exit_init_params(self, raise_error: bool) -> None:
        if self._init_gather is None:
            return
        changed_by_rank = self._init_gather.exit(raise_on_change=raise_error)
        if any(changed_by_rank):
            raise _in_place_error("parameters built by zero3.Init", changed_by_rank)

    def _refuse_changes(self, comm: Communicator, fetcher: Fetcher, sps: list[ShardedParam],
                        raise_error: bool) -> None:
        """Drop the holds of `sps` in `fetcher`, undoing any in-place write made to them inside
        the context (a released parameter is gathered from its unchanged shard next time; one
        that stays gathered gets its values from entry back); with `raise_error`, raise on
        every rank if any rank wrote one."""
        changed = [sp for sp in sps if written_since(sp.param, self._marks[id(sp)])]
        changed_by_rank = comm.gather_objects([sp.name for sp in changed])
        with torch.no_grad():
            for sp in changed:  # undo (through .data: no autograd version bump)
                if id(sp) in self._snapshots:
                    sp.param.data.copy_(self._snapshots[id(sp)])
        fetcher.drop(sps, keep_aliases=True)
        if any(changed_by_rank) and raise_error:
            raise _in_place_error("parameters", changed_by_rank)


def _in_place_error(what: str, changed_by_rank: list[list[str]]) -> GatheredParametersError:
    where = "; ".join(f"rank {r}: {', '.join(names)}" for r, names in enumerate(changed_by_rank) if names)
    return GatheredParametersError(
        f"in-place modification of {what} inside GatheredParameters(modifier_rank=None) ({where}); the "
        "parameters were partitioned again with their values from before the block, since the write would be "
        "lost on release. Pass modifier_rank=<the rank whose values should be kept> (e.g. 0) to keep it"
    )


def _adopt_values_of(comm: Communicator, optimizer: OptimizerAccess, sps: list[ShardedParam], src: int) -> None:
    """Broadcast rank `src`'s full values over `comm`; every rank rebuilds its shard and
    its fp32 master (where `optimizer` keeps one apart from the shard)."""
    with torch.no_grad():
        for sp in sps:
            if sp.state is not ParamState.FULL or sp.numel == 0:
                continue
            comm.broadcast(sp.param.data, src=src)
            start, end = sp.range_of(sp.rank)
            values = sp.param.detach().reshape(-1)[start:end]
            sp.write_shard(values)  # into the shard, or its NVMe file
            master = optimizer.master_of(sp)
            if master is not None and master is not sp.shard:
                master[: end - start].copy_(values)
