"""DeepSpeed 0.19.x ZeRO-3 checkpoints, read-only: find, validate, describe, read slices.

What DeepSpeed writes for ZeRO stage 3 (`save_dir/latest` names the tag):

  <tag>/zero_pp_rank_{r}_mp_rank_00_model_states.pt           one per data-parallel rank r
      module (buffers; parameters as empty placeholders of their dtype), buffer_names,
      param_shapes (one {name: shape} per optimizer sub-group, in flat order),
      frozen_param_shapes / frozen_param_fragments (rank r's padded slice of each
      parameter the optimizer does not own; None with exclude_frozen_parameters),
      shared_params, lr_scheduler, global_steps, global_samples, skipped_steps,
      dp_world_size, mp_world_size, ds_config, ds_version, and the client_state's keys.
  <tag>/[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt
      optimizer_state_dict: zero_stage, loss_scaler, partition_count,
      fp32_flat_groups (rank r's master of each sub-group, flat: fp32, or bf16 despite the
      name with bf16_master_weights_and_grads), and the torch
      optimizer's state_dict whose entry i is sub-group i (exp_avg, ... flat; step: a
      tensor from torch's optimizers, a Python int from DeepSpeed's own, read as a tensor).

Partitioning: a parameter of n elements on N ranks is padded to N * ceil(n / N); rank r
holds elements [r * ceil(n/N), (r+1) * ceil(n/N)) of it, the tail of the last ranks being
padding. A sub-group's flat holds its parameters' slices back to back, so a parameter
sits at the same offset in the flat of every rank. zero3's own partition (partition.py)
is the same, which is why a DeepSpeed checkpoint loads on any number of ranks: a rank
reads the elements it owns from whichever source ranks hold them, never the padding.

`DeepSpeedCheckpoint.open` checks before anything is returned: every rank file present
(model and optimizer, 0..N-1), `partition_count` == `dp_world_size` == N, ZeRO stage 3,
one model-parallel rank, the element counts of every flat and fragment equal to what the
shapes account for, the optimizer state's keys the same everywhere. Refused, naming
what was found: tensor / pipeline parallel files (mp_rank > 0, layer_*), MoE expert
files, universal checkpoints, ZeRO stage 0/1/2 layouts. NVMe-offloaded saves load like the
others: their swapped optimizer state is read from `<tag>/offloaded_tensors/` (offloaded.py).

The result speaks zero3's checkpoint vocabulary (checkpoint/save_load.py), so that the same load
code restores both: `layout` has the manifest's per-parameter entries, `common` the
counters / scheduler / hyper-parameters / client_state, and the reader methods give the
tensors by zero3's keys (`param/<name>`, `master/<name>`, `optim/<name>/<key>`,
`optim_whole/<name>/<key>`, `buffer/<name>`). Files are memory-mapped; a slice read is
copied out of them by the caller.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zero3.checkpoint.deepspeed.unpickle import (
    DeepSpeedCheckpointError,
    SavedDynamicLossScaler,
    SavedLossScaler,
    SavedZeroStage,
    load_deepspeed_file,
)
from zero3.checkpoint.deepspeed.offloaded import fill_offloaded, saved_with_nvme
from zero3.checkpoint.paths import checked_tag, read_pointer

LATEST = "latest"
MODEL_FILE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
OPTIM_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
# The keys DeepSpeed writes into a model_states file; every other key is the client's.
DEEPSPEED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
    "checkpoint_parallel_dimensions", "ds_config", "ds_version", "universal_checkpoint_info",
})
# Param-group keys that choose an implementation, not a hyper-parameter: the engine keeps its own.
IMPLEMENTATION_KEYS = frozenset({"params", "foreach", "fused", "capturable", "differentiable"})


# ------------------------------------------------------------------ recognizing
def _has_deepspeed_files(folder: Path) -> bool:
    if not folder.is_dir():
        return False
    return any(p.name.endswith(("_model_states.pt", "_optim_states.pt")) for p in folder.iterdir())


def deepspeed_tag_folder(root: Path, tag: str | None = None) -> Path | None:
    """The tag folder a load of (root, tag) means, if it is in DeepSpeed's layout; else None.

    `root` is a save_dir (with `latest`, or with tag given) or a tag folder itself."""
    root = Path(root)
    if tag is not None:
        folder = root / checked_tag(tag, "the tag argument")
        return folder if _has_deepspeed_files(folder) else None
    if _has_deepspeed_files(root):
        return root
    for pointer in (LATEST, "latest_universal"):
        named = read_pointer(root / pointer)  # CheckpointPathError unless a plain folder name
        if named is not None and _has_deepspeed_files(root / named):
            return root / named
    return None


def is_deepspeed_checkpoint(root: Path, tag: str | None = None) -> bool:
    """Whether `engine.load_checkpoint(root, tag)` would read a DeepSpeed ZeRO-3 folder."""
    return deepspeed_tag_folder(root, tag) is not None


def _unsupported_layout(folder: Path) -> str | None:
    """What makes `folder` a DeepSpeed layout zero3 does not read, by its file names."""
    names = sorted(p.name for p in folder.iterdir())
    experts = [n for n in names if "expert_" in n]
    if experts:
        return f"MoE expert files ({', '.join(experts[:3])}): expert-parallel checkpoints are not supported"
    layers = [n for n in names if re.match(r"^layer_\d+-", n)]
    if layers:
        return f"pipeline-parallel layer files ({', '.join(layers[:3])}): pipeline parallelism is not supported"
    parallel = [n for n in names if (m := re.search(r"mp_rank_(\d+)", n)) and int(m.group(1)) > 0]
    if parallel:
        return (f"model-parallel rank files ({', '.join(parallel[:3])}): tensor / pipeline parallel "
                "checkpoints (mp_rank > 0) are not supported")
    if (folder / "zero").is_dir():
        return ("a universal checkpoint (a zero/ folder of per-parameter files): load the ZeRO-3 folder it "
                "was converted from instead")
    if "mp_rank_00_model_states.pt" in names and not any(MODEL_FILE.match(n) for n in names):
        return ("a ZeRO stage 0/1/2 layout (mp_rank_00_model_states.pt holds the whole model): zero3 reads "
                "ZeRO stage 3 checkpoints only")
    if not any(MODEL_FILE.match(n) for n in names):
        return "no zero_pp_rank_*_mp_rank_00_model_states.pt file: not a DeepSpeed ZeRO-3 checkpoint"
    return None


def _rank_files(folder: Path) -> tuple[dict[int, Path], dict[int, Path]]:
    """rank -> model_states file, rank -> optim_states file; ambiguous names refused."""
    models: dict[int, Path] = {}
    optims: dict[int, Path] = {}
    for path in sorted(folder.iterdir()):
        if m := MODEL_FILE.match(path.name):
            models[int(m.group(1))] = path
        elif m := OPTIM_FILE.match(path.name):
            rank = int(m.group(2))
            if rank in optims:
                raise DeepSpeedCheckpointError(
                    f"{folder}: two optimizer files for rank {rank} ({optims[rank].name}, {path.name}); "
                    "remove the one the run did not write last")
            optims[rank] = path
    return models, optims


def _missing_rank_files(folder: Path, models: dict, optims: dict, world: int) -> list[str]:
    problems = []
    prefix = "bf16_" if any(p.name.startswith("bf16_") for p in optims.values()) else ""
    for rank in range(world):
        if rank not in models:
            problems.append(f"{folder / f'zero_pp_rank_{rank}_mp_rank_00_model_states.pt'}: missing")
        if rank not in optims:
            problems.append(f"{folder / f'{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt'}: missing")
    extra = sorted(r for r in set(models) | set(optims) if r >= world)
    if extra:
        problems.append(f"{folder}: files of ranks {extra}, but the checkpoint says dp_world_size {world}")
    return problems


# ------------------------------------------------------------------ the layout
@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in every rank's files: `partition` elements per rank
    (ceil(numel / N)); trainable ones at `offset` of sub-group `sub_group`'s flat."""

    name: str
    shape: tuple[int, ...]
    numel: int
    partition: int
    trainable: bool
    sub_group: int = -1
    offset: int = 0


