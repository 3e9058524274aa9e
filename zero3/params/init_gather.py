"""GatheredParameters over parameters partitioned by zero3.Init and not yet given to an engine.

Between the end of a `zero3.Init` context and `zero3.initialize`, a parameter's values
live only in its `InitShard` (init.py's registry) and the parameter's storage is released.
`InitGather` gathers such parameters whole on every rank (a collective) and, on exit,
either adopts one rank's values (`modifier_rank=r`) into every rank's shard, or checks
that nothing was written in place (`modifier_rank=None`, DeepSpeed's rule,
write_marks.py: a write is undone and raises `GatheredParametersError` on every rank),
then releases the storage again.

Memory: while gathered, each parameter holds its full values; with modifier_rank=None a
snapshot copy of those held by an enclosing context too (freed on exit). The shards stay
owned by init.py's registry.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from zero3.params.init import InitShard, init_shard_of
from zero3.params.released import describe, release_storage, restore_storage
from zero3.params.shard_layout import owned_range
from zero3.params.wire import gather_rows
from zero3.params.write_marks import WriteMark, mark, written_since
from zero3.platform.collectives import Communicator

_holds: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> open GatheredParameters on it


class InitGather:
    """The zero3.Init-partitioned parameters of one GatheredParameters context."""

    def __init__(self, params: list[torch.Tensor], modifier_rank: int | None) -> None:
        self.params = params
        self.modifier_rank = modifier_rank
        self.comm = Communicator()
        self._snapshots: dict[int, torch.Tensor] = {}  # id -> values on entry, of those held already
        self._marks: dict[int, WriteMark] = {}

    def enter(self) -> None:
        """Every parameter full on every rank (an all-gather per parameter not already held)."""
        with torch.no_grad():
            for param in self.params:
                held_already = _holds.get(param, 0) > 0
                if not held_already:
                    self._gather(param, init_shard_of(param))
                _holds[param] = _holds.get(param, 0) + 1
                if self.modifier_rank is None:
                    self._marks[id(param)] = mark(param)
                    if held_already:
                        self._snapshots[id(param)] = param.detach().clone()

    def exit(self, raise_on_change: bool) -> list[str]:
        """Adopt or check the values, release the storage; returns the changes seen on each rank."""
        changed_by_rank: list = []
        with torch.no_grad():
            if self.modifier_rank is not None:
                self._adopt(self.modifier_rank)
            else:
                changed_by_rank = self._undo_changes()
            for param in self.params:
                _holds[param] -= 1
                if _holds[param] == 0:
                    del _holds[param]
                    release_storage(param, keep_aliases=True)  # tensors taken inside keep their values
        self._snapshots.clear()
        self._marks.clear()
        return changed_by_rank if raise_on_change else []

    def _gather(self, param: torch.Tensor, record: InitShard) -> None:
        restore_storage(param)
        rows = gather_rows(self.comm, record.shard, param.device).view(-1)
        with torch.autograd._unsafe_preserve_version_counter(param):
            param.data.view(-1).copy_(rows[: param.numel()])

    def _adopt(self, src: int) -> None:
        for param in self.params:
            full = param.data.contiguous()
            self.comm.broadcast(full, src=src)
            record = init_shard_of(param)
            start, end = owned_range(param.numel(), record.shard_numel, record.rank)
            record.shard[: end - start].copy_(full.reshape(-1)[start:end])
            if full is not param.data:
                param.data.copy_(full)

    def _undo_changes(self) -> list:
        changed = [i for i, p in enumerate(self.params) if written_since(p, self._marks[id(p)])]
        for i in changed:
            if id(self.params[i]) in self._snapshots:  # the others are released: their shards are unchanged
                self.params[i].data.copy_(self._snapshots[id(self.params[i])])
        names = [f"#{i} {describe(self.params[i])}" for i in changed]
        return self.comm.gather_objects(names)

