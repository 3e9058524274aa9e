"""Consolidated state dicts (fp32 or 16-bit) written as safetensors, and held-byte counts.

Consolidation streams one parameter at a time: it is all-gathered (a collective: every
rank calls it), rank 0 copies it to host memory and writes its bytes straight into the
output file, and it is released again. No device ever holds more than one whole
parameter beyond its shards, and rank 0's host never holds more than one either: the
safetensors header is written first (names, dtypes and shapes are known up front), then
each tensor's bytes as it arrives (`write_safetensors`).

Names are the model's own, in `model.state_dict()` order: every name of a tied parameter
(each written in full, since plain `load_state_dict(strict=True)` asks for every name) and
the persistent buffers, so the result loads with plain `model.load_state_dict`.

Offline export (`offline_export.export_checkpoint`) does the same from a checkpoint's shard files, in one
process and without torch.distributed: it is what `zero3 checkpoint export` runs.

DeepSpeed's `safe_get_full_fp32_param` / `safe_get_full_optimizer_state` have their
counterparts here (`full_fp32_param`, `full_optimizer_state`): collectives that return one
parameter's whole, unpadded value on every rank.

What each function reads is in its signature: the model and its shards (`ShardedModel`)
and the optimizer's masters and state (`OptimizerAccess`, which waits for an update in
flight), engine_parts/views.py. The functions a user calls with an engine (`consolidated_state_dict`,
`save_consolidated`, `save_fp32_model`, `full_fp32_param`, `full_optimizer_state`) read
those two views of it and nothing else, and hand them to their counterparts over the
views (`consolidate`, `write_consolidated`, `whole_fp32_param`, `whole_optimizer_state`),
which the engine and the checkpoint code call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zero3.checkpoint.files import ExportError, TensorSpec, write_safetensors
from zero3.engine_parts.views import OptimizerAccess, ShardedModel, ShardedTraining
from zero3.grads.sink import GradSink
from zero3.params.partition import ShardedParam
from zero3.params.wire import gather_rows


def on_every_rank(comm, fn: Callable[[], Any], error: type[Exception] = RuntimeError) -> Any:
    """Run `fn` on every rank; if it raises on any rank, raise on every rank.

    The error raised everywhere names each failing rank and its message, so a problem
    seen by one rank (a file it could not write or read) never leaves the others waiting
    in the next collective. A collective itself: every rank must call it.
    """
    value, failure = _run(fn)
    messages = comm.gather_objects(None if failure is None else _describe(failure, error))
    _raise_failures(comm, messages, failure, error)
    return value


def gather_on_every_rank(comm, fn: Callable[[], Any], error: type[Exception] = RuntimeError) -> list[Any]:
    """`on_every_rank`, and every rank's value of `fn` (picklable), in rank order, in the same
    one collective: an agreement and the exchange it guards cost one round trip, not two."""
    value, failure = _run(fn)
    outcomes = comm.gather_objects((value, None) if failure is None else (None, _describe(failure, error)))
    _raise_failures(comm, [message for _, message in outcomes], failure, error)
    return [value for value, _ in outcomes]


def _run(fn: Callable[[], Any]) -> tuple[Any, Exception | None]:
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - reported on every rank by the caller
        return None, exc


def _raise_failures(comm, messages: list[str | None], failure: Exception | None,
                    error: type[Exception]) -> None:
    """Raise `error` naming each failing rank, if any message is set (the same on every rank)."""
    failed = [(rank, text) for rank, text in enumerate(messages) if text is not None]
    if not failed:
        return
    if len(failed) == 1 or all(text == failed[0][1] for _, text in failed):
        ranks = ", ".join(str(rank) for rank, _ in failed)
        text = failed[0][1] if comm.world_size == 1 else f"on rank {ranks}: {failed[0][1]}"
    else:
        text = "\n".join(f"rank {rank}: {message}" for rank, message in failed)
    raise error(text) from failure


def _describe(exc: Exception, expected: type[Exception]) -> str:
    return str(exc) if isinstance(exc, expected) else f"{type(exc).__name__}: {exc}"


# ------------------------------------------------------------- the model's own names
def state_dict_entries(module: nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    """(name, "param" | "buffer", tensor) for every key of `module.state_dict()`, in order.

    Walks modules as `nn.Module.state_dict` does: a module's parameters, then its
    persistent buffers, then its children; a tied parameter appears under each name.
    """
    out: list[tuple[str, str, torch.Tensor]] = []

    def walk(mod: nn.Module, prefix: str) -> None:
        for name, p in mod._parameters.items():
            if p is not None:
                out.append((prefix + name, "param", p))
        for name, b in mod._buffers.items():
            if b is not None and name not in mod._non_persistent_buffers_set:
                out.append((prefix + name, "buffer", b))
        for name, child in mod._modules.items():
            if child is not None:
                walk(child, prefix + name + ".")

    walk(module, "")
    return out


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers that `module.state_dict()` holds, by their state-dict name."""
    return {name: t for name, kind, t in state_dict_entries(module) if kind == "buffer"}


