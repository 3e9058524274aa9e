"""Checkpointed decoder layers whose saved input (the hidden states) waits on the host.

`checkpoint_on_host(layer_call, recompute_call, hidden, store)` runs `layer_call(hidden)`
under no_grad and keeps only `hidden`, copied to pinned host memory on a side stream; in
backward it brings the copy back, runs `recompute_call(hidden)` with grad and back-propagates
through it. At long sequences these inputs are the activations that remain (32 layers of a
256K-token, 4096-wide model hold 64 GiB in bf16): on the host they cost the card nothing.

Overlap: the copy down starts on the side stream as soon as the layer's input exists (it
waits for the compute stream's work up to then) and runs beside the layer's compute; the
device tensor is marked used by the side stream, so its memory is not reused before the copy
ends. In backward, layer k's recomputation first asks for layer k-1's copy up
(`HostStore.prefetch`), which runs beside layer k's backward; layer k-1 then waits only for
an event. On the CPU there is nothing to offload to: the tensor is kept as it is (no copy),
so the path is the GPU's minus the copies.

RNG: the CPU and device RNG states at the forward are restored for the recomputation (dropout
draws the same masks).

A LoRA model's first layer may get an input that needs no gradient while its parameters do:
a zero-element tensor that requires grad is passed along, so the layer's output always
requires grad and its backward always runs.

Ownership: the store owns the pinned buffers, one pool per (shape, dtype), reused from step
to step (pinning gigabytes is slow); an entry holds a buffer from its forward until its
backward has copied it up, then returns it to the pool. The device copy made at backward
belongs to the recomputation.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch


class _Entry:
    """One saved layer input: on the host (`host`, with the copy's event) or back on the
    device (`device`, with the copy-up's event)."""

    def __init__(self, index: int, original: torch.Tensor) -> None:
        self.index = index
        self.shape, self.dtype, self.device = original.shape, original.dtype, original.device
        self.requires_grad = original.requires_grad
        self.kept: torch.Tensor | None = None      # CPU runs: the tensor itself
        self.host: torch.Tensor | None = None
        self.down: torch.cuda.Event | None = None
        self.up_tensor: torch.Tensor | None = None
        self.up: torch.cuda.Event | None = None
        self.consumed = False


class HostStore:
    """The host copies of one model's checkpointed layer inputs, in forward order."""

    def __init__(self) -> None:
        self.entries: list[_Entry] = []
        self.pool: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        self._stream: torch.cuda.Stream | None = None
        self.bytes_offloaded = 0

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    def save(self, hidden: torch.Tensor) -> _Entry:
        """Start the copy down of `hidden` (a new entry, after the previous ones)."""
        if self.entries and all(e.consumed for e in self.entries):
            self.entries.clear()  # every entry of the last forward was used by its backward
        entry = _Entry(len(self.entries), hidden)
        self.entries.append(entry)
        if hidden.device.type != "cuda":
            entry.kept = hidden.detach()
            return entry
        stream = self._side_stream(hidden.device)
        stream.wait_stream(torch.cuda.current_stream(hidden.device))
        host = self._buffer(hidden)
        with torch.cuda.stream(stream):
            host.copy_(hidden.detach(), non_blocking=True)
            entry.down = torch.cuda.Event()
            entry.down.record(stream)
        hidden.record_stream(stream)
        entry.host = host
        self.bytes_offloaded += hidden.numel() * hidden.element_size()
        return entry

    def _buffer(self, like: torch.Tensor) -> torch.Tensor:
        free = self.pool[(tuple(like.shape), like.dtype)]
        if free:
            return free.pop()
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=True)

    def prefetch(self, index: int) -> None:
        """Start the copy up of entry `index` (a no-op if there is none or it is started)."""
        if not 0 <= index < len(self.entries):
            return
        entry = self.entries[index]
        if entry.host is None or entry.up_tensor is not None:
            return
        stream = self._side_stream(entry.device)
        with torch.cuda.stream(stream):
            stream.wait_event(entry.down)
            entry.up_tensor = torch.empty(entry.shape, dtype=entry.dtype, device=entry.device)
            entry.up_tensor.copy_(entry.host, non_blocking=True)
            entry.up = torch.cuda.Event()
            entry.up.record(stream)

    def load(self, entry: _Entry) -> torch.Tensor:
        """The saved input back on its device (waits for its copy up on the compute stream);
        its host buffer goes back to the pool once the copy is done."""
        entry.consumed = True
        if entry.kept is not None:
            value, entry.kept = entry.kept, None
            return value
        self.prefetch(entry.index)
        current = torch.cuda.current_stream(entry.device)
        current.wait_event(entry.up)
        value = entry.up_tensor
        value.record_stream(current)
        entry.up.synchronize()  # the host buffer may be reused only after the copy read it
        self.pool[(tuple(entry.shape), entry.dtype)].append(entry.host)
        entry.host = entry.up_tensor = None
        return value

    def host_bytes(self) -> int:
        """Pinned bytes held (in the pool and by live entries)."""
        pooled = sum(t.numel() * t.element_size() for free in self.pool.values() for t in free)
        live = sum(e.host.numel() * e.host.element_size() for e in self.entries if e.host is not None)
        return pooled + live


class _HostCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, layer_call: Callable, recompute_call: Callable, store: HostStore,
                hidden: torch.Tensor, _grad_anchor: torch.Tensor) -> Any:
        ctx.recompute_call, ctx.store = recompute_call, store
        ctx.cpu_rng = torch.get_rng_state()
        ctx.device_rng = torch.cuda.get_rng_state(hidden.device) if hidden.device.type == "cuda" else None
        ctx.entry = store.save(hidden)
        with torch.no_grad():
            output = layer_call(hidden)
        ctx.single = torch.is_tensor(output)
        return output if ctx.single else tuple(output)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor):
        store, entry = ctx.store, ctx.entry
        hidden = store.load(entry).detach().requires_grad_(entry.requires_grad)
        store.prefetch(entry.index - 1)  # the previous layer's input comes up behind this backward
        with torch.random.fork_rng(devices=[hidden.device] if ctx.device_rng is not None else []):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.device_rng is not None:
                torch.cuda.set_rng_state(ctx.device_rng, hidden.device)
            with torch.enable_grad():
                output = ctx.recompute_call(hidden)
        outputs = [output] if torch.is_tensor(output) else list(output)
        pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return None, None, None, hidden.grad if entry.requires_grad else None, None


def checkpoint_on_host(layer_call: Callable, recompute_call: Callable, hidden: torch.Tensor, store: HostStore) -> Any:
    """The module docstring's checkpoint of one layer; returns what `layer_call` returns."""
    anchor = torch.empty(0, device=hidden.device, requires_grad=True)
    return _HostCheckpoint.apply(layer_call, recompute_call, store, hidden, anchor)
