"""Replacing a complete checkpoint folder whole: the previous save stays until the new one is in.

Overwriting a tag (`save_checkpoint(dir, tag="last")` again and again, a common way to keep
one rolling checkpoint) must not open a window in which neither the old nor the new save
is complete. So a save over a committed tag writes its files into a hidden staging folder
next to it (`.<tag>.incoming`, a name no tag can have: save refuses tags starting with
'.'), commits the manifest there, and only then puts the staging folder in the tag's place:

- with `renameat2(RENAME_EXCHANGE)` (Linux 3.15+, on ext4, xfs, btrfs, tmpfs and most
  local file systems) the two folders trade names in one atomic step: at every instant
  the tag names a complete checkpoint;
- where the file system cannot exchange, two renames (the tag to `.<tag>.replaced`, the
  staging folder to the tag), with the directory fsynced after each. A crash between
  them leaves the tag missing; `checkpoint_format.resolve_tag` then names the hidden
  folders in its message.

Afterwards the previous save (now in the hidden folder) is removed. A crash before that
leaves a hidden folder that the next save of the same tag removes. Nothing here holds
memory; only rank 0 calls these functions.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from pathlib import Path

from zero3.checkpoint.files import fsync_dir

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_CANNOT_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV}


def staging_folder(target: Path) -> Path:
    """Where a save over the committed tag folder `target` writes its files first."""
    return target.parent / f".{target.name}.incoming"


def replaced_folder(target: Path) -> Path:
    """Where the previous save of `target` waits between the two renames (no exchange)."""
    return target.parent / f".{target.name}.replaced"


def put_in_place(staging: Path, target: Path) -> None:
    """Make the complete folder `staging` the folder `target` (which exists), then remove
    the previous contents of `target`. Durable when it returns."""
    parent = target.parent
    if _exchange(staging, target):
        fsync_dir(parent)
        shutil.rmtree(staging)  # holds the previous save now
        return
    previous = replaced_folder(target)
    shutil.rmtree(previous, ignore_errors=True)
    os.rename(target, previous)
    fsync_dir(parent)
    os.rename(staging, target)
    fsync_dir(parent)
    shutil.rmtree(previous)


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names of `a` and `b` atomically; False where the system cannot."""
    renameat2 = getattr(_libc(), "renameat2", None)
    if renameat2 is None:
        return False
    result = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in _CANNOT_EXCHANGE:
        return False
    raise OSError(code, f"exchanging {a} and {b}: {os.strerror(code)}")


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
