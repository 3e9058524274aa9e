"""Whole and local values of one sharded parameter: fp32 master, gradient, optimizer state.

What DeepSpeed's `safe_get_full_*` / `safe_set_full_*` / `safe_get_local_*` functions
read and write, over zero3's own state (zero3.utils spells them DeepSpeed's way):

- "full" values have the parameter's shape and are the same on every rank; getting one
  is a collective (an all-gather of the rank's slice), setting one is not (each rank
  takes its own slice of the value it is given, so every rank must pass the same value).
- "local" values are this rank's flat shard: `shard_numel` elements, the tail past the
  parameter's end being padding. Neither getting nor setting one communicates.

A frozen parameter has no fp32 master, gradient or optimizer state: the getters return
None for it, as DeepSpeed's do. Reads and writes wait for an optimizer update still
running behind the forward (optim/host_step.py) first.

Memory: getters return new CPU tensors (full) or clones (local) that the caller owns;
setters copy into the engine's tensors and keep no reference to the value given.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zero3.checkpoint.export import gather_full, state_dict_entries
from zero3.engine_parts.owner import ParamOwner, owner_of
from zero3.engine_parts.views import OptimizerAccess, ShardedModel
from zero3.params.partition import ShardedParam


class ParamAccessError(RuntimeError):
    """A parameter or value that the full / local accessors cannot serve."""


def _owner_and_shard(param: nn.Parameter) -> tuple[ParamOwner, ShardedParam]:
    owner = owner_of(param)
    if owner is None:
        raise ParamAccessError(
            f"parameter of shape {tuple(param.shape)} belongs to no live zero3 engine; call this on a "
            "parameter of a model passed to zero3.initialize (before engine.destroy())")
    owner.optimizer.settle()
    return owner, owner.model.table[param]


def _as_shape(value: torch.Tensor, shape: tuple[int, ...] | torch.Size, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape):
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ParamAccessError(f"{what}: expected a tensor of shape {tuple(shape)}, got {got}")
    return value.detach()


def _slice_of(sp: ShardedParam, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of a whole value, flat (no padding)."""
    start, end = sp.range_of(sp.rank)
    return full.reshape(-1)[start:end]


def _write_local(target: torch.Tensor, sp: ShardedParam, piece: torch.Tensor) -> None:
    """Copy `piece` (this rank's valid elements) into the front of a shard-shaped tensor."""
    with torch.no_grad():
        target[: piece.numel()].copy_(piece.to(target.device, target.dtype))


# ----------------------------------------------------------------------- fp32 weights
def get_full_fp32_param(param: nn.Parameter) -> torch.Tensor | None:
    owner, sp = _owner_and_shard(param)
    master = owner.optimizer.master_of(sp)
    if master is None:
        return None
    return gather_full(owner.model, sp, master).cpu()


def set_full_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    """New fp32 weights: the master, the compute-dtype shard and, where the parameter is
    gathered now (resident), its full values."""
    owner, sp = _owner_and_shard(param)
    value = _as_shape(value, sp.shape, f"set_full_fp32_param({sp.name})")
    master = owner.optimizer.master_of(sp)
    if master is None:
        raise ParamAccessError(f"{sp.name} is frozen (requires_grad=False): it has no fp32 master to set")
    piece = _slice_of(sp, value)
    _write_local(master, sp, piece)
    _write_weights(sp, piece, value)


def _write_weights(sp: ShardedParam, piece: torch.Tensor, full: torch.Tensor | None) -> None:
    if sp.backing is not None:  # the NVMe tier: read, changed, written back
        sp.write_shard(piece.to(sp.shard.dtype))
    elif sp.shard is not None and not sp.aliased:
        _write_local(sp.shard, sp, piece)
    if sp.param.untyped_storage().nbytes() > 0 and full is not None:
        with torch.no_grad():
            sp.param.data.copy_(full.to(sp.param.device, sp.param.dtype))


def get_local_fp32_param(param: nn.Parameter) -> torch.Tensor | None:
    owner, sp = _owner_and_shard(param)
    master = owner.optimizer.master_of(sp)
    return None if master is None else master.detach().clone()


def set_local_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    """This rank's fp32 shard (padding included); the compute-dtype shard follows."""
    owner, sp = _owner_and_shard(param)
    master = owner.optimizer.master_of(sp)
    if master is None:
        raise ParamAccessError(f"{sp.name} is frozen (requires_grad=False): it has no fp32 master to set")
    value = _as_shape(value, master.shape, f"set_local_fp32_param({sp.name})")
    with torch.no_grad():
        master.copy_(value.to(master.device, master.dtype))
    piece = master[: sp.local_valid_numel]
    _write_weights(sp, piece, None)
    if sp.param.untyped_storage().nbytes() > 0:
        _write_local(_slice_of(sp, sp.param.data), sp, piece)


