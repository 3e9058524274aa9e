"""The NVMe tier of parameter shards (offload_param.device "nvme", DeepSpeed ZeRO-Infinity).

Which shards: those of the fetch units the plan puts on NVMe (placement/plan.py, rule 5),
except resident (persistent) parameters, which are whole on the device between steps and
keep their small shards in host memory.

Layout: per owning unit, in unit order, consecutive parameters are packed into *swap
groups* whose shards fit one staging buffer (`buffer_size` elements of the widest shard
dtype, rounded up to 4096 bytes); each group has one file in this rank's swap folder
(zero3/nvme/folder.py), each parameter a 4096-aligned region in it. A shard of more than
`buffer_size` elements is refused at initialize, naming it and the buffer_size it needs
(DeepSpeed's rule too).

A shard is PARKED (`sp.shard` a meta tensor of its shape and dtype: any read of its values
fails; the values are in the file) or BOUND (`sp.shard` a view of its group's staging
buffer), the latter only while the wire copies it into a gather's send buffer (`bind` /
`unbind`). A group's buffer is filled by a read started ahead of the gather (`prefetch`,
driven by the look-ahead while the current unit computes) or, if none was, by `bind`
itself; it serves that one gather and goes back to the pool at `unbind` (on CUDA once the
copies out of it have run: an event recorded on the copying stream).

Writes (`write`): the values (a master after the step, a loaded checkpoint, a changed
parameter) are cast into a new aligned host tensor, owned by the write until it completes,
and written asynchronously; a prefetched buffer of that group not yet consumed is dropped
(its bytes are older). Requests run in the order they were started (zero3/nvme/io.py), so a
read started after a write sees it. Frozen shards are written once, at initialize; trainable
ones after each optimizer step, which then `drain()`s: a failed write is raised by the step,
and by every later bind or read (the values are lost: rebuild the engine from the last
checkpoint; `lost` tells the teardown not to gather them back).

Threads: the fetch path (the main thread) binds and prefetches; the overlapped host step's
worker writes. One lock guards the groups and the pool, and nothing waits for a free pool
buffer while holding it: a bind that finds none takes one from the furthest prefetched
group, else reads into a temporary buffer (logged once: raise buffer_count).

Memory: the pool (`buffer_count` buffers of at most `buffer_size` elements, pinned with
`pin_memory` where CUDA is) is the tier's host memory, plus each write's temporary until
it completes; `readable` returns a new tensor the caller owns. The shards' own storage is
the files.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zero3.config import AioConfig, OffloadConfig
from zero3.nvme.backends import open_files
from zero3.nvme.buffers import BufferPool, aligned_bytes, aligned_empty
from zero3.nvme.folder import SwapFolder, SwapSetupError
from zero3.nvme.io import IssueSettings, SwapIO, SwapIOError
from zero3.params.partition import ShardedParam
from zero3.placement.plan import PlacementError
from zero3.platform.collectives import Communicator

logger = logging.getLogger("zero3")

KEY = "offload_param.nvme_path"
FIX = "keep more parameter shards in host memory (offload_param.max_in_cpu)"
ADVICE = (FIX, "The parameter shards written since the last step are lost")


@dataclass(eq=False)
class SwapGroup:
    """One file: its members' regions, and the staging buffer holding its bytes, if any."""

    path: Path | None  # set once the folder exists
    members: list[ShardedParam]
    nbytes: int
    buffer: torch.Tensor | None = None
    pooled: bool = False  # the buffer is the pool's (else a temporary)
    reading: Future | None = None
    bound: int = 0  # members bound now


@dataclass(frozen=True)
class Region:
    group: SwapGroup
    offset: int
    nbytes: int
    dtype: torch.dtype


@dataclass
class _Buffers:
    """Pool buffers handed back on CUDA, each returned once its event (the copies out of it) is done."""

    draining: list[tuple[torch.cuda.Event, torch.Tensor]] = field(default_factory=list)

    def reclaim(self, pool: BufferPool, wait: bool = False) -> None:
        """The buffers whose copies are done back to `pool` (with `wait`: the oldest waited for)."""
        keep = []
        for index, (event, buffer) in enumerate(self.draining):
            if wait and index == 0:
                event.synchronize()
            if event.query():
                pool.give(buffer)
            else:
                keep.append((event, buffer))
        self.draining = keep


