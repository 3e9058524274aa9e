"""The per-rank swap folder under `nvme_path`: scratch space, never a checkpoint.

Layout: `<nvme_path>/zero3_swap/<host>-pid<pid>-rank<r>[-<kind>]/` (a kind per tier that
swaps: the optimizer state has none, parameter shards "params", so both may share a path) holding `lock` (held with
`fcntl.flock` for the process's life) and the swap files. `SwapFolder.create` (at
initialize, on every rank):
1. checks that `nvme_path` exists, is a folder and is writable (a probe file is written,
   fsynced and removed), else `SwapSetupError` saying what was found and what to do;
2. clears the leftovers of killed runs: every folder under `zero3_swap` whose lock can be
   taken has no live owner (a lock dies with its process) and is removed, logged, never
   read; folders of live runs (their lock held) are left alone, and so is a folder another
   rank is creating at that moment (its lock appears only once held, step 4);
3. checks that the file system has room for `needed` bytes (the state the plan puts on
   NVMe, measured from its sizes before training starts), else `SwapSetupError` with
   both numbers;
4. creates this run's folder and takes its lock.
`remove()` deletes the folder (destroy(); a clean interpreter exit runs it too, through
`weakref.finalize`).

Memory: owns the lock's descriptor and the folder on disk.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import socket
import time
import weakref
from pathlib import Path

logger = logging.getLogger("zero3")

GIB = 1 << 30
ROOT = "zero3_swap"
LOCK = "lock"
CREATING_S = 60.0  # a folder without its lock this long is a leftover (its run died creating it)


class SwapSetupError(RuntimeError):
    """The swap folder cannot be used (missing, not writable, too small)."""


OPTIMIZER_KEY = "offload_optimizer.nvme_path"
OPTIMIZER_FIX = "keep more of the optimizer state on the host (placement.host_budget)"


def check_path(nvme_path: str, key: str = OPTIMIZER_KEY) -> Path:
    """`nvme_path` (the config's `key`) as a folder that exists and takes a written, fsynced file."""
    path = Path(nvme_path)
    if not path.exists():
        raise SwapSetupError(f"{key} {nvme_path!r} does not exist; create the folder "
                             "(on a local NVMe drive) or point nvme_path at one")
    if not path.is_dir():
        raise SwapSetupError(f"{key} {nvme_path!r} is not a folder; point it at a folder")
    probe = path / f".zero3_probe_{socket.gethostname()}_{os.getpid()}"
    try:
        with open(probe, "wb") as handle:
            handle.write(b"\0" * 4096)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        raise SwapSetupError(f"{key} {nvme_path!r} is not writable by this process "
                             f"({exc.strerror or exc}); give it write permission or choose another folder") from exc
    finally:
        probe.unlink(missing_ok=True)
    return path


def clear_leftovers(root: Path) -> list[Path]:
    """Remove the folders under `root` that no live process holds the lock of; return them."""
    cleared = []
    if not root.is_dir():
        return cleared
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        if _held(folder / LOCK):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        cleared.append(folder)
    return cleared


def _held(lock: Path) -> bool:
    """True when a live process holds `lock`. A folder with no lock file yet is one being
    created (its lock appears already held: `create`), unless it is older than CREATING_S."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        try:
            return time.time() - lock.parent.stat().st_mtime < CREATING_S
        except OSError:
            return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a lock taken here
    return False


def check_space(path: Path, needed: int, key: str = OPTIMIZER_KEY, fix: str = OPTIMIZER_FIX) -> None:
    free = shutil.disk_usage(path).free
    if free < needed:
        raise SwapSetupError(
            f"{key} {str(path)!r} has {free / GIB:.3f} GiB free, and this rank's swap "
            f"files need {needed / GIB:.3f} GiB ({needed} bytes); free space there, point nvme_path at a larger "
            f"drive, or {fix}")


class SwapFolder:
    """This rank's locked swap folder (see the module docstring)."""

    def __init__(self, path: Path, lock_fd: int) -> None:
        self.path = path
        self._lock_fd: int | None = lock_fd
        self._finalizer = weakref.finalize(self, _remove, path, lock_fd)  # also runs at a clean exit

    @classmethod
    def create(cls, nvme_path: str, rank: int, needed: int, kind: str = "", key: str = OPTIMIZER_KEY,
               fix: str = OPTIMIZER_FIX) -> tuple["SwapFolder", list[Path]]:
        """Steps 1-4 of the module docstring; returns the folder and the leftovers cleared.
        `key` and `fix` name the config key and the remedy in the errors."""
        base = check_path(nvme_path, key)
        root = base / ROOT
        cleared = clear_leftovers(root)
        check_space(base, needed, key, fix)
        path = root / (f"{socket.gethostname()}-pid{os.getpid()}-rank{rank}" + (f"-{kind}" if kind else ""))
        shutil.rmtree(path, ignore_errors=True)  # an earlier engine of this process, not removed
        path.mkdir(parents=True)
        # The lock is taken under another name and then renamed into place (the lock stays
        # with the file), so that another run clearing leftovers never sees it free.
        fd = os.open(path / f"{LOCK}.new", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(path / f"{LOCK}.new", path / LOCK)
        return cls(path, fd), cleared

    def file(self, name: str) -> Path:
        return self.path / name

    def remove(self) -> None:
        """Delete the folder and its files and drop the lock (idempotent)."""
        self._finalizer()


def _remove(path: Path, lock_fd: int) -> None:
    shutil.rmtree(path, ignore_errors=True)
    try:
        os.close(lock_fd)
    except OSError:
        pass
