"""`zero3 checkpoint import-deepspeed`: a DeepSpeed ZeRO-3 checkpoint rewritten in zero3's format.

Offline, in one process, without torch.distributed and without DeepSpeed: the source
folder is read by checkpoint/deepspeed/layout.py (validated, memory-mapped, nothing executed) and written
as a normal zero3 checkpoint of world size 1 (checkpoint/save_load.py's layout: one shard file with
every parameter whole, common.pt, manifest.json with sizes and checksums, `latest`),
which loads on any number of ranks like any other zero3 checkpoint.

What is written, per parameter: its compute-dtype values (`param/`, the fp32 master cast
to the run's dtype, as DeepSpeed refreshes them on load; a frozen parameter's own
values), the master where it differs from those (`master/`), and the optimizer
state (`optim/`, `optim_whole/`), each in the dtype DeepSpeed saved it in (fp32, or bf16 from a
run with bf16_master_weights_and_grads / bf16_optimizer_states; a load converts to the
engine's setting); rank 0's persistent buffers; counters, scheduler,
param-group hyper-parameters, fp16 loss scaler and client_state. DeepSpeed saves no RNG
state: the rank file records none, and loading leaves the RNG as it is.

The destination tag folder must not exist yet (nothing is overwritten). Everything is
checked before the first write; each file goes through a temporary name, fsync and
rename, the manifest last (an import cut short leaves a folder without one, which no
load accepts), then `latest`.
"""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from zero3.checkpoint import format as ckpt
from zero3.checkpoint.deepspeed.layout import DeepSpeedCheckpoint
from zero3.checkpoint.deepspeed.unpickle import DeepSpeedCheckpointError
from zero3.checkpoint.files import TensorSpec, fsync_dir, removed_on_failure, write_safetensors
from zero3.version import __version__

WORLD = 1  # the imported checkpoint holds every parameter whole, in one rank file


def _write_atomically(path: Path, data: bytes) -> dict[str, Any]:
    tmp = path.with_name(path.name + ".tmp")
    with removed_on_failure(tmp), open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return ckpt.file_digest(path)