def _partition(numel: int, world: int) -> int:
    return math.ceil(numel / world) if numel else 0


def _shapes_of(value: Any, what: str, path: Path) -> list[tuple[str, tuple[int, ...]]]:
    if not isinstance(value, dict):
        raise DeepSpeedCheckpointError(f"{path}: {what} is {type(value).__name__}, expected a name -> shape map")
    return [(str(name), tuple(int(s) for s in shape)) for name, shape in value.items()]


def _config_section(config: Any, *keys: str) -> Any:
    for key in keys:
        config = config.get(key) if isinstance(config, dict) else None
    return config


def _compute_dtype(model0: dict, optim_names: list[str]) -> torch.dtype:
    """The run's 16-bit / 32-bit compute dtype: from its config, else from the file names."""
    config = model0.get("ds_config")
    if _config_section(config, "bf16", "enabled") or _config_section(config, "bfloat16", "enabled"):
        return torch.bfloat16
    if _config_section(config, "fp16", "enabled"):
        return torch.float16
    return torch.bfloat16 if any(n.startswith("bf16_") for n in optim_names) else torch.float32


def _check_rank_headers(folder: Path, models: list[dict], optims: list[dict]) -> None:
    """Each rank's files agree with the folder: N ranks, stage 3, one model-parallel rank."""
    world = len(models)
    for rank, (model, optim) in enumerate(zip(models, optims)):
        where = f"{folder}: rank {rank}"
        if not isinstance(model, dict) or not isinstance(optim, dict):
            raise DeepSpeedCheckpointError(
                f"{where}'s files hold {type(model).__name__} and {type(optim).__name__}, not DeepSpeed's dicts")
        if model.get("dp_world_size") != world:
            raise DeepSpeedCheckpointError(
                f"{where}'s model file says dp_world_size {model.get('dp_world_size')}, the folder holds "
                f"{world} ranks' files")
        dims = model.get("checkpoint_parallel_dimensions") or {}
        if model.get("mp_world_size", 1) != 1 or dims.get("tp_degree", 1) != 1 or dims.get("pp_degree", 1) != 1:
            raise DeepSpeedCheckpointError(
                f"{where}: saved with model parallelism (mp_world_size {model.get('mp_world_size')}, {dims}); "
                "tensor / pipeline parallel checkpoints are not supported")
        state = optim.get("optimizer_state_dict")
        if not isinstance(state, dict):
            raise DeepSpeedCheckpointError(f"{where}'s optimizer file has no optimizer_state_dict")
        stage = state.get("zero_stage")
        if stage != SavedZeroStage.weights:
            raise DeepSpeedCheckpointError(
                f"{where}'s optimizer file is ZeRO stage {int(stage) if stage is not None else 'unknown'}; "
                "zero3 reads ZeRO stage 3 checkpoints only")
        counts = state.get("partition_count")
        counts = counts if isinstance(counts, (list, tuple)) else [counts]
        if any(count != world for count in counts):
            raise DeepSpeedCheckpointError(
                f"{where}'s optimizer file says partition_count {state.get('partition_count')}, the folder "
                f"holds {world} ranks' files (dp_world_size {world})")
        if state.get("ds_zero_partition_groups") is not None:
            raise DeepSpeedCheckpointError(
                f"{where}: parameters partitioned over expert groups (ds_zero_partition_groups); MoE / "
                "expert-parallel checkpoints are not supported")



