"""`deepspeed.utils.zero_to_fp32`'s functions, over zero3's own checkpoints.

Single process, no torch.distributed: a checkpoint folder (the one holding `latest` and
the tag folders) becomes one consolidated fp32 state dict, as DeepSpeed's functions make
one of a DeepSpeed checkpoint. Trainable parameters come from their fp32 masters, frozen
ones from their saved weights (upcast to fp32); buffers keep their dtype. The checkpoint
is verified first (manifest, sizes, checksums): a damaged one raises CheckpointError and
nothing is returned or written.

Memory: the returned state dict is owned by the caller; tied names share one tensor
object, as DeepSpeed's do (the files written with safe_serialization give each its own
copy, since safetensors refuses shared storage).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from zero3.checkpoint import format as ckpt
from zero3.compat.param_access import load_into_live_params
from zero3.engine_parts.owner import owner_of

logger = logging.getLogger("zero3")

_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def _tag_folder(checkpoint_dir: str | os.PathLike, tag: str | None) -> Path:
    root = Path(checkpoint_dir)
    resolved, warning = ckpt.resolve_tag(root, tag)
    if resolved is None:
        if tag is None:
            raise ValueError(f"no 'latest' file in {root}: pass tag= (one of the checkpoint's tag folders)")
        raise FileNotFoundError(f"checkpoint tag folder {root / str(tag)} does not exist")
    if warning:
        logger.warning(warning)
    return root / resolved


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | os.PathLike, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The whole model in fp32 from a zero3 checkpoint: {state-dict name: CPU tensor}.

    `tag` None reads `latest`. `lazy_mode` is accepted for DeepSpeed's signature; the values
    are always real tensors (`.contiguous()` on them is a no-op, as on DeepSpeed's lazy ones).
    """
    del lazy_mode
    folder = _tag_folder(checkpoint_dir, tag)
    manifest = ckpt.read_manifest(folder)
    problems = ckpt.verify_files(folder, manifest)
    if problems:
        raise ckpt.CheckpointError(f"checkpoint {folder} failed verification:\n  " + "\n  ".join(problems))
    aliases_of: dict[str, list[str]] = {}
    for alias, canonical in manifest.get("aliases", {}).items():
        aliases_of.setdefault(canonical, []).append(alias)
    out: dict[str, torch.Tensor] = {}
    with ckpt.ShardReader(folder, manifest) as reader:
        for name, entry in manifest["params"].items():
            if exclude_frozen_parameters and not entry["trainable"]:
                continue
            key = f"master/{name}" if entry.get("master") else f"param/{name}"
            value = reader.read_range(key, entry["numel"], 0, entry["numel"]).view(entry["shape"])
            value = value.float() if value.is_floating_point() else value
            value = value.clone()
            for out_name in [name, *aliases_of.get(name, [])]:
                out[out_name] = value
        for name, entry in manifest.get("buffers", {}).items():
            out[name] = reader.read_whole(f"buffer/{name}").view(entry["shape"]).clone()
    return out


def _shard_limit(max_shard_size: int | str | None) -> int | None:
    if max_shard_size is None or isinstance(max_shard_size, int):
        return max_shard_size
    text = str(max_shard_size).strip().upper()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if text.endswith(unit) and text[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(text[: -len(unit)]) * _UNITS[unit])
    raise ValueError(f"max_shard_size={max_shard_size!r}: write a size such as \"5GB\" or \"500MB\", or an int of bytes")


def _split(state_dict: dict[str, torch.Tensor], limit: int | None) -> list[list[str]]:
    """Names grouped into files of at most `limit` bytes (a larger tensor gets its own)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if limit is not None and groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike,
                                               max_shard_size: int | str | None = "5GB",
                                               safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> list[str]:
    """Write the fp32 state dict into `output_dir` as Transformers names its files:
    `pytorch_model.bin` (torch.save) or `model.safetensors`, split into
    `...-00001-of-0000N...` files with a `.index.json` beyond `max_shard_size`.
    Returns the file names written."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    weights_name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    groups = _split(state_dict, _shard_limit(max_shard_size))
    output = Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    stem, suffix = weights_name.rsplit(".", 1)
    names = [weights_name] if len(groups) == 1 else [
        f"{stem}-{i + 1:05d}-of-{len(groups):05d}.{suffix}" for i in range(len(groups))]
    weight_map = {}
    for file_name, group in zip(names, groups):
        part = {name: state_dict[name].contiguous() for name in group}
        if safe_serialization:
            part = _unshared(part)
            save_file(part, str(output / file_name), metadata={"format": "pt"})
        else:
            torch.save(part, output / file_name)
        weight_map.update({name: file_name for name in group})
    if len(groups) > 1:
        total = sum(t.numel() * t.element_size() for t in state_dict.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (output / f"{weights_name}.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        names.append(f"{weights_name}.index.json")
    return names


def _unshared(part: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`part` with a tensor object that several names share copied for all but the first."""
    seen: set[int] = set()
    out = {}
    for name, tensor in part.items():
        out[name] = tensor.clone() if id(tensor) in seen else tensor
        seen.add(id(tensor))
    return out


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str | os.PathLike,
                                         tag: str | None = None) -> nn.Module:
    """Load the checkpoint's fp32 weights into `model` (not strict: a frozen-excluded
    checkpoint leaves those weights as they are). Returns the model.

    A plain model is moved to the CPU first, as DeepSpeed's function does. A model whose
    parameters a live engine manages (`engine.module`, e.g. inside
    `GatheredParameters(model.parameters(), modifier_rank=None)` after training) stays
    where it is: the values go into the engine's fp32 masters and shards and into the
    gathered parameters (compat/param_access.py), so training and the block's exit keep them.
    Every rank must call it then, with the same checkpoint."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    if any(owner_of(p) is not None for p in model.parameters()):
        load_into_live_params(model, state_dict)
        return model
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model
