"""`zero3 checkpoint export-deepspeed`: a zero3 checkpoint written in DeepSpeed 0.19's ZeRO-3 layout.

Offline, in one process, without torch.distributed and without DeepSpeed. The source is
any committed zero3 checkpoint (verified first: manifest, sizes, sha256), saved on any
number of ranks; the result is what DeepSpeed 0.19's `save_checkpoint` writes for ZeRO
stage 3 on `world_size` data-parallel ranks with the given `sub_group_size`
(layout.py describes it), so `engine.load_checkpoint(DST)` of a DeepSpeed engine
built the same way resumes it. The sub_group_size and the optimizer DeepSpeed builds
(whose keys the param groups must hold) default to the checkpoint's recorded config
(export_target.py):

  DST/latest                                              the tag
  DST/<tag>/zero_pp_rank_R_mp_rank_00_model_states.pt     R = 0 .. world_size-1
      module (buffers; parameters as empty placeholders of their dtype), buffer_names,
      param_shapes per sub-group, frozen_param_shapes / frozen_param_fragments (None
      when the source left frozen parameters out), shared_params, lr_scheduler, the
      counters, dp_world_size, mp_world_size, ds_config, ds_version, client_state's keys
  DST/<tag>/[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt
      optimizer_state_dict: zero_stage, loss_scaler (DeepSpeed's class, pickling.py),
      dynamic_loss_scale, overflow, partition_count, the torch optimizer's state dict
      (entry i = sub-group i: its flat Adam moments and step; param groups with their
      hyper-parameters) and fp32_flat_groups (rank R's masters, one flat per sub-group; the
      flats and moments in the dtypes the source saved them in: bf16 from a run with
      bf16_master_weights_and_grads / bf16_optimizer_states, whose keys ds_config then carries)

Sub-groups are DeepSpeed's: each param group's parameters in the group's order, cut
after the parameter that brings the rank's element count to `sub_group_size` or more
(one sub-group per param group when the group is smaller). A parameter of n elements
gives each rank ceil(n / world_size) elements, the tail padded with zeros. One rank's
files are built and written at a time, holding only that rank's slices.

DeepSpeed keeps one optimizer step count per sub-group: parameters of one sub-group
with different counts (a parameter that got no gradient on some steps) are refused,
naming them. Every check runs before the first write; the destination tag folder must
not exist; each file goes through a temporary name and a rename, `latest` last.

A Hugging Face Trainer `checkpoint-N` folder as the source (it holds trainer_state.json)
is exported whole: DST becomes a `checkpoint-N` folder that the Trainer with `deepspeed=`
resumes, the Trainer's files copied as they are (trainer_folder.py says which it reads).
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zero3.checkpoint import format as ckpt
from zero3.checkpoint.deepspeed import trainer_folder as trainer
from zero3.checkpoint.deepspeed.export_target import ExportTarget, deepspeed_param_group, deepspeed_step, resolve
from zero3.checkpoint.deepspeed.layout import DEEPSPEED_KEYS
from zero3.checkpoint.deepspeed.pickling import loss_scaler_object, save_with_deepspeed_names, zero_stage_3
from zero3.checkpoint.files import fsync_dir, removed_on_failure

DEEPSPEED_VERSION = "0.19.8"  # the layout written is the one this version saves and loads


@dataclass(frozen=True)
class Member:
    """One parameter's place in a rank's flat of its sub-group."""

    name: str
    shape: tuple[int, ...]
    numel: int
    partition: int
    offset: int


def _partition(numel: int, world: int) -> int:
    return math.ceil(numel / world) if numel else 0


def _group_members(manifest: dict, common: dict, folder: Path) -> list[list[str]]:
    """Each param group's trainable parameters in the group's order."""
    trainable = [n for n, e in manifest["params"].items() if e["trainable"]]
    members = common.get("param_group_members")
    if members is not None:
        return [list(group) for group in members]
    if len(common.get("param_groups", [])) <= 1:
        return [trainable]
    raise ckpt.CheckpointError(
        f"{folder}: {len(common['param_groups'])} optimizer param groups, but the checkpoint does not record "
        "which parameters each holds (it was saved before zero3 recorded it); save it again with this version, "
        "or resume it under zero3 and save once, then export")


def sub_groups(manifest: dict, common: dict, folder: Path, world: int,
               sub_group_size: int) -> tuple[list[list[Member]], list[int]]:
    """DeepSpeed's sub-groups for `world` ranks (module docstring), with flat offsets, and
    the param group of each."""
    result, group_of = [], []
    for group_id, members in enumerate(_group_members(manifest, common, folder)):
        cut, current, count = [], [], 0
        for name in members:
            current.append(name)
            count += _partition(manifest["params"][name]["numel"], world)
            if count >= sub_group_size:
                cut.append(current)
                current, count = [], 0
        if current:
            cut.append(current)
        for names in cut:
            offset, placed = 0, []
            for name in names:
                entry = manifest["params"][name]
                part = _partition(entry["numel"], world)
                placed.append(Member(name, tuple(entry["shape"]), entry["numel"], part, offset))
                offset += part
            result.append(placed)
            group_of.append(group_id)
    return result, group_of


def _rank_slice(reader: ckpt.ShardReader, key: str, member: Member, rank: int,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank `rank`'s padded slice (member.partition elements) of saved tensor `key`, in `dtype`."""
    out = torch.zeros(member.partition, dtype=dtype)
    start = rank * member.partition
    end = min(start + member.partition, member.numel)
    if start < end:
        out[: end - start] = reader.read_range(key, member.numel, start, end).to(dtype)
    return out