def _trainable_slots(folder: Path, models: list[dict]) -> list[list[Slot]]:
    """Per sub-group, its parameters in flat order (rank 0's param_shapes, the same on all)."""
    world = len(models)
    groups = models[0].get("param_shapes")
    if not isinstance(groups, list):
        raise DeepSpeedCheckpointError(f"{folder}: rank 0's model file has no param_shapes list")
    for rank, model in enumerate(models[1:], start=1):
        if model.get("param_shapes") != groups:
            raise DeepSpeedCheckpointError(f"{folder}: rank {rank}'s param_shapes differ from rank 0's")
    slots = []
    for index, group in enumerate(groups):
        offset, members = 0, []
        for name, shape in _shapes_of(group, f"param_shapes[{index}]", folder):
            numel = math.prod(shape)
            members.append(Slot(name, shape, numel, _partition(numel, world), True, index, offset))
            offset += _partition(numel, world)
        slots.append(members)
    return slots


def _check_flats(folder: Path, optims: list[dict], slots: list[list[Slot]]) -> None:
    """Every rank's flat of every sub-group holds exactly its parameters' slices."""
    for rank, optim in enumerate(optims):
        flats = optim["optimizer_state_dict"].get("fp32_flat_groups")
        if not isinstance(flats, (list, tuple)) or len(flats) != len(slots):
            raise DeepSpeedCheckpointError(
                f"{folder}: rank {rank} has {len(flats) if isinstance(flats, (list, tuple)) else 'no'} fp32 "
                f"flat groups, param_shapes describes {len(slots)} sub-groups")
        for index, (flat, members) in enumerate(zip(flats, slots)):
            wanted = sum(s.partition for s in members)
            if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or flat.numel() != wanted:
                raise DeepSpeedCheckpointError(
                    f"{folder}: rank {rank}, sub-group {index}: the fp32 flat holds "
                    f"{tuple(flat.shape) if isinstance(flat, torch.Tensor) else type(flat).__name__} elements, "
                    f"its {len(members)} parameters account for {wanted} (ceil(numel / {len(optims)}) each); "
                    "the file does not match its own layout")


