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

Where host memory runs out: at the first save of each forward the store decides how many of
that forward's `layer_count` inputs the host keeps: all of them while they fit the host's
share (`host_bytes`; "auto", None: on a GPU, the host's available memory divided among the
ranks on this machine, less a reserve of a tenth of its memory (at least 4 GiB), plus what the
store already holds; on the CPU no bound), and the ranks agree on the smallest count (one
small all-reduce). The earliest layers' inputs beyond it go to the NVMe tier
(hidden_spill.py), which backward reads last; without `long_sequence.nvme_path` a forward
that does not fit is refused on every rank before anything is copied, saying how much it
needs and how to fix it.

Ownership: the store owns the pinned buffers, one pool per (shape, dtype), reused from step
to step (pinning gigabytes is slow) and trimmed to the count the host keeps; an entry holds a
buffer from its forward until its backward has copied it up, then returns it to the pool.
The device copy made at backward belongs to the recomputation. The spill tier, when there is
one, is the store's; `close()` ends it.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zero3.platform.memory import available_host_bytes, total_host_bytes
from zero3.platform.pinned import pinned_empty
from zero3.sequence.hidden_spill import HiddenSpill, SpillSettings

GIB = 1 << 30
MIN_HOST_RESERVE = 4 * GIB
HOST_RESERVE_SHARE = 0.1


class HiddenStatesDoNotFitError(RuntimeError):
    """A forward's checkpointed layer inputs need more host memory than its share, and no
    NVMe tier is configured (the message says how much and what to set)."""


class _Entry:
    """One saved layer input: on the host (`host`, with the copy's event) or back on the
    device (`device`, with the copy-up's event)."""

    def __init__(self, index: int, original: torch.Tensor) -> None:
        self.index = index
        self.shape, self.dtype, self.device = original.shape, original.dtype, original.device
        self.requires_grad = original.requires_grad
        self.spilled = None                         # in the NVMe tier (hidden_spill._Spilled)
        self.kept: torch.Tensor | None = None      # CPU runs: the tensor itself
        self.host: torch.Tensor | None = None
        self.down: torch.cuda.Event | None = None
        self.up_tensor: torch.Tensor | None = None
        self.up: torch.cuda.Event | None = None
        self.consumed = False


