"""Page-aligned host staging buffers for the swap files (DeepSpeed's `buffer_count`).

`aligned_bytes(n)`: n rounded up to 4096, the unit of direct I/O. `BufferPool` holds
`count` buffers of `size` bytes each (a multiple of 4096), every one starting on a
4096-byte boundary (a uint8 tensor cut from a slightly larger allocation), pinned when
asked and CUDA is there. `take()` blocks until one is free; `give(buffer)` returns it.

Memory: the pool owns its buffers for its whole life (count * size bytes of host memory,
allocated once, never resized); a taken buffer is the taker's until given back.
"""

from __future__ import annotations

import threading

import torch

from zero3.platform.pinned import pinned_empty

ALIGN = 4096


def aligned_bytes(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A uint8 tensor of `nbytes` (rounded up to 4096) whose first byte is 4096-aligned.
    Pinned ones come from platform/pinned.py, page-aligned at their exact size where it can
    (torch's pinned allocator would round 256 MiB and the alignment slack up to 512 MiB)."""
    size = aligned_bytes(nbytes)
    pin = pin and torch.cuda.is_available()
    if pin:
        exact = pinned_empty(size, torch.uint8)
        if exact.data_ptr() % ALIGN == 0:
            return exact
    raw = torch.empty(size + ALIGN, dtype=torch.uint8, device="cpu", pin_memory=pin)
    start = (-raw.data_ptr()) % ALIGN
    return raw[start:start + size]


class BufferPool:
    """`count` aligned buffers of `size` bytes; taking one waits for a free one."""

    def __init__(self, count: int, size: int, pin: bool = False) -> None:
        self.size = aligned_bytes(size)
        self._free = [aligned_empty(self.size, pin) for _ in range(count)]
        self.count = count
        self._ready = threading.Condition()

    def take(self) -> torch.Tensor:
        with self._ready:
            while not self._free:
                self._ready.wait()
            return self._free.pop()

    def try_take(self) -> torch.Tensor | None:
        """A free buffer, or None at once when there is none."""
        with self._ready:
            return self._free.pop() if self._free else None

    def give(self, buffer: torch.Tensor) -> None:
        with self._ready:
            self._free.append(buffer)
            self._ready.notify()

    @property
    def nbytes(self) -> int:
        return self.count * self.size