def _pickled(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _tensor_plan(source: DeepSpeedCheckpoint) -> list[tuple[TensorSpec, str, str]]:
    """(spec, key read from the source, kind of read) for every tensor of the shard file."""
    plan = []
    for name, entry in source.layout["params"].items():
        numel, dtype = entry["numel"], getattr(torch, entry["dtype"])
        plan.append((TensorSpec(f"param/{name}", dtype, (numel,)), f"param/{name}", "range"))
        if entry["master"]:
            plan.append((TensorSpec(f"master/{name}", source.master_dtype, (numel,)), f"master/{name}", "range"))
        for key, kind in entry["optim"].items():
            if kind == "elementwise":
                plan.append((TensorSpec(f"optim/{name}/{key}", source.state_dtype, (numel,)),
                             f"optim/{name}/{key}", "range"))
            else:
                value = source.read_whole(f"optim_whole/{name}/{key}")
                plan.append((TensorSpec(f"optim_whole/{name}/{key}", value.dtype, tuple(value.shape)),
                             f"optim_whole/{name}/{key}", "whole"))
    for name, entry in source.layout["buffers"].items():
        plan.append((TensorSpec(f"buffer/{name}", getattr(torch, entry["dtype"]), tuple(entry["shape"])),
                     f"buffer/{name}", "whole"))
    return plan


def _values(source: DeepSpeedCheckpoint, plan: list[tuple[TensorSpec, str, str]]) -> Iterator[torch.Tensor]:
    """The tensors of `plan`, one at a time, each in its spec's dtype."""
    for spec, key, how in plan:
        if how == "whole":
            yield source.read_whole(key).to(spec.dtype)
        else:
            yield source.read_range(key, spec.shape[0], 0, spec.shape[0]).to(spec.dtype)


def _layout_entry(entry: dict[str, Any]) -> dict[str, Any]:
    return {"shape": entry["shape"], "dtype": entry["dtype"], "numel": entry["numel"],
            "shard_numel": entry["numel"], "trainable": entry["trainable"], "persistent": False,
            "master": entry["master"], "optim": entry["optim"]}


def _manifest(source: DeepSpeedCheckpoint, tag: str, files: dict[str, Any]) -> dict[str, Any]:
    common = source.common
    return {
        "format": "zero3", "format_version": ckpt.FORMAT_VERSION, "zero3_version": __version__,
        "torch_version": torch.__version__, "tag": tag, "world_size": WORLD,
        "partition": "flat, ceil(numel / world_size) elements per rank, in rank order",
        "global_steps": common["global_steps"], "micro_steps": common["micro_steps"],
        "compute_dtype": str(source.compute_dtype).removeprefix("torch."), "created_unix": time.time(),
        "master_dtype": source.layout["master_dtype"], "optimizer_state_dtype": source.layout["optimizer_state_dtype"],
        "exclude_frozen_parameters": source.layout["exclude_frozen_parameters"],
        "files": dict(sorted(files.items())),
        "params": {name: _layout_entry(entry) for name, entry in source.layout["params"].items()},
        "buffers": source.layout["buffers"], "aliases": source.layout["aliases"],
        "imported_from": {"format": "deepspeed", "folder": str(source.folder.resolve()),
                          "ds_version": source.describe()["ds_version"], "world_size": source.world_size},
    }


def _common_file(source: DeepSpeedCheckpoint) -> bytes:
    common = {"format_version": ckpt.FORMAT_VERSION, **source.common}
    problem = ckpt.plain_value_problem(common, "the checkpoint's common state")
    if problem:
        raise DeepSpeedCheckpointError(
            f"{source.folder}: {problem} cannot be written as a plain value; nothing was imported")
    return _pickled(common)


def import_deepspeed(src: Path, dst: Path, tag: str | None = None) -> dict[str, Any]:
    """Write the DeepSpeed ZeRO-3 checkpoint (src, tag) as zero3 checkpoint `dst/<its tag>`
    and point `dst/latest` at it. Returns what was written (folder, tag, files, sizes).

    Raises DeepSpeedCheckpointError for an unreadable or unsupported source and
    CheckpointError when the destination tag exists or the result fails verification."""
    with DeepSpeedCheckpoint.open(Path(src), tag) as source:
        out_tag = source.folder.name
        folder = Path(dst) / out_tag
        if folder.exists():
            raise ckpt.CheckpointError(f"{folder} already exists; import into another directory or remove it")
        plan, common = _tensor_plan(source), _common_file(source)  # every check before the first write
        folder.mkdir(parents=True)
        files = {ckpt.shard_file(0, WORLD): write_safetensors(
            folder / ckpt.shard_file(0, WORLD), [spec for spec, _, _ in plan], _values(source, plan),
            metadata={"format": "zero3", "rank": "0", "world_size": str(WORLD)})}
        files[ckpt.state_file(0, WORLD)] = _write_atomically(
            folder / ckpt.state_file(0, WORLD), _pickled({"rng": None, "rank": 0}))
        files[ckpt.COMMON] = _write_atomically(folder / ckpt.COMMON, common)
        manifest = ckpt.seal(_manifest(source, out_tag, files))
        _write_atomically(folder / ckpt.MANIFEST, json.dumps(manifest, indent=1).encode())
    problems = ckpt.verify_checkpoint(folder)
    if problems:
        raise ckpt.CheckpointError(f"{folder}: the imported checkpoint failed verification:\n  " + "\n  ".join(problems))
    _write_atomically(Path(dst) / ckpt.LATEST, out_tag.encode())
    return {"folder": str(folder), "tag": out_tag, "params": len(manifest["params"]),
            "bytes": sum(f["size"] for f in files.values()), "source_world_size": source.world_size,
            "global_steps": manifest["global_steps"]}
