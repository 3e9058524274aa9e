"""Checkpoints: save / load / reshard, commit marker, checksums, RNG and counters.

Layout of `save_dir/tag/`:
  rank{r}-of-{W}.safetensors   this rank's unpadded slices, per parameter by name:
                                 param/<name>   compute-dtype values
                                 master/<name>  fp32 master (only where it differs from param)
                                 optim/<name>/<key>  optimizer state (shard-shaped or scalar)
  rank{r}-of-{W}.state.pt      this rank's RNG states (loaded with weights_only=True)
  common.pt                    counters, scheduler, client_state, optimizer hyper-parameters
  manifest.json                the commit marker: files with sizes and sha256, world size,
                               per-parameter layout, versions
and `save_dir/latest` holds the tag of the newest complete checkpoint.

Commit protocol: the old manifest of the tag (if any) is removed first; every file is
written under a temporary name, fsynced and renamed; then rank 0 writes the manifest
(temporary name, fsync, rename, fsync of the directory), and only then `latest`.
A checkpoint without a manifest is incomplete and is never loaded.

Resharding: rank r of W owns elements [r*ceil(n/W), ...) of each parameter; the loader
computes its own range for its world size and reads the overlapping slices of every
source file, so a checkpoint saved on N ranks loads on M ranks.

Nothing is unpickled without `weights_only=True`; tensors live in safetensors files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .partition import ParamState, ShardedParam

if TYPE_CHECKING:
    from .engine import Engine

logger = logging.getLogger("zero3")

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
COMMON = "common.pt"
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete, damaged, or does not fit the model."""


# ---------------------------------------------------------------------- names
def shard_file(rank: int, world: int) -> str:
    return f"rank{rank:05d}-of-{world:05d}.safetensors"


def state_file(rank: int, world: int) -> str:
    return f"rank{rank:05d}-of-{world:05d}.state.pt"


def owned_range(numel: int, rank: int, world: int) -> tuple[int, int]:
    shard = math.ceil(numel / world) if numel else 0
    start = min(rank * shard, numel)
    return start, min(start + shard, numel)


# ------------------------------------------------------------------ file I/O
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit_file(tmp: Path, final: Path) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)


def _write_bytes_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def file_digest(path: Path) -> dict[str, Any]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return {"size": path.stat().st_size, "sha256": h.hexdigest()}


# ----------------------------------------------------------------------- save
def _check_can_save(engine: "Engine") -> None:
    steps = engine.config.gradient_accumulation_steps
    if engine.micro_steps % steps != 0:
        raise CheckpointError(
            f"save_checkpoint called in the middle of a gradient-accumulation window "
            f"(micro step {engine.micro_steps}, gradient_accumulation_steps {steps}): the "
            "partial gradients would be lost. Save right after the engine.step() that runs "
            "the optimizer (engine.is_gradient_accumulation_boundary() was True)"
        )


def _rank_tensors(engine: "Engine", exclude_frozen: bool) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    optimizer = engine.optimizer
    for sp in engine.table.values():
        if exclude_frozen and not sp.requires_grad:
            continue
        valid = sp.local_valid_numel
        tensors[f"param/{sp.name}"] = sp.shard[:valid].detach().cpu().contiguous()
        master = optimizer.master_of(sp) if optimizer is not None else None
        if master is None:
            continue
        if master is not sp.shard:
            tensors[f"master/{sp.name}"] = master[:valid].detach().cpu().contiguous()
        for key, value in optimizer.optimizer.state.get(master, {}).items():
            if not isinstance(value, torch.Tensor):
                continue
            if value.shape == master.shape:
                tensors[f"optim/{sp.name}/{key}"] = value[:valid].detach().cpu().contiguous()
            else:
                tensors[f"optim_whole/{sp.name}/{key}"] = value.detach().cpu().contiguous()
    return tensors


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _common_state(engine: "Engine", client_state: dict) -> dict[str, Any]:
    optimizer = engine.optimizer
    groups = []
    extras: dict[str, dict[str, Any]] = {}
    if optimizer is not None:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.optimizer.param_groups]
        for sp, master in zip(optimizer.params, optimizer.masters):
            values = optimizer.optimizer.state.get(master, {})
            plain = {k: v for k, v in values.items() if not isinstance(v, torch.Tensor)}
            if plain:
                extras[sp.name] = plain
    scheduler = engine.lr_scheduler
    return {
        "format_version": FORMAT_VERSION,
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps,
        "loss_scaler": engine.loss_scaler_state() if hasattr(engine, "loss_scaler_state") else None,
        "param_groups": groups,
        "optim_extras": extras,
        "lr_scheduler": scheduler.state_dict() if scheduler is not None and hasattr(scheduler, "state_dict") else None,
        "client_state": client_state,
    }


