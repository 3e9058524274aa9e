"""The wire: the one path by which parameter shards become whole parameters.

Every gather of managed parameters goes through `GatherWire`: one coalesced all-gather
per dtype group, carrying the divergence header (`divergence.py`) in front of each rank's
payload, so that ranks whose control flow differs raise `DivergenceError` instead of
hanging or mixing values. Prefetches are the same all-gather issued asynchronously (on a
side stream on CUDA) and finished by `Communicator.complete`/`drain`.

`gather_rows` is the unguarded primitive under it, also used where the order of gathers
is fixed by construction rather than by the model's control flow: `zero3.Init`'s
materialization (model construction is SPMD), the engine's resident refresh after a step
and the adoption of resident parameters at initialize, and the offline export.

NVMe-tier shards (nvme_shards.py) are bound to host staging buffers, after the fence, only
while the send buffer is filled; their reads were started ahead by the look-ahead.

Memory: the send and receive buffers are temporaries of one gather (of one prefetch,
until it completes); the values land in each parameter's own storage
(`ShardedParam.finish_gather`). Before a group's shards are read, `shard_fence(group)`
lets an optimizer update still running behind the forward publish them (optim/host_step.py).

Counts: `live_numel` is the number of non-persistent elements FULL or GATHERING; the
wire adds what it gathers, the releaser (`Fetcher.drop`) subtracts what it frees.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

from zero3.params.divergence import HEADER_BYTES, HEADER_WORDS, GatherGuard, Phase, Site
from zero3.params.partition import ShardedParam
from zero3.platform.collectives import Communicator, Pending

T = TypeVar("T")


def group_by_dtype(items: Iterable[T], dtype_of: Callable[[T], torch.dtype] = lambda sp: sp.dtype
                   ) -> list[tuple[torch.dtype, list[T]]]:
    """`items` grouped by dtype, groups in first-seen order, items in their given order."""
    groups: dict[torch.dtype, list[T]] = {}
    for item in items:
        groups.setdefault(dtype_of(item), []).append(item)
    return list(groups.items())


def gather_rows(comm: Communicator, local: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Every rank's flat `local` (same numel everywhere) as rows: [world_size, numel].

    A collective with no divergence header: only for gathers whose order every rank fixes
    by construction (see the module docstring). At world size 1 it is a copy of `local`.
    """
    local = local.detach().reshape(-1).to(device)
    rows = torch.empty(comm.world_size * local.numel(), dtype=local.dtype, device=device)
    comm.all_gather_into(rows, local)
    return rows.view(comm.world_size, local.numel())