class ParamSwap:
    """The NVMe tier of one engine's parameter shards (module docstring). `attach` lays it
    out and writes every shard once (a collective: setup failures are raised on every rank)."""

    def __init__(self, offload: OffloadConfig, aio: AioConfig, compute_device: torch.device,
                 backend: str = "auto") -> None:
        self.offload = offload
        self.settings = IssueSettings(aio.block_size, aio.queue_depth, aio.intra_op_parallelism,
                                      aio.single_submit, aio.overlap_events)
        self.compute_device = compute_device
        self.backend = backend
        self.groups: list[SwapGroup] = []
        self.regions: dict[int, Region] = {}  # id(sp) -> its region
        self._parked: dict[int, torch.Tensor] = {}  # id(sp) -> its meta placeholder
        self.folder: SwapFolder | None = None
        self.io: SwapIO | None = None
        self.pool: BufferPool | None = None
        self._lock = threading.RLock()
        self._ahead: list[SwapGroup] = []  # prefetched, in the order started
        self._buffers = _Buffers()
        self._writes: list[Future] = []
        self._failed: SwapIOError | None = None
        self._warned = False

    # ------------------------------------------------------------------ setup
    def attach(self, params_by_unit: list[list[ShardedParam]], comm: Communicator) -> None:
        """Lay the shards out, prepare this rank's folder and write every shard once; each
        shard is PARKED after. Every rank's failure is raised on every rank."""
        self._layout(params_by_unit)
        error = self._prepare(comm.rank, sum(g.nbytes for g in self.groups))
        if error is None:
            error = self._write_all()
        failures = [(rank, e) for rank, e in enumerate(comm.gather_objects(error)) if e]
        if failures:
            self.close()
            rank, first = failures[0]
            raise SwapSetupError(first if first == error else f"rank {rank}: {first}")

    def _layout(self, params_by_unit: list[list[ShardedParam]]) -> None:
        """Swap groups per unit (module docstring); refuses a shard larger than a buffer."""
        every = [sp for unit in params_by_unit for sp in unit]
        largest = max(every, key=lambda sp: sp.shard_numel, default=None)
        if largest is not None and largest.shard_numel > self.offload.buffer_size:
            raise PlacementError(
                f"offload_param.buffer_size is {self.offload.buffer_size} elements, and the shard of {largest.name} "
                f"on this rank is {largest.shard_numel} elements: every shard on NVMe must fit one staging "
                f"buffer; raise offload_param.buffer_size to at least {largest.shard_numel}")
        width = max((sp.shard.element_size() for sp in every), default=1)
        capacity = aligned_bytes(self.offload.buffer_size * width)
        for unit in params_by_unit:
            members: list[tuple[ShardedParam, int]] = []
            size = 0
            for sp in unit:
                nbytes = aligned_bytes(sp.shard_numel * sp.shard.element_size())
                if members and size + nbytes > capacity:
                    self._add_group(members, size)
                    members, size = [], 0
                members.append((sp, size))
                size += nbytes
            if members:
                self._add_group(members, size)

    def _add_group(self, members: list[tuple[ShardedParam, int]], size: int) -> None:
        group = SwapGroup(None, [sp for sp, _ in members], size)
        self.groups.append(group)
        for sp, offset in members:
            self.regions[id(sp)] = Region(group, offset, sp.shard_numel * sp.shard.element_size(), sp.shard.dtype)
            self._parked[id(sp)] = torch.empty(sp.shard_numel, dtype=sp.shard.dtype, device="meta")

    def _prepare(self, rank: int, needed: int) -> str | None:
        """This rank's folder, I/O and staging buffers; the error text instead of raising."""
        try:
            self.folder, cleared = SwapFolder.create(self.offload.nvme_path, rank, needed, "params", KEY, FIX)
        except (SwapSetupError, OSError) as exc:
            return str(exc)
        for path in cleared:
            logger.warning("zero3: removed the swap folder %s of a run that did not end cleanly; "
                           "its files were never read", path)
        for index, group in enumerate(self.groups):
            group.path = self.folder.file(f"params{index:05d}.swp")
        files, why = open_files(self.backend, self.folder.path, self.settings.threads, self.settings.block_size)
        self.io = SwapIO(files, self.settings, ADVICE)
        largest = max((g.nbytes for g in self.groups), default=0)
        pin = self.offload.pin_memory and self.compute_device.type == "cuda"
        self.pool = BufferPool(self.offload.buffer_count if self.groups else 0, largest, pin=pin)
        logger.info("zero3: rank %d parameter shards on NVMe: %d parameters in %d files, %.3f GiB in %s; "
                    "%d staging buffers of %.3f GiB; %s", rank, len(self.regions), len(self.groups),
                    needed / 2**30, self.folder.path, self.pool.count, self.pool.size / 2**30, why)
        return None

    def _write_all(self) -> str | None:
        """Every shard written once and parked (the error text instead of raising)."""
        try:
            for group in self.groups:
                for sp in group.members:
                    values = sp.shard
                    sp.backing = self
                    self.write(sp, values)
            self.drain()
        except OSError as exc:
            return str(exc)
        return None

    # ------------------------------------------------------------ the gather
    def bind(self, sps: list[ShardedParam]) -> None:
        """Each shard of `sps` a view of its bytes in a staging buffer, until `unbind`
        (reads not started ahead are started here; waits for all of them)."""
        with self._lock:
            self._raise_if_lost()
            groups = list({id(self.regions[id(sp)].group): self.regions[id(sp)].group for sp in sps}.values())
            for group in groups:
                if group.buffer is None:
                    self._start_read(group, *self._take(groups))
            for group in groups:
                self._finish_read(group)
            self._raise_if_lost()
            for sp in sps:
                region = self.regions[id(sp)]
                region.group.bound += 1
                sp.shard = region.group.buffer[region.offset:region.offset + region.nbytes].view(region.dtype)

    def unbind(self, sps: list[ShardedParam]) -> None:
        """The shards PARKED again; a group no member is bound to gives its buffer back."""
        event = None
        if self.compute_device.type == "cuda":  # the copies out of the buffers were queued on this stream
            event = torch.cuda.Event()
            event.record()
        with self._lock:
            for sp in sps:
                sp.shard = self._parked[id(sp)]
                self.regions[id(sp)].group.bound -= 1
            for sp in sps:
                group = self.regions[id(sp)].group
                if group.bound == 0 and group.buffer is not None:
                    self._give_back(group, event)

    def prefetch(self, sps: list[ShardedParam]) -> bool:
        """Start reading the groups of `sps` not in a buffer yet, while free buffers last
        (never waits); False once none is free."""
        with self._lock:
            if self._failed is not None or self.pool is None:
                return False
            for sp in sps:
                group = self.regions[id(sp)].group
                if group.buffer is not None:
                    continue
                self._buffers.reclaim(self.pool)
                buffer = self.pool.try_take()
                if buffer is None:
                    return False
                self._start_read(group, buffer, True)
                self._ahead.append(group)
            return True

    def _take(self, needed: list[SwapGroup]) -> tuple[torch.Tensor, bool]:
        """A buffer for a bind: a free one, one handed back whose copies are done, the one of
        the furthest prefetched group not `needed`, or else a temporary."""
        self._buffers.reclaim(self.pool)
        buffer = self.pool.try_take()
        if buffer is None:
            spare = [g for g in self._ahead if g.bound == 0 and all(g is not n for n in needed)]
            if spare:
                self._give_back(spare[-1], None)
            else:
                self._buffers.reclaim(self.pool, wait=bool(self._buffers.draining))
            buffer = self.pool.try_take()
        if buffer is not None:
            return buffer, True
        if not self._warned:
            self._warned = True
            logger.info("zero3: a gather needs more NVMe staging buffers than offload_param.buffer_count=%d; "
                           "reading into temporary host memory (raise buffer_count)", self.pool.count)
        return aligned_empty(self.pool.size), False

    def _start_read(self, group: SwapGroup, buffer: torch.Tensor, pooled: bool) -> None:
        group.buffer, group.pooled = buffer, pooled
        group.reading = self.io.read(group.path, buffer[:group.nbytes])

    def _finish_read(self, group: SwapGroup) -> None:
        if group.reading is not None:
            reading, group.reading = group.reading, None
            try:
                reading.result()
            except SwapIOError as exc:
                self._failed = self._failed or exc
        if group in self._ahead:
            self._ahead.remove(group)

    def _give_back(self, group: SwapGroup, event: torch.cuda.Event | None) -> None:
        """The group's buffer back to the pool (after its read; on CUDA after `event`)."""
        self._finish_read(group)
        buffer, group.buffer = group.buffer, None
        if not group.pooled:
            return
        if event is not None:
            self._buffers.draining.append((event, buffer))
        else:
            self.pool.give(buffer)

    # ------------------------------------------------------------ values
    def write(self, sp: ShardedParam, values: torch.Tensor) -> None:
        """`values` (shard_numel elements) become `sp`'s shard, written asynchronously; the
        shard stays PARKED. A prefetched copy of its group not consumed yet is dropped."""
        region = self.regions[id(sp)]
        data = aligned_empty(region.nbytes)
        with torch.no_grad():
            data[:region.nbytes].view(region.dtype).copy_(values.detach().reshape(-1))
        with self._lock:
            self._raise_if_lost()
            group = region.group
            if group.buffer is not None and group.bound == 0:
                self._give_back(group, None)
            sp.shard = self._parked[id(sp)]
            write = self.io.write(group.path, data, region.offset)
            write.add_done_callback(self._note_failure)
            self._writes = [w for w in self._writes if not w.done()] + [write]

    def _note_failure(self, write: Future) -> None:
        error = write.exception()
        if error is not None and self._failed is None:
            self._failed = error

    def readable(self, sp: ShardedParam) -> torch.Tensor:
        """A new host tensor holding `sp`'s shard values, read from its file (after the
        writes started before)."""
        region = self.regions[id(sp)]
        out = aligned_empty(region.nbytes)
        with self._lock:
            self._raise_if_lost()
            reading = self.io.read(region.group.path, out, region.offset)
        reading.result()
        self._raise_if_lost()
        return out[:region.nbytes].view(region.dtype)

    def drain(self) -> None:
        """Every write started is on disk, or the first failure is raised."""
        with self._lock:
            writes, self._writes = self._writes, []
        for write in writes:
            write.exception()
        self._raise_if_lost()

    @property
    def staging_buffers(self) -> int:
        return self.pool.count if self.pool is not None else 0

    @property
    def lost(self) -> bool:
        """A write failed: the files no longer hold every shard."""
        return self._failed is not None

    def _raise_if_lost(self) -> None:
        if self._failed is not None:
            raise SwapIOError(self._failed.errno, str(self._failed))

    def close(self) -> None:
        """Wait for the writes, stop the I/O threads, remove this rank's swap folder."""
        try:
            if self.io is not None:
                for write in self._writes:
                    write.exception()
                self.io.close()
        finally:
            if self.folder is not None:
                self.folder.remove()
            self.io = None
            self.folder = None


def drain_param_writes(sps: Iterable[ShardedParam]) -> None:
    """The writes of every NVMe tier among `sps` are on disk (a failed one raised)."""
    for swap in {id(sp.backing): sp.backing for sp in sps if sp.backing is not None}.values():
        swap.drain()


def attach_param_swap(offload: OffloadConfig, aio: AioConfig, params_by_unit: list[list[ShardedParam]],
                      comm: Communicator, compute_device: torch.device) -> ParamSwap | None:
    """The NVMe tier over `params_by_unit` (a collective: every rank calls it, even with no
    shard on NVMe, when offload_param.device is "nvme"); None without one."""
    if not offload.nvme:
        return None
    swap = ParamSwap(offload, aio, compute_device)
    swap.attach([unit for unit in params_by_unit if unit], comm)
    return swap
