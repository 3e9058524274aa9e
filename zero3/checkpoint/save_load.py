"""Checkpoints, engine side: save / load / reshard, commit protocol, RNG and counters.

The format's read-only side (names, manifest, verification, tags, the shard reader) is
checkpoint/format.py, shared with the CLI, the offline export and the DeepSpeed import.

`save` and `load` take a `TrainingState` (the model and its shards, the optimizer view,
scheduler, counters, loss scaler, where gradient shards live and how to drop them) that
the engine builds at each call, plus the config values they use as plain arguments.

Layout of `save_dir/<tag>/` (W ranks saved it):
  rank{r:05d}-of-{W:05d}.safetensors  rank r's unpadded slices, per parameter by name:
                                 param/<name>             compute-dtype values
                                 master/<name>            master (only where separate), in the
                                                          dtype it lives in (fp32, or bf16 with
                                                          bf16_master_weights_and_grads)
                                 optim/<name>/<key>       elementwise optimizer state
                                 optim_whole/<name>/<key> any other tensor state (AdamW's step)
                                 grad/<name>              gradient accumulated so far (fp32, or
                                                          data_types.grad_accum_dtype), when
                                                          saved inside an accumulation window
                               and in rank 0's file, buffer/<name>: the persistent buffers,
                                 late/<name>: parameters attached after initialize, whole
                                 (late_params.py)
  rank{r:05d}-of-{W:05d}.state.pt    rank r's RNG states: python, numpy, torch, cuda
  common.pt                    counters, scheduler, client_state, optimizer hyper-parameters
  pytorch_model.safetensors    consolidated 16-bit weights, only with the config's
                               gather_16bit_weights_on_model_save
  manifest.json                the commit marker (below)
and `save_dir/latest` holds the tag of the newest committed checkpoint.

Why our own format: torch.distributed.checkpoint reshards, but reads its metadata with
plain pickle, keeps no checksums and has no commit marker. safetensors gives tensors
without code execution and lazy slices, which resharding needs, so tensors live in
safetensors files; the small rest is loaded with `torch.load(weights_only=True)`.
Nothing is ever unpickled without `weights_only=True`.

Manifest: format version, zero3 and torch versions, tag, world size, counters, every file
with its size and sha256, per-parameter layout (shape, dtype, numel, shard_numel,
master, optimizer state kinds), buffers, tied-parameter aliases; and a sha256 of all of
that, so a damaged manifest is itself detected.

Commit protocol (`save`):
  1. rank 0 refuses a tag folder holding entries that are no checkpoint's files
     (checkpoint/tag_contents.py says what a save may replace). The save writes into the
     tag's folder, emptied first, unless that folder holds a checkpoint (zero3's committed
     one, or DeepSpeed's of the same tag, e.g. after a rollback resume; one warning names
     it): then into a hidden staging folder beside it (checkpoint/folder_swap.py), so the
     previous checkpoint of the tag stays loadable until the new one replaces it whole;
  2. every rank writes its files under `<name>.tmp`, fsyncs, renames, fsyncs the folder;
  3. rank 0 writes the manifest the same way (temporary name, fsync, rename, fsync),
     and a staging folder then takes the tag's place (an atomic exchange where the file
     system has one);
  4. only then rank 0 writes `latest` the same way (unless save_latest=False).
A failure on any rank raises on every rank (never a hang). A crash anywhere before
step 3 completes leaves a folder without a manifest: incomplete, never loaded; when the
tag was committed before, it still holds that previous save.

Choosing what to load (`resolve_tag`):
  - tag given: that folder; missing -> (None, None) and a warning, as DeepSpeed; present
    without a manifest -> CheckpointError "incomplete".
  - no tag: `latest` missing -> (None, None) and a warning. `latest` names a committed
    tag -> that one. `latest` names a tag with no manifest (or no folder) -> the newest
    committed tag (by global step, then time) with a warning naming both; with no
    committed tag at all -> CheckpointError (never a silent fresh start). Only that
    case falls back: an interrupted save is a normal event that the protocol makes
    harmless, so a week-long run restarts by itself from its last good checkpoint. A
    *damaged* checkpoint (bad manifest, checksum, size, missing or extra file) is not
    expected and never skipped silently: it raises, naming the files.

A DeepSpeed ZeRO-3 folder (its `latest` and `zero_pp_rank_*` files, checkpoint/deepspeed/layout.py) is
recognized first and loaded through the same checks and restore, its files read by
DeepSpeedCheckpoint instead of ShardReader (`_load_deepspeed`).

Loading verifies everything before any state is touched: the manifest and its checksum,
every file's presence, size and sha256 (shared out across ranks), no extra files, the
safetensors headers against the layout, the model against the layout, and the pickled
parts with weights_only=True. Every rank raises the same error.

Resharding: rank r of W owns elements [r*ceil(n/W), ...) of each flattened parameter
(`owned_range`, params/shard_layout.py); the loader computes its own range for its
world size and reads the overlapping slices of every source file, so a checkpoint saved
on N ranks loads on M ranks.

RNG: every save records each rank's Python, NumPy, torch (and CUDA) RNG states; a load
leaves the RNG as it is, as DeepSpeed does, unless the config's `checkpoint.load_rng_state`
asks for them (then ranks below N restore theirs; a rank at or past N keeps its own).

Debugging aid (`ZERO3_CHECKPOINT_PAUSE`): set it to a phase of `PAUSE_PHASES`, optionally
`<phase>@<rank>`, and a save freezes at that point (logging it, and writing its pid to
`ZERO3_CHECKPOINT_PAUSE_MARKER` if set) until the process is killed, or for
`ZERO3_CHECKPOINT_PAUSE_SECONDS` if set: a way to look at a half-written checkpoint, what
the fault-injection tests SIGKILL, and (bounded) how they hold an asynchronous save in flight.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import random
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from zero3.checkpoint.deepspeed.layout import DeepSpeedCheckpoint, deepspeed_tag_folder
from zero3.checkpoint.errors import CheckpointError, CheckpointTagMismatchError
from zero3.checkpoint.export import (
    gather_on_every_rank,
    on_every_rank,
    parameter_aliases,
    persistent_buffers,
    write_consolidated,
)
from zero3.checkpoint.files import TensorSpec, fsync_dir, removed_on_failure, write_safetensors
from zero3.checkpoint.folder_swap import put_in_place, replaced_folder, staging_folder
from zero3.checkpoint.format import (
    COMMON,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    MODEL_16BIT,
    ShardReader,
    plain_value_problem,
    read_manifest,
    resolve_tag,
    seal,
    shard_file,
    state_file,
    unpickle_file,
    verify_files,
)
from zero3.checkpoint.paths import checked_tag
from zero3.checkpoint.tag_contents import refuse_unknown_entries, replacement_warning, tag_contents
from zero3.engine_parts.counters import StepCounters
from zero3.engine_parts.views import OptimizerAccess, ShardedModel
from zero3.placement.devices import Placement
from zero3.optim.loss_scaler import LossScaler
from zero3.optim.precision import MasterPrecision, converted_note
from zero3.params.nvme_shards import drain_param_writes
from zero3.params.late_params import LATE_KEY, late_layout, restore_late, unmanaged_parameters
from zero3.params.partition import ParamState, ShardedParam
from zero3.platform.collectives import Communicator
from zero3.version import __version__

logger = logging.getLogger("zero3")

PAUSE_ENV = "ZERO3_CHECKPOINT_PAUSE"
PAUSE_MARKER_ENV = "ZERO3_CHECKPOINT_PAUSE_MARKER"
PAUSE_SECONDS_ENV = "ZERO3_CHECKPOINT_PAUSE_SECONDS"
PAUSE_PHASES = {
    "shard-partial": "a rank's shard file is half written (header and first tensor)",
    "shards-written": "rank 0, after every rank committed its files, before the manifest",
    "manifest-written": "rank 0, after the manifest is committed (in the staging folder when the save "
                        "replaces a committed tag, not yet in its place), before `latest`",
}


@dataclass(frozen=True, eq=False)
class TrainingState:
    """What a checkpoint saves and restores: the engine's collaborators when save or load is called.

    Ownership: every object here is the engine's. A save only reads them; a load writes
    into them in place (shards, fp32 masters, optimizer state and param groups, the
    scheduler, counters and loss scaler) and calls `zero_grad` to drop the gradients of
    the window it replaces. Saved gradient shards are restored as new fp32 tensors on
    the device `placement` gives each one's optimizer side, owned by their ShardedParams
    from then on."""

    model: ShardedModel
    optimizer: OptimizerAccess
    lr_scheduler: Any
    counters: StepCounters
    loss_scaler: LossScaler | None
    placement: Placement
    zero_grad: Callable[[], None]
    ds_config: dict | None = None  # the config as given (JSON values), recorded in common.pt


# ------------------------------------------------------------------ file I/O
def _write_bytes_atomically(path: Path, data: bytes) -> dict[str, Any]:
    """`path` becomes `data` or stays as it was: temporary name, fsync, rename, fsync dir."""
    tmp = path.with_name(path.name + ".tmp")
    with removed_on_failure(tmp), open(tmp, "wb") as f:  # a full disk: the error names `tmp`, removed
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _pickled(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


# ------------------------------------------------------------ debugging aid
def pause_point(phase: str, rank: int) -> None:
    """Freeze here if ZERO3_CHECKPOINT_PAUSE asks for `phase` (on this rank): until killed,
    or for ZERO3_CHECKPOINT_PAUSE_SECONDS seconds when that is set (then the save goes on)."""
    wanted = os.environ.get(PAUSE_ENV)
    if not wanted:
        return
    name, _, only_rank = wanted.partition("@")
    if name != phase or (only_rank and int(only_rank) != rank):
        return
    marker = os.environ.get(PAUSE_MARKER_ENV)
    seconds = os.environ.get(PAUSE_SECONDS_ENV)
    until = f"for {seconds} s" if seconds else "until the process is killed"
    message = (f"zero3: checkpoint save paused at {phase!r} ({PAUSE_PHASES[phase]}) on rank {rank}, "
               f"pid {os.getpid()}, because {PAUSE_ENV}={wanted}, {until}")
    logger.warning(message)
    print(message, file=sys.stderr, flush=True)
    if marker:
        _write_bytes_atomically(Path(marker), str(os.getpid()).encode())
    if seconds:
        time.sleep(float(seconds))
        return
    while True:
        time.sleep(1)


def _check_pause_setting() -> None:
    wanted = os.environ.get(PAUSE_ENV)
    if not wanted:
        return
    name, _, only_rank = wanted.partition("@")
    if name not in PAUSE_PHASES or (only_rank and not only_rank.isdigit()):
        raise CheckpointError(
            f"{PAUSE_ENV}={wanted!r} is not '<phase>' or '<phase>@<rank>' with a phase of "
            f"{sorted(PAUSE_PHASES)}; unset it to save normally"
        )
    seconds = os.environ.get(PAUSE_SECONDS_ENV)
    if seconds and not seconds.replace(".", "", 1).isdigit():
        raise CheckpointError(f"{PAUSE_SECONDS_ENV}={seconds!r} is not a number of seconds; unset it to pause "
                              "until the process is killed")


# ----------------------------------------------------------------------- save
def _check_client_state(client_state: Any) -> None:
    if type(client_state) is not dict:
        raise CheckpointError(f"client_state must be a dict, got {type(client_state).__name__}")
    problem = plain_value_problem(client_state)
    if problem:
        raise CheckpointError(
            f"client_state holds a value that could only be loaded by running code from the "
            f"file ({problem}); keep dict / list / tuple / str / int / float / bool / None and "
            "torch tensors there (e.g. convert numpy values with .item() or torch.from_numpy)"
        )


def _saved_params(table: dict[torch.nn.Parameter, ShardedParam], exclude_frozen: bool) -> list[ShardedParam]:
    return [sp for sp in table.values() if not (exclude_frozen and not sp.requires_grad)]


def _rank_tensors(model: ShardedModel, optimizer: OptimizerAccess, exclude_frozen: bool,
                  optimizer_state: dict | None = None) -> tuple[list[TensorSpec], list[Callable], dict]:
    """This rank's tensors: specs, a producer for each (called one at a time, in order),
    and per parameter {"master": bool, "optim": {key: "elementwise" | "whole"}}.
    `optimizer_state`: read instead of the optimizer's own state (None: its own)."""
    specs: list[TensorSpec] = []
    producers: list[Callable[[], torch.Tensor]] = []
    kinds: dict[str, dict[str, Any]] = {}
    masters = optimizer.masters(paged_in=False)  # NVMe-tier ones streamed from their files below
    optimizer_state = optimizer.state(paged_in=False) if optimizer_state is None else optimizer_state

    def add(name: str, tensor: torch.Tensor, first: int | None = None,
            produce: Callable[[], torch.Tensor] | None = None) -> None:
        """`tensor` (its `first` elements, when given), read when the file is written
        (by `produce`, when given: `tensor` then gives the dtype and shape only)."""
        specs.append(TensorSpec(name, tensor.dtype, tuple(tensor.shape) if first is None else (first,)))
        producers.append(produce or (lambda: optimizer.readable(tensor) if first is None
                                     else optimizer.readable(tensor)[:first]))

    for sp in _saved_params(model.table, exclude_frozen):
        valid = sp.local_valid_numel
        # an NVMe-tier shard streams from its swap file (params/nvme_shards.py)
        add(f"param/{sp.name}", sp.shard[:valid], produce=lambda sp=sp, valid=valid: sp.shard_values()[:valid])
        master = masters.get(id(sp))
        info: dict[str, Any] = {"master": master is not None and master is not sp.shard, "optim": {}}
        kinds[sp.name] = info
        if sp.grad_shard is not None:  # saved inside an accumulation window: keep what it gathered
            info["grad"] = True
            add(f"grad/{sp.name}", sp.grad_shard[:valid])
        if master is None:
            continue
        if info["master"]:
            add(f"master/{sp.name}", master, valid)
        for key, value in optimizer_state.get(master, {}).items():
            if not isinstance(value, torch.Tensor):
                continue
            if value.shape == master.shape:
                info["optim"][str(key)] = "elementwise"
                add(f"optim/{sp.name}/{key}", value, valid)
            else:
                info["optim"][str(key)] = "whole"
                add(f"optim_whole/{sp.name}/{key}", value)
    if model.comm.rank == 0:
        for name, buffer in persistent_buffers(model.module).items():
            add(f"buffer/{name}", buffer)
        for name, p in unmanaged_parameters(model.module, model.table).items():
            add(LATE_KEY + name, p.detach())
    return specs, producers, kinds


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


