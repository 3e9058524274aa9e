"""cpu_checkpointing: a checkpoint's saved inputs kept in host memory until its recomputation.

`HostOffload` is a saved-tensor hook pair entered around one reentrant checkpoint call, so it
sees exactly the tensors that checkpoint saves for backward (its inputs; the forward itself
runs under no_grad and saves nothing). Each floating-point device tensor is copied into a
pinned host tensor on a side stream (the copy waits for the producing stream; the device
tensor is marked used by the side stream, so its memory is not reused before the copy ends);
the saved handle keeps only the host copy, so the device input is freed once nothing else
holds it. At unpack (the recomputation, in backward) the copy is brought back to the device on
the current stream after the side stream's copy event.

On the CPU there is nothing to offload to: the tensor is kept as it is (the same storage, no
copy) and counted as offloaded, so the path is the GPU's minus the copies.

Ownership: the pinned host tensor is owned by the saved handle (autograd frees it with the
graph); the device copy made at unpack is the recomputation's. Tensors this hook does not
offload (parameters, integer tensors, tensors already on the host) go to the saved-tensor
hooks that were active outside it (zero3's safety net during a root forward), so those keep
working inside a checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class OffloadCounts:
    """Tensors and bytes offloaded since the last `reset_counts()`, and tensors left to the
    outer saved-tensor hooks (tests and logs read it)."""

    tensors: int = 0
    bytes: int = 0
    deferred: int = 0


COUNTS = OffloadCounts()
_side_streams: dict[torch.device, Any] = {}


def reset_counts() -> None:
    COUNTS.tensors, COUNTS.bytes, COUNTS.deferred = 0, 0, 0


@dataclass
class _OnHost:
    """A saved input moved to the host: the host tensor, where it came from, and the event
    after which the host copy is complete (None on the CPU)."""

    host: torch.Tensor
    device: torch.device
    ready: Any


@dataclass
class _Outer:
    """A saved tensor left to the hooks active outside this one: what they packed."""

    packed: Any


def _side_stream(device: torch.device) -> Any:
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device=device)
    return _side_streams[device]


def _offloadable(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() and not isinstance(tensor, nn.Parameter)


def _to_host(tensor: torch.Tensor) -> _OnHost:
    """Pack: the device tensor copied to pinned host memory on a side stream."""
    COUNTS.tensors += 1
    COUNTS.bytes += tensor.numel() * tensor.element_size()
    if tensor.device.type != "cuda":
        return _OnHost(tensor, tensor.device, None)
    stream = _side_stream(tensor.device)
    stream.wait_stream(torch.cuda.current_stream(tensor.device))
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    with torch.cuda.stream(stream):
        host.copy_(tensor.detach(), non_blocking=True)
        tensor.record_stream(stream)
        ready = torch.cuda.Event()
        ready.record(stream)
    return _OnHost(host, tensor.device, ready)


def _to_device(saved: _OnHost) -> torch.Tensor:
    """Unpack: the host copy back on its device, ordered after the offload copy."""
    if saved.ready is None:
        return saved.host
    torch.cuda.current_stream(saved.device).wait_event(saved.ready)
    return saved.host.to(saved.device, non_blocking=True)


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Enter around one checkpoint call; see the module docstring."""

    def __init__(self) -> None:
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self._outer_pack, self._outer_unpack = outer if outer is not None else (None, None)
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        if _offloadable(tensor):
            return _to_host(tensor)
        if self._outer_pack is None:
            return tensor
        COUNTS.deferred += 1
        return _Outer(self._outer_pack(tensor))

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _OnHost):
            return _to_device(packed)
        if isinstance(packed, _Outer):
            return self._outer_unpack(packed.packed)
        return packed
