"""Consolidated state dicts (fp32 or 16-bit) written as safetensors, and held-byte counts.

Consolidation streams one parameter at a time: it is all-gathered (a collective: every
rank calls it), rank 0 copies it to host memory, and it is released again, so no device
ever holds more than one whole parameter beyond its shards. Names are the model's own
(`named_parameters()`), so the result loads with plain `model.load_state_dict` (buffers
included).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

if TYPE_CHECKING:
    from .engine import Engine


def consolidated_state_dict(engine: "Engine", dtype: torch.dtype | None = None,
                            exclude_frozen: bool = False, use_master: bool = False) -> dict[str, torch.Tensor]:
    """The whole model's state dict on rank 0 (CPU tensors); empty on other ranks.

    `use_master=True` takes trainable values from the fp32 master shards (exact fp32
    weights under bf16/fp16 training); otherwise from the compute-dtype parameters.
    """
    comm = engine.comm
    out: dict[str, torch.Tensor] = {}
    for sp in engine.table.values():
        if exclude_frozen and not sp.requires_grad:
            continue
        master = engine.optimizer.master_of(sp) if (use_master and engine.optimizer is not None) else None
        local = (master if master is not None else sp.shard).detach()
        rows = torch.empty(comm.world_size * sp.shard_numel, dtype=local.dtype, device=engine.device)
        comm.all_gather_into(rows, local.to(engine.device))
        if comm.rank == 0:
            full = rows[: sp.numel].view(sp.shape).cpu()
            out[sp.name] = full.to(dtype) if dtype is not None else full.clone()
        del rows
    if comm.rank == 0:
        for name, buffer in engine.module.named_buffers():
            out[name] = buffer.detach().cpu().to(dtype) if (dtype and buffer.is_floating_point()) else buffer.detach().cpu().clone()
    return out


def save_safetensors(state: dict[str, torch.Tensor], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)


def save_16bit_model(engine: "Engine", save_dir, save_filename: str, exclude_frozen: bool) -> bool:
    """DeepSpeed's save_16bit_model: the compute-dtype weights, whole, in one file (rank 0)."""
    dtype = engine.compute_dtype if engine.compute_dtype != torch.float32 else None
    state = consolidated_state_dict(engine, dtype=dtype, exclude_frozen=exclude_frozen)
    if engine.comm.rank == 0:
        save_safetensors(state, Path(save_dir) / save_filename)
    engine.comm.barrier()
    return True


def held_bytes(engine: "Engine") -> dict[str, int]:
    """Bytes this rank holds: parameter shards, resident full parameters, gradient
    shards, fp32 masters (when separate from the shards) and optimizer state."""
    def nbytes(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.numel() * t.element_size()

    shards = sum(nbytes(sp.shard) for sp in engine.table.values())
    resident = sum(
        sp.param.untyped_storage().nbytes() for sp in engine.table.values() if sp.persistent
    )
    grads = sum(nbytes(sp.grad_shard) for sp in engine.table.values())
    masters = optim_state = 0
    if engine.optimizer is not None:
        masters = sum(
            nbytes(m) for sp, m in zip(engine.optimizer.params, engine.optimizer.masters) if m is not sp.shard
        )
        for state in engine.optimizer.optimizer.state.values():
            optim_state += sum(nbytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return {"param_shards": shards, "resident_params": resident, "grad_shards": grads,
            "masters": masters, "optimizer_state": optim_state}
