"""Page-locked (pinned) host memory of exactly the bytes asked for.

torch's pinned allocations (`tensor.pin_memory()`, `pin_memory=True`) come from its caching
host allocator, which rounds each request up to a power of two (a 4096 x 11008 fp32 master,
172 MiB, takes 256 MiB) and keeps freed blocks for reuse instead of returning them. For the
long-lived host state of an offloaded run (parameter shards, fp32 masters, optimizer state,
the gradient buffer: tens of gigabytes) that costs up to a third more host memory than the
state itself, enough to run a 128 GiB host out of memory under a 6.7B full fine-tune.

Here a large request gets an anonymous mapping of its own (page-aligned, sharing no page
with anything else), registered with CUDA (`cudaHostRegister`) so that copies to and from it
are asynchronous DMA like any pinned tensor's. Ownership follows the tensors, as for any
torch tensor: the mapping lives while a tensor or view of it lives; when the last one dies the
device is synchronised (a copy may still be reading it), the range unregistered, and only
then unmapped. Requests under `EXACT_MIN_BYTES`, a failed registration, or a machine
without CUDA fall back to torch's own pinning (no pinning at all without CUDA).

Use it for memory that lives across steps; transient staging buffers are better served by
torch's caching allocator, which reuses them.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from typing import Callable

import torch

EXACT_MIN_BYTES = 1 << 20

_lock = threading.Lock()
_registered = [0]  # bytes registered by this module and not yet released


def registered_bytes() -> int:
    """Host bytes this module holds page-locked right now (for reports and tests)."""
    return _registered[0]


def pinned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised pinned host tensor of `numel` elements (zeros when the exact path is
    taken: fresh anonymous pages). Not pinned where CUDA is absent."""
    if not torch.cuda.is_available():
        return torch.empty(numel, dtype=dtype, device="cpu")
    nbytes = numel * dtype.itemsize
    if nbytes >= EXACT_MIN_BYTES:
        exact = _registered_tensor(nbytes)
        if exact is not None:
            return exact.view(dtype)[:numel]
    return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=True)  # explicit: a torch.device context may say cuda


def pinned_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    if not torch.cuda.is_available():
        return torch.zeros(numel, dtype=dtype, device="cpu")
    tensor = pinned_empty(numel, dtype)
    return tensor if registered_block_of(tensor) else tensor.zero_()


def pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of `tensor` (any device), same shape and dtype, contiguous. The
    caller owns it; `tensor` is not changed."""
    if not torch.cuda.is_available():
        return tensor.to("cpu", copy=True).contiguous()
    flat = pinned_empty(tensor.numel(), tensor.dtype)
    out = flat.view(tensor.shape)
    out.copy_(tensor)
    return out


def registered_block_of(tensor: torch.Tensor) -> bool:
    """True when `tensor` lives in a mapping this module registered."""
    with _lock:
        return any(start <= tensor.data_ptr() < start + size for start, size in _blocks.values())


# ------------------------------------------------------------------ the blocks
_blocks: dict[int, tuple[int, int]] = {}  # id(block) -> (address, bytes)
_block_types: dict[int, type] = {}


def _registered_tensor(nbytes: int) -> torch.Tensor | None:
    """A uint8 tensor over a fresh registered mapping of `nbytes`, or None where CUDA refuses
    to register it."""
    block = exact_block(nbytes, _unregister)
    address = ctypes.addressof(block)
    if torch.cuda.cudart().cudaHostRegister(address, nbytes, 0) != 0:
        block.release = None  # nothing to undo
        return None
    with _lock:
        _blocks[id(block)] = (address, nbytes)
        _registered[0] += nbytes
    return torch.frombuffer(block, dtype=torch.uint8)


def _unregister(block_id: int, address: int, nbytes: int) -> None:
    with _lock:
        if _blocks.pop(block_id, None) is None:
            return
        _registered[0] -= nbytes
    try:
        torch.cuda.synchronize()  # a copy queued from or into it must finish first
        torch.cuda.cudart().cudaHostUnregister(address)
    except Exception:  # noqa: BLE001 - interpreter shutdown: the process is ending anyway
        pass


def exact_block(nbytes: int, on_release: Callable[[int, int, int], None]) -> ctypes.Array:
    """`nbytes` of fresh anonymous memory as a ctypes byte array (it exports the buffer
    torch.frombuffer views). `on_release(id, address, nbytes)` runs when the last reference
    to the array goes (every tensor over it dead), before the mapping is unmapped: the
    array holds the mapping, and its finaliser runs before its references are dropped."""
    mapping = mmap.mmap(-1, nbytes)
    block = _block_type(nbytes).from_buffer(mapping)
    block.release = on_release
    return block


def _block_type(nbytes: int) -> type:
    kind = _block_types.get(nbytes)
    if kind is None:
        def finalise(self) -> None:
            if self.release is not None:
                self.release(id(self), ctypes.addressof(self), nbytes)

        kind = type("ExactHostBlock", (ctypes.c_uint8 * nbytes,), {"__del__": finalise, "release": None})
        _block_types[nbytes] = kind
    return kind