def parameter_aliases(model: ShardedModel) -> dict[str, str]:
    """Second and later names of tied parameters -> the name the table keeps them under."""
    aliases = {}
    for name, kind, tensor in state_dict_entries(model.module):
        if kind == "param" and tensor in model.table and model.table[tensor].name != name:
            aliases[name] = model.table[tensor].name
    return aliases


# ---------------------------------------------------------------- gathering, in order
def gather_full(model: ShardedModel, sp: ShardedParam, local: torch.Tensor) -> torch.Tensor:
    """All ranks' `local` shards (shard_numel elements each) -> the whole unpadded tensor.

    A collective over `model.comm`: every rank calls it for the same parameter in the same
    order. The result, on every rank, has `sp.shape` and `local`'s dtype, on `model.device`.
    """
    if local.numel() != sp.shard_numel:
        raise ExportError(f"{sp.name}: a shard-shaped tensor has {local.numel()} elements, expected {sp.shard_numel}")
    rows = gather_rows(model.comm, local, model.device)
    return rows.view(-1)[: sp.numel].view(sp.shape)


def full_fp32_param(engine: ShardedTraining, param: nn.Parameter) -> torch.Tensor:
    """The whole fp32 master of `param` on every rank (its compute values, upcast, when it
    has no master: a frozen parameter). Collective, as DeepSpeed's safe_get_full_fp32_param."""
    return whole_fp32_param(engine.sharded_model, engine.optimizer_access, param)


def whole_fp32_param(model: ShardedModel, optimizer: OptimizerAccess, param: nn.Parameter) -> torch.Tensor:
    """full_fp32_param over the views: a new CPU tensor the caller owns. Collective."""
    sp = model.table[param]
    master = optimizer.masters().get(id(sp))
    local = master if master is not None else sp.shard_values().float()
    return gather_full(model, sp, local).cpu()


def full_optimizer_state(engine: ShardedTraining, param: nn.Parameter, key: str) -> torch.Tensor | None:
    """The whole optimizer state `key` (e.g. "exp_avg") of `param` on every rank; a scalar
    state (e.g. "step") as it is; None if the parameter has no such state. Collective."""
    return whole_optimizer_state(engine.sharded_model, engine.optimizer_access, param, key)