def _param_layout(engine: "Engine", exclude_frozen: bool) -> dict[str, Any]:
    layout = {}
    for sp in engine.table.values():
        if exclude_frozen and not sp.requires_grad:
            continue
        layout[sp.name] = {
            "shape": list(sp.shape),
            "dtype": str(sp.dtype).removeprefix("torch."),
            "numel": sp.numel,
            "trainable": sp.requires_grad,
            "persistent": sp.persistent,
        }
    return layout


def save(engine: "Engine", save_dir, tag, client_state: dict, save_latest: bool,
         exclude_frozen: bool) -> bool:
    _check_can_save(engine)
    comm = engine.comm
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    _validate_tag(engine, tag)
    root = Path(save_dir)
    folder = root / tag
    if comm.rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / MANIFEST).unlink(missing_ok=True)  # the tag is incomplete from here on
        _fsync_dir(folder)
    comm.barrier()
    world, rank = comm.world_size, comm.rank
    written: dict[str, dict[str, Any]] = {}

    shard_path = folder / shard_file(rank, world)
    tmp = shard_path.with_name(shard_path.name + ".tmp")
    save_file(_rank_tensors(engine, exclude_frozen), str(tmp), metadata={"format": "zero3"})
    _commit_file(tmp, shard_path)
    written[shard_path.name] = file_digest(shard_path)

    rng_path = folder / state_file(rank, world)
    torch.save({"rng": _rng_state(), "rank": rank}, rng_path.with_name(rng_path.name + ".tmp"))
    _commit_file(rng_path.with_name(rng_path.name + ".tmp"), rng_path)
    written[rng_path.name] = file_digest(rng_path)

    if rank == 0:
        common_path = folder / COMMON
        torch.save(_common_state(engine, client_state), common_path.with_name(COMMON + ".tmp"))
        _commit_file(common_path.with_name(COMMON + ".tmp"), common_path)
        written[COMMON] = file_digest(common_path)

    all_written = comm.gather_objects(written)
    if rank == 0:
        files: dict[str, Any] = {}
        for part in all_written:
            files.update(part)
        manifest = {
            "format": "zero3",
            "format_version": FORMAT_VERSION,
            "zero3_version": _zero3_version(),
            "torch_version": torch.__version__,
            "tag": tag,
            "world_size": world,
            "global_steps": engine.global_steps,
            "created_unix": time.time(),
            "exclude_frozen_parameters": exclude_frozen,
            "files": files,
            "params": _param_layout(engine, exclude_frozen),
        }
        _fsync_dir(folder)
        _write_bytes_atomically(folder / MANIFEST, json.dumps(manifest, indent=1).encode())
        if save_latest:
            _write_bytes_atomically(root / LATEST, tag.encode())
    comm.barrier()
    return True


def _validate_tag(engine: "Engine", tag: str) -> None:
    if not tag or "/" in tag or tag in (".", ".."):
        raise CheckpointError(f"checkpoint tag {tag!r} is not a valid folder name; use e.g. 'global_step100'")
    tags = engine.comm.gather_objects(tag)
    if any(t != tag for t in tags):
        raise CheckpointError(
            f"ranks passed different checkpoint tags {sorted(set(tags))}; pass the same tag on every rank"
        )


def _zero3_version() -> str:
    from . import __version__

    return __version__


# ----------------------------------------------------------------------- load
def resolve_tag(load_dir: Path, tag) -> str | None:
    if tag is not None:
        return str(tag)
    latest = load_dir / LATEST
    if not latest.is_file():
        return None
    return latest.read_text().strip()


def read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {folder} is incomplete: it has no {MANIFEST} (the save did not finish, "
            "or was interrupted). Load an earlier tag, or save again"
        )
    try:
        manifest = json.loads(path.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); the checkpoint is damaged") from exc
    if manifest.get("format") != "zero3" or manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format {manifest.get('format')!r} version {manifest.get('format_version')!r} "
            f"is not zero3 checkpoint format version {FORMAT_VERSION}"
        )
    return manifest