def saved_dtypes(manifest: dict) -> tuple[torch.dtype, torch.dtype]:
    """(masters, optimizer state) dtypes the checkpoint was saved with (fp32 where it does not
    say: saved before zero3 recorded them); DeepSpeed's flats and moments are written in them."""
    return (getattr(torch, manifest.get("master_dtype") or "float32"),
            getattr(torch, manifest.get("optimizer_state_dtype") or "float32"))


def _master_key(manifest: dict, name: str) -> str:
    return f"master/{name}" if manifest["params"][name].get("master") else f"param/{name}"


def _check_states(manifest: dict, common: dict, reader: ckpt.ShardReader, groups: list[list[Member]],
                  folder: Path) -> list[dict[str, Any]]:
    """Per sub-group, its scalar state (step) and the elementwise keys, the same for all its members."""
    result = []
    for index, group in enumerate(groups):
        kinds = {m.name: manifest["params"][m.name].get("optim", {}) for m in group}
        first = group[0].name
        if any(k != kinds[first] for k in kinds.values()):
            raise ckpt.CheckpointError(
                f"{folder}: sub-group {index} mixes parameters with and without optimizer state "
                f"({ {n: sorted(k) for n, k in kinds.items()} }); DeepSpeed keeps one state per sub-group: "
                "pick a sub_group_size that separates them, or export after a step that updated them all")
        scalars = {}
        for key, kind in kinds[first].items():
            if kind != "whole":
                continue
            values = {m.name: reader.read_whole(f"optim_whole/{m.name}/{key}").clone() for m in group}
            if any(not torch.equal(v, values[first]) for v in values.values()):
                raise ckpt.CheckpointError(
                    f"{folder}: optimizer state {key!r} differs within DeepSpeed sub-group {index}: "
                    f"{ {n: v.tolist() for n, v in values.items()} } (a parameter that got no gradient on some "
                    "steps); DeepSpeed keeps one per sub-group, so this cannot be written as it is: export with a "
                    "--sub-group-size that puts the parameters of different counts in different sub-groups, and "
                    "give the DeepSpeed run the same zero_optimization.sub_group_size (nothing was written)")
            scalars[key] = values[first]
        extras = [common.get("optim_extras", {}).get(m.name, {}) for m in group]
        if any(e != extras[0] for e in extras):
            raise ckpt.CheckpointError(f"{folder}: non-tensor optimizer state differs within sub-group {index}")
        elementwise = [key for key, kind in kinds[first].items() if kind == "elementwise"]
        result.append({"scalars": scalars, "elementwise": elementwise, "extras": extras[0]})
    return result


