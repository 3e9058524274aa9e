"""Where averaged gradient slices end up: each ShardedParam's `grad_shard`.

Gradient shards are fp32, or bf16 with DeepSpeed's bf16_master_weights_and_grads
(`grad_dtype`, optim/precision.py): accumulation over micro-steps then adds in bf16, as
DeepSpeed's bf16 gradient partitions do.

The reducer hands over, for one parameter, this rank's slice of the averaged gradient
(`deliver`); the sink adds it into the parameter's gradient shard on the optimizer's
device. The first slice of an accumulation window (`grad_shard is None`) is written, not
added, so no zero fill is ever paid for.

Each parameter's gradient shard lives where the placement (zero3/placement/devices.py)
puts its optimizer side, one of two ways:
- same device as the slice (the optimizer side on the device, or a CPU-only run): the first slice is
  cast into a fresh fp32 tensor, later ones are added in place. The tensor is dropped by
  the optimizer after its step, so between steps no gradient memory is held.
- host, from a CUDA slice (the optimizer side offloaded): gradient shards are views of
  one page-locked fp32 buffer owned here over the host-side parameters, allocated at first
  use and kept until the placement changes (`placement_changed`) (re-faulting gigabytes of fresh host memory every step costs more
  than the step). The slice is cast to fp32 on the GPU, on the current stream, and
  copied by DMA on a stream of its own, so backward keeps computing while gradients go
  down. The first slice of a window goes straight into its shard (cast to fp32 on the
  GPU); a later one (gradient accumulation) goes down in its own dtype, half the bytes of
  fp32 for a 16-bit model, into a pinned staging tensor that a worker thread adds into the
  shard once its copy is done: the add computes in the shard's dtype as the device path's
  add does (a 16-bit slice into an fp32 shard is cast exactly), so the sum is the device
  path's, bit for bit, and the thread that launches the backward never waits for it. Bounded: when more than `staging_bytes` are staged, the caller waits
  for the oldest add.

- host, with an accumulator on the device (the placement grants one under a budget with
  gradient accumulation, placement/plan.py): until the window's last backward
  (`window_ends`, set by the engine before each forward) the slices are summed in an fp32
  shard on the device, as for a device-side parameter; in the last backward the slice is
  added there and the sum goes down as a window's first slice does (one fp32 copy, its
  norm taken on the GPU), and the device shard is dropped. `ship_held()` sends down what
  is still held (a window whose last backward was not announced) before the optimizer
  reads the gradients.

Invariant: `sp.grad_sq_norm`, when not None, is the squared L2 norm of `sp.grad_shard`
(on the GPU); the host path sets it for a window's first slice and clears it on a second.
Whoever drops a `grad_shard` drops it too.

Invariant: after `finish()` every `grad_shard` holds its complete value and no copy or
add is in flight. Until then a `grad_shard` may still be being written (by the copy
stream or the add worker): nothing but `finish()` reads it.

Fence: `fence` (when set) is called before a slice is written: an optimizer update still
running behind the forward (optim/host_step.py) reads the host buffer, which the next
backward's slices overwrite.

Memory ownership: the slices passed in belong to the caller; a slice read by the copy
stream is marked used by that stream (`record_stream`), so the caching allocator does not
reuse it before the copy is done.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from zero3.params.partition import ShardedParam
from zero3.placement.devices import Placement
from zero3.platform.pinned import pinned_zeros


class GradSink:
    """Accumulates gradient slices into `grad_dtype` gradient shards where `placement` puts
    each parameter's optimizer side."""

    def __init__(self, params: list[ShardedParam], placement: Placement, staging_bytes: int,
                 fence: Callable[[], None] | None = None, grad_dtype: torch.dtype = torch.float32) -> None:
        self.placement = placement
        self.grad_dtype = grad_dtype
        self.params = [sp for sp in params if sp.requires_grad]
        self.staging_bytes = max(int(staging_bytes), 1)
        self._host_views: dict[int, torch.Tensor] | None = None  # id(sp) -> view of the pinned buffer
        self._host_buffer: torch.Tensor | None = None
        self._copy_stream: torch.cuda.Stream | None = None
        self._copies_done: torch.cuda.Event | None = None
        self._staged: deque[tuple[Future, int]] = deque()  # the adds queued on the worker, their bytes
        self._staged_bytes = 0
        self._adder: ThreadPoolExecutor | None = None
        self.fence = fence
        # Whether the backward under way ends the accumulation window (engine: before each
        # forward). True unless told otherwise: gradients then go where their optimizer side is.
        self.window_ends = True
        # Told of each parameter whose slice was delivered, with a call that waits for it to land
        # and whether the window ends with this backward (optim/early_update.py starts host
        # updates from it in the last backward, and learns of gradients that come after).
        self.on_delivery: Callable[[ShardedParam, Callable[[], None], bool], None] | None = None

    # ----------------------------------------------------------------- entry
    def deliver(self, sp: ShardedParam, piece: torch.Tensor) -> None:
        """Add `piece` (this rank's slice of the averaged gradient, at most shard_numel
        elements, any floating dtype) into `sp.grad_shard`."""
        self.deliver_many([(sp, piece)])

    def deliver_many(self, pairs: list[tuple[ShardedParam, torch.Tensor]]) -> None:
        """`deliver` for many slices at once. Slices from a GPU to host shards go down one
        by one (`_deliver_to_host`); the others are written in two fused kernels in all
        (`_write_local`)."""
        if not pairs:
            return
        if self.fence is not None:
            self.fence()
        local = []
        for sp, piece in pairs:
            device = self.placement.state_device(sp)
            if device.type == "cpu" and piece.device.type == "cuda":
                if not self.window_ends and self.placement.accumulates_on_device(sp) and \
                        (sp.grad_shard is None or sp.grad_shard.device.type == "cuda"):
                    local.append((sp, piece))  # summed on the device until the window's last backward
                else:
                    self._deliver_to_host(sp, piece)
            else:
                local.append((sp, piece.to(device)))
        if len({id(sp) for sp, _ in local}) < len(local):  # one parameter's gradient twice: in order
            for pair in local:
                self._write_local([pair])
        elif local:
            self._write_local(local)
        if self.on_delivery is not None:
            landed = self.landed_marker()
            for sp, _ in pairs:
                self.on_delivery(sp, landed, self.window_ends)

    def landed_marker(self) -> Callable[[], None]:
        """A call (for any thread) that returns once every slice delivered so far is in its
        gradient shard: the copies queued on the copy stream and the adds queued on the worker."""
        copied = self._copies_done
        adds = [future for future, _ in self._staged]

        def landed() -> None:
            if copied is not None:
                copied.synchronize()
            for future in adds:
                future.result()

        return landed

    def _write_local(self, pairs: list[tuple[ShardedParam, torch.Tensor]]) -> None:
        """Slices on their gradient shard's device, each parameter once, in one call per
        device (`_write_local_on`)."""
        by_device: dict[torch.device, list[tuple[ShardedParam, torch.Tensor]]] = {}
        for sp, piece in pairs:
            by_device.setdefault(piece.device, []).append((sp, piece))
        for device, on_device in by_device.items():
            self._write_local_on(device, on_device)

    def _write_local_on(self, device: torch.device, pairs: list[tuple[ShardedParam, torch.Tensor]]) -> None:
        """The first slices of the window are cast into views of one fresh `grad_dtype` buffer on
        `device` (`_foreach_copy_`), later ones added (`_foreach_add_`). The buffer lives as
        long as any of its views."""
        first = [(sp, piece) for sp, piece in pairs if sp.grad_shard is None]
        later = [(sp, piece) for sp, piece in pairs if sp.grad_shard is not None]
        if first:
            flat = torch.empty(sum(sp.shard_numel for sp, _ in first), dtype=self.grad_dtype, device=device)
            views, heads = [], []
            offset = 0
            for sp, piece in first:
                shard = flat[offset:offset + sp.shard_numel]
                if piece.numel() < sp.shard_numel:
                    shard[piece.numel():].zero_()  # padding of the last rank's shard
                views.append(shard)
                heads.append(shard[: piece.numel()])
                offset += sp.shard_numel
            torch._foreach_copy_(heads, [piece for _, piece in first])
            for (sp, _), shard in zip(first, views):
                sp.grad_shard = shard
        if later:
            torch._foreach_add_([sp.grad_shard[: piece.numel()] for sp, piece in later],
                                [piece for _, piece in later])

    def finish(self) -> None:
        """Wait for the copies in flight and the adds of what is staged: gradients complete."""
        if self._copies_done is not None:
            self._copies_done.synchronize()
            self._copies_done = None
        while self._staged:
            self._wait_oldest_staged()

    def close(self) -> None:
        """Finish, then stop the add worker (made again at the next staged slice)."""
        self.finish()
        if self._adder is not None:
            self._adder.shutdown(wait=True)
            self._adder = None

    def ship_held(self) -> None:
        """Send down every gradient still summed on the device for a host-side optimizer
        (a window whose last backward was not announced), so the optimizer finds each
        gradient where its optimizer side is. Then `finish()`."""
        for sp in self.params:
            held = sp.grad_shard
            if held is not None and held.device.type == "cuda" and self.placement.state_device(sp).type == "cpu":
                self._deliver_to_host(sp, held[:0])
        self.finish()

    def placement_changed(self) -> None:
        """The placement moved some optimizer sides (between steps, no gradient held): the
        pinned buffer is dropped and made again, over the host-side parameters, at its
        next use."""
        self.finish()
        self._host_buffer = None
        self._host_views = None

    def held_bytes(self) -> int:
        """Bytes of the persistent host buffer (0 when gradients are not kept on the host)."""
        return 0 if self._host_buffer is None else self._host_buffer.numel() * self._host_buffer.element_size()

    # ----------------------------------------------------------------- host path
    def _deliver_to_host(self, sp: ShardedParam, piece: torch.Tensor) -> None:
        """The first slice's squared norm is taken on the GPU on its way down
        (`sp.grad_sq_norm`): a norm over gigabytes of host gradients costs more than
        the CPU optimizer step. A sum held on the device (`window_ends` came) takes `piece`
        and goes down in its place, as the window's first slice."""
        held = sp.grad_shard
        if held is not None and held.device.type == "cuda":
            held[: piece.numel()].add_(piece)
            sp.grad_shard, piece = None, held
        first = sp.grad_shard is None
        source = piece.to(self.grad_dtype) if first and piece.dtype != self.grad_dtype else piece
        if first:
            sp.grad_sq_norm = torch.linalg.vector_norm(source, dtype=torch.float64).square()
        stream = self._stream(source.device)
        stream.wait_stream(torch.cuda.current_stream(source.device))
        source.record_stream(stream)
        with torch.cuda.stream(stream):
            if first:
                shard = self._host_view(sp)
                shard[: source.numel()].copy_(source, non_blocking=True)
                sp.grad_shard = shard
            else:
                sp.grad_sq_norm = None  # a second slice: the norm is the host's to compute
                staging = torch.empty(source.numel(), dtype=source.dtype, pin_memory=True)
                staging.copy_(source, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
                self._stage_add(event, staging, sp.grad_shard)
            self._copies_done = torch.cuda.Event()
            self._copies_done.record(stream)
        while self._staged_bytes > self.staging_bytes and len(self._staged) > 1:
            self._wait_oldest_staged()

    def _stage_add(self, copied: torch.cuda.Event, staging: torch.Tensor, shard: torch.Tensor) -> None:
        """Queue `shard += staging` on the add worker, once `copied` (the copy into the
        pinned `staging`) is done. Adds of one shard run in the order queued (one worker)."""
        if self._adder is None:
            self._adder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero3-grad-add")

        def add() -> None:
            copied.synchronize()
            shard[: staging.numel()].add_(staging)  # in the shard's dtype, as a slice added on the device

        nbytes = staging.numel() * staging.element_size()
        self._staged.append((self._adder.submit(add), nbytes))
        self._staged_bytes += nbytes

    def _wait_oldest_staged(self) -> None:
        """Wait for the oldest queued add (re-raising its failure here)."""
        future, nbytes = self._staged.popleft()
        self._staged_bytes -= nbytes
        future.result()

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device)
        return self._copy_stream

    def _host_view(self, sp: ShardedParam) -> torch.Tensor:
        """`sp`'s slot in the pinned buffer (allocated at first use, zero padding)."""
        if self._host_views is None:
            on_host = [p for p in self.params if self.placement.state_device(p).type == "cpu"]
            total = sum(p.shard_numel for p in on_host)
            self._host_buffer = pinned_zeros(total, self.grad_dtype)
            self._host_views = {}
            offset = 0
            for p in on_host:
                self._host_views[id(p)] = self._host_buffer[offset:offset + p.shard_numel]
                offset += p.shard_numel
        return self._host_views[id(sp)]
