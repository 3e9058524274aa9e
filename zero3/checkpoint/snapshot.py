"""A rank's checkpoint tensors copied into host memory, for a save written in the background.

An asynchronous save (checkpoint/async_save.py) must return to training before its files
are written, so the values it writes are copied first, while training is stopped, into
one host buffer that this module owns (`HostSnapshot`):

- the buffer is one flat uint8 tensor holding every tensor of the rank's shard file back
  to back, in the file's order (each slice 64-byte aligned). `reserve` allocates it ahead
  of the first save (the engine does at initialize when checkpoint.async_save is on, or at
  `engine.prepare_async_checkpoint()`), sized for a save once the optimizer has stepped,
  and writes every page of a pageable buffer once (zeros), so the first save copies at
  the speed of the later ones: an untouched allocation would take a page fault per 4 KiB
  inside the first copy (about 3x its time on CPU). Without `reserve`, the first save
  allocates it. Either way it is kept for the next saves, since allocating, and above all
  pinning, gigabytes takes longer than copying them. It grows when a save needs more (a
  save inside an accumulation window also holds the gradient shards) and is freed by
  `release()`;
- pinned (page-locked) when any source tensor is on an accelerator, so the copies run at
  the bus's speed, issued on a side stream that first waits for the compute stream's
  work, and awaited before `take` returns: once it returns, training may change the
  sources freely;
- before allocating, the host's available memory (MemAvailable) is checked: a buffer that
  cannot be had is a `CheckpointError` naming the bytes needed and available, raised
  before anything is written.

Ownership: the buffer and the views `take` returns belong to the HostSnapshot. A view
stays valid until the next `take` or `release`; the caller (the background writer) must
be done with them by then, which the one-save-in-flight rule of async_save.py ensures.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from zero3.checkpoint.errors import CheckpointError
from zero3.checkpoint.files import TensorSpec
from zero3.platform.memory import available_host_bytes

ALIGN = 64
# Left free beside the snapshot, so that the rest of the process and the page cache of the
# writes have room: a snapshot that would leave less is refused.
HEADROOM_BYTES = 1 << 30


def snapshot_bytes(specs: Sequence[TensorSpec]) -> int:
    """Host bytes a snapshot of `specs` takes (each tensor's bytes, 64-byte aligned)."""
    return sum(_aligned(spec.nbytes) for spec in specs)


class HostSnapshot:
    """The host buffer of one rank's asynchronous saves (see the module docstring)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    @property
    def held_bytes(self) -> int:
        """Host bytes this snapshot holds now (0 before the first save and after release)."""
        return 0 if self._buffer is None else self._buffer.numel()

    @property
    def pinned(self) -> bool:
        return self._buffer is not None and self._buffer.is_pinned()

    @property
    def buffer(self) -> torch.Tensor | None:
        """The buffer itself (None when none is held); the snapshot's, for reading only."""
        return self._buffer

    def reserve(self, specs: Sequence[TensorSpec], sources: Sequence[torch.Tensor], rank: int) -> int:
        """Hold, from now on, the buffer a `take` of `specs` from `sources` needs (pinned when a
        source is on an accelerator), every page of a pageable one written once; the bytes held.

        A buffer already big enough, pinned alike, is kept. `sources` are only looked at
        for their device (meta tensors stand for state not created yet). Raises
        CheckpointError when the buffer cannot be allocated (then none is held)."""
        need, pin = snapshot_bytes(specs), _pin_for(sources)
        if not self._fits(need, pin):
            buffer = self._buffer_for(need, pin, rank)
            if not pin:  # page-locked memory is resident once allocated; pageable is not
                buffer.zero_()
        return self.held_bytes

    def take(self, specs: Sequence[TensorSpec], producers: Sequence[Callable[[], torch.Tensor]],
             rank: int) -> list[torch.Tensor]:
        """Copy every producer's tensor into the buffer; host views of them, in `specs` order.

        Returns once every copy is complete. Raises CheckpointError, before copying
        anything, when the buffer cannot be allocated."""
        sources = [producer() for producer in producers]
        pin = _pin_for(sources)
        buffer = self._buffer_for(snapshot_bytes(specs), pin=pin, rank=rank)
        views = _views(buffer, specs)
        if pin:
            _copy_on_side_stream(views, sources)
        else:
            with torch.no_grad():
                for view, source in zip(views, sources):
                    view.copy_(source.detach().reshape(view.shape))
        return views

    def release(self) -> None:
        """Free the buffer (the next `take` allocates again)."""
        self._buffer = None

    def _fits(self, need: int, pin: bool) -> bool:
        current = self._buffer
        return current is not None and current.numel() >= need and current.is_pinned() == pin

    def _buffer_for(self, need: int, pin: bool, rank: int) -> torch.Tensor:
        """The buffer, allocated anew (untouched) unless it holds `need` bytes, pinned alike."""
        if self._fits(need, pin):
            return self._buffer
        self._buffer = None  # the old buffer goes before the new one is allocated
        check_host_memory(need, rank)
        try:
            self._buffer = torch.empty(max(need, 1), dtype=torch.uint8, pin_memory=pin)
        except RuntimeError as exc:  # an allocation refused by the system or the driver
            raise CheckpointError(
                f"rank {rank}: cannot allocate the {_gib(need)} host buffer of an asynchronous save "
                f"({'pinned' if pin else 'pageable'}): {exc}; free host memory, or save synchronously "
                "(async_save=False, or checkpoint.async_save: false); nothing was written") from exc
        return self._buffer


def check_host_memory(need: int, rank: int) -> None:
    """CheckpointError when `need` bytes (plus HEADROOM_BYTES) are not available on the host."""
    available = available_host_bytes()
    if available is None or need + HEADROOM_BYTES <= available:
        return
    raise CheckpointError(
        f"rank {rank}: an asynchronous save needs a host buffer of {_gib(need)} (this rank's shards, "
        f"masters and optimizer state) and {_gib(HEADROOM_BYTES)} beside it, but only {_gib(available)} of "
        "host memory is available; save synchronously (async_save=False, or checkpoint.async_save: false), "
        "use more ranks, or free host memory; nothing was written")


def _pin_for(sources: Sequence[torch.Tensor]) -> bool:
    """Whether a snapshot of `sources` is pinned: when one is on an accelerator (CUDA here)."""
    return torch.cuda.is_available() and any(t.device.type not in ("cpu", "meta") for t in sources)


def _views(buffer: torch.Tensor, specs: Sequence[TensorSpec]) -> list[torch.Tensor]:
    views, offset = [], 0
    for spec in specs:
        raw = buffer[offset: offset + spec.nbytes]
        views.append(raw.view(spec.dtype).view(spec.shape) if spec.nbytes else
                     torch.empty(spec.shape, dtype=spec.dtype))
        offset += _aligned(spec.nbytes)
    return views


def _copy_on_side_stream(views: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Device-to-host copies on a side stream that starts after the compute stream's work."""
    device = next(t.device for t in sources if t.device.type == "cuda")
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.no_grad(), torch.cuda.stream(stream):
        for view, source in zip(views, sources):
            view.copy_(source.detach().reshape(view.shape), non_blocking=True)
    stream.synchronize()


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"