class GatherWire:
    """Guarded, coalesced all-gathers of parameter groups (synchronous and prefetched)."""

    def __init__(self, comm: Communicator, compute_device: torch.device, guard: GatherGuard,
                 param_index: dict[int, int], shards_on_host: bool,
                 shard_fence: Callable[[list[ShardedParam]], None] | None = None) -> None:
        self.comm = comm
        self.compute_device = compute_device
        self.guard = guard
        self._param_index = param_index  # id(ShardedParam) -> position in the parameter table
        self.live_numel = 0
        self.check_ins = 0  # header-only exchanges (check_in): counted so a step's collectives add up
        self.shard_fence = shard_fence
        self.side_stream = torch.cuda.Stream(compute_device) if compute_device.type == "cuda" else None
        self.shards_on_host = self.side_stream is not None and shards_on_host
        self._shards_ready: torch.cuda.Event | None = None

    # ------------------------------------------------------------ sites
    def site(self, group: list[ShardedParam], dtype: torch.dtype, phase: Phase, unit_index: int) -> Site:
        return Site(phase, unit_index, self._param_index.get(id(group[0]), -1), len(group),
                    sum(sp.shard_numel for sp in group) * dtype.itemsize)

    def mark_shards_ready(self) -> None:
        """Start of a forward (CUDA): prefetches on the side stream wait for what the
        current stream queued before this point (the optimizer's shard updates)."""
        if self.side_stream is not None:
            self._shards_ready = torch.cuda.Event()
            self._shards_ready.record()

    # ------------------------------------------------------ synchronous
    def gather(self, group: list[ShardedParam], dtype: torch.dtype, phase: Phase, unit_index: int) -> None:
        """SHARDED -> FULL for one dtype group: one guarded all-gather (none at world size 1)."""
        site = self.site(group, dtype, phase, unit_index)
        if not self.comm.active:  # world size 1: the concatenated shards are the values
            values = self._send_buffer(group, dtype, 0).view(dtype).view(1, -1)
        else:
            values = self._guarded_all_gather(site, group, dtype)
        self.live_numel += sum(sp.numel for sp in group)
        offset = 0
        for sp in group:
            sp.begin_gather()
            sp.finish_gather(values[:, offset:offset + sp.shard_numel])
            offset += sp.shard_numel

    def _guarded_all_gather(self, site: Site, group: list[ShardedParam], dtype: torch.dtype) -> torch.Tensor:
        """[world_size, elements] of every rank's shards, after the headers agreed.

        Every rank sends a payload of the predicted size (the same on every rank): its
        shards if its site is the predicted one, zeros otherwise; a shared misprediction
        costs a second all-gather with the real payload.
        """
        world = self.comm.world_size
        own = self.guard.header(site)
        predicted = self.guard.predict()
        hit = predicted == site
        if predicted is None:
            self._all_gather_headers(own)
        else:
            send = self._send_buffer(group if hit else None, dtype, predicted.nbytes, own)
            rows = self._all_gather(send).view(world, -1)
            self.guard.check(rows[:, :HEADER_BYTES].contiguous().view(torch.int64), own, now=not hit)
        if not hit:
            self.guard.mispredicted += 1
            rows = self._all_gather(self._send_buffer(group, dtype, site.nbytes)).view(world, -1)
            self.guard.observe(site)
            return rows.view(dtype)
        self.guard.observe(site)
        return rows[:, HEADER_BYTES:].view(dtype)

    def check_in(self, unit_index: int) -> None:
        """A header-only exchange: units entered since the last gather (resident parameters
        only) must match on every rank too."""
        self.check_ins += 1
        site = Site(Phase.CHECK, unit_index, -1, 0, 0)
        own = self.guard.header(site)
        predicted = self.guard.predict()
        self._agree_headers(own, predicted, now=predicted != site)
        self.guard.observe(site)

    # ----------------------------------------------------- asynchronous
    def gather_async(self, group: list[ShardedParam], dtype: torch.dtype, unit_index: int,
                     on_done: Callable[[], None]) -> Pending:
        """Start SHARDED -> GATHERING -> FULL for a prefetch; done when the returned handle
        completes (`Communicator.complete` / `drain`), after which `on_done()` runs.

        A correctly predicted site sends its header with the payload (checked when the
        gather completes); otherwise the headers are agreed first, synchronously, and the
        payload follows alone. On CUDA the send buffer is built, and the collective issued,
        on a side stream, so neither waits for the compute queued on the current stream.
        """
        header = self._prefetch_header(group, dtype, unit_index) if self.comm.active else None
        for sp in group:
            sp.begin_gather()
        self.live_numel += sum(sp.numel for sp in group)
        stream = self.side_stream
        if stream is None:
            return self._issue(group, dtype, header, on_done)
        if self._shards_ready is not None:
            stream.wait_event(self._shards_ready)
        with torch.cuda.stream(stream):
            return self._issue(group, dtype, header, on_done)

    def _issue(self, group: list[ShardedParam], dtype: torch.dtype, header: list[int] | None,
               on_done: Callable[[], None]) -> Pending:
        send = self._send_buffer(group, dtype, 0, header)
        recv = send if not self.comm.active else torch.empty(
            self.comm.world_size * send.numel(), dtype=torch.uint8, device=send.device)

        def finish() -> None:
            self._finish_async(group, dtype, send, recv, header)
            on_done()

        return self.comm.all_gather_into_async(recv, send, finish)

    def _prefetch_header(self, group: list[ShardedParam], dtype: torch.dtype, unit_index: int) -> list[int] | None:
        """The header to send with a prefetch, or None when it was agreed on beforehand."""
        site = self.site(group, dtype, Phase.PREFETCH, unit_index)
        own = self.guard.header(site)
        predicted = self.guard.predict()
        hit = predicted == site
        if not hit:
            self._agree_headers(own, predicted, now=True)
            self.guard.mispredicted += 1
        self.guard.observe(site)
        return own if hit else None

    def _finish_async(self, group: list[ShardedParam], dtype: torch.dtype, send: torch.Tensor,
                      recv: torch.Tensor, header: list[int] | None) -> None:
        """A prefetch completed: check its headers, write the values into the parameters.

        Runs on the current stream, which `drain`/`complete` made wait for the gather; the
        buffers were allocated on the side stream and are marked used here, so the
        allocator does not hand them out again before this stream is done with them."""
        if self.side_stream is not None:
            current = torch.cuda.current_stream(recv.device)
            send.record_stream(current)
            recv.record_stream(current)
        rows = recv.view(self.comm.world_size, -1)
        if header is not None:
            self.guard.check(rows[:, :HEADER_BYTES].contiguous().view(torch.int64), header, now=False)
            rows = rows[:, HEADER_BYTES:]
        values = rows.view(dtype)
        offset = 0
        for sp in group:
            sp.finish_gather(values[:, offset:offset + sp.shard_numel])
            offset += sp.shard_numel

    # ------------------------------------------------------------ buffers
    def _agree_headers(self, own: list[int], predicted: Site | None, now: bool) -> None:
        """Exchange and check headers: alone (fixed size) when nothing was predicted, else
        in a payload of the predicted size, as the other ranks send it."""
        world = self.comm.world_size
        if predicted is None:
            send = torch.tensor(own, dtype=torch.int64, device=self.compute_device)
            self.guard.check(self._all_gather(send).view(world, HEADER_WORDS), own, now=True)
            return
        rows = self._all_gather(self._send_buffer(None, torch.uint8, predicted.nbytes, own)).view(world, -1)
        self.guard.check(rows[:, :HEADER_BYTES].contiguous().view(torch.int64), own, now=now)

    def _all_gather_headers(self, own: list[int]) -> None:
        self._agree_headers(own, None, now=True)

    def _send_buffer(self, group: list[ShardedParam] | None, dtype: torch.dtype, nbytes: int,
                     header: list[int] | None = None) -> torch.Tensor:
        """A uint8 send buffer: [header] + the group's shards (or `nbytes` zeros if None).
        NVMe-tier shards are bound to their staging buffers for the copy (nvme_shards.py)."""
        head = HEADER_BYTES if header is not None else 0
        backed: list[ShardedParam] = []
        if group is not None:
            nbytes = sum(sp.shard_numel for sp in group) * dtype.itemsize
            if self.shard_fence is not None:
                self.shard_fence(group)
            backed = [sp for sp in group if sp.backing is not None]
        send = torch.empty(head + nbytes, dtype=torch.uint8, device=self.compute_device)
        if header is not None:
            send[:head].view(torch.int64).copy_(torch.tensor(header, dtype=torch.int64))
        if group is None:
            send[head:].zero_()
            return send
        if backed:
            backed[0].backing.bind(backed)
        try:
            self._copy_shards(group, send[head:].view(dtype))
        finally:
            if backed:
                backed[0].backing.unbind(backed)
        return send

    def _copy_shards(self, group: list[ShardedParam], payload: torch.Tensor) -> None:
        """The group's shards, in order, into `payload` (on the compute device)."""
        if group[0].shard.device.type == "cpu" and self.compute_device.type != "cpu":
            offset = 0  # host shards: each copied straight into place
            for sp in group:
                payload[offset:offset + sp.shard_numel].copy_(sp.shard, non_blocking=True)
                offset += sp.shard_numel
        else:
            torch.cat([sp.shard.to(self.compute_device, non_blocking=True) for sp in group], out=payload)

    def _all_gather(self, send: torch.Tensor) -> torch.Tensor:
        recv = torch.empty(self.comm.world_size * send.numel(), dtype=send.dtype, device=send.device)
        self.comm.all_gather_into(recv, send)
        return recv