def _frozen_slots(folder: Path, models: list[dict]) -> list[Slot] | None:
    """Parameters the optimizer does not own, with their fragments checked; None when the
    save left them out (exclude_frozen_parameters)."""
    world = len(models)
    shapes = models[0].get("frozen_param_shapes")
    if shapes is None:
        return None
    slots = []
    for name, shape in _shapes_of(shapes, "frozen_param_shapes", folder):
        numel = math.prod(shape)
        slots.append(Slot(name, shape, numel, _partition(numel, world), False))
    for rank, model in enumerate(models):
        fragments = model.get("frozen_param_fragments") or {}
        for slot in slots:
            fragment = fragments.get(slot.name)
            if not isinstance(fragment, torch.Tensor) or fragment.numel() != slot.partition:
                got = fragment.numel() if isinstance(fragment, torch.Tensor) else "no tensor"
                raise DeepSpeedCheckpointError(
                    f"{folder}: rank {rank}'s fragment of frozen {slot.name} {slot.shape} holds {got} elements, "
                    f"expected {slot.partition} (ceil({slot.numel} / {world}))")
    return slots


def _state_kinds(folder: Path, optims: list[dict], slots: list[list[Slot]]) -> dict[str, str]:
    """Optimizer state key -> "elementwise" (a flat like the masters) or "whole" (a scalar),
    the same for every sub-group on every rank (or no state at all: never stepped)."""
    kinds: dict[str, str] | None = None
    for rank, optim in enumerate(optims):
        state, indices = _sub_group_states(folder, rank, optim, len(slots))
        flats = optim["optimizer_state_dict"]["fp32_flat_groups"]
        for index, (entry, flat) in enumerate(zip((state.get(i, {}) for i in indices), flats)):
            found = {}
            for key, value in entry.items():
                if not isinstance(value, torch.Tensor):
                    continue
                if value.dim() == 0:
                    found[key] = "whole"
                elif value.shape == flat.shape:
                    found[key] = "elementwise"
                else:
                    raise DeepSpeedCheckpointError(
                        f"{folder}: rank {rank}, sub-group {index}: optimizer state {key!r} has shape "
                        f"{tuple(value.shape)}, neither the flat's {tuple(flat.shape)} nor a scalar; "
                        "only elementwise optimizers can be resharded")
            if kinds is None:
                kinds = found
            elif found != kinds:
                raise DeepSpeedCheckpointError(
                    f"{folder}: rank {rank}, sub-group {index} holds optimizer state {sorted(found)}, "
                    f"other sub-groups {sorted(kinds)}; the optimizer state is inconsistent")
    return kinds or {}


