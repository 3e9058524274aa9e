"""The collectives zero3 issues, with call and byte counters.

Every collective of the engine goes through one `Communicator`, so the counters are the
whole truth about what a step moved. Bytes are counted as the size of the local input
of each call (for an all-gather, the shard this rank contributes; for a reduce-scatter,
the full buffer this rank reduces). With world size 1 no collective is issued and
nothing is counted: the data is copied locally.

`ZERO3_COLLECTIVES_AT_WORLD_SIZE_1=1` makes world size 1 take exactly the path of world
size N: the same all-gathers and reduce-scatters through the process group, the same
buffers and streams (with NCCL, its asynchronous completion and the caching allocator's
cross-stream reuse are then exercised on one GPU). It is read once, when the engine's
Communicator is built; it changes no value, only which path computes it. Off by default.

Asynchronous collectives (`*_async`) return at once; their completion callback runs when
they are drained. Invariant: at most the outstanding asynchronous collectives run ahead
of the host, and every collective call (synchronous or not) first drains them, in issue
order. So each rank's collectives complete, and their callbacks (a gather's header check,
a gradient bucket's accumulation) run, in the same order on every rank, and a rank that
finds its peers diverged raises before it issues anything else.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import os

import torch
import torch.distributed as dist

from zero3.platform.comms_log import COMMS_LOGGER

# torch 2.13 names these *_single; older releases (e.g. a GPU image's 2.11) only have
# the *_tensor spelling, which 2.13 still accepts with a deprecation warning.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


COLLECTIVES_AT_WORLD_SIZE_1 = "ZERO3_COLLECTIVES_AT_WORLD_SIZE_1"


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


class _StreamWork:
    """A local copy queued on a CUDA stream, awaited like a collective's work handle."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    @staticmethod
    def after_current(tensor: torch.Tensor) -> "_StreamWork | None":
        if not tensor.is_cuda:
            return None  # done already
        event = torch.cuda.Event()
        event.record()
        return _StreamWork(event)

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)


@dataclass(eq=False)
class Pending:
    """An issued asynchronous collective: its work handle and what to do once it is done."""

    work: object | None
    on_done: Callable[[], None]
    guarded: bool
    done: bool = False
    timed: tuple[str, int, float] | None = None  # (op, message bytes, start) when the comms logger is on


