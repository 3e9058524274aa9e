"""Durable files: safetensors written one tensor at a time, fsync of files and folders.

The write path every checkpoint and export file takes: bytes go to `<name>.tmp`, are
fsynced and renamed over the final name, and the folder is fsynced, so a file is either
absent, its old version, or complete. Nothing here knows of the engine or of sharding:
the offline tools (DeepSpeed import, offline export) use it as the engine does.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch


class ExportError(RuntimeError):
    """A consolidated export cannot be written as asked."""


# ------------------------------------------------------------ safetensors, streaming
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}


class TensorSpec(NamedTuple):
    """What one tensor of a safetensors file will be: known before its bytes exist."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * torch.empty((), dtype=self.dtype).element_size()


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable (the directory entry itself)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def safetensors_header(specs: Sequence[TensorSpec], metadata: dict[str, str] | None) -> bytes:
    """The 8-byte length and the JSON header, padded with spaces to 8-byte alignment.

    Offsets follow the order of `specs`: the data section is the tensors' bytes back to
    back in that order, as the safetensors format requires (no holes, no overlap).
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for spec in specs:
        if spec.dtype not in SAFETENSORS_DTYPES:
            raise ExportError(f"{spec.name}: dtype {spec.dtype} has no safetensors code; convert it first")
        if spec.name in header:
            raise ExportError(f"tensor name {spec.name!r} appears twice")
        header[spec.name] = {"dtype": SAFETENSORS_DTYPES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(path: Path, specs: Sequence[TensorSpec], tensors: Iterable[torch.Tensor],
                      metadata: dict[str, str] | None = None,
                      after_first: Callable[[], None] | None = None) -> dict[str, Any]:
    """Write `tensors` (one per spec, in order) to `path`, one tensor in memory at a time.

    Crash safety: the bytes go to `<path>.tmp`, which is fsynced and then renamed over
    `path` (and the directory fsynced), so `path` is either absent, its old version, or
    the complete new file. Returns {"size", "sha256"} of what was written, hashed on the
    way out (no second read). `after_first` runs once the first tensor's bytes have been
    flushed to the file (the checkpoint's fault-injection point for a half-written file).
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with removed_on_failure(tmp):
        digest, size = _write_safetensors_to(tmp, path, specs, tensors, metadata, after_first)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return {"size": size, "sha256": digest.hexdigest()}


@contextlib.contextmanager
def removed_on_failure(tmp: Path) -> Iterator[None]:
    """`tmp` (a temporary file being written) is removed if the block fails; an OSError
    (a full disk, a quota, a read-only folder) is raised again naming the file."""
    try:
        yield
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename is None:
            raise type(exc)(exc.errno, f"{exc.strerror or exc} (while writing the file)", str(tmp)) from exc
        raise


def _write_safetensors_to(tmp: Path, path: Path, specs: Sequence[TensorSpec], tensors: Iterable[torch.Tensor],
                          metadata: dict[str, str] | None, after_first: Callable[[], None] | None):
    """The body of write_safetensors: every byte into `tmp`, fsynced; (sha256, size)."""
    digest = hashlib.sha256()
    size = 0
    with open(tmp, "wb") as f:
        def put(data) -> None:
            nonlocal size
            f.write(data)
            digest.update(data)
            size += memoryview(data).nbytes

        put(safetensors_header(specs, metadata))
        source = iter(tensors)  # not zip(): its reused result tuple would keep the last tensor alive
        for count, spec in enumerate(specs, start=1):
            tensor = next(source, None)
            if tensor is None:
                raise ExportError(f"{path}: {len(specs)} tensors announced, {count - 1} given")
            _check_matches(spec, tensor)
            put(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del tensor  # nothing of it is kept while the next one is produced
            if count == 1 and after_first is not None:
                f.flush()
                after_first()
        if next(source, None) is not None:
            raise ExportError(f"{path}: more tensors given than the {len(specs)} announced")
        f.flush()
        os.fsync(f.fileno())
    return digest, size


def _check_matches(spec: TensorSpec, tensor: torch.Tensor) -> None:
    if tensor.dtype != spec.dtype or tuple(tensor.shape) != tuple(spec.shape):
        raise ExportError(
            f"{spec.name}: announced {spec.dtype} {tuple(spec.shape)}, got {tensor.dtype} "
            f"{tuple(tensor.shape)} (an engine invariant is broken)"
        )