# ------------------------------------------------------------------ rank files
@dataclass
class _Export:
    """Everything a rank's two files are made of, checked before the first write."""

    folder: Path
    manifest: dict[str, Any]
    common: dict[str, Any]
    world: int
    target: ExportTarget
    groups: list[list[Member]]
    group_of: list[int]
    states: list[dict[str, Any]]

    @property
    def compute_dtype(self) -> torch.dtype:
        return getattr(torch, self.manifest.get("compute_dtype") or "float32")

    @property
    def frozen(self) -> list[str]:
        optimized = {m.name for group in self.groups for m in group}
        return [n for n in self.manifest["params"] if n not in optimized]


def _ds_config(export: _Export) -> dict[str, Any]:
    """The parts of a DeepSpeed config this checkpoint implies (DeepSpeed's loader does not
    read it; zero3's reader takes the compute dtype and accumulation steps from it, and
    export-deepspeed the sub_group_size and optimizer section after an import)."""
    common, dtype = export.common, export.compute_dtype
    steps = int(common.get("global_steps", 0))
    micro = int(common.get("micro_steps", 0))
    config: dict[str, Any] = {
        "gradient_accumulation_steps": micro // steps if steps and micro % steps == 0 else 1,
        "zero_optimization": {"stage": 3, "sub_group_size": export.target.sub_group_size},
        "bf16": {"enabled": dtype == torch.bfloat16}, "fp16": {"enabled": dtype == torch.float16},
    }
    master_dtype, state_dtype = saved_dtypes(export.manifest)
    if master_dtype == torch.bfloat16:  # DeepSpeed's keys for the dtypes the flats and moments are in
        config["bf16"]["bf16_master_weights_and_grads"] = True
        config["bf16"]["bf16_optimizer_states"] = state_dtype == torch.bfloat16
    if common.get("lr_scheduler_type") in DEEPSPEED_SCHEDULERS:
        config["scheduler"] = {"type": common["lr_scheduler_type"]}
    recorded = common.get("ds_config") or {}  # kept so that importing the export finds the same optimizer
    if isinstance(recorded.get("optimizer"), dict):
        config["optimizer"] = recorded["optimizer"]
    offload = (recorded.get("zero_optimization") or {}).get("offload_optimizer")
    if isinstance(offload, dict):
        config["zero_optimization"]["offload_optimizer"] = offload
    return config


DEEPSPEED_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")


def _optim_state(export: _Export, reader: ckpt.ShardReader, rank: int) -> dict[str, Any]:
    """Rank `rank`'s optimizer file contents."""
    flats, state = [], {}
    master_dtype, state_dtype = saved_dtypes(export.manifest)
    for index, (group, sub_state) in enumerate(zip(export.groups, export.states)):
        flat = torch.cat([_rank_slice(reader, _master_key(export.manifest, m.name), m, rank, master_dtype)
                          for m in group])
        flats.append(flat.requires_grad_(True))
        entry: dict[str, Any] = {key: value.clone() for key, value in sub_state["scalars"].items()}
        if "step" in entry:
            entry["step"] = deepspeed_step(entry["step"], export.target)
        for key in sub_state["elementwise"]:
            entry[key] = torch.cat([_rank_slice(reader, f"optim/{m.name}/{key}", m, rank, state_dtype)
                                    for m in group])
        entry.update(sub_state["extras"])
        if entry:
            state[index] = entry
    param_groups = []
    for group_id, hyper in enumerate(export.common.get("param_groups", [])):
        indices = [i for i, owner in enumerate(export.group_of) if owner == group_id]
        param_groups.append({**deepspeed_param_group(hyper, export.target, group_id), "params": indices})
    scaler = export.common.get("loss_scaler")
    return {"optimizer_state_dict": {
        "zero_stage": zero_stage_3(), "loss_scaler": loss_scaler_object(scaler, export.compute_dtype),
        "dynamic_loss_scale": bool(scaler and scaler.get("dynamic")), "overflow": False,
        "partition_count": export.world,
        "optimizer_state_dict": {"state": state, "param_groups": param_groups},
        "fp32_flat_groups": flats,
    }, "ds_config": _ds_config(export), "ds_version": DEEPSPEED_VERSION}