def _common_state(optimizer: OptimizerAccess, scheduler: Any, counters: StepCounters,
                  loss_scaler: LossScaler | None, client_state: dict,
                  ds_config: dict | None = None) -> dict[str, Any]:
    """common.pt: counters, loss scaler, optimizer hyper-parameters and non-tensor state,
    the scheduler's state, `client_state` (plain values only) and the engine's config as
    given (`ds_config`: export-deepspeed reads its sub_group_size and optimizer from it)."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups()]
    extras: dict[str, dict[str, Any]] = {}
    state = optimizer.state(paged_in=False)  # its non-tensor values only
    for sp, master in optimizer.stepped(paged_in=False):
        plain = {k: v for k, v in state.get(master, {}).items() if not isinstance(v, torch.Tensor)}
        if plain:
            extras[sp.name] = plain
    has_state = scheduler is not None and hasattr(scheduler, "state_dict")
    return {
        "format_version": FORMAT_VERSION,
        **counters.state_dict(),
        "loss_scaler": loss_scaler.state_dict() if loss_scaler is not None else None,
        "param_groups": groups,
        "param_group_members": _param_group_members(optimizer),
        "optim_extras": extras,
        "lr_scheduler": scheduler.state_dict() if has_state else None,
        "lr_scheduler_type": type(scheduler).__qualname__ if has_state else None,
        "client_state": client_state,
        "ds_config": _plain_config(ds_config),
    }


def _plain_config(config: dict | None) -> dict | None:
    """The config as JSON values (a value JSON cannot hold, given in a dict config, as its str)."""
    return None if config is None else json.loads(json.dumps(config, default=str))


def _param_group_members(optimizer: OptimizerAccess) -> list[list[str]]:
    """Each optimizer param group's parameter names, in the group's order (what a DeepSpeed
    export needs to rebuild its sub-groups; checkpoint/deepspeed/exporter.py)."""
    name_of = {id(master): sp.name for sp, master in optimizer.stepped(paged_in=False)}
    return [[name_of[id(m)] for m in g["params"] if id(m) in name_of] for g in optimizer.param_groups()]


def _param_layout(table: dict[torch.nn.Parameter, ShardedParam], exclude_frozen: bool, kinds: dict) -> dict[str, Any]:
    layout = {}
    for sp in _saved_params(table, exclude_frozen):
        layout[sp.name] = {
            "shape": list(sp.shape),
            "dtype": _dtype_name(sp.dtype),
            "numel": sp.numel,
            "shard_numel": sp.shard_numel,
            "trainable": sp.requires_grad,
            "persistent": sp.persistent,
            "master": kinds[sp.name]["master"],
            "optim": kinds[sp.name]["optim"],
            "grad": kinds[sp.name].get("grad", False),
        }
    return layout


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _folder_to_write(folder: Path) -> Path:
    """Rank 0: the empty folder this save writes into: `folder` itself, or, when `folder`
    holds a checkpoint (zero3's committed one or DeepSpeed's, checkpoint/tag_contents.py),
    its staging folder, put in its place at commit. Entries that are no checkpoint's files
    are refused before anything changes."""
    contents = tag_contents(folder)
    refuse_unknown_entries(folder, contents)
    if not contents.replaced_whole:
        _prepare_folder(folder)
        return folder
    warning = replacement_warning(folder, contents)
    if warning:
        logger.warning(warning)
    staging = staging_folder(folder)
    shutil.rmtree(replaced_folder(folder), ignore_errors=True)  # left by a crash after an earlier swap
    shutil.rmtree(staging, ignore_errors=True)  # an earlier interrupted save over this tag
    _prepare_folder(staging)
    return staging


def _prepare_folder(folder: Path) -> None:
    """Rank 0: make `folder` an empty, incomplete tag (it holds zero3's files at most)."""
    folder.mkdir(parents=True, exist_ok=True)
    contents = tag_contents(folder)
    refuse_unknown_entries(folder, contents)
    (folder / MANIFEST).unlink(missing_ok=True)  # the tag is incomplete from here on
    fsync_dir(folder)
    for stale in contents.own:
        (folder / stale).unlink(missing_ok=True)
    fsync_dir(folder)


@dataclass(frozen=True)
class SaveTarget:
    """Where a save goes: `root/tag` is the tag's folder; `write_to` is that folder or, when
    it holds a committed checkpoint, its staging folder (put in its place at commit)."""

    root: Path
    tag: str
    write_to: Path

    @property
    def folder(self) -> Path:
        return self.root / self.tag


@dataclass(frozen=True, eq=False)
class RankFiles:
    """What one rank writes, taken while training is stopped: its shard file's specs and
    tensors (live or snapshot), its RNG file's bytes and, on rank 0, common.pt's bytes."""

    specs: list[TensorSpec]
    tensors: list[Callable[[], torch.Tensor]]
    kinds: dict
    rng_data: bytes
    common_data: bytes | None


def rank_files(state: TrainingState, client_state: dict, exclude_frozen: bool) -> RankFiles:
    """This rank's files as of now (the tensors still the engine's own; the bytes copies)."""
    rank = state.model.comm.rank
    specs, producers, kinds = _rank_tensors(state.model, state.optimizer, exclude_frozen)
    rng_data = _pickled({"rng": _rng_state(), "rank": rank})
    common_data = None
    if rank == 0:
        common_data = _pickled(_common_state(state.optimizer, state.lr_scheduler, state.counters,
                                             state.loss_scaler, client_state, state.ds_config))
        try:
            torch.load(io.BytesIO(common_data), weights_only=True)
        except Exception as exc:  # noqa: BLE001 - named and re-raised
            raise CheckpointError(
                f"the scheduler or optimizer state cannot be saved as plain values ({exc}); "
                "nothing that needs code to load is written"
            ) from exc
    return RankFiles(specs, producers, kinds, rng_data, common_data)


def foreseen_rank_tensors(state: TrainingState) -> tuple[list[TensorSpec], list[torch.Tensor]]:
    """This rank's shard file (specs, tensors) in a save once every master has stepped: the
    tensors now, frozen parameters included, with the optimizer state a first step has yet
    to create foreseen as meta tensors (optim/state_probe.py). What sizes the buffer of
    asynchronous saves before the first one (async_save.py); the tensors are the engine's."""
    specs, producers, _ = _rank_tensors(state.model, state.optimizer, False, state.optimizer.foreseen_state())
    return specs, [producer() for producer in producers]


def warm_up_rank_files() -> None:
    """Read the RNG states and pickle them once, for nothing: the first time in a process costs
    about 10 ms (lazy imports and set-up), which `prepare` of async_save.py takes here rather
    than the blocking part of the first asynchronous save."""
    _pickled({"rng": _rng_state(), "rank": 0})


def write_rank_files(files: RankFiles, folder: Path, rank: int, world: int) -> dict[str, Any]:
    """Step 2 of the commit protocol for one rank: its files, durable; name -> digest."""
    written: dict[str, dict[str, Any]] = {}
    values = (producer() for producer in files.tensors)
    shard_path = folder / shard_file(rank, world)
    written[shard_path.name] = write_safetensors(
        shard_path, files.specs, values, metadata={"format": "zero3", "rank": str(rank), "world_size": str(world)},
        after_first=lambda: pause_point("shard-partial", rank))
    rng_path = folder / state_file(rank, world)
    written[rng_path.name] = _write_bytes_atomically(rng_path, files.rng_data)
    if files.common_data is not None:
        written[COMMON] = _write_bytes_atomically(folder / COMMON, files.common_data)
    return written


def begin_save(state: TrainingState, save_dir, tag, client_state: dict, tag_validation: str) -> SaveTarget:
    """Step 1 of the commit protocol (a collective): the arguments checked, the tag agreed
    on, and the folder this save writes into chosen and emptied by rank 0."""
    comm = state.model.comm
    rank = comm.rank
    tag = str(tag) if tag is not None else f"global_step{state.counters.global_steps}"

    def checked() -> str:
        _check_pause_setting()
        _check_client_state(client_state)
        _check_tag_name(tag)
        return tag

    tag = _agree_on_tag(comm.rank, gather_on_every_rank(comm, checked, CheckpointError), tag_validation)
    root = Path(save_dir)
    folder = root / tag
    chosen = gather_on_every_rank(comm, lambda: str(_folder_to_write(folder)) if rank == 0 else None,
                                  CheckpointError)[0]
    return SaveTarget(root, tag, Path(chosen))


def abandon_save(target: SaveTarget) -> None:
    """Rank 0, after a failed save: a staging folder goes, the tag keeps its previous save."""
    if target.write_to != target.folder:
        shutil.rmtree(target.write_to, ignore_errors=True)


def commit_manifest(target: SaveTarget, manifest: dict[str, Any], save_latest: bool) -> None:
    """Steps 3 and 4 of the commit protocol, on rank 0 once every rank's files are durable:
    the manifest (with its `files` filled in), the staging folder put in place, `latest`."""
    pause_point("shards-written", 0)
    _write_bytes_atomically(target.write_to / MANIFEST, json.dumps(seal(manifest), indent=1).encode())
    pause_point("manifest-written", 0)
    if target.write_to != target.folder:
        put_in_place(target.write_to, target.folder)
    if save_latest:
        _write_bytes_atomically(target.root / LATEST, target.tag.encode())


def save(state: TrainingState, save_dir, tag, client_state: dict, save_latest: bool, exclude_frozen: bool,
         tag_validation: str, write_16bit_model: bool) -> bool:
    """Write a checkpoint with the commit protocol above; a collective. True when done.

    `tag_validation` is checkpoint.tag_validation ("WARN", "IGNORE" or "FAIL", see
    `_agree_on_tag`); `write_16bit_model` adds the consolidated compute-dtype weights
    (zero_optimization.gather_16bit_weights_on_model_save)."""
    comm = state.model.comm
    target = begin_save(state, save_dir, tag, client_state, tag_validation)
    try:
        _write_and_commit(state, target, client_state, save_latest, exclude_frozen, write_16bit_model)
    except CheckpointError:  # raised on every rank alike (on_every_rank), so all of them are here
        if comm.rank == 0:
            abandon_save(target)  # the tag still holds its previous save, whole
        comm.gather_objects(None)  # no rank returns before the staging folder is gone
        raise
    return True


def write_16bit_file(state: TrainingState, target: SaveTarget, exclude_frozen: bool) -> dict[str, Any] | None:
    """The consolidated compute-dtype weights into the save (a collective); rank 0's digest."""
    model = state.model
    digest = on_every_rank(model.comm, lambda: write_consolidated(
        model, state.optimizer, target.write_to / MODEL_16BIT, dtype=model.compute_dtype,
        exclude_frozen=exclude_frozen), CheckpointError)
    return {MODEL_16BIT: digest} if model.comm.rank == 0 else None


def _write_and_commit(state: TrainingState, target: SaveTarget, client_state: dict,
                      save_latest: bool, exclude_frozen: bool, write_16bit_model: bool) -> None:
    """Steps 2-4 of the commit protocol, into `target.write_to`."""
    model = state.model
    comm = model.comm
    rank = comm.rank

    def write() -> tuple[dict[str, Any], dict]:
        files = rank_files(state, client_state, exclude_frozen)
        return write_rank_files(files, target.write_to, rank, comm.world_size), files.kinds

    outcomes = gather_on_every_rank(comm, write, CheckpointError)
    kinds = merge_kinds([kinds for _, kinds in outcomes])  # the same on every rank: raises on all alike
    extra = (write_16bit_file(state, target, exclude_frozen) or {}) if write_16bit_model else {}

    def commit() -> None:
        if rank != 0:
            return
        files: dict[str, Any] = dict(extra)
        for written, _ in outcomes:
            files.update(written)
        manifest = checkpoint_manifest(state, target.tag, files, kinds, exclude_frozen)
        commit_manifest(target, manifest, save_latest)

    on_every_rank(comm, commit, CheckpointError)


def checkpoint_manifest(state: TrainingState, tag: str, files: dict, kinds: dict,
                        exclude_frozen: bool) -> dict[str, Any]:
    """The manifest of a save of `state` as it is now (`files` may be filled in later)."""
    manifest = _manifest(state.model, state.counters, tag, files, kinds, exclude_frozen)
    if state.optimizer.present:  # the dtypes masters and state are saved in (optim/precision.py)
        precision = state.optimizer.precision()
        manifest["master_dtype"] = _dtype_name(precision.master_dtype)
        manifest["optimizer_state_dtype"] = _dtype_name(precision.state_dtype)
    return manifest


def merge_kinds(all_kinds: list[dict]) -> dict:
    """Per parameter {"master", "optim"}, which every rank must agree on (it follows from
    the parameter's shard size and the optimizer, both the same on every rank)."""
    merged = all_kinds[0]
    for rank, part in enumerate(all_kinds):
        if part != merged:
            names = sorted(n for n in set(part) | set(merged) if part.get(n) != merged.get(n))
            raise CheckpointError(
                f"rank {rank} holds different master / optimizer state kinds than rank 0 for {names[:5]}: "
                f"{[part.get(n) for n in names[:5]]} vs {[merged.get(n) for n in names[:5]]}; the "
                "optimizer state is inconsistent across ranks"
            )
    return merged


def _manifest(model: ShardedModel, counters: StepCounters, tag: str, files: dict, kinds: dict,
              exclude_frozen: bool) -> dict[str, Any]:
    return {
        "format": "zero3",
        "format_version": FORMAT_VERSION,
        "zero3_version": _zero3_version(),
        "torch_version": torch.__version__,
        "tag": tag,
        "world_size": model.comm.world_size,
        "partition": "flat, ceil(numel / world_size) elements per rank, in rank order",
        "global_steps": counters.global_steps,
        "micro_steps": counters.micro_steps,
        "compute_dtype": _dtype_name(model.compute_dtype),
        "created_unix": time.time(),
        "exclude_frozen_parameters": exclude_frozen,
        "files": dict(sorted(files.items())),
        "params": _param_layout(model.table, exclude_frozen, kinds),
        "buffers": {name: {"shape": list(b.shape), "dtype": _dtype_name(b.dtype)}
                    for name, b in persistent_buffers(model.module).items()},
        "aliases": parameter_aliases(model),
        "late_params": late_layout(model.module, model.table),
    }


def _check_tag_name(tag: str) -> None:
    checked_tag(tag, "save_checkpoint's tag argument")
    if str(tag).startswith("."):
        raise CheckpointError(f"checkpoint tag {tag!r} is not a valid folder name; use e.g. 'global_step100'")


def _agree_on_tag(rank: int, tags: list[str], mode: str) -> str:
    """The tag every rank saves under, from every rank's (checked) `tags`, after DeepSpeed's
    checkpoint.tag_validation. The same outcome on every rank, which all hold `tags`.

    Ranks that pass different tags get, with "Warn" (the default), a warning and with
    "Ignore" nothing, and all of them save under rank 0's tag (a checkpoint has one tag;
    DeepSpeed would scatter it over several folders); with "Fail" an error on every rank.
    """
    if all(t == tags[0] for t in tags):
        return tags[0]
    by_rank = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags))
    if mode == "FAIL":
        raise CheckpointTagMismatchError(
            f"ranks passed different checkpoint tags ({by_rank}) and checkpoint.tag_validation is \"Fail\"; "
            "pass the same tag on every rank (a tag with rank-specific text cannot be loaded back)")
    if mode == "WARN" and rank == 0:
        logger.warning("zero3: ranks passed different checkpoint tags (%s); every rank saves under rank 0's "
                       "tag %r. Pass the same tag on every rank (checkpoint.tag_validation: \"Ignore\" "
                       "silences this)", by_rank, tags[0])
    return tags[0]


