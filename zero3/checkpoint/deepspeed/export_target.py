"""What the DeepSpeed run that loads an export will build: its sub_group_size and optimizer.

DeepSpeed's ZeRO-3 loader hands the exported param groups to its own optimizer's
`load_state_dict`, which replaces the optimizer's groups with them: every key that
optimizer reads at `step()` must be in the export, and the per-sub-group `step` must
have the type its kernel takes. Which optimizer DeepSpeed 0.19.8 builds follows from
the config (runtime/engine.py, `_configure_basic_optimizer`):

  "fused"     config optimizer Adam / AdamW: deepspeed.ops.adam.FusedAdam (CUDA's
              kernel, or on the CPU accelerator its C++ CPU op). Group keys lr,
              bias_correction, betas, eps, weight_decay; state step a Python int.
  "cpu-adam"  the same under zero_optimization.offload_optimizer (device cpu or nvme):
              DeepSpeedCPUAdam. Group keys lr, betas, eps, weight_decay,
              bias_correction, amsgrad; state step a Python int (its C++ op takes one).
  "torch"     a client torch optimizer (no optimizer section in the config) or Adam /
              AdamW with params.torch_adam: torch.optim's groups (the ones zero3
              recorded, from the same torch optimizer); state step a tensor.

zero3 checkpoints record the engine's config (common.pt "ds_config"); the export takes
the sub_group_size and the optimizer from it unless the command names them. A checkpoint
saved before zero3 recorded its config exports with DeepSpeed's default sub_group_size
(1e9) and "torch" unless told otherwise, and the summary says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zero3.checkpoint import format as ckpt

OPTIMIZERS = ("fused", "cpu-adam", "torch")
DEEPSPEED_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed 0.19's zero_optimization.sub_group_size default
_TRUE = (True, 1, "true", "True", "1", "yes", "on")
# The keys each DeepSpeed optimizer reads from a param group, with DeepSpeed's defaults
# (FusedAdam / DeepSpeedCPUAdam __init__) for those torch's groups do not hold.
_GROUP_DEFAULTS = {
    "fused": {"bias_correction": True},
    "cpu-adam": {"bias_correction": True, "amsgrad": False},
    "torch": {},
}
_NEEDED = {
    "fused": ("lr", "bias_correction", "betas", "eps", "weight_decay"),
    "cpu-adam": ("lr", "betas", "eps", "weight_decay", "bias_correction", "amsgrad"),
    "torch": ("lr",),
}


@dataclass(frozen=True)
class ExportTarget:
    """The DeepSpeed run the export is written for, and where each choice came from."""

    sub_group_size: int
    sub_group_size_from: str
    optimizer: str
    optimizer_from: str
    bias_correction: bool = True


def _zero_section(config: dict) -> dict:
    section = config.get("zero_optimization")
    return section if isinstance(section, dict) else {}


def recorded_sub_group_size(config: dict | None) -> int | None:
    """zero_optimization.sub_group_size of a recorded config (None: not given there, or not
    a number, such as a Trainer's "auto")."""
    value = _zero_section(config or {}).get("sub_group_size")
    try:
        return None if value is None or isinstance(value, bool) else int(float(value))
    except (TypeError, ValueError):
        return None


def recorded_optimizer(config: dict | None) -> str | None:
    """The DeepSpeed optimizer a recorded config builds (module docstring); None: no config."""
    if config is None:
        return None
    section = config.get("optimizer")
    if not isinstance(section, dict):
        return "torch"  # the engine was given a client optimizer
    params = section.get("params") or {}
    if str(section.get("type", "")).lower() not in ("adam", "adamw") or params.get("torch_adam") in _TRUE:
        return "torch"
    offload = _zero_section(config).get("offload_optimizer")
    device = offload.get("device") if isinstance(offload, dict) else None
    return "cpu-adam" if str(device).lower() in ("cpu", "nvme") else "fused"


def resolve(common: dict, sub_group_size: int | None, optimizer: str | None) -> ExportTarget:
    """The export's target: the command's values where given, else the recorded config's."""
    config = common.get("ds_config")
    none_recorded = "the checkpoint records no config (saved by an older zero3)"
    why = "the checkpoint's config gives no number" if config is not None else none_recorded
    size, size_from = _first_given((sub_group_size, "from --sub-group-size"),
                                   (recorded_sub_group_size(config), "from the checkpoint's config"),
                                   (DEEPSPEED_SUB_GROUP_SIZE, f"DeepSpeed's default: {why}"))
    if size < 1:
        raise ckpt.CheckpointError(f"sub_group_size {size} ({size_from}): it must be at least 1")
    if optimizer is not None and optimizer not in OPTIMIZERS:
        raise ckpt.CheckpointError(f"optimizer {optimizer!r}: pick one of {', '.join(OPTIMIZERS)}")
    kind, kind_from = _first_given((optimizer, "from --optimizer"),
                                   (recorded_optimizer(config), "from the checkpoint's config"),
                                   ("torch", f"a client optimizer assumed: {none_recorded}"))
    params = ((config or {}).get("optimizer") or {}).get("params") or {}
    return ExportTarget(size, size_from, kind, kind_from, params.get("bias_correction", True) in _TRUE)


def _first_given(*choices: tuple[Any, str]) -> tuple[Any, str]:
    """The first (value, where it came from) whose value is not None (the last always is)."""
    return next(choice for choice in choices if choice[0] is not None)


def deepspeed_param_group(hyper: dict[str, Any], target: ExportTarget, group_id: int) -> dict[str, Any]:
    """A recorded param group (torch's keys) with the keys `target.optimizer` reads added."""
    group = dict(hyper)
    for key, value in _GROUP_DEFAULTS[target.optimizer].items():
        group.setdefault(key, target.bias_correction if key == "bias_correction" else value)
    missing = [key for key in _NEEDED[target.optimizer] if key not in group]
    if missing:
        raise ckpt.CheckpointError(
            f"param group {group_id} recorded as {sorted(hyper)} lacks {missing}, which DeepSpeed's "
            f"{target.optimizer} optimizer reads at step(): export with the --optimizer the DeepSpeed run builds "
            f"({', '.join(OPTIMIZERS)}); nothing was written")
    return group


def deepspeed_step(value: Any, target: ExportTarget) -> Any:
    """A sub-group's `step` as the target optimizer keeps it: a Python int for FusedAdam and
    DeepSpeedCPUAdam (their kernels take an int), the recorded tensor for torch."""
    if target.optimizer == "torch":
        return value.clone() if isinstance(value, torch.Tensor) else value
    return int(value.item()) if isinstance(value, torch.Tensor) else int(value)