# ----------------------------------------------------------------------- gradients
def _grad_shard(owner: ParamOwner, sp: ShardedParam) -> torch.Tensor | None:
    owner.flush_gradients()  # every slice of the current backward is in grad_shard
    return sp.grad_shard


def get_full_grad(param: nn.Parameter) -> torch.Tensor | None:
    """The averaged fp32 gradient accumulated since the last optimizer step (None when
    there is none: frozen, or right after a step). Collective."""
    owner, sp = _owner_and_shard(param)
    present = owner.model.comm.gather_objects(_grad_shard(owner, sp) is not None)
    if not all(present):
        if any(present):
            raise ParamAccessError(f"the gradient of {sp.name} exists on ranks {present} only")
        return None
    return gather_full(owner.model, sp, sp.grad_shard[: sp.shard_numel]).cpu()


def set_full_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    owner, sp = _owner_and_shard(param)
    value = _as_shape(value, sp.shape, f"set_full_grad({sp.name})")
    _set_grad_shard(owner, sp, _slice_of(sp, value))


def get_local_grad(param: nn.Parameter) -> torch.Tensor | None:
    owner, sp = _owner_and_shard(param)
    grad = _grad_shard(owner, sp)
    return None if grad is None else grad[: sp.shard_numel].detach().clone()


def set_local_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    owner, sp = _owner_and_shard(param)
    value = _as_shape(value, (sp.shard_numel,), f"set_local_grad({sp.name})")
    _set_grad_shard(owner, sp, value[: sp.local_valid_numel])


def update_full_grad_vectorized(params: list[nn.Parameter], update_func: Any) -> None:
    """DeepSpeed's `safe_update_full_grad_vectorized`: for each trainable parameter, its
    whole fp32 gradient becomes `update_func(whole gradient, param)` (every rank must pass
    the same parameters, in the same order, and the function must give every rank the same
    value). A parameter with no gradient yet is skipped. Collective (one all-gather per
    parameter)."""
    for param in params:
        if not param.requires_grad:
            continue
        full = get_full_grad(param)
        if full is not None:
            set_full_grad(param, update_func(full, param))


def _set_grad_shard(owner: ParamOwner, sp: ShardedParam, piece: torch.Tensor) -> None:
    if not sp.requires_grad:
        raise ParamAccessError(f"{sp.name} is frozen (requires_grad=False): it has no gradient to set")
    _grad_shard(owner, sp)
    if sp.grad_shard is None:
        master = owner.optimizer.master_of(sp)  # gradient shards take the optimizer's grad_dtype (optim/precision.py)
        dtype = owner.optimizer.precision().grad_dtype if master is not None else torch.float32
        sp.grad_shard = torch.zeros(sp.shard_numel, dtype=dtype, device=owner.placement.state_device(sp))
    _write_local(sp.grad_shard, sp, piece)
    sp.grad_sq_norm = None  # the sink's cached norm no longer describes grad_shard


# ----------------------------------------------------------------- optimizer state
def _state_of(optimizer: OptimizerAccess, sp: ShardedParam) -> tuple[torch.Tensor | None, dict[str, Any]]:
    master = optimizer.master_of(sp)
    if master is None:
        return None, {}
    return master, optimizer.state().get(master, {})


def get_full_optimizer_state(param: nn.Parameter, key: str) -> torch.Tensor | None:
    owner, sp = _owner_and_shard(param)
    master, state = _state_of(owner.optimizer, sp)
    present = owner.model.comm.gather_objects(key in state)
    if not all(present):
        if any(present):
            raise ParamAccessError(f"optimizer state {key!r} of {sp.name} exists on ranks {present} only")
        return None
    value = state[key]
    if isinstance(value, torch.Tensor) and value.shape == master.shape:
        return gather_full(owner.model, sp, value).cpu()
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def set_full_optimizer_state(param: nn.Parameter, value: torch.Tensor, key: str) -> None:
    owner, sp = _owner_and_shard(param)
    value = _as_shape(value, sp.shape, f"set_full_optimizer_state({sp.name}, {key!r})")
    _write_state(owner.optimizer, sp, key, _slice_of(sp, value))


def get_local_optimizer_state(param: nn.Parameter, key: str) -> torch.Tensor | None:
    owner, sp = _owner_and_shard(param)
    _, state = _state_of(owner.optimizer, sp)
    value = state.get(key)
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def set_local_optimizer_state(param: nn.Parameter, value: torch.Tensor, key: str) -> None:
    owner, sp = _owner_and_shard(param)
    value = _as_shape(value, (sp.shard_numel,), f"set_local_optimizer_state({sp.name}, {key!r})")
    _write_state(owner.optimizer, sp, key, value[: sp.local_valid_numel])