def _zero3_version() -> str:
    return __version__


# ----------------------------------------------------------------------- load
def model_differences(model: ShardedModel, manifest: dict[str, Any], strict: bool) -> list[str]:
    """Every way the model's parameters and buffers differ from the checkpoint's."""
    saved = manifest["params"]
    differences = []
    ours = {sp.name: sp for sp in model.table.values()}
    excluded_frozen = manifest.get("exclude_frozen_parameters", False)
    missing, unexpected = [], []
    for name, sp in ours.items():
        entry = saved.get(name)
        if entry is None:
            if not (excluded_frozen and not sp.requires_grad):
                missing.append((name, tuple(sp.shape), _dtype_name(sp.dtype)))
            continue
        differences += _entry_differences(name, tuple(sp.shape), _dtype_name(sp.dtype), entry)
    unexpected = [(n, tuple(e["shape"]), e["dtype"]) for n, e in saved.items() if n not in ours]
    buffers = persistent_buffers(model.module)
    saved_buffers = manifest.get("buffers", {})
    for name, buffer in buffers.items():
        if name in saved_buffers:
            differences += _entry_differences(name, tuple(buffer.shape), _dtype_name(buffer.dtype),
                                              saved_buffers[name], "buffer ")
        else:
            missing.append((f"{name} (buffer)", tuple(buffer.shape), _dtype_name(buffer.dtype)))
    unexpected += [(f"{n} (buffer)", tuple(e["shape"]), e["dtype"])
                   for n, e in saved_buffers.items() if n not in buffers]
    if strict:
        differences += [f"missing in checkpoint: {n} {s} {d}" for n, s, d in missing]
        differences += [f"unexpected in checkpoint (not in model): {n} {s} {d}" for n, s, d in unexpected]
        differences += _rename_hints(missing, unexpected)
    return differences


