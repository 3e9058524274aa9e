"""The collectives zero3 issues, with call and byte counters.

Every collective of the engine goes through one `Communicator`, so the counters are the
whole truth about what a step moved. Bytes are counted as the size of the local input
of each call (for an all-gather, the shard this rank contributes; for a reduce-scatter,
the full buffer this rank reduces). With world size 1 no collective is issued and
nothing is counted: the data is copied locally.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


# torch 2.13 names these *_single; older releases (e.g. a GPU image's 2.11) only have
# the *_tensor spelling, which 2.13 still accepts with a deprecation warning.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommCounters:
    """Cumulative collective calls and bytes, per operation name."""

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def record(self, op: str, tensor: torch.Tensor) -> None:
        self.calls[op] += 1
        self.bytes[op] += tensor.numel() * tensor.element_size()

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """A copy: op name -> (calls, bytes)."""
        return {op: (self.calls[op], self.bytes[op]) for op in sorted(self.calls)}


class Communicator:
    """The process group the engine shards over, and the collectives on it."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.counters = CommCounters()

    @property
    def active(self) -> bool:
        """True when collectives are really issued (world size above 1)."""
        return self.distributed and self.world_size > 1

    def all_gather_into(self, output: torch.Tensor, shard: torch.Tensor) -> None:
        """output[r * n:(r + 1) * n] = shard of rank r, n = shard.numel()."""
        if not self.active:
            output.copy_(shard)
            return
        self.counters.record("all_gather", shard)
        _all_gather_single(output, shard, group=self.group)

    def reduce_scatter_sum(self, output: torch.Tensor, full: torch.Tensor) -> None:
        """output = sum over ranks of full[rank * n:(rank + 1) * n], n = output.numel()."""
        if not self.active:
            output.copy_(full)
            return
        self.counters.record("reduce_scatter", full)
        _reduce_scatter_single(output, full, op=dist.ReduceOp.SUM, group=self.group)

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
        if not self.active:
            return
        self.counters.record("all_reduce", tensor)
        dist.all_reduce(tensor, op=op, group=self.group)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        if not self.active:
            return
        self.counters.record("broadcast", tensor)
        dist.broadcast(tensor, src=src, group=self.group)

    def barrier(self) -> None:
        if self.active:
            dist.barrier(group=self.group)

    def all_agree(self, flag: bool) -> bool:
        """True on every rank only if `flag` is True on every rank."""
        value = torch.tensor([0 if flag else 1], dtype=torch.int32)
        self.all_reduce(value)
        return int(value.item()) == 0

    def gather_objects(self, obj: object) -> list[object]:
        """`obj` of every rank, in rank order, on every rank (small metadata only)."""
        if not self.active:
            return [obj]
        out: list[object] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out