class Communicator:
    """The process group the engine shards over, and the collectives on it."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.counters = CommCounters()
        self._outstanding: deque[Pending] = deque()
        self.on_cuda = self.distributed and dist.get_backend(group) == "nccl"
        self.collectives_at_world_size_1 = os.environ.get(COLLECTIVES_AT_WORLD_SIZE_1, "") == "1"

    @property
    def active(self) -> bool:
        """True when collectives are really issued (world size above 1, or the switch on)."""
        return self.distributed and (self.world_size > 1 or self.collectives_at_world_size_1)

    # ------------------------------------------------------------ asynchronous
    def drain(self) -> None:
        """Wait for every outstanding asynchronous collective and run its callback, in order.

        On CUDA, `wait()` makes the current stream wait for the collective's stream (the
        host does not block); with gloo the host waits.
        """
        while self._outstanding:
            self._complete_first()

    def complete(self, handle: Pending) -> None:
        """Complete `handle` (and, to keep the order, every collective issued before it)."""
        while not handle.done and self._outstanding:
            self._complete_first()

    def _complete_first(self) -> None:
        pending = self._outstanding.popleft()
        if pending.work is not None:
            pending.work.wait()
        if pending.timed is not None:
            COMMS_LOGGER.finish(*pending.timed[:2], self.world_size, pending.timed[2], self.on_cuda)
        pending.done = True
        pending.on_done()

    @property
    def outstanding(self) -> int:
        return len(self._outstanding)

    def _before_async(self) -> None:
        """On CPU, gathers are completed (their headers checked) before anything else is
        issued; on CUDA the process group's stream orders the collectives itself."""
        if self._outstanding and not self.on_cuda:
            guarded = [p for p in self._outstanding if p.guarded]
            if guarded:
                self.complete(guarded[-1])

    def all_gather_into_async(self, output: torch.Tensor, shard: torch.Tensor,
                              on_done: Callable[[], None]) -> Pending:
        """`all_gather_into`, returning before it completes; `on_done()` runs at completion.

        A gather carries a header checked in `on_done` (guarded)."""
        self._before_async()
        if not self.active:
            if output.data_ptr() != shard.data_ptr():
                output.copy_(shard)  # on CUDA, queued on the current (side) stream
            return self._enqueue(Pending(_StreamWork.after_current(output), on_done, guarded=True))
        self.counters.record("all_gather", shard)
        timed = self._timing("all_gather", output)
        work = all_gather_single(output, shard, group=self.group, async_op=True)
        return self._enqueue(Pending(work, on_done, guarded=True, timed=timed))

    def reduce_scatter_sum_async(self, output: torch.Tensor, full: torch.Tensor,
                                 on_done: Callable[[], None]) -> Pending:
        """`reduce_scatter_sum`, returning before it completes; `on_done()` runs at completion."""
        self._before_async()
        if not self.active:
            output.copy_(full)
            return self._enqueue(Pending(None, on_done, guarded=False))
        self.counters.record("reduce_scatter", full)
        timed = self._timing("reduce_scatter", full)
        work = reduce_scatter_single(output, full, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return self._enqueue(Pending(work, on_done, guarded=False, timed=timed))

    def _timing(self, op: str, message: torch.Tensor) -> tuple[str, int, float] | None:
        """What the comms logger needs to time `op` (platform/comms_log.py), or None when off."""
        if not COMMS_LOGGER.wants(op):
            return None
        if self.on_cuda:
            torch.cuda.synchronize()  # the collective's own time, not the queue before it
        return op, message.numel() * message.element_size(), COMMS_LOGGER.start()

    def _finish(self, timed: tuple[str, int, float] | None) -> None:
        if timed is not None:
            COMMS_LOGGER.finish(*timed[:2], self.world_size, timed[2], self.on_cuda)

    def _enqueue(self, pending: Pending) -> Pending:
        self._outstanding.append(pending)
        return pending

    # ------------------------------------------------------------- synchronous
    def all_gather_into(self, output: torch.Tensor, shard: torch.Tensor) -> None:
        """output[r * n:(r + 1) * n] = shard of rank r, n = shard.numel()."""
        self.drain()
        if not self.active:
            output.copy_(shard)
            return
        self.counters.record("all_gather", shard)
        timed = self._timing("all_gather", output)
        all_gather_single(output, shard, group=self.group)
        self._finish(timed)

    def reduce_scatter_sum(self, output: torch.Tensor, full: torch.Tensor) -> None:
        """output = sum over ranks of full[rank * n:(rank + 1) * n], n = output.numel()."""
        self.drain()
        if not self.active:
            output.copy_(full)
            return
        self.counters.record("reduce_scatter", full)
        timed = self._timing("reduce_scatter", full)
        reduce_scatter_single(output, full, op=dist.ReduceOp.SUM, group=self.group)
        self._finish(timed)

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
        self.drain()
        if not self.active:
            return
        self.counters.record("all_reduce", tensor)
        timed = self._timing("all_reduce", tensor)
        dist.all_reduce(tensor, op=op, group=self.group)
        self._finish(timed)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.drain()
        if not self.active:
            return
        self.counters.record("broadcast", tensor)
        timed = self._timing("broadcast", tensor)
        dist.broadcast(tensor, src=src, group=self.group)
        self._finish(timed)

    def barrier(self) -> None:
        self.drain()
        if self.active:
            dist.barrier(group=self.group)

    def all_agree(self, flag: bool) -> bool:
        """True on every rank only if `flag` is True on every rank."""
        value = torch.tensor([0 if flag else 1], dtype=torch.int32)
        self.all_reduce(value)
        return int(value.item()) == 0

    def gather_objects(self, obj: object) -> list[object]:
        """`obj` of every rank, in rank order, on every rank (small metadata only)."""
        self.drain()
        if not self.active:
            return [obj]
        out: list[object] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out