def _entry_differences(name: str, shape: tuple, dtype: str, entry: dict, kind: str = "") -> list[str]:
    out = []
    if list(shape) != list(entry["shape"]):
        out.append(f"shape of {kind}{name}: model {shape}, checkpoint {tuple(entry['shape'])}")
    if dtype != entry["dtype"]:
        out.append(f"dtype of {kind}{name}: model {dtype}, checkpoint {entry['dtype']}")
    return out


def _rename_hints(missing: list, unexpected: list) -> list[str]:
    hints = []
    for name, shape, dtype in missing:
        same = [n for n, s, d in unexpected if (s, d) == (shape, dtype)]
        if len(same) == 1:
            hints.append(f"renamed? checkpoint {same[0]} -> model {name} (same shape and dtype)")
    return hints


@dataclass
class _Plan:
    """Everything a load will write, read and checked before any state is touched.

    `open_reader()` gives a context manager whose value reads the saved tensors by key
    (`read_range`, `read_whole`, `whole_shape`): a ShardReader for our own format, a
    DeepSpeedCheckpoint (checkpoint/deepspeed/layout.py) for DeepSpeed's."""

    folder: Path
    manifest: dict[str, Any]
    common: dict[str, Any]
    rng: dict[str, Any] | None
    restore_optimizer: bool
    open_reader: Callable[[], Any]
    restore_rng: bool = False  # checkpoint.load_rng_state (DeepSpeed's folders hold no RNG state)
    conversions: set[tuple[str, str, str]] = field(default_factory=set)  # (what, saved dtype, engine's)

    def note_conversion(self, what: str, saved: torch.dtype, now: torch.dtype) -> None:
        """Remember that `what` was saved in another dtype than the engine keeps it in."""
        if saved != now:
            self.conversions.add((what, str(saved), str(now)))

    def log_conversions(self, rank: int) -> None:
        """One note per conversion, on rank 0 (optim/precision.py's wording)."""
        for what, saved, now in sorted(self.conversions):
            if rank == 0:
                logger.warning(converted_note(what, getattr(torch, saved.removeprefix("torch.")),
                                              getattr(torch, now.removeprefix("torch."))))


