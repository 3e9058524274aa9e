"""The optimizer side of the NVMe tier: masters and optimizer state of NVMe-tier sub-groups
living in swap files, read in to step and written back.

Swap groups: the sub-groups of the NVMe tier as the sharded optimizer makes them at
initialize (optim/masters.py; at most `sub_group_size` elements, whole parameters, one tier,
ending at fetch-unit ends with the overlapped step). Each has one file (zero3/nvme/); in it,
for each of its parameters, a region per swapped tensor, each 4096-aligned: the fp32 master
(unless the master is the compute shard itself, which stays in memory where the forward
reads it) and every elementwise optimizer state tensor (Adam's exp_avg, exp_avg_sq, as the
optimizer's first step will create them: optim/state_probe.py). A state that is not shaped
like its master (a `step` counter) stays in memory.

A swap group is in one of three states:
- PARKED: its bytes are in its file; its tensors keep shape, dtype and identity (the client
  optimizer's param groups and `state` are keyed by the masters) with storage freed, so a
  read that bypasses this module fails loudly;
- BOUND: read into a staging buffer of the pool; its tensors are views of that buffer
  (`Tensor.set_`, identity kept);
- LOOSE: its tensors hold storage of their own (brought in for a reader outside the step,
  or a checkpoint load); their values are the truth, the file is stale until stored.

The step (`begin`, `before(k)`, `after(k)` around each of the step's sub-groups, driven by
ShardedOptimizer on the thread that steps): before sub-group k its swap groups are BOUND
(the read of sub-group k+1 started, with `pipeline_read`, while k steps); after it they are
written (the write left running while k+1 steps, with `pipeline_write`) and PARKED; the last
`after` waits for every write. The update is the host tier's (the same torch kernel over the
same values, the bytes round-trip through the file exactly), so results equal the host
tier's bit for bit.

Outside the step: `readable(t)` gives a PARKED tensor's values read from its file, one tensor
at a time (what checkpoint saves stream); `loosen(master)` makes one swap group LOOSE and
stores the one made LOOSE before it (what a checkpoint load uses, one group at a time);
`materialize()` makes every group LOOSE (what the other readers, such as the DeepSpeed
accessors and consolidated exports, need: the whole state is then in host memory until the
next step writes it back). `close()` waits for the writes and removes the files.

Memory: the pool's `buffer_count` buffers (each the size of the largest swap group) are the
host memory of the tier (at initialize too: the masters are made without storage and each
group's are cast from the compute shards into a buffer and written, one group at a time); tensors are never owned here, only re-pointed.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from zero3.config import AioConfig, OffloadConfig
from zero3.nvme.backends import open_files
from zero3.nvme.buffers import BufferPool, aligned_bytes
from zero3.nvme.folder import SwapFolder, SwapSetupError
from zero3.nvme.io import IssueSettings, SwapIO
from zero3.nvme.pager import GroupPager
from zero3.optim.state_probe import foreseen_state
from zero3.platform.memory import available_host_bytes
from zero3.placement.plan import Tier



class SteppedOptimizer(Protocol):
    """What this module reads of the sharded optimizer (optim/masters.py), which imports it."""

    params: list[Any]  # ShardedParam, in step order
    masters: list[torch.Tensor]  # masters[i] pairs with params[i]
    optimizer: torch.optim.Optimizer
    placement: Any  # zero3.placement.devices.Placement
    comm: Any  # zero3.platform.collectives.Communicator

    def sub_groups(self) -> list[list[int]]: ...

logger = logging.getLogger("zero3")

MASTER = "\0master"  # the key of the master's region (no optimizer state key looks like it)


class Held(enum.Enum):
    PARKED = "parked"
    BOUND = "bound"
    LOOSE = "loose"


@dataclass(frozen=True)
class Region:
    """One tensor's bytes in its group's file."""

    index: int  # into ShardedOptimizer.params
    key: str  # MASTER or an optimizer state key
    offset: int
    nbytes: int
    dtype: torch.dtype


@dataclass
class SwapGroup:
    members: list[int]
    regions: list[Region]
    nbytes: int
    held: Held = Held.LOOSE  # at initialize the masters hold storage of their own


class NoSwap:
    """No NVMe tier: every hook does nothing."""

    groups: list[SwapGroup] = []

    @contextlib.contextmanager
    def stepping(self, k: int, groups: list[list[int]]) -> Iterator[None]:
        yield

    def readable(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def loosen(self, master: torch.Tensor) -> None: ...

    def store_loose(self) -> None: ...

    def materialize(self) -> None: ...

    def close(self) -> None: ...


class OptimizerSwap:
    """The NVMe tier of one sharded optimizer (module docstring). Built from the config,
    attached by the ShardedOptimizer at the end of its construction (a collective: setup
    failures are raised on every rank)."""

    def __init__(self, offload: OffloadConfig, aio: AioConfig, backend: str = "auto") -> None:
        self.offload = offload
        self.settings = IssueSettings(aio.block_size, aio.queue_depth, aio.intra_op_parallelism,
                                      aio.single_submit, aio.overlap_events)
        self.backend = backend
        self.groups: list[SwapGroup] = []
        self.folder: SwapFolder | None = None
        self.pager: GroupPager | None = None
        self._group_of: dict[int, int] = {}  # param index -> swap group
        self._sequence: list[list[int]] = []
        self._parked: dict[int, tuple[int, Region, torch.Tensor]] = {}  # id(tensor) -> (group, region, it)
        self._loose: list[int] = []
        self.waited = {"read": 0.0, "write": 0.0}  # seconds the step spent blocked on swap I/O

    # ------------------------------------------------------------------ setup
    def attach(self, optimizer: SteppedOptimizer) -> None:
        """Lay out the NVMe-tier sub-groups of `optimizer`, prepare this rank's folder (every
        rank's failure raised on every rank), and write each group's masters once."""
        self.opt = optimizer
        placement = optimizer.placement
        nvme = [g for g in optimizer.sub_groups() if placement.state_tier(optimizer.params[g[0]]) is Tier.NVME]
        foreseen = foreseen_state(optimizer.optimizer)
        self.groups = [self._layout(members, foreseen) for members in nvme]
        self._group_of = {i: g for g, group in enumerate(self.groups) for i in group.members}
        needed = sum(group.nbytes for group in self.groups)
        error = self._prepare(optimizer.comm.rank, needed)
        failures = [(rank, e) for rank, e in enumerate(optimizer.comm.gather_objects(error)) if e]
        if failures:
            self.close()
            rank, first = failures[0]
            raise SwapSetupError(first if first == error else f"rank {rank}: {first}")
        for g in range(len(self.groups)):
            self._store(g, wait=False, first=True)
        self.pager.drain()

    def _layout(self, members: list[int], foreseen: dict[Any, dict[str, Any]]) -> SwapGroup:
        """Regions of one swap group: each member's separate master, then its elementwise state."""
        regions, offset = [], 0
        for i in members:
            master, shard = self.opt.masters[i], self.opt.params[i].shard
            tensors = [] if master is shard else [(MASTER, master)]
            tensors += [(key, value) for key, value in sorted(foreseen.get(master, {}).items())
                        if isinstance(value, torch.Tensor) and value.shape == master.shape and master.numel()]
            for key, value in tensors:
                nbytes = value.numel() * value.element_size()
                regions.append(Region(i, key, offset, nbytes, value.dtype))
                offset += aligned_bytes(nbytes)
        return SwapGroup(list(members), regions, offset)

    def _prepare(self, rank: int, needed: int) -> str | None:
        """This rank's folder, I/O and buffers; the error text instead of raising."""
        largest = max((group.nbytes for group in self.groups), default=0)
        count = self.offload.buffer_count if self.groups else 0
        too_big = staging_beyond_host(count, largest)
        if too_big:
            return too_big
        try:
            self.folder, cleared = SwapFolder.create(self.offload.nvme_path, rank, needed)
        except (SwapSetupError, OSError) as exc:
            return str(exc)
        for path in cleared:
            logger.warning("zero3: removed the swap folder %s of a run that did not end cleanly; "
                           "its files were never read", path)
        files, why = open_files(self.backend, self.folder.path, self.settings.threads, self.settings.block_size)
        pool = BufferPool(count, largest, pin=self.offload.pin_memory)
        paths = [self.folder.file(f"group{g:05d}.swp") for g in range(len(self.groups))]
        self.pager = GroupPager(SwapIO(files, self.settings), pool, paths, [g.nbytes for g in self.groups])
        logger.info("zero3: rank %d NVMe tier: %d sub-groups, %.3f GiB in %s; %d staging buffers of %.3f GiB; %s",
                    rank, len(self.groups), needed / 2**30, self.folder.path, count, pool.size / 2**30, why)
        return None

    # ------------------------------------------------------------------ tensors
    def _tensor(self, region: Region) -> torch.Tensor | None:
        """The tensor a region holds now: the master, or the state tensor under its key
        (None when the optimizer has not created that state yet)."""
        master = self.opt.masters[region.index]
        if region.key == MASTER:
            return master
        value = self.opt.optimizer.state.get(master, {}).get(region.key)
        return value if isinstance(value, torch.Tensor) else None

    def _present(self, g: int) -> Iterator[tuple[Region, torch.Tensor]]:
        for region in self.groups[g].regions:
            tensor = self._tensor(region)
            if tensor is not None:
                yield region, tensor

    def _bind(self, g: int, buffer: torch.Tensor) -> None:
        """PARKED -> BOUND: each parked tensor of g becomes a view of its region of `buffer`."""
        storage, base = buffer.untyped_storage(), buffer.storage_offset()
        with torch.no_grad():
            for region, tensor in self._present(g):
                if self._parked.pop(id(tensor), None) is not None:
                    tensor.set_(storage, (base + region.offset) // tensor.element_size(), tensor.shape, tensor.stride())
        self.groups[g].held = Held.BOUND

    def _park(self, g: int) -> None:
        """Each tensor of g gives up its storage (its values are in the file now)."""
        with torch.no_grad():
            for region, tensor in self._present(g):
                tensor.set_(torch.UntypedStorage(region.nbytes), 0, tensor.shape, tensor.stride())
                tensor.untyped_storage().resize_(0)
                self._parked[id(tensor)] = (g, region, tensor)
        self.groups[g].held = Held.PARKED

    def _store(self, g: int, wait: bool, first: bool = False) -> None:
        """BOUND or LOOSE -> PARKED: every tensor's values into g's buffer (those not already
        there: a state created by the step, a LOOSE tensor), the buffer written, the tensors parked.
        `first` (at attach): the masters have no storage yet (precision.make_master's `parked`);
        their values are their compute shards', cast into the buffer."""
        group = self.groups[g]
        if group.held is Held.PARKED:
            return
        buffer = self.pager.resident(g) if group.held is Held.BOUND else self.pager.fresh(g)
        with torch.no_grad():
            for region, tensor in self._present(g):
                if (tensor.dtype, tensor.numel() * tensor.element_size()) != (region.dtype, region.nbytes):
                    raise RuntimeError(
                        f"NVMe swap: optimizer state {region.key!r} of {self.opt.params[region.index].name} is "
                        f"{tensor.dtype} x {tensor.numel()}, its swap region was laid out for {region.dtype}, "
                        f"{region.nbytes} bytes (from the optimizer's first step, foreseen at initialize); an "
                        "optimizer whose state changes shape cannot use the NVMe tier: use offload_optimizer "
                        '"cpu"')
                target = buffer[region.offset:region.offset + region.nbytes].view(region.dtype)
                if first and region.key == MASTER:
                    target.copy_(self.opt.params[region.index].shard_values().reshape(-1))
                elif target.data_ptr() != tensor.data_ptr():
                    target.copy_(tensor.reshape(-1))
        self._park(g)
        self.pager.store(g, wait=wait)

    # ------------------------------------------------------------------ the step
    @contextlib.contextmanager
    def stepping(self, k: int, groups: list[list[int]]) -> Iterator[None]:
        """Around sub-group k of the step's `groups` (its update and its write-back into the
        compute shards): its swap groups in memory; then written back and parked."""
        if k == 0:
            self.begin(groups)
        self.before(k)
        yield
        self.after(k)

    def begin(self, groups: list[list[int]]) -> None:
        """The step's sub-groups (indices into params), in the order they will run."""
        self._sequence = [list(dict.fromkeys(self._group_of[i] for i in group if i in self._group_of))
                          for group in groups]
        if self.offload.pipeline_read and self._sequence:
            self._prefetch(0)

    def _prefetch(self, k: int) -> None:
        if k < len(self._sequence):
            for g in self._sequence[k]:
                if self.groups[g].held is Held.PARKED:
                    self.pager.prefetch(g)

    def before(self, k: int) -> None:
        """Sub-group k's swap groups in memory (BOUND, or LOOSE as they are); k+1's read started."""
        for g in self._sequence[k]:
            if self.groups[g].held is Held.PARKED:
                start = time.perf_counter()
                buffer = self.pager.resident(g)
                self.waited["read"] += time.perf_counter() - start
                self._bind(g, buffer)
        if self.offload.pipeline_read:
            self._prefetch(k + 1)

    def after(self, k: int) -> None:
        """Sub-group k's swap groups written back and PARKED; after the last, every write done."""
        start = time.perf_counter()
        for g in self._sequence[k]:
            self._store(g, wait=not self.offload.pipeline_write)  # waits for a free buffer, too
        if self.offload.pipeline_read:
            self._prefetch(k + 1)
        if k == len(self._sequence) - 1:
            self.pager.drain()
            self._loose = []
        self.waited["write"] += time.perf_counter() - start

    # ------------------------------------------------------------------ outside the step
    def readable(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`'s values: itself when in memory, else (a PARKED tensor or a view of one)
        a new tensor read from its region of the file."""
        base = tensor._base if tensor._base is not None else tensor
        found = self._parked.get(id(base))
        if found is None or found[2] is not base:
            return tensor
        g, region, _ = found
        raw = self.pager.read_range(g, region.offset, aligned_bytes(region.nbytes))[:region.nbytes]
        full = raw.view(region.dtype).view(base.shape)
        return full.as_strided(tensor.shape, tensor.stride(), full.storage_offset() + tensor.storage_offset())

    def loosen(self, master: torch.Tensor) -> None:
        """`master`'s swap group LOOSE; the group loosened before it (if another) stored."""
        index = next((i for i, m in enumerate(self.opt.masters) if m is master), None)
        g = self._group_of.get(index) if index is not None else None
        if g is None:
            return
        for other in [o for o in self._loose if o != g]:
            self._store(other, wait=False)
        self._loose = [g]
        self._make_loose(g)

    def _make_loose(self, g: int) -> None:
        group = self.groups[g]
        if group.held is Held.LOOSE:
            return
        buffer = self.pager.resident(g)
        with torch.no_grad():
            for region, tensor in self._present(g):
                self._parked.pop(id(tensor), None)
                values = buffer[region.offset:region.offset + region.nbytes].view(region.dtype)
                tensor.set_(values.clone().untyped_storage(), 0, tensor.shape, tensor.stride())
        self.pager.release(g)
        group.held = Held.LOOSE

    def store_loose(self) -> None:
        """Every LOOSE group written back and PARKED (the end of a checkpoint load)."""
        for g in range(len(self.groups)):
            self._store(g, wait=False)
        self._loose = []
        if self.pager is not None:
            self.pager.drain()

    def materialize(self) -> None:
        """Every swap group LOOSE: the whole NVMe state in host memory until the next step."""
        for g in range(len(self.groups)):
            self._make_loose(g)

    def close(self) -> None:
        """Wait for the writes, stop the I/O threads, remove this rank's swap folder (never
        raises for a failed write: the step that started it has raised it)."""
        try:
            if self.pager is not None:
                self.pager.close()
        except OSError as exc:  # a failed write was raised by its step already: the files go anyway
            logger.warning("zero3: NVMe swap write failed while closing (%s); removing the swap files", exc)
        finally:
            if self.folder is not None:
                self.folder.remove()
            self.pager = None
            self.folder = None


def staging_beyond_host(count: int, group_bytes: int) -> str | None:
    """Why `count` staging buffers of `group_bytes` cannot be had (more than the host has
    available), or None; checked before anything is allocated or created."""
    need, available = count * aligned_bytes(group_bytes), available_host_bytes()
    if available is None or need <= available:
        return None
    return (f"offload_optimizer nvme: {count} staging buffers (offload_optimizer.buffer_count) of the largest swap "
            f"group, {group_bytes / 2**30:.2f} GiB of masters and optimizer state, need {need / 2**30:.2f} GiB of "
            f"host memory and {available / 2**30:.2f} GiB is available; lower zero_optimization.sub_group_size "
            f"(a swap group holds at most that many elements, or one larger parameter) or buffer_count")


def attached(swap: OptimizerSwap | None, optimizer: SteppedOptimizer) -> OptimizerSwap | NoSwap:
    """`swap` attached to `optimizer` (a collective), or a NoSwap when there is none."""
    if swap is None:
        return NoSwap()
    swap.attach(optimizer)
    return swap
