"""The NVMe tier of the checkpointed hidden states: layer inputs that the host cannot hold.

At a long sequence the saved layer inputs outgrow the host (a 512K-token, 4096-wide model's
32 inputs are 128 GiB in bf16). `HostStore` (host_checkpoint.py) decides at the first save
of each forward how many of that forward's inputs the host keeps; the *earliest* layers'
inputs beyond that go here, because backward needs them last: their writes have the rest of
the forward to finish, and their reads run behind the backward of the layers above.

One file per layer index under this rank's swap folder
(`<nvme_path>/zero3_swap/<host>-pid<pid>-rank<r>-hidden/`, zero3/nvme/folder.py: checked,
locked, left-overs of killed runs cleared, removed at `close()` and at a clean exit),
rewritten every step. A write: the input is copied into a staging buffer (on the given side
stream on a GPU; pinned), and the buffer is written once the copy is done (a waiter thread
waits for the copy's event, then hands the buffer to zero3/nvme/io.py's request thread),
then goes back to the pool. A read (`start_read`, ahead of use): a staging buffer is filled
from the file; `device_tensor` copies it to the device (side stream, its event waited on by
the compute stream) and returns the buffer. The bytes read are the bytes written: results
equal the host tier's bit for bit.

Errors: a failed write or read (a full disk) is a `SwapIOError` naming the file, raised at the
next use of that entry; the training step cannot go on (the layer's input is lost): rebuild
the engine and load the last checkpoint.

Memory: `staging` buffers of the largest input (pinned where CUDA is), owned by this object
for its life, taken by one write or read at a time; the device tensor made by
`device_tensor` belongs to the caller.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from zero3.nvme.backends import open_files
from zero3.nvme.buffers import BufferPool, aligned_bytes
from zero3.nvme.folder import SwapFolder, check_space
from zero3.nvme.io import IssueSettings, SwapIO

logger = logging.getLogger("zero3")

KEY = "long_sequence.nvme_path"
FIX = "keep more of the hidden states on the host (long_sequence.host_bytes) or shorten the sequence"
ADVICE = (FIX, "This step's hidden states are lost")
STAGING = 3  # one being written, one being read, one being copied to the device


@dataclass(frozen=True)
class SpillSettings:
    """Where spilled hidden states go and how the I/O is issued (the config's `aio`)."""

    nvme_path: str
    issue: IssueSettings = IssueSettings()
    backend: str = "auto"


class _Spilled:
    """One layer input in its file: the write in flight or done, then the read."""

    def __init__(self, path: Path, shape: torch.Size, dtype: torch.dtype, nbytes: int) -> None:
        self.path, self.shape, self.dtype, self.nbytes = path, shape, dtype, nbytes
        self.written: Future | None = None
        self.read: Future | None = None
        self.buffer: torch.Tensor | None = None  # the staging buffer of the read


class HiddenSpill:
    """This rank's swap files of spilled layer inputs (module docstring)."""

    def __init__(self, settings: SpillSettings, rank: int) -> None:
        self.settings, self.rank = settings, rank
        self.folder: SwapFolder | None = None
        self.io: SwapIO | None = None
        self.pool: BufferPool | None = None
        self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero3-hidden-spill")
        self.bytes_written = 0

    @staticmethod
    def staging_bytes(nbytes: int) -> int:
        """Host bytes the staging buffers take for inputs of `nbytes`."""
        return STAGING * aligned_bytes(nbytes)

    def prepare(self, count: int, nbytes: int, pin: bool) -> None:
        """Room for `count` inputs of `nbytes` each: the folder (at first use), the space
        checked, staging buffers of that size. Raises SwapSetupError naming what is wrong."""
        if self.folder is None:
            self.folder, cleared = SwapFolder.create(self.settings.nvme_path, self.rank, 0, "hidden", KEY, FIX)
            for path in cleared:
                logger.warning("zero3: removed the swap folder %s of a run that did not end cleanly", path)
            files, why = open_files(self.settings.backend, self.folder.path, self.settings.issue.threads,
                                    self.settings.issue.block_size)
            self.io = SwapIO(files, self.settings.issue, ADVICE)
            logger.info("zero3: rank %d hidden states beyond the host's share go to %s (%s)", self.rank,
                        self.folder.path, why)
        held = sum(p.stat().st_size for p in self.folder.path.glob("hidden*.swp"))
        check_space(self.folder.path, max(count * aligned_bytes(nbytes) - held, 0), KEY, FIX)
        if self.pool is None or self.pool.size < aligned_bytes(nbytes):
            self.pool = BufferPool(STAGING, nbytes, pin=pin)

    def write(self, index: int, hidden: torch.Tensor, stream: torch.cuda.Stream | None) -> _Spilled:
        """Start writing `hidden` as layer input `index` (module docstring). On a GPU the copy
        into the staging buffer runs on `stream`, which the caller made wait for `hidden`."""
        nbytes = hidden.numel() * hidden.element_size()
        entry = _Spilled(self.folder.file(f"hidden{index:05d}.swp"), hidden.shape, hidden.dtype, nbytes)
        buffer = self.pool.take()
        view = buffer[:nbytes].view(hidden.dtype).view(hidden.shape)
        if stream is None:
            view.copy_(hidden.detach())
            done = None
        else:
            with torch.cuda.stream(stream):
                view.copy_(hidden.detach(), non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
            hidden.record_stream(stream)
        entry.written = self._waiter.submit(self._write_when_copied, entry.path, buffer, done)
        self.bytes_written += nbytes
        return entry

    def _write_when_copied(self, path: Path, buffer: torch.Tensor, copied: torch.cuda.Event | None) -> None:
        try:
            if copied is not None:
                copied.synchronize()
            self.io.write(path, buffer).result()
        finally:
            self.pool.give(buffer)

    def start_read(self, entry: _Spilled) -> None:
        """Read `entry` into a staging buffer ahead of use (once)."""
        if entry.read is not None:
            return
        entry.written.result()  # raises the write's SwapIOError; written before it is read back
        entry.buffer = self.pool.take()
        entry.read = self.io.read(entry.path, entry.buffer)

    def device_tensor(self, entry: _Spilled, device: torch.device, stream: torch.cuda.Stream | None) -> torch.Tensor:
        """The input back on `device` (the compute stream waits for its copy); the staging
        buffer goes back to the pool."""
        self.start_read(entry)
        entry.read.result()
        view = entry.buffer[:entry.nbytes].view(entry.dtype).view(entry.shape)
        try:
            if stream is None:
                return view.clone()
            with torch.cuda.stream(stream):
                value = torch.empty(entry.shape, dtype=entry.dtype, device=device)
                value.copy_(view, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
            current = torch.cuda.current_stream(device)
            current.wait_event(done)
            value.record_stream(current)
            done.synchronize()  # the staging buffer is reused only after the copy read it
            return value
        finally:
            self.pool.give(entry.buffer)
            entry.buffer = None

    def drain(self, entries: list[_Spilled]) -> None:
        """Wait for `entries`' writes and reads and give their buffers back (a forward whose
        backward never ran)."""
        for entry in entries:
            if entry.written is not None:
                entry.written.exception()
            if entry.read is not None:
                entry.read.exception()
            if entry.buffer is not None:
                self.pool.give(entry.buffer)
                entry.buffer = None

    def close(self) -> None:
        """Wait for the I/O, stop the threads, remove the folder (idempotent)."""
        self._waiter.shutdown(wait=True)
        if self.io is not None:
            self.io.close()
            self.io = None
        if self.folder is not None:
            self.folder.remove()
            self.folder = None