class HostStore:
    """The host copies of one model's checkpointed layer inputs, in forward order.
    `layer_count`: the checkpointed layers of one forward; `host_bytes`: the host's share
    (None: "auto", module docstring); `spill`: the NVMe tier's settings, or None."""

    def __init__(self, layer_count: int = 0, host_bytes: int | None = None, spill: SpillSettings | None = None) -> None:
        self.entries: list[_Entry] = []
        self.pool: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        self._stream: torch.cuda.Stream | None = None
        self.layer_count, self.host_share, self.spill_settings = layer_count, host_bytes, spill
        self._spill: HiddenSpill | None = None
        self.spill_below = 0  # this forward's inputs with a smaller index go to the NVMe tier
        self.bytes_offloaded = 0
        self.bytes_spilled = 0

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    def save(self, hidden: torch.Tensor) -> _Entry:
        """Start the copy down of `hidden` (a new entry, after the previous ones)."""
        if self.entries and all(e.consumed for e in self.entries):
            self.entries.clear()  # every entry of the last forward was used by its backward
        if not self.entries:
            self._plan_forward(hidden)
        entry = _Entry(len(self.entries), hidden)
        self.entries.append(entry)
        on_gpu = hidden.device.type == "cuda"
        stream = self._side_stream(hidden.device) if on_gpu else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(hidden.device))
        if entry.index < self.spill_below:
            entry.spilled = self._spill.write(entry.index, hidden, stream)
            self.bytes_spilled += hidden.numel() * hidden.element_size()
            return entry
        if not on_gpu:
            entry.kept = hidden.detach()
            return entry
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
        return pinned_empty(like.numel(), like.dtype).view(like.shape)  # exact bytes, not a power of two

    # ------------------------------------------------------------------ the host's share
    def _plan_forward(self, hidden: torch.Tensor) -> None:
        """How many of this forward's inputs the host keeps, the rest spilled (module docstring)."""
        nbytes = hidden.numel() * hidden.element_size()
        share = self._host_share(hidden.device)
        count = self.layer_count
        if share is None or nbytes == 0 or count == 0:
            self.spill_below = 0
            return
        keep = min(count, share // nbytes)
        if keep < count and self.spill_settings is not None:
            staging = HiddenSpill.staging_bytes(nbytes)
            keep = min(count, max(share - staging, 0) // nbytes)
        keep = _agreed_min(keep, hidden.device)
        if keep < count and self.spill_settings is None:
            raise HiddenStatesDoNotFitError(
                f"long_sequence.offload_hidden_states: the {count} checkpointed layer inputs of this forward need "
                f"{count * nbytes / GIB:.2f} GiB of host memory ({nbytes / GIB:.3f} GiB each, {tuple(hidden.shape)} "
                f"{hidden.dtype}), and the host's share for them is {share / GIB:.2f} GiB "
                f"({self._share_source()}), enough for {keep} on the smallest rank. Set long_sequence.nvme_path to a "
                "folder on a local NVMe drive to keep the rest there, give them more host memory "
                "(long_sequence.host_bytes), or shorten the sequence")
        self.spill_below = count - keep
        self._trim_pool(hidden, keep)
        if self.spill_below:
            if self._spill is None:
                rank = dist.get_rank() if dist.is_initialized() else 0
                self._spill = HiddenSpill(self.spill_settings, rank)
            self._spill.prepare(self.spill_below, nbytes, pin=hidden.device.type == "cuda")

    def _host_share(self, device: torch.device) -> int | None:
        if self.host_share is not None:
            return self.host_share
        if device.type != "cuda":
            return None
        available, total = available_host_bytes(), total_host_bytes()
        if available is None or total is None:
            return None
        reserve = max(int(total * HOST_RESERVE_SHARE), MIN_HOST_RESERVE)
        local_ranks = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
        return max(available // local_ranks - reserve, 0) + self.host_bytes()

    def _share_source(self) -> str:
        if self.host_share is not None:
            return "long_sequence.host_bytes"
        return ("auto: the host's available memory over the ranks on this machine, less a reserve of a tenth of "
                "its memory, plus what the store holds")

    def _trim_pool(self, like: torch.Tensor, keep: int) -> None:
        free = self.pool[(tuple(like.shape), like.dtype)]
        del free[keep:]

    def prefetch(self, index: int) -> None:
        """Start the copy up of entry `index` (a no-op if there is none or it is started)."""
        if not 0 <= index < len(self.entries):
            return
        entry = self.entries[index]
        if entry.spilled is not None:
            self._spill.start_read(entry.spilled)  # the copy up follows at load
            return
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
        if entry.spilled is not None:
            stream = self._side_stream(entry.device) if entry.device.type == "cuda" else None
            value = self._spill.device_tensor(entry.spilled, entry.device, stream)
            entry.spilled = None
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
        """Pinned bytes held (in the pool, by live entries and as the spill tier's staging)."""
        pooled = sum(t.numel() * t.element_size() for free in self.pool.values() for t in free)
        live = sum(e.host.numel() * e.host.element_size() for e in self.entries if e.host is not None)
        staging = self._spill.pool.nbytes if self._spill is not None and self._spill.pool is not None else 0
        return pooled + live + staging

    def close(self) -> None:
        """End the spill tier (its I/O waited for, its folder removed) and drop the buffers."""
        if self._spill is not None:
            self._spill.drain([e.spilled for e in self.entries if e.spilled is not None])
            self._spill.close()
            self._spill = None
        self.entries.clear()
        self.pool.clear()


def _agreed_min(count: int, device: torch.device) -> int:
    """The smallest `count` over the ranks (every rank calls this at the same point)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return count
    value = torch.tensor([count], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return int(value.item())


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