def whole_optimizer_state(model: ShardedModel, optimizer: OptimizerAccess, param: nn.Parameter,
                          key: str) -> torch.Tensor | None:
    """full_optimizer_state over the views: a CPU copy the caller owns (a non-tensor state
    as it is). Collective."""
    sp = model.table[param]
    master = optimizer.masters().get(id(sp))
    state = optimizer.state().get(master, {}) if master is not None else {}
    present = model.comm.gather_objects(key in state)
    if not any(present):
        return None
    if not all(present):
        raise ExportError(f"optimizer state {key!r} of {sp.name} exists on some ranks only: {present}")
    value = state[key]
    if isinstance(value, torch.Tensor) and master is not None and value.shape == master.shape:
        return gather_full(model, sp, value).cpu()
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def export_specs(model: ShardedModel, optimizer: OptimizerAccess, dtype: torch.dtype | None,
                 exclude_frozen: bool, use_master: bool) -> list[tuple[TensorSpec, str, Any]]:
    """(spec, kind, source) for each tensor of a consolidated export, in write order.

    kind "param": source is the ShardedParam (every alias follows its canonical name at
    once, so one gathered value serves them all); kind "buffer": the buffer itself.
    Parameters become `dtype` (None: their own; fp32 with `use_master` when a master
    exists). Buffers keep their dtype, as in DeepSpeed's 16-bit state dict.
    """
    masters = optimizer.masters() if use_master else {}
    names_of: dict[int, list[str]] = {}
    order: list[tuple[str, str, Any]] = []
    for name, kind, tensor in state_dict_entries(model.module):
        if kind == "buffer" or tensor not in model.table:  # a parameter attached after initialize: whole
            order.append((name, "buffer", tensor))
            continue
        sp = model.table[tensor]
        if exclude_frozen and not sp.requires_grad:
            continue
        if id(sp) not in names_of:
            names_of[id(sp)] = []
            order.append((sp.name, kind, sp))
        names_of[id(sp)].append(name)
    specs: list[tuple[TensorSpec, str, Any]] = []
    for name, kind, source in order:
        if kind == "buffer":
            specs.append((TensorSpec(name, source.dtype, tuple(source.shape)), kind, source))
            continue
        own = torch.float32 if id(source) in masters else source.dtype
        out_dtype = dtype if (dtype is not None and source.dtype.is_floating_point) else own
        for alias in names_of[id(source)]:
            specs.append((TensorSpec(alias, out_dtype, tuple(source.shape)), kind, source))
    return specs


def iter_consolidated(model: ShardedModel, optimizer: OptimizerAccess, specs: list[tuple[TensorSpec, str, Any]],
                      use_master: bool) -> Iterator[torch.Tensor | None]:
    """The tensors of `specs`, one at a time, on CPU on rank 0 (None elsewhere).

    A collective generator: every rank must run it to the end. Each parameter is gathered
    once and its value reused for its aliases; nothing is kept after it is yielded.
    """
    optimizer.settle()  # the shards are read below, masters or not
    masters = optimizer.masters() if use_master else {}
    rank0 = model.comm.rank == 0
    last_sp, last_value = None, None
    for spec, kind, source in specs:
        if kind == "buffer":
            yield source.detach().to("cpu", spec.dtype) if rank0 else None
            continue
        if source is not last_sp:
            last_sp = last_value = None  # the previous parameter is gone before the next arrives
            master = masters.get(id(source))
            local = master if master is not None else source.shard_values()
            full = gather_full(model, source, local)
            last_sp, last_value = source, (full.to("cpu", spec.dtype) if rank0 else None)
            del full
        yield last_value


def consolidated_state_dict(engine: ShardedTraining, dtype: torch.dtype | None = None,
                            exclude_frozen: bool = False, use_master: bool = False) -> dict[str, torch.Tensor]:
    """The whole model's state dict on rank 0 (CPU tensors); empty on other ranks.

    A collective. Keys are those of `model.state_dict()`. `use_master=True` takes
    trainable values from the fp32 master shards (exact fp32 weights under bf16
    training); otherwise from the compute-dtype parameters. Floating parameters are cast
    to `dtype` when given; buffers keep theirs.
    """
    return consolidate(engine.sharded_model, engine.optimizer_access, dtype, exclude_frozen, use_master)


def consolidate(model: ShardedModel, optimizer: OptimizerAccess, dtype: torch.dtype | None = None,
                exclude_frozen: bool = False, use_master: bool = False) -> dict[str, torch.Tensor]:
    """consolidated_state_dict over the views: new CPU tensors on rank 0, owned by the caller."""
    specs = export_specs(model, optimizer, dtype, exclude_frozen, use_master)
    out: dict[str, torch.Tensor] = {}
    for (spec, _, _), value in zip(specs, iter_consolidated(model, optimizer, specs, use_master)):
        if value is not None:
            out[spec.name] = value.clone()
    return out


