"""Offline export: a checkpoint folder's consolidated weights into one safetensors file,
in one process, without torch.distributed (the `zero3 checkpoint export` command).

The checkpoint is read through checkpoint/save_load.py's verified reader; the file is written by
checkpoint/export.py's streaming safetensors writer, one tensor at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import torch

from zero3.checkpoint import format as ckpt
from zero3.checkpoint.files import TensorSpec, write_safetensors

EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export_checkpoint(folder, out_path, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Write a verified checkpoint's consolidated weights to `out_path` (safetensors).

    One process, no torch.distributed: each parameter is read from the shard files of
    every source rank (fp32 master where saved, else the compute values), cast to
    `dtype` (floating parameters; buffers keep theirs) and streamed out. The checkpoint
    is verified first (manifest, sizes, checksums); a damaged one raises CheckpointError
    and nothing is written. Returns a summary: tensors, bytes, names.
    """
    folder = Path(folder)
    manifest = ckpt.read_manifest(folder)
    problems = ckpt.verify_files(folder, manifest)
    if problems:
        raise ckpt.CheckpointError(f"checkpoint {folder} failed verification; nothing exported:\n  "
                                   + "\n  ".join(problems))
    specs: list[tuple[TensorSpec, str, str]] = []
    aliases_of: dict[str, list[str]] = {}
    for alias, canonical in manifest.get("aliases", {}).items():
        aliases_of.setdefault(canonical, []).append(alias)
    for name, entry in manifest["params"].items():
        own = getattr(torch, entry["dtype"])
        out_dtype = dtype if own.is_floating_point else own
        for out_name in [name, *aliases_of.get(name, [])]:
            specs.append((TensorSpec(out_name, out_dtype, tuple(entry["shape"])), "param", name))
    for name, entry in manifest.get("buffers", {}).items():
        specs.append((TensorSpec(name, getattr(torch, entry["dtype"]), tuple(entry["shape"])), "buffer", name))
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with ckpt.ShardReader(folder, manifest) as reader:
        digest = write_safetensors(out_path, [s for s, _, _ in specs],
                                   _offline_values(reader, manifest, specs), metadata={"format": "pt"})
    return {"tensors": len(specs), "bytes": digest["size"], "sha256": digest["sha256"],
            "names": [s.name for s, _, _ in specs]}


def _offline_values(reader, manifest: dict[str, Any], specs) -> Iterator[torch.Tensor]:
    last_name, last_value = None, None
    for spec, kind, name in specs:
        if kind == "buffer":
            yield reader.read_whole(f"buffer/{name}").to(spec.dtype).view(spec.shape)
            continue
        if name != last_name:
            entry = manifest["params"][name]
            key = f"master/{name}" if entry.get("master") else f"param/{name}"
            last_name = name
            last_value = reader.read_range(key, entry["numel"], 0, entry["numel"]).view(spec.shape)
        yield last_value.to(spec.dtype)