def verify_files(folder: Path, manifest: dict[str, Any], ranks: tuple[int, int] = (0, 1)) -> list[str]:
    """Problems with the files of a checkpoint, checked by this rank's share (rank, world)."""
    rank, world = ranks
    problems: list[str] = []
    listed = manifest["files"]
    if rank == 0:
        present = {p.name for p in folder.iterdir() if p.is_file()} - {MANIFEST}
        for extra in sorted(present - set(listed)):
            problems.append(f"{folder / extra}: extra file not listed in the manifest")
    for index, (name, expected) in enumerate(sorted(listed.items())):
        if index % world != rank:
            continue
        path = folder / name
        if not path.is_file():
            problems.append(f"{path}: missing")
            continue
        size = path.stat().st_size
        if size != expected["size"]:
            problems.append(f"{path}: size {size} bytes, manifest says {expected['size']} (truncated or overwritten)")
            continue
        if file_digest(path)["sha256"] != expected["sha256"]:
            problems.append(f"{path}: sha256 differs from the manifest (the file is corrupted)")
    return problems


def model_differences(engine: "Engine", manifest: dict[str, Any], strict: bool) -> list[str]:
    saved = manifest["params"]
    differences = []
    ours = {sp.name: sp for sp in engine.table.values()}
    excluded_frozen = manifest.get("exclude_frozen_parameters", False)
    for name, sp in ours.items():
        entry = saved.get(name)
        if entry is None:
            if strict and not (excluded_frozen and not sp.requires_grad):
                differences.append(f"missing in checkpoint: {name} {tuple(sp.shape)}")
            continue
        if list(sp.shape) != entry["shape"]:
            differences.append(f"shape of {name}: model {tuple(sp.shape)}, checkpoint {tuple(entry['shape'])}")
        dtype = str(sp.dtype).removeprefix("torch.")
        if dtype != entry["dtype"]:
            differences.append(f"dtype of {name}: model {dtype}, checkpoint {entry['dtype']}")
    if strict:
        for name in saved:
            if name not in ours:
                differences.append(f"unexpected in checkpoint (not in model): {name} {tuple(saved[name]['shape'])}")
    return differences


class ShardReader:
    """Reads any element range of a saved tensor from the files of all source ranks."""

    def __init__(self, folder: Path, world: int) -> None:
        self.world = world
        self.handles = [safe_open(str(folder / shard_file(r, world)), framework="pt") for r in range(world)]
        self.keys = [set(h.keys()) for h in self.handles]

    def has(self, key: str) -> bool:
        return any(key in keys for keys in self.keys)

    def read_range(self, key: str, numel: int, start: int, end: int) -> torch.Tensor:
        pieces = []
        for src in range(self.world):
            src_start, src_end = owned_range(numel, src, self.world)
            lo, hi = max(start, src_start), min(end, src_end)
            if lo >= hi:
                continue
            pieces.append(self.handles[src].get_slice(key)[lo - src_start:hi - src_start])
        if not pieces:
            return torch.empty(0)
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    def read_whole(self, key: str) -> torch.Tensor:
        for handle, keys in zip(self.handles, self.keys):
            if key in keys:
                return handle.get_tensor(key)
        raise KeyError(key)

    def optim_keys(self, kind: str, name: str) -> list[str]:
        prefix = f"{kind}/{name}/"
        return sorted({k[len(prefix):] for keys in self.keys for k in keys if k.startswith(prefix)})


def _fill(target: torch.Tensor, values: torch.Tensor) -> None:
    """target[:len(values)] = values; the padding tail is set to zero."""
    with torch.no_grad():
        target.zero_()
        target[: values.numel()].copy_(values.to(target.dtype))


def _load_param(engine: "Engine", sp: ShardedParam, reader: ShardReader, numel: int) -> torch.Tensor:
    start, end = sp.range_of(sp.rank)
    values = reader.read_range(f"param/{sp.name}", numel, start, end)
    _fill(sp.shard, values)
    if sp.state is ParamState.FULL and sp.numel:
        full = reader.read_range(f"param/{sp.name}", numel, 0, numel).to(sp.param.device, sp.dtype)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(sp.param):
            sp.param.data.view(-1).copy_(full)
    return values


def _load_optimizer_of(engine: "Engine", sp: ShardedParam, reader: ShardReader, numel: int,
                       extras: dict[str, Any], load_states: bool) -> None:
    optimizer = engine.optimizer
    master = optimizer.master_of(sp) if optimizer is not None else None
    if master is None:
        return
    start, end = sp.range_of(sp.rank)
    if master is not sp.shard:
        key = f"master/{sp.name}" if reader.has(f"master/{sp.name}") else f"param/{sp.name}"
        _fill(master, reader.read_range(key, numel, start, end))
    if not load_states:
        return
    state: dict[str, Any] = dict(extras.get(sp.name, {}))
    for key in reader.optim_keys("optim", sp.name):
        sliced = reader.read_range(f"optim/{sp.name}/{key}", numel, start, end)
        value = torch.zeros(master.shape, dtype=sliced.dtype, device=master.device)
        _fill(value, sliced)
        state[key] = value
    for key in reader.optim_keys("optim_whole", sp.name):
        whole = reader.read_whole(f"optim_whole/{sp.name}/{key}")
        state[key] = whole if whole.dim() == 0 else whole.to(master.device)  # `step` stays on cpu
    optimizer.optimizer.state[master] = state