def save_consolidated(engine: ShardedTraining, path, dtype: torch.dtype | None = None,
                      exclude_frozen: bool = False, use_master: bool = False) -> dict[str, Any] | None:
    """Stream the consolidated state dict into one safetensors file (rank 0 writes).

    A collective. Returns the file's {"size", "sha256"} on rank 0, None elsewhere.
    """
    return write_consolidated(engine.sharded_model, engine.optimizer_access, path, dtype, exclude_frozen,
                              use_master)


def write_consolidated(model: ShardedModel, optimizer: OptimizerAccess, path, dtype: torch.dtype | None = None,
                       exclude_frozen: bool = False, use_master: bool = False) -> dict[str, Any] | None:
    """save_consolidated over the views. Rank 0 holds one parameter's value at a time."""
    specs = export_specs(model, optimizer, dtype, exclude_frozen, use_master)
    values = iter_consolidated(model, optimizer, specs, use_master)
    if model.comm.rank != 0:
        for _ in values:
            pass
        return None
    try:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_safetensors(path, [s for s, _, _ in specs], values, metadata={"format": "pt"})
    finally:
        for _ in values:  # after an error, keep the gathers in step with the other ranks
            pass


def save_16bit_model(model: ShardedModel, optimizer: OptimizerAccess, save_dir, save_filename: str,
                     exclude_frozen: bool) -> bool:
    """DeepSpeed's save_16bit_model: the compute-dtype weights, whole, in one file (rank 0).

    Unlike DeepSpeed, this works whatever `gather_16bit_weights_on_model_save` says: the
    export streams one parameter at a time, so it never needs the memory DeepSpeed's
    switch protects. That switch makes save_checkpoint write the same file too.
    """
    on_every_rank(model.comm, lambda: write_consolidated(
        model, optimizer, Path(save_dir) / save_filename, dtype=model.compute_dtype, exclude_frozen=exclude_frozen),
        ExportError)
    return True


def save_fp32_model(engine: ShardedTraining, save_dir, save_filename: str = "pytorch_model_fp32.safetensors",
                    exclude_frozen: bool = False) -> bool:
    """The fp32 weights (trainable ones from the fp32 masters), whole, in one file (rank 0)."""
    model, optimizer = engine.sharded_model, engine.optimizer_access
    on_every_rank(model.comm, lambda: write_consolidated(
        model, optimizer, Path(save_dir) / save_filename, dtype=torch.float32, exclude_frozen=exclude_frozen,
        use_master=True), ExportError)
    return True


# --------------------------------------------------------------------- held bytes
def held_bytes(model: ShardedModel, optimizer: OptimizerAccess, grad_sink: GradSink) -> dict[str, int]:
    """Bytes this rank holds: parameter shards, resident full parameters, gradient
    shards, fp32 masters (when separate from the shards) and optimizer state."""
    def nbytes(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.numel() * t.element_size()

    optimizer.settle()
    table = model.table
    shards = sum(nbytes(sp.shard) for sp in table.values() if sp.backing is None)  # NVMe: in files
    resident = sum(  # an aliased parameter's storage is its shard, counted above
        sp.param.untyped_storage().nbytes() for sp in table.values() if sp.persistent and not sp.aliased
    )
    # Host gradient shards are views of one persistent pinned buffer, held between steps too.
    grads = max(sum(nbytes(sp.grad_shard) for sp in table.values()), grad_sink.held_bytes())
    masters = sum(nbytes(m) for sp, m in optimizer.stepped() if m is not sp.shard)
    optim_state = 0
    for state in optimizer.state().values():
        optim_state += sum(nbytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return {"param_shards": shards, "resident_params": resident, "grad_shards": grads,
            "masters": masters, "optimizer_state": optim_state}