def _module_placeholders(export: _Export, reader: ckpt.ShardReader) -> dict[str, torch.Tensor]:
    """DeepSpeed's `module`: parameters as empty tensors of their dtype, buffers whole."""
    manifest = export.manifest
    module = {name: torch.empty(0, dtype=getattr(torch, e["dtype"])) for name, e in manifest["params"].items()}
    for alias, canonical in manifest.get("aliases", {}).items():
        if canonical in module:
            module[alias] = torch.empty(0, dtype=module[canonical].dtype)
    for name in manifest.get("buffers", {}):
        module[name] = reader.read_whole(f"buffer/{name}").clone()
    return module


def _frozen_fragments(export: _Export, reader: ckpt.ShardReader, rank: int) -> dict[str, torch.Tensor] | None:
    if export.manifest.get("exclude_frozen_parameters"):
        return None
    fragments = {}
    for name in export.frozen:
        entry = export.manifest["params"][name]
        member = Member(name, tuple(entry["shape"]), entry["numel"], _partition(entry["numel"], export.world), 0)
        fragments[name] = _rank_slice(reader, f"param/{name}", member, rank).to(getattr(torch, entry["dtype"]))
    return fragments


def _model_state(export: _Export, reader: ckpt.ShardReader, rank: int) -> dict[str, Any]:
    """Rank `rank`'s model_states file contents."""
    manifest, common = export.manifest, export.common
    excluded = bool(manifest.get("exclude_frozen_parameters"))
    state = {
        "module": _module_placeholders(export, reader),
        "buffer_names": list(manifest.get("buffers", {})),
        "optimizer": None,
        "param_shapes": [{m.name: torch.Size(m.shape) for m in group} for group in export.groups],
        "frozen_param_shapes": None if excluded else {
            n: torch.Size(manifest["params"][n]["shape"]) for n in export.frozen},
        "shared_params": dict(manifest.get("aliases", {})),
        "frozen_param_fragments": _frozen_fragments(export, reader, rank),
        "lr_scheduler": common.get("lr_scheduler"),
        "data_sampler": None, "random_ltd": None,
        "skipped_steps": int(common.get("skipped_steps", 0)),
        "global_steps": int(common.get("global_steps", 0)),
        "global_samples": int(common.get("global_samples", 0)),
        "dp_world_size": export.world, "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": _ds_config(export), "ds_version": DEEPSPEED_VERSION,
    }
    state.update(common.get("client_state") or {})
    return state


