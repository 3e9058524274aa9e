"""Positioned reads and writes between files and host memory: the two implementations.

`KvikioFiles` uses NVIDIA's KvikIO (`kvikio-cu13` / `kvikio-cu12`): its `CuFile` reads and
writes host buffers through its own thread pool (POSIX I/O in its compatibility mode,
GPUDirect Storage where the machine has it). It needs the CUDA driver library
(`libcuda.so.1`) even for host buffers: on a machine without one (a CPU-only CI machine)
every call fails with "libcuda.so.1: cannot open shared object file".

`PosixFiles` is Python's own positioned I/O (`os.preadv` / `os.pwritev`, which release the
GIL) on zero3's thread pool (io.py): what KvikIO's compatibility mode does, with no
dependency. It opens files with `O_DIRECT` where the file system accepts it (not tmpfs),
so the page cache neither holds the state nor hides the disk's speed; the buffers and
offsets it is given are 4096-aligned for that (buffers.py, pager.py).

`open_files(kind)` picks one: "kvikio", "posix", or "auto" (KvikIO when it imports and a
probe write and read of a scratch file works, else POSIX, saying why). The environment
variable ZERO3_NVME_BACKEND overrides the choice.

Memory: a backend owns its open file descriptors only; the buffers are the caller's and
must stay alive until the call returns. Threads: each file is opened once, under a lock, by
the first call that needs it (two threads opening the same path at once used to open it
twice; KvikIO then closed the handle it dropped while a write on it was in flight, which
its POSIX path reports as "Operation not permitted", its text for EBADF).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

import torch

logger = logging.getLogger("zero3")
T = TypeVar("T")

ALIGN = 4096


class SwapFiles(Protocol):
    """Blocking positioned I/O on files opened by path (safe to call from several threads)."""

    name: str
    direct: bool

    def pread(self, path: Path, buffer: torch.Tensor, offset: int) -> int: ...

    def pwrite(self, path: Path, buffer: torch.Tensor, offset: int) -> int: ...

    def close(self) -> None: ...


def _view(buffer: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU uint8 tensor, writable, without a copy."""
    return memoryview(buffer.numpy()).cast("B")


def _opened_once(handles: dict[Path, T], lock: threading.Lock, path: Path, open_path: Callable[[Path], T]) -> T:
    """`handles[path]`, opened by `open_path` under `lock` by the first caller that needs it
    (the read outside the lock is safe: an entry is written once, before it is read)."""
    handle = handles.get(path)
    if handle is not None:
        return handle
    with lock:
        if path not in handles:
            handles[path] = open_path(path)
        return handles[path]


class PosixFiles:
    """os.preadv / os.pwritev on descriptors kept open per path (O_DIRECT where it works)."""

    name = "posix"

    def __init__(self, direct: bool = True) -> None:
        self.direct = direct and hasattr(os, "O_DIRECT")
        self._fds: dict[Path, int] = {}
        self._opening = threading.Lock()

    def _fd(self, path: Path) -> int:
        return _opened_once(self._fds, self._opening, path, self._open)

    def _open(self, path: Path) -> int:
        flags = os.O_RDWR | os.O_CREAT
        if self.direct:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o600)
            except OSError:  # tmpfs and some others refuse O_DIRECT
                self.direct = False
        return os.open(path, flags, 0o600)

    def pread(self, path: Path, buffer: torch.Tensor, offset: int) -> int:
        return os.preadv(self._fd(path), [_view(buffer)], offset)

    def pwrite(self, path: Path, buffer: torch.Tensor, offset: int) -> int:
        return os.pwritev(self._fd(path), [_view(buffer)], offset)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class KvikioFiles:
    """KvikIO's CuFile per path, opened read-write; each call waits for its future."""

    name = "kvikio"

    def __init__(self, threads: int, task_size: int) -> None:
        import kvikio
        import kvikio.defaults

        self._kvikio = kvikio
        kvikio.defaults.set({"num_threads": threads, "task_size": task_size})
        self.direct = False
        for key in ("auto_direct_io_read", "auto_direct_io_write"):  # newer KvikIO only
            try:
                kvikio.defaults.set(key, True)
                self.direct = True
            except Exception:  # noqa: BLE001 - an older KvikIO: buffered I/O
                pass
        self._files: dict[Path, object] = {}
        self._opening = threading.Lock()

    def _file(self, path: Path):
        return _opened_once(self._files, self._opening, path, self._open)

    def _open(self, path: Path):
        if not path.exists():
            path.touch(mode=0o600)
        return self._kvikio.CuFile(path, "r+")

    def pread(self, path: Path, buffer: torch.Tensor, offset: int) -> int:
        handle = self._file(path)  # held until the read is done
        return int(handle.pread(buffer.numpy(), buffer.numel(), offset).get())

    def pwrite(self, path: Path, buffer: torch.Tensor, offset: int) -> int:
        handle = self._file(path)  # held until the write is done
        return int(handle.pwrite(buffer.numpy(), buffer.numel(), offset).get())

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()


def open_files(kind: str, folder: Path, threads: int, block_size: int) -> tuple[SwapFiles, str]:
    """The backend for `kind` ("auto", "kvikio", "posix"; ZERO3_NVME_BACKEND overrides) and
    a line saying which and why. "kvikio" that cannot work raises, naming the reason."""
    kind = os.environ.get("ZERO3_NVME_BACKEND", kind)
    if kind not in ("auto", "kvikio", "posix"):
        raise ValueError(f"ZERO3_NVME_BACKEND={kind!r}: expected auto, kvikio or posix")
    if kind != "posix":
        try:
            files = KvikioFiles(threads, block_size)
            _probe(files, folder)
            return files, f"KvikIO {files._kvikio.__version__}"
        except Exception as exc:  # noqa: BLE001 - named below
            if kind == "kvikio":
                raise RuntimeError(f"ZERO3_NVME_BACKEND=kvikio, but KvikIO cannot read and write here: "
                                   f"{type(exc).__name__}: {exc}") from exc
            why = f"KvikIO unavailable ({type(exc).__name__}: {str(exc).strip()[:160]})"
    else:
        why = "ZERO3_NVME_BACKEND=posix"
    files = PosixFiles()
    return files, f"POSIX positioned I/O; {why}"


def _probe(files: SwapFiles, folder: Path) -> None:
    """One aligned write and read of a scratch file in `folder`, removed after."""
    path = folder / "probe.kvikio"
    data = torch.arange(ALIGN, dtype=torch.uint8)
    back = torch.empty_like(data)
    try:
        files.pwrite(path, data, 0)
        files.pread(path, back, 0)
        if not torch.equal(data, back):
            raise RuntimeError("the probe read back other bytes than it wrote")
    finally:
        files.close()
        path.unlink(missing_ok=True)