def _steps_as_tensors(optims: list[dict]) -> None:
    """A `step` kept as a Python number becomes the 0-dim float32 tensor torch's optimizers
    keep (in place, in the loaded state). DeepSpeed's own optimizers count steps in a Python
    int: DeepSpeedCPUAdam (`offload_optimizer`), FusedAdam, CPU Adagrad and Lion; torch's
    Adam and AdamW refuse a number there at their first step ("`state_steps` argument must
    contain a list of singleton tensors")."""
    for optim in optims:
        inner = optim["optimizer_state_dict"].get("optimizer_state_dict")
        states = inner.get("state", {}) if isinstance(inner, dict) else {}
        for entry in states.values():
            step = entry.get("step") if isinstance(entry, dict) else None
            if isinstance(step, (int, float)) and not isinstance(step, bool):
                entry["step"] = torch.tensor(float(step), dtype=torch.float32)


def _sub_group_states(folder: Path, rank: int, optim: dict, count: int) -> tuple[dict, list]:
    """The torch optimizer's state and the state index of each sub-group, in flat order."""
    inner = optim["optimizer_state_dict"].get("optimizer_state_dict")
    if not isinstance(inner, dict) or "param_groups" not in inner:
        raise DeepSpeedCheckpointError(f"{folder}: rank {rank}'s optimizer file has no torch optimizer state")
    indices = [i for group in inner["param_groups"] for i in group.get("params", [])]
    if len(indices) != count:
        raise DeepSpeedCheckpointError(
            f"{folder}: rank {rank}'s optimizer has {len(indices)} parameters in its groups, "
            f"param_shapes describes {count} sub-groups")
    return inner.get("state", {}), indices


def _loss_scaler_state(scaler: Any, dtype: torch.dtype) -> dict[str, Any] | None:
    """DeepSpeed's fp16 loss scaler as zero3's LossScaler state (optim/loss_scaler.py); None for
    bf16 / fp32 runs, whose scaler is a constant 1."""
    if dtype != torch.float16 or not isinstance(scaler, SavedLossScaler):
        return None
    if not isinstance(scaler, SavedDynamicLossScaler):
        return {"scale": float(scaler.cur_scale), "dynamic": False}
    return {
        "scale": float(scaler.cur_scale), "dynamic": True, "window": int(scaler.scale_window),
        "min_scale": float(scaler.min_scale), "hysteresis": int(scaler.delayed_shift),
        "consecutive_hysteresis": bool(scaler.consecutive_hysteresis), "factor": float(scaler.scale_factor),
        "iteration": int(scaler.cur_iter), "last_overflow_iteration": int(scaler.last_overflow_iter),
        "hysteresis_left": int(scaler.cur_hysteresis),
    }


def _plain_config(config: Any) -> dict | None:
    """The DeepSpeed run's config as JSON values (any other value as its str); None if absent."""
    return json.loads(json.dumps(config, default=str)) if isinstance(config, dict) else None