def optim_file_name(rank: int, dtype: torch.dtype) -> str:
    return f"{'bf16_' if dtype == torch.bfloat16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def model_file_name(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def _save(value: Any, path: Path) -> int:
    tmp = path.with_name(path.name + ".tmp")
    with removed_on_failure(tmp):
        save_with_deepspeed_names(value, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    return path.stat().st_size


def _planned(folder: Path, world: int, sub_group_size: int | None, optimizer: str | None,
             reader: ckpt.ShardReader) -> _Export:
    manifest = ckpt.read_manifest(folder)
    common = ckpt.unpickle_file(folder / ckpt.COMMON)
    target = resolve(common, sub_group_size, optimizer)
    groups, group_of = sub_groups(manifest, common, folder, world, target.sub_group_size)
    states = _check_states(manifest, common, reader, groups, folder)
    clashes = sorted(map(str, set(common.get("client_state") or {}) & DEEPSPEED_KEYS))
    if clashes:
        raise ckpt.CheckpointError(
            f"{folder}: client_state keys {clashes} are names DeepSpeed uses for its own entries in the model "
            "file, where the client_state is written (DeepSpeed would read them as its own): rename them in the "
            "client_state given to save_checkpoint, save again and export that (nothing was written)")
    for group_id, hyper in enumerate(common.get("param_groups", [])):
        deepspeed_param_group(hyper, target, group_id)  # refused before the first write
    return _Export(folder, manifest, common, world, target, groups, group_of, states)


def _source_folder(src: Path, tag: str | None) -> Path:
    if (src / ckpt.MANIFEST).is_file() and tag is None:
        return src
    resolved, warning = ckpt.resolve_tag(src, tag)
    if resolved is None:
        raise ckpt.CheckpointError(warning.removeprefix("zero3: ") if warning else f"{src}: no checkpoint")
    return src / resolved


def export_deepspeed(src: Path, dst: Path, world_size: int, sub_group_size: int | None = None,
                     tag: str | None = None, optimizer: str | None = None) -> dict[str, Any]:
    """Write zero3 checkpoint (src, tag) as DeepSpeed ZeRO-3 checkpoint `dst/<its tag>` for
    `world_size` ranks and point `dst/latest` at it. Returns what was written.

    `sub_group_size` and `optimizer` ("fused", "cpu-adam", "torch": the optimizer the
    DeepSpeed run builds) default to what the checkpoint's recorded config implies
    (export_target.py); the summary says which values were used and where they came from.

    When `src` is a Hugging Face Trainer `checkpoint-N` folder (trainer_state.json), `dst`
    becomes one too: the Trainer's files are copied beside DeepSpeed's (trainer_folder.py),
    so `Trainer(args=TrainingArguments(deepspeed=...)).train(resume_from_checkpoint=dst)`
    resumes it.

    Raises CheckpointError for a source that fails verification or cannot be expressed
    in DeepSpeed's layout, and when the destination tag (or a Trainer file) exists;
    nothing is written then."""
    if world_size < 1 or (sub_group_size is not None and sub_group_size < 1):
        raise ckpt.CheckpointError(
            f"world_size {world_size} and sub_group_size {sub_group_size}: both must be at least 1")
    folder = _source_folder(Path(src), tag)
    manifest = ckpt.read_manifest(folder)
    problems = ckpt.verify_files(folder, manifest)
    if problems:
        raise ckpt.CheckpointError(f"checkpoint {folder} failed verification; nothing exported:\n  "
                                   + "\n  ".join(problems))
    out = Path(dst) / folder.name
    if out.exists():
        raise ckpt.CheckpointError(f"{out} already exists; export into another directory or remove it")
    extra = trainer.trainer_entries(Path(src)) if trainer.is_trainer_checkpoint(Path(src)) else []
    trainer.refuse_existing(extra, Path(dst))
    with ckpt.ShardReader(folder, manifest) as reader:
        export = _planned(folder, world_size, sub_group_size, optimizer, reader)
        written = _write_rank_files(export, reader, out)
    copied = _copy_trainer_files(extra, out)
    _write_latest(Path(dst), folder.name)
    summary = {"folder": str(out), "tag": folder.name, "world_size": world_size, "sub_groups": len(export.groups),
               "sub_group_size": export.target.sub_group_size, "sub_group_size_from": export.target.sub_group_size_from,
               "optimizer": export.target.optimizer, "optimizer_from": export.target.optimizer_from,
               "files": sorted(written), "bytes": sum(written.values()),
               "global_steps": int(export.common.get("global_steps", 0)), "trainer_files": copied,
               "trainer_note": trainer.rng_note(extra, world_size) if extra else None}
    return summary


def _write_rank_files(export: _Export, reader: ckpt.ShardReader, out: Path) -> dict[str, int]:
    """Every rank's two files in the new folder `out`; the folder is removed on failure."""
    written: dict[str, int] = {}
    out.mkdir(parents=True)
    try:
        for rank in range(export.world):
            model_path = out / model_file_name(rank)
            optim_path = out / optim_file_name(rank, export.compute_dtype)
            written[model_path.name] = _save(_model_state(export, reader, rank), model_path)
            written[optim_path.name] = _save(_optim_state(export, reader, rank), optim_path)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # no half-written DeepSpeed folder is left
        raise
    fsync_dir(out)
    return written


def _copy_trainer_files(entries: list[Path], out: Path) -> list[str]:
    """The Trainer's files beside the tag folder `out`; `out` is removed if copying fails."""
    try:
        return trainer.copy_entries(entries, out.parent) if entries else []
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise


def _write_latest(dst: Path, tag: str) -> None:
    """`dst/latest` names `tag`: written last, through a temporary name."""
    latest = dst / "latest"
    with removed_on_failure(latest.with_name("latest.tmp")), open(latest.with_name("latest.tmp"), "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest.with_name("latest.tmp"), latest)
    fsync_dir(dst)