def _plan(state: TrainingState, folder: Path, manifest: dict[str, Any], strict: bool,
          load_optimizer_states: bool, load_lr_scheduler_states: bool, load_module_only: bool,
          load_rng_state: bool) -> _Plan:
    common = unpickle_file(folder / COMMON)
    rank, world = state.model.comm.rank, manifest["world_size"]
    restore_rng = load_rng_state and not load_module_only
    rng = unpickle_file(folder / state_file(rank, world)) if (rank < world and restore_rng) else None
    plan = _Plan(folder, manifest, common, rng, False, lambda: ShardReader(folder, manifest), restore_rng)
    return _checked_plan(state, plan, strict, load_optimizer_states, load_lr_scheduler_states, load_module_only)


def _checked_plan(state: TrainingState, plan: _Plan, strict: bool, load_optimizer_states: bool,
                  load_lr_scheduler_states: bool, load_module_only: bool) -> _Plan:
    """`plan` once the model, optimizer and scheduler are known to fit it (else CheckpointError)."""
    folder, common = plan.folder, plan.common
    differences = model_differences(state.model, plan.manifest, strict)
    if differences:
        raise CheckpointError(
            f"checkpoint {folder} does not fit the model ({len(differences)} differences; "
            "load_module_strict=False skips missing and unexpected names), nothing was loaded:\n  "
            + "\n  ".join(differences)
        )
    plan.restore_optimizer = load_optimizer_states and not load_module_only and state.optimizer.present
    if plan.restore_optimizer:
        _check_optimizer_fits(state.optimizer, state.model.comm.world_size, plan)
    if (not load_module_only and load_lr_scheduler_states and state.lr_scheduler is not None
            and common.get("lr_scheduler") is not None):
        mismatch = _scheduler_mismatch(state.lr_scheduler, common)
        if mismatch:
            raise CheckpointError(
                f"checkpoint {folder} {mismatch}; use the same scheduler or pass load_lr_scheduler_states=False")
    return plan