def _write_state(optimizer: OptimizerAccess, sp: ShardedParam, key: str, piece: torch.Tensor) -> None:
    master, state = _state_of(optimizer, sp)
    if master is None:
        raise ParamAccessError(f"{sp.name} is frozen (requires_grad=False): it has no optimizer state")
    target = state.get(key)
    if not isinstance(target, torch.Tensor) or target.shape != master.shape:
        raise ParamAccessError(
            f"optimizer state {key!r} of {sp.name} is not a per-element tensor here (it is "
            f"{type(target).__name__}); the optimizer creates it at its first step: set it after one")
    _write_local(target, sp, piece)


# ----------------------------------------------------------------- whole state dict
def full_state_dict(model: ShardedModel, optimizer: OptimizerAccess, prefix: str = "") -> dict[str, torch.Tensor]:
    """`module.state_dict()` with every parameter whole (compute dtype), on every rank, as
    CPU tensors the caller owns. A collective: one all-gather per parameter, in order."""
    out: dict[str, torch.Tensor] = {}
    gathered: dict[int, torch.Tensor] = {}
    optimizer.settle()
    for name, kind, tensor in state_dict_entries(model.module):
        if kind == "buffer" or tensor not in model.table:  # attached after initialize: whole already
            out[prefix + name] = tensor.detach().cpu().clone()
            continue
        sp = model.table[tensor]
        if id(sp) not in gathered:
            gathered[id(sp)] = gather_full(model, sp, sp.shard_values()).cpu()
        out[prefix + name] = gathered[id(sp)]
    return out


def load_full_state_dict(model: ShardedModel, optimizer: OptimizerAccess, state_dict: dict[str, torch.Tensor],
                         prefix: str, strict: bool) -> tuple[list[str], list[str]]:
    """Write whole values into the shards, fp32 masters and buffers; no collective (every
    rank must pass the same values). Returns (missing keys, unexpected keys); with
    `strict` either is an error and nothing is written."""
    optimizer.settle()
    entries = {prefix + name: (kind, tensor) for name, kind, tensor in state_dict_entries(model.module)}
    missing = [k for k in entries if k not in state_dict]
    unexpected = [k for k in state_dict if k not in entries]
    if strict and (missing or unexpected):
        raise ParamAccessError(
            f"load_state_dict: missing keys {missing[:8]}{'...' if len(missing) > 8 else ''}, unexpected keys "
            f"{unexpected[:8]}{'...' if len(unexpected) > 8 else ''}; keys are the model's state-dict names "
            f"prefixed {prefix!r}, as engine.state_dict() gives them (pass strict=False to load a subset)")
    for key, (kind, tensor) in entries.items():
        if key not in state_dict:
            continue
        value = _as_shape(state_dict[key], tensor.shape, f"load_state_dict[{key!r}]")
        if kind == "buffer" or tensor not in model.table:
            with torch.no_grad():
                tensor.copy_(value)
            continue
        sp = model.table[tensor]
        piece = _slice_of(sp, value)
        master = optimizer.master_of(sp)
        if master is not None:
            _write_local(master, sp, piece.float())
        _write_weights(sp, piece, value)
    return missing, unexpected


def load_into_live_params(module: nn.Module, state_dict: dict[str, torch.Tensor]) -> list[str]:
    """Whole values by `module`'s state-dict names into its parameters and buffers, where
    some are managed by a live engine: a managed parameter's fp32 master (trainable ones),
    its compute-dtype shard and, where it is gathered now (inside GatheredParameters, or
    resident), its full values, written through `.data` (no in-place write as
    GatheredParameters(modifier_rank=None) counts one), so they stay after the block; other
    tensors are copied into. No collective: every rank must pass the same values. Names
    absent from `state_dict` are left as they are. Returns the names not found."""
    entries = state_dict_entries(module)
    missing = []
    for name, kind, tensor in entries:
        if name not in state_dict:
            missing.append(name)
            continue
        value = _as_shape(state_dict[name], tensor.shape, f"load_state_dict_from_zero_checkpoint[{name!r}]")
        owner = owner_of(tensor) if kind != "buffer" else None
        if owner is None:
            with torch.no_grad():
                tensor.data.copy_(value.to(tensor.device, tensor.dtype))
            continue
        owner.optimizer.settle()
        sp = owner.model.table[tensor]
        piece = _slice_of(sp, value)
        master = owner.optimizer.master_of(sp)
        if master is not None:
            _write_local(master, sp, piece.float())
        _write_weights(sp, piece, value)
    return missing
