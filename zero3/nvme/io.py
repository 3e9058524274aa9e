"""One swap request (a byte range of one file, to or from host memory) issued as the `aio`
section says.

A request of n bytes is cut into calls of `block_size` bytes (the last one shorter). With
`single_submit` they run one after another; otherwise up to `queue_depth` of them are in
flight at once on `intra_op_parallelism` I/O threads, and with `overlap_events` a new call
is issued as soon as the oldest one completes (a sliding window), without it only once the
whole window has completed. Requests themselves run on one request thread, in the order
they were started, and each returns a Future, so a caller overlaps a request with its own
work and waits only when it needs the bytes.

Errors: a call that fails or moves fewer bytes than asked (a full disk, a file size limit)
fails its request with `SwapIOError`, naming the file, the range, the error and the free
space left, and saying what to do; nothing is retried.

Memory: the buffers belong to the caller and must stay alive until the request's Future
is done; this object owns its threads and the backend's descriptors.
"""

from __future__ import annotations

import errno as errno_codes
import os
import shutil
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from zero3.nvme.backends import SwapFiles

GIB = 1 << 30


class SwapIOError(OSError):
    """A read or write of a swap file failed (the message says which, why and what to do)."""


@dataclass(frozen=True)
class IssueSettings:
    """The `aio` section's effect on how a request is issued (config.AioConfig)."""

    block_size: int = 1 << 20
    queue_depth: int = 8
    threads: int = 1
    single_submit: bool = False
    overlap_events: bool = True


OPTIMIZER_ADVICE = ("keep more of the optimizer state on the host (placement.host_budget)",
                    "The optimizer state of this step is partly applied")


class SwapIO:
    """Requests over one backend; requests run in start order on one request thread.
    `advice`: (what else frees space, what a failure leaves behind), for the error messages."""

    def __init__(self, files: SwapFiles, settings: IssueSettings, advice: tuple[str, str] = OPTIMIZER_ADVICE) -> None:
        self.files = files
        self.settings = settings
        self.advice = advice
        self._calls = ThreadPoolExecutor(max_workers=settings.threads, thread_name_prefix="zero3-nvme-io")
        self._requests = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero3-nvme-request")
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.bytes_written = 0
        self._allocated: dict[Path, int] = {}  # bytes allocated per file (`_allocate`), by the request thread only

    def read(self, path: Path, buffer: torch.Tensor, offset: int = 0) -> Future:
        """Fill `buffer` (uint8, contiguous) from `path` at `offset`."""
        return self._requests.submit(self._request, "read", path, buffer, offset)

    def write(self, path: Path, buffer: torch.Tensor, offset: int = 0) -> Future:
        """Write `buffer` (uint8, contiguous) to `path` at `offset`."""
        return self._requests.submit(self._request, "write", path, buffer, offset)

    def _request(self, op: str, path: Path, buffer: torch.Tensor, offset: int) -> None:
        call = self.files.pread if op == "read" else self.files.pwrite
        size, block = buffer.numel(), self.settings.block_size
        if op == "write":
            self._allocate(path, offset + size)
        chunks = [(start, min(block, size - start)) for start in range(0, size, block)]

        def one(start: int, length: int) -> None:
            done = self._call(call, op, path, buffer[start:start + length], offset + start)
            with self._lock:
                if op == "read":
                    self.bytes_read += done
                else:
                    self.bytes_written += done

        if self.settings.single_submit or self.settings.threads == 1 and len(chunks) == 1:
            for start, length in chunks:
                one(start, length)
            return
        self._windowed(chunks, one)

    def _allocate(self, path: Path, end: int) -> None:
        """The file's blocks up to `end`, allocated before the write (posix_fallocate, once
        per file and size). Direct writes past a file's end extend it, and file systems run
        those one at a time; into allocated blocks they run side by side, at the drive's
        speed (measured: 15% of the drive's write bandwidth without, bench/results_*nvme*).
        A full disk fails here, before any byte of the group is written."""
        if self._allocated.get(path, 0) >= end:
            return
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, end)
            except OSError as exc:
                if exc.errno not in (errno_codes.EOPNOTSUPP, errno_codes.EINVAL):
                    raise
            finally:
                os.close(fd)
        except OSError as exc:
            raise SwapIOError(exc.errno, _failure("write", path, 0, end, exc, self.advice)) from exc
        self._allocated[path] = end

    def _windowed(self, chunks: list[tuple[int, int]], one: Callable[[int, int], None]) -> None:
        """At most queue_depth calls in flight: a sliding window (overlap_events) or lockstep."""
        pending: deque[Future] = deque()
        try:
            for start, length in chunks:
                pending.append(self._calls.submit(one, start, length))
                if len(pending) >= self.settings.queue_depth:
                    if self.settings.overlap_events:
                        pending.popleft().result()
                    else:
                        while pending:
                            pending.popleft().result()
            while pending:
                pending.popleft().result()
        finally:
            for future in pending:  # after a failure: let the others end before raising
                future.exception()

    def _call(self, call: Callable, op: str, path: Path, view: torch.Tensor, offset: int) -> int:
        """One call, all of its bytes (a short transfer is continued, then called a failure)."""
        done, want = 0, view.numel()
        try:
            while done < want:
                moved = call(path, view[done:], offset + done)
                if moved <= 0:
                    raise OSError(errno_codes.ENOSPC if op == "write" else errno_codes.EIO,
                                  f"{op} moved {moved} bytes")
                done += moved
        except OSError as exc:
            raise SwapIOError(exc.errno, _failure(op, path, offset + done, want - done, exc, self.advice)) from exc
        return done

    def close(self) -> None:
        """Wait for the requests started, stop the threads, close the files."""
        self._requests.shutdown(wait=True)
        self._calls.shutdown(wait=True)
        self.files.close()


def _failure(op: str, path: Path, offset: int, left: int, exc: OSError, advice: tuple[str, str]) -> str:
    try:
        free = f"{shutil.disk_usage(path.parent).free / GIB:.3f} GiB free on its file system"
    except OSError:
        free = "free space unknown"
    fix = (f"free space under nvme_path (or point it at a larger drive), or {advice[0]}"
           if op == "write" else "check the drive")
    return (f"NVMe swap {op} of {path} failed at byte {offset} with {left} bytes left: "
            f"{exc.strerror or exc} (errno {exc.errno}); {free}. Fix: {fix}. {advice[1]}: rebuild the engine "
            "and load the last checkpoint")