def _scheduler_mismatch(scheduler: Any, common: dict[str, Any]) -> str | None:
    """Why the saved scheduler state does not fit `scheduler`, or None. Without a saved
    type (a DeepSpeed client scheduler), the state's keys must be the scheduler's own."""
    ours = type(scheduler).__qualname__
    saved_type = common.get("lr_scheduler_type")
    if saved_type is not None:
        return None if saved_type == ours else (
            f"holds the state of a {saved_type} scheduler, the engine has a {ours}")
    saved_keys, our_keys = sorted(map(str, common["lr_scheduler"])), sorted(map(str, scheduler.state_dict()))
    return None if saved_keys == our_keys else (
        f"holds a scheduler state with keys {saved_keys}, the engine's {ours} has {our_keys}")


def _check_optimizer_fits(optimizer: OptimizerAccess, world_size: int, plan: _Plan) -> None:
    """The saved optimizer state fits `optimizer` on `world_size` ranks (else CheckpointError)."""
    folder, manifest = plan.folder, plan.manifest
    groups = optimizer.param_groups()
    saved_groups = plan.common["param_groups"]
    if len(saved_groups) != len(groups):
        raise CheckpointError(
            f"checkpoint {folder} has {len(saved_groups)} optimizer param groups, the optimizer "
            f"has {len(groups)}; build the optimizer with the same groups, or pass "
            "load_optimizer_states=False"
        )
    if manifest["world_size"] == world_size:
        return
    with plan.open_reader() as reader:
        for name, entry in manifest["params"].items():
            for key, kind in entry.get("optim", {}).items():
                if kind == "whole" and reader.whole_shape(f"optim_whole/{name}/{key}"):
                    raise CheckpointError(
                        f"optimizer state {key!r} of {name} is neither elementwise nor a scalar, so it "
                        f"cannot be resharded from {manifest['world_size']} to {world_size} "
                        "ranks; load on the same number of ranks or pass load_optimizer_states=False"
                    )


