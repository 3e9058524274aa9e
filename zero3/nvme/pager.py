"""Swap groups between their files and the staging buffers, asynchronously.

A swap group is a run of bytes with a file of its own (`sizes[g]` bytes, a multiple of
4096). `GroupPager` keeps, per group, at most one buffer of the pool holding its bytes:
- `prefetch(g)` starts reading g into a free buffer, if one is free now (never waits);
- `resident(g)` returns g's buffer, reading g first (or waiting for its prefetch); a group
  never written has no bytes yet: its buffer comes back with what the pool left in it;
- `fresh(g)` returns a buffer for g without reading it (g is about to be written whole);
- `store(g)` starts writing g's buffer to its file; the buffer goes back to the pool once
  the write is done, and g is no longer resident (its bytes are the file's);
- `read_range(g, offset, n)` reads n bytes of g's file into a new aligned tensor, for a
  reader of one tensor outside the step (checkpoints), without a buffer of the pool;
- `drain()` waits for every write started and raises the first failure.

Invariants: a group's file is read only after this pager wrote it (the files are this
run's scratch, never state from elsewhere); requests run in the order they were started
(io.py), so a read started after a write of the same group sees that write.

Memory: the pool's buffers are the pager's; the caller uses g's buffer only between
`resident(g)` and `store(g)`. Not thread-safe: one thread at a time drives it.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import torch

from zero3.nvme.buffers import BufferPool, aligned_bytes, aligned_empty
from zero3.nvme.io import SwapIO


class GroupPager:
    """Groups `0..len(paths)-1`, file `paths[g]` of `sizes[g]` bytes, over `pool`."""

    def __init__(self, io: SwapIO, pool: BufferPool, paths: list[Path], sizes: list[int]) -> None:
        self.io = io
        self.pool = pool
        self.paths = paths
        self.sizes = [aligned_bytes(n) for n in sizes]
        self.written = [False] * len(paths)
        self._buffer: dict[int, torch.Tensor] = {}
        self._reading: dict[int, Future] = {}
        self._writes: list[Future] = []

    def is_resident(self, g: int) -> bool:
        return g in self._buffer

    def prefetch(self, g: int) -> bool:
        """Start reading `g` if it is written, not resident and a buffer is free; True if reading."""
        if g in self._buffer or not self.written[g]:
            return g in self._reading
        buffer = self.pool.try_take()
        if buffer is None:
            return False
        self._start_read(g, buffer)
        return True

    def _start_read(self, g: int, buffer: torch.Tensor) -> None:
        self._buffer[g] = buffer
        self._reading[g] = self.io.read(self.paths[g], buffer[:self.sizes[g]])

    def resident(self, g: int) -> torch.Tensor:
        """g's bytes in a buffer of the pool (the first `sizes[g]` bytes of it)."""
        if g not in self._buffer:
            buffer = self.pool.take()
            if self.written[g]:
                self._start_read(g, buffer)
            else:
                self._buffer[g] = buffer
        reading = self._reading.pop(g, None)
        if reading is not None:
            reading.result()
        return self._buffer[g][:self.sizes[g]]

    def fresh(self, g: int) -> torch.Tensor:
        """A buffer for g, not read (its bytes are about to be written whole)."""
        if g not in self._buffer:
            self._buffer[g] = self.pool.take()
        reading = self._reading.pop(g, None)
        if reading is not None:
            reading.result()
        return self._buffer[g][:self.sizes[g]]

    def release(self, g: int) -> None:
        """g's buffer back to the pool unwritten (its bytes were copied out; the file stays)."""
        self.pool.give(self._buffer.pop(g))

    def store(self, g: int, wait: bool = False) -> None:
        """Write g's buffer to its file; the buffer is the pool's again once written."""
        buffer = self._buffer.pop(g)
        self._reading.pop(g, None)
        write = self.io.write(self.paths[g], buffer[:self.sizes[g]])
        write.add_done_callback(lambda _: self.pool.give(buffer))
        self.written[g] = True
        self._writes.append(write)
        if wait:
            write.result()

    def read_range(self, g: int, offset: int, nbytes: int) -> torch.Tensor:
        """`nbytes` of g's file from `offset` (both 4096-aligned), into a new aligned tensor."""
        self.drain()
        out = aligned_empty(nbytes)
        self.io.read(self.paths[g], out, offset).result()
        return out[:nbytes]

    def drain(self) -> None:
        """Every write started is on disk (or its error raised, the first one)."""
        writes, self._writes = self._writes, []
        for write in writes:
            write.exception()  # wait for all before raising any
        for write in writes:
            write.result()

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self.io.close()