def _accumulation_steps(config: Any, world: int) -> int:
    """gradient_accumulation_steps of the run's config (given, or from the batch sizes), else 1."""
    steps = _config_section(config, "gradient_accumulation_steps")
    if isinstance(steps, int) and steps > 0:
        return steps
    total, micro = (_config_section(config, "train_batch_size"),
                    _config_section(config, "train_micro_batch_size_per_gpu"))
    if isinstance(total, int) and isinstance(micro, int) and micro > 0 and total % (micro * world) == 0:
        return max(total // (micro * world), 1)
    return 1


class DeepSpeedCheckpoint:
    """One validated DeepSpeed ZeRO-3 tag folder, readable by zero3's keys (module doc).

    Holds the loaded (memory-mapped) contents of every rank's two files until `close()`
    or the end of its `with` block. The tensors its read methods return are views into
    them or fresh copies, never to be written to (the caller copies them into its own
    shards)."""

    def __init__(self, folder: Path, models: list[dict], optims: list[dict], optim_names: list[str]) -> None:
        _check_rank_headers(folder, models, optims)
        self.folder = folder
        self.world_size = len(models)
        self._models = models
        _steps_as_tensors(optims)
        self._states = [o["optimizer_state_dict"] for o in optims]
        self.sub_groups = _trainable_slots(folder, models)
        if saved_with_nvme(models[0].get("ds_config")):  # swapped sub-groups: their values in files
            fill_offloaded(folder, optims, [sum(s.partition for s in group) for group in self.sub_groups])
        _check_flats(folder, optims, self.sub_groups)
        self.frozen = _frozen_slots(folder, models)
        self.state_kinds = _state_kinds(folder, optims, self.sub_groups)
        self.slots = {s.name: s for group in self.sub_groups for s in group}
        self.slots.update({s.name: s for s in self.frozen or []})
        self.compute_dtype = _compute_dtype(models[0], optim_names)
        self._sub_group_state = [self._states_by_sub_group(rank) for rank in range(self.world_size)]
        self.master_dtype, self.state_dtype = self._saved_dtypes()
        self.layout = self._layout()
        self.common = self._common()

    @classmethod
    def open(cls, root: Path, tag: str | None = None) -> "DeepSpeedCheckpoint":
        """Find, load and validate the folder that (root, tag) names; DeepSpeedCheckpointError
        naming every missing file or the first inconsistency otherwise."""
        folder = deepspeed_tag_folder(root, tag)
        if folder is None:
            raise DeepSpeedCheckpointError(f"{root}: no DeepSpeed checkpoint (tag {tag!r}) found")
        problem = _unsupported_layout(folder)
        if problem:
            raise DeepSpeedCheckpointError(f"{folder}: {problem}")
        model_files, optim_files = _rank_files(folder)
        if 0 not in model_files:
            raise DeepSpeedCheckpointError(f"{folder / 'zero_pp_rank_0_mp_rank_00_model_states.pt'}: missing")
        first = load_deepspeed_file(model_files[0])
        world = first.get("dp_world_size") if isinstance(first, dict) else None
        if not isinstance(world, int) or world < 1:
            raise DeepSpeedCheckpointError(f"{model_files[0]}: no dp_world_size; not a DeepSpeed model file")
        missing = _missing_rank_files(folder, model_files, optim_files, world)
        if missing:
            raise DeepSpeedCheckpointError(
                f"DeepSpeed checkpoint {folder} is incomplete ({world} ranks saved it):\n  " + "\n  ".join(missing))
        models = [first] + [load_deepspeed_file(model_files[r]) for r in range(1, world)]
        optims = [load_deepspeed_file(optim_files[r]) for r in range(world)]
        return cls(folder, models, optims, [optim_files[r].name for r in range(world)])

    def close(self) -> None:
        """Drop the memory-mapped file contents (`layout`, `common` stay readable)."""
        self._models, self._states, self._sub_group_state = [], [], []

    def __enter__(self) -> "DeepSpeedCheckpoint":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ----------------------------------------------------------- zero3's view
    def _states_by_sub_group(self, rank: int) -> list[dict[str, Any]]:
        inner = self._states[rank]["optimizer_state_dict"]
        indices = [i for group in inner["param_groups"] for i in group.get("params", [])]
        return [inner.get("state", {}).get(i, {}) for i in indices]

    def _dtype_of(self, name: str) -> torch.dtype:
        placeholder = self._models[0].get("module", {}).get(name)
        if isinstance(placeholder, torch.Tensor):
            return placeholder.dtype
        fragment = (self._models[0].get("frozen_param_fragments") or {}).get(name)
        return fragment.dtype if isinstance(fragment, torch.Tensor) else self.compute_dtype

    def _saved_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """(the masters' dtype, the elementwise optimizer state's): fp32, or bf16 when DeepSpeed
        ran with bf16_master_weights_and_grads / bf16_optimizer_states (its `fp32_flat_groups`
        then hold bf16 tensors under their usual name)."""
        flats = self._states[0].get("fp32_flat_groups") or []
        master = flats[0].dtype if flats else torch.float32
        for entry in self._sub_group_state[0]:
            for key, value in entry.items():
                if self.state_kinds.get(key) == "elementwise" and isinstance(value, torch.Tensor):
                    return master, value.dtype
        return master, master

    def _layout(self) -> dict[str, Any]:
        """The manifest-shaped description checkpoint/save_load.py checks the model against."""
        params = {}
        for name, slot in self.slots.items():
            dtype = self._dtype_of(name)
            params[name] = {
                "shape": list(slot.shape), "dtype": str(dtype).removeprefix("torch."), "numel": slot.numel,
                "trainable": slot.trainable, "master": slot.trainable and dtype != self.master_dtype,
                "optim": dict(self.state_kinds) if slot.trainable else {},
            }
        model0 = self._models[0]
        buffers = {name: {"shape": list(model0["module"][name].shape),
                          "dtype": str(model0["module"][name].dtype).removeprefix("torch.")}
                   for name in model0.get("buffer_names") or [] if name in model0.get("module", {})}
        return {"format": "deepspeed", "world_size": self.world_size, "params": params, "buffers": buffers,
                "master_dtype": str(self.master_dtype).removeprefix("torch."),
                "optimizer_state_dtype": str(self.state_dtype).removeprefix("torch."),
                "exclude_frozen_parameters": self.frozen is None,
                "aliases": dict(model0.get("shared_params") or {})}

    def _common(self) -> dict[str, Any]:
        """Counters, scheduler, hyper-parameters, loss scaler and client_state, as common.pt's."""
        model0 = self._models[0]
        inner = self._states[0]["optimizer_state_dict"]
        config = model0.get("ds_config")
        steps = int(model0.get("global_steps", 0))
        extras = {}
        for slot in self.slots.values():
            if slot.trainable:
                plain = {k: v for k, v in self._sub_group_state[0][slot.sub_group].items()
                         if not isinstance(v, torch.Tensor)}
                if plain:
                    extras[slot.name] = plain
        return {
            "global_steps": steps,
            "micro_steps": steps * _accumulation_steps(config, self.world_size),
            "global_samples": int(model0.get("global_samples", 0)),
            "skipped_steps": int(model0.get("skipped_steps", 0)),
            "loss_scaler": _loss_scaler_state(self._states[0].get("loss_scaler"), self.compute_dtype),
            "param_groups": [{k: v for k, v in g.items() if k not in IMPLEMENTATION_KEYS}
                             for g in inner["param_groups"]],
            "param_group_members": [[slot.name for index in group["params"] for slot in self.sub_groups[index]]
                                    for group in inner["param_groups"]],
            "optim_extras": extras,
            "lr_scheduler": model0.get("lr_scheduler"),
            "lr_scheduler_type": _config_section(config, "scheduler", "type"),
            "client_state": {k: v for k, v in model0.items() if k not in DEEPSPEED_KEYS},
            "ds_config": _plain_config(config),  # what export-deepspeed reads to go back
        }

    # ------------------------------------------------------------- reading
    def _slot(self, name: str) -> Slot:
        slot = self.slots.get(name)
        if slot is None:
            raise DeepSpeedCheckpointError(f"{self.folder}: no parameter {name!r} in this DeepSpeed checkpoint")
        return slot

    def _rank_piece(self, rank: int, kind: str, slot: Slot, state_key: str | None) -> torch.Tensor:
        """Rank `rank`'s padded slice (slot.partition elements) of a parameter's tensor `kind`:
        a view into the loaded file, detached (the saved masters require grad)."""
        if not slot.trainable:
            if kind != "param":
                raise DeepSpeedCheckpointError(f"{self.folder}: frozen {slot.name} has no {kind} tensor")
            return self._models[rank]["frozen_param_fragments"][slot.name].detach().reshape(-1)
        if kind in ("param", "master"):
            flat = self._states[rank]["fp32_flat_groups"][slot.sub_group]
        else:
            flat = self._sub_group_state[rank][slot.sub_group][state_key]
        return flat.detach()[slot.offset:slot.offset + slot.partition]

    def read_range(self, key: str, numel: int, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the flattened tensor `key` (`numel` elements in all),
        from the ranks that hold them; the padding past `numel` is never read."""
        kind, name, state_key = _parse_key(key)
        slot = self._slot(name)
        if numel != slot.numel:
            raise DeepSpeedCheckpointError(f"{self.folder}: {name} has {slot.numel} elements, not {numel}")
        pieces = []
        for rank in range(self.world_size):
            first = rank * slot.partition
            lo, hi = max(start, first), min(end, first + slot.partition, slot.numel)
            if lo < hi:
                pieces.append(self._rank_piece(rank, kind, slot, state_key)[lo - first:hi - first])
        if not pieces:
            return self._rank_piece(0, kind, slot, state_key)[0:0]
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    def read_whole(self, key: str, rank: int = 0) -> torch.Tensor:
        """A buffer (rank 0's) or a scalar optimizer state (of the parameter's sub-group on
        source rank `rank`), as a fresh tensor."""
        kind, name, state_key = _parse_key(key)
        if kind == "buffer":
            return self._models[0]["module"][name].detach().clone()
        if kind != "optim_whole":
            raise DeepSpeedCheckpointError(f"{self.folder}: {key} is read by range, not whole")
        slot = self._slot(name)
        return self._sub_group_state[min(rank, self.world_size - 1)][slot.sub_group][state_key].detach().clone()

    def whole_shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.read_whole(key).shape)

    # ------------------------------------------------------------ describing
    def describe(self) -> dict[str, Any]:
        """What the folder holds, for `zero3 checkpoint inspect` (plain values)."""
        trainable = [s for s in self.slots.values() if s.trainable]
        common = self.common
        return {
            "format": "deepspeed", "tag": self.folder.name, "ds_version": self._models[0].get("ds_version"),
            "world_size": self.world_size, "compute_dtype": str(self.compute_dtype).removeprefix("torch."),
            "global_steps": common["global_steps"], "global_samples": common["global_samples"],
            "skipped_steps": common["skipped_steps"], "params": len(self.slots),
            "elements": sum(s.numel for s in self.slots.values()), "trainable": len(trainable),
            "trainable_elements": sum(s.numel for s in trainable), "sub_groups": len(self.sub_groups),
            "param_groups": len(common["param_groups"]), "optimizer_state": sorted(self.state_kinds),
            "frozen_saved": self.frozen is not None, "buffers": len(self.layout["buffers"]),
            "lr_scheduler": common["lr_scheduler_type"] or ("saved" if common["lr_scheduler"] else None),
            "loss_scale": (common["loss_scaler"] or {}).get("scale"),
            "client_state_keys": sorted(map(str, common["client_state"])),
        }


def _parse_key(key: str) -> tuple[str, str, str | None]:
    """zero3's tensor keys: kind/<name> or kind/<name>/<state key>."""
    kind, _, rest = key.partition("/")
    if kind in ("optim", "optim_whole"):
        name, _, state_key = rest.rpartition("/")
        return kind, name, state_key
    if kind in ("param", "master", "buffer"):
        return kind, rest, None
    raise DeepSpeedCheckpointError(f"unknown tensor key {key!r}")