def _fill(target: torch.Tensor, values: torch.Tensor) -> None:
    """target[:len(values)] = values; the padding tail is set to zero."""
    with torch.no_grad():
        target.zero_()
        target[: values.numel()].copy_(values.to(target.dtype))


def _loaded_shard(sp: ShardedParam, values: torch.Tensor) -> torch.Tensor:
    """`values` as `sp`'s shard (padding zero): filled into it, or written to its NVMe swap
    file; returns a tensor holding the shard's new values."""
    if sp.backing is None:
        _fill(sp.shard, values)
        return sp.shard
    whole = torch.empty(sp.shard_numel, dtype=sp.shard.dtype)
    _fill(whole, values)
    sp.write_shard(whole)
    return whole


def _apply_param(optimizer: OptimizerAccess, world_size: int, sp: ShardedParam, reader: ShardReader, plan: _Plan,
                 masters: dict[int, torch.Tensor], groups: dict[int, dict]) -> None:
    """`sp`'s saved values into its shard (and its full values, if resident), its master
    and, with `plan.restore_optimizer`, its optimizer state (resharded to `world_size`)."""
    entry = plan.manifest["params"][sp.name]
    numel = entry["numel"]
    start, end = sp.range_of(sp.rank)
    shard = _loaded_shard(sp, reader.read_range(f"param/{sp.name}", numel, start, end))
    if sp.state is ParamState.FULL and sp.numel:
        full = reader.read_range(f"param/{sp.name}", numel, 0, numel).to(sp.param.device, sp.dtype)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(sp.param):
            sp.param.data.view(-1).copy_(full)
    master = masters.get(id(sp))
    if master is None:
        return
    optimizer.loosen(master)  # an NVMe-tier master and its state in memory, one swap group at a time
    if master is not sp.shard:
        if plan.restore_optimizer and entry.get("master"):
            saved = reader.read_range(f"master/{sp.name}", numel, start, end)
            plan.note_conversion("masters", saved.dtype, master.dtype)
            _fill(master, saved)
        else:  # as DeepSpeed: the master is refreshed from the loaded 16-bit weights
            _fill(master, shard)
    elif plan.restore_optimizer and entry.get("master"):  # saved apart, now the shard (rounded, as saved)
        plan.note_conversion("masters", _saved_master_dtype(plan.manifest), master.dtype)
    if plan.restore_optimizer:
        state = _optimizer_state_of(world_size, sp, reader, plan, master, groups[id(master)], optimizer.precision())
        optimizer_state = optimizer.state(paged_in=False)
        if state:
            optimizer_state[master] = state
        else:
            optimizer_state.pop(master, None)


def _optimizer_state_of(world_size: int, sp: ShardedParam, reader: ShardReader, plan: _Plan,
                        master: torch.Tensor, group: dict, precision: MasterPrecision) -> dict[str, Any]:
    entry = plan.manifest["params"][sp.name]
    numel = entry["numel"]
    start, end = sp.range_of(sp.rank)
    same_world = plan.manifest["world_size"] == world_size
    state: dict[str, Any] = dict(plan.common.get("optim_extras", {}).get(sp.name, {}))
    on_device = bool(group.get("fused") or group.get("capturable"))
    for key, kind in entry.get("optim", {}).items():
        if kind == "elementwise":
            sliced = reader.read_range(f"optim/{sp.name}/{key}", numel, start, end)
            dtype = precision.state_value(sliced[:0]).dtype  # the engine's state dtype (floating state)
            plan.note_conversion("optimizer state tensors", sliced.dtype, dtype)
            value = torch.zeros(master.shape, dtype=dtype, device=master.device)
            _fill(value, sliced)
        else:
            value = reader.read_whole(f"optim_whole/{sp.name}/{key}", sp.rank if same_world else 0)
            if key != "step" or on_device:  # torch keeps a plain optimizer's `step` on the CPU
                value = value.to(master.device)
        state[key] = value
    return state


def _saved_master_dtype(manifest: dict[str, Any]) -> torch.dtype:
    """The dtype the checkpoint's separate masters were saved in (fp32 before it was recorded)."""
    return getattr(torch, manifest.get("master_dtype") or "float32")


def _apply(state: TrainingState, plan: _Plan, load_lr_scheduler_states: bool, load_module_only: bool) -> None:
    """Write what `plan` holds into the engine's state (every check has passed by now)."""
    grads = _apply_tensors(state.model, state.optimizer, state.placement, plan, load_module_only)
    common = plan.common
    if plan.restore_optimizer:
        for group, saved in zip(state.optimizer.param_groups(), common["param_groups"]):
            group.update(saved)
    if not load_module_only:
        _restore_progress(state, plan, load_lr_scheduler_states)
    state.zero_grad()
    for sp, grad in grads:  # a checkpoint saved inside an accumulation window goes on from there
        sp.grad_shard = grad


def _apply_tensors(model: ShardedModel, optimizer: OptimizerAccess, placement: Placement, plan: _Plan,
                   load_module_only: bool) -> list[tuple[ShardedParam, torch.Tensor]]:
    """Parameters, masters, optimizer state, buffers and late parameters from the saved
    tensors; returns the saved gradient shards (new tensors where `placement` puts them) to set
    once the gradients of the current window are dropped."""
    masters = optimizer.masters(paged_in=False)  # each brought in by _apply_param, then written back
    groups = {id(p): g for g in optimizer.param_groups() for p in g["params"]}
    grads: list[tuple[ShardedParam, torch.Tensor]] = []
    with plan.open_reader() as reader:
        for sp in model.table.values():
            if sp.name in plan.manifest["params"]:
                _apply_param(optimizer, model.comm.world_size, sp, reader, plan, masters, groups)
                if plan.restore_optimizer and not load_module_only and plan.manifest["params"][sp.name].get("grad"):
                    dtype = optimizer.precision().grad_dtype if id(sp) in masters else torch.float32
                    grads.append((sp, _saved_grad(placement.state_device(sp), sp, reader, plan, dtype)))
        saved_buffers = plan.manifest.get("buffers", {})
        with torch.no_grad():
            for name, buffer in persistent_buffers(model.module).items():
                if name in saved_buffers:
                    buffer.copy_(reader.read_whole(f"buffer/{name}"))
        restore_late(model.module, model.table, plan.manifest.get("late_params", {}), reader.read_whole,
                     model.comm.rank)
    optimizer.store_loose()
    drain_param_writes(model.table.values())
    plan.log_conversions(model.comm.rank)
    return grads


