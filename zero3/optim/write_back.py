"""Updated masters into the compute-dtype parameter shards, after each sub-group's update.

Pairs on one device: one fused cast-copy (`_foreach_copy_`). A host master into a device
shard (the optimizer side offloaded, the shard kept on the GPU by the placement) from the
worker thread of the overlapped host step: the cast happens on the host into a pinned
staging buffer (a 16-bit shard then crosses the bus at half the bytes of its fp32 master),
and the copies run on a side stream that first waits for what the compute stream had
queued when the step started (the backward's gathers still reading those shards); the
write is complete when `write` returns, so a sub-group published afterwards is final.

Memory ownership: the staging buffer and the side stream are owned here and reused; the
staging buffer grows to the largest sub-group's shards and is kept.
"""

from __future__ import annotations

import torch


class ShardWriteBack:
    """Writes masters into shards; owns the pinned staging buffer and the side stream."""

    def __init__(self) -> None:
        self._stream: torch.cuda.Stream | None = None
        self._staging: torch.Tensor | None = None

    def write(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after: torch.cuda.Event | None = None) -> None:
        """Each (shard, master) pair: shard <- master, cast. `after`: given on the worker
        thread, an event of the compute stream the device writes must wait for."""
        by_devices: dict[tuple[torch.device, torch.device], tuple[list, list]] = {}
        for shard, master in pairs:
            shards, sources = by_devices.setdefault((shard.device, master.device), ([], []))
            shards.append(shard)
            sources.append(master)
        with torch.no_grad():
            for (shard_device, master_device), (shards, sources) in by_devices.items():
                if shard_device == master_device:
                    torch._foreach_copy_(shards, sources)
                elif after is not None and shard_device.type == "cuda":
                    self._upload(shards, sources, after)
                else:
                    for shard, source in zip(shards, sources):
                        shard.copy_(source)

    def _upload(self, shards: list[torch.Tensor], sources: list[torch.Tensor], after: torch.cuda.Event) -> None:
        """Host masters into device shards: cast into the staging buffer, one asynchronous
        copy per shard on the side stream, waited for before returning."""
        staging = self._staging_for(sum(s.numel() for s in shards), shards[0].dtype)
        stream = self._side_stream(shards[0].device)
        stream.wait_event(after)
        offset = 0
        with torch.cuda.stream(stream):
            for shard, source in zip(shards, sources):
                part = staging[offset:offset + shard.numel()]
                part.copy_(source)
                shard.copy_(part, non_blocking=True)
                offset += shard.numel()
        stream.synchronize()

    def _staging_for(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < numel or self._staging.dtype != dtype:
            self._staging = torch.empty(numel, dtype=dtype, pin_memory=True)
        return self._staging

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream


def record_current_stream(device: torch.device) -> torch.cuda.Event | None:
    """An event at the end of what is queued on `device`'s current stream (None off CUDA)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