def load(engine: "Engine", load_dir, tag, strict: bool, load_optimizer_states: bool,
         load_lr_scheduler_states: bool, load_module_only: bool):
    comm = engine.comm
    root = Path(load_dir)
    resolved = resolve_tag(root, tag)
    folder = root / resolved if resolved is not None else None
    if folder is None or not folder.is_dir():
        logger.warning(
            "zero3: no checkpoint to load in %s (%s); nothing was loaded",
            root, "no 'latest' file" if resolved is None else f"tag {resolved!r} not found",
        )
        return None, None
    manifest = _agreed(comm, lambda: read_manifest(folder))
    problems = verify_files(folder, manifest, (comm.rank, comm.world_size))
    problems = [p for part in comm.gather_objects(problems) for p in part]
    if problems:
        raise CheckpointError(
            f"checkpoint {folder} failed verification, nothing was loaded:\n  " + "\n  ".join(problems)
        )
    differences = model_differences(engine, manifest, strict)
    if differences:
        raise CheckpointError(
            f"checkpoint {folder} does not fit the model ({len(differences)} differences; "
            "load_module_strict=False skips missing and unexpected names):\n  " + "\n  ".join(differences)
        )
    common = torch.load(folder / COMMON, weights_only=True)
    reader = ShardReader(folder, manifest["world_size"])
    extras = common.get("optim_extras", {})
    restore_optimizer = load_optimizer_states and not load_module_only
    if engine.optimizer is not None:
        engine.optimizer.optimizer.state.clear()
    for sp in engine.table.values():
        entry = manifest["params"].get(sp.name)
        if entry is None:
            continue
        _load_param(engine, sp, reader, entry["numel"])
        _load_optimizer_of(engine, sp, reader, entry["numel"], extras, restore_optimizer)
    if restore_optimizer and engine.optimizer is not None:
        _restore_param_groups(engine, common["param_groups"], folder)
    if not load_module_only:
        if load_lr_scheduler_states and engine.lr_scheduler is not None and common["lr_scheduler"] is not None:
            engine.lr_scheduler.load_state_dict(common["lr_scheduler"])
        engine.global_steps = common["global_steps"]
        engine.micro_steps = common["micro_steps"]
        engine.global_samples = common["global_samples"]
        engine.skipped_steps = common["skipped_steps"]
        if common.get("loss_scaler") is not None and hasattr(engine, "load_loss_scaler_state"):
            engine.load_loss_scaler_state(common["loss_scaler"])
        _restore_rng(folder, manifest, comm.rank)
    if engine.optimizer is not None:
        engine.optimizer.zero_grad()
    comm.barrier()
    return str(folder), common["client_state"]


def _restore_param_groups(engine: "Engine", saved_groups: list[dict], folder: Path) -> None:
    groups = engine.optimizer.optimizer.param_groups
    if len(saved_groups) != len(groups):
        raise CheckpointError(
            f"checkpoint {folder} has {len(saved_groups)} optimizer param groups, the optimizer "
            f"has {len(groups)}; build the optimizer with the same groups, or pass "
            "load_optimizer_states=False"
        )
    for group, saved in zip(groups, saved_groups):
        group.update(saved)


def _restore_rng(folder: Path, manifest: dict[str, Any], rank: int) -> None:
    if rank >= manifest["world_size"]:
        logger.warning("zero3: rank %d has no saved RNG state (checkpoint of %d ranks); RNG not restored",
                       rank, manifest["world_size"])
        return
    state = torch.load(folder / state_file(rank, manifest["world_size"]), weights_only=True)
    _set_rng_state(state["rng"])


def _agreed(comm, read):
    """Run `read` on every rank; if it fails on any rank, raise the same error on all."""
    try:
        value, error = read(), None
    except CheckpointError as exc:
        value, error = None, str(exc)
    errors = [e for e in comm.gather_objects(error) if e]
    if errors:
        raise CheckpointError(errors[0])
    return value