def _restore_progress(state: TrainingState, plan: _Plan, load_lr_scheduler_states: bool) -> None:
    """The scheduler (if asked), counters, loss scale and, with `plan.restore_rng`, this rank's RNG."""
    common = plan.common
    if load_lr_scheduler_states and state.lr_scheduler is not None and common["lr_scheduler"] is not None:
        state.lr_scheduler.load_state_dict(common["lr_scheduler"])
    state.counters.load_state_dict(common)
    if common.get("loss_scaler") is not None and state.loss_scaler is not None:
        state.loss_scaler.load_state_dict(common["loss_scaler"])
    rank = state.model.comm.rank
    if not plan.restore_rng:
        return
    if plan.rng is not None and plan.rng.get("rng") is not None:  # None: imported, saved without RNG
        _set_rng_state(plan.rng["rng"])
    elif rank >= plan.manifest["world_size"]:
        logger.warning("zero3: rank %d has no saved RNG state (checkpoint of %d ranks); its RNG is "
                       "not restored", rank, plan.manifest["world_size"])


def _saved_grad(master_device: torch.device, sp: ShardedParam, reader: ShardReader, plan: _Plan,
                dtype: torch.dtype) -> torch.Tensor:
    """This rank's slice of the accumulated gradient, in a new shard-sized tensor of the
    engine's gradient dtype (the master's)."""
    numel = plan.manifest["params"][sp.name]["numel"]
    start, end = sp.range_of(sp.rank)
    grad = torch.zeros(sp.shard_numel, dtype=dtype, device=master_device)
    _fill(grad, reader.read_range(f"grad/{sp.name}", numel, start, end))
    return grad


def load(state: TrainingState, load_dir, tag, strict: bool, load_optimizer_states: bool,
         load_lr_scheduler_states: bool, load_module_only: bool, gradient_accumulation_steps: int,
         load_rng_state: bool = False):
    """Verify, then load a checkpoint into `state`; (path, client_state), or (None, None) when absent.

    A collective. Every check runs before any state is written; a failed check raises
    the same CheckpointError on every rank and leaves the engine as it was.
    `gradient_accumulation_steps` places a DeepSpeed checkpoint's micro-step count;
    `load_rng_state` (the config's checkpoint.load_rng_state) restores the saved RNG states.
    """
    comm = state.model.comm
    root = Path(load_dir)
    deepspeed_folder = _deepspeed_folder(comm, root, tag)
    if deepspeed_folder is not None:
        return _load_deepspeed(state, deepspeed_folder, strict, load_optimizer_states,
                               load_lr_scheduler_states, load_module_only, gradient_accumulation_steps)
    resolved, warning = on_every_rank(comm, lambda: resolve_tag(root, tag), CheckpointError)
    choices = comm.gather_objects(resolved)
    if any(choice != resolved for choice in choices):
        raise CheckpointError(f"ranks see different checkpoints in {root}: {choices}; is it on a shared filesystem?")
    if warning:
        logger.warning(warning)
    if resolved is None:
        return None, None
    folder = root / resolved
    manifest = on_every_rank(comm, lambda: read_manifest(folder), CheckpointError)
    mine = on_every_rank(comm, lambda: verify_files(folder, manifest, (comm.rank, comm.world_size)),
                         CheckpointError)
    problems = [p for part in comm.gather_objects(mine) for p in part]
    if problems:
        raise CheckpointError(
            f"checkpoint {folder} failed verification, nothing was loaded:\n  " + "\n  ".join(sorted(set(problems)))
        )
    plan = on_every_rank(comm, lambda: _plan(state, folder, manifest, strict, load_optimizer_states,
                                             load_lr_scheduler_states, load_module_only, load_rng_state),
                         CheckpointError)
    _apply(state, plan, load_lr_scheduler_states, load_module_only)
    comm.barrier()
    return str(folder), plan.common["client_state"]


# ------------------------------------------------------ DeepSpeed ZeRO-3 folders
def _deepspeed_folder(comm: Communicator, root: Path, tag) -> Path | None:
    """The DeepSpeed ZeRO-3 tag folder (root, tag) names (checkpoint/deepspeed/layout.py), the same on every rank."""
    found = on_every_rank(comm, lambda: deepspeed_tag_folder(root, tag), CheckpointError)
    seen = comm.gather_objects(None if found is None else str(found))
    if any(view != seen[0] for view in seen):
        raise CheckpointError(f"ranks see different checkpoints in {root}: {seen}; is it on a shared filesystem?")
    return found


def _load_deepspeed(state: TrainingState, folder: Path, strict: bool, load_optimizer_states: bool,
                    load_lr_scheduler_states: bool, load_module_only: bool, gradient_accumulation_steps: int):
    """Load a DeepSpeed ZeRO-3 checkpoint with the checks and restore of our own format.

    Every rank reads (memory-mapped) every source rank's files and takes the elements it
    owns; DeepSpeed's files hold no RNG state, so the RNG is left as it is. Micro-steps
    restart at the accumulation boundary after `global_steps`, as in DeepSpeed."""
    comm = state.model.comm
    source = on_every_rank(comm, lambda: DeepSpeedCheckpoint.open(folder), CheckpointError)
    try:
        common = source.common
        common["micro_steps"] = common["global_steps"] * gradient_accumulation_steps
        plan = on_every_rank(comm, lambda: _checked_plan(
            state, _Plan(folder, source.layout, common, None, False, lambda: nullcontext(source)), strict,
            load_optimizer_states, load_lr_scheduler_states, load_module_only), CheckpointError)
        _apply(state, plan, load_lr_scheduler_states, load_module_only)
    finally:
        source.close()
    if comm.rank == 0:
        _log_deepspeed_load(state.model, folder, source)
    comm.barrier()
    return str(folder), common["client_state"]


def _log_deepspeed_load(model: ShardedModel, folder: Path, source: DeepSpeedCheckpoint) -> None:
    frozen = [sp.name for sp in model.table.values() if not sp.requires_grad]
    if source.layout["exclude_frozen_parameters"] and frozen:
        logger.warning("zero3: %s was saved with exclude_frozen_parameters: the model's own values of its %d "
                       "frozen parameters are kept (e.g. %s)", folder, len(frozen), frozen[0])
    logger.info("zero3: loaded DeepSpeed ZeRO-3 checkpoint %s (saved on %d ranks, global step %d) on %d ranks; "
                "it holds no RNG state, so the RNG was not restored", folder, source.world_size,
                source.common["global_steps"], model.comm.world_size)
