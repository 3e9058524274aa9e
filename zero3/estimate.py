"""Per-rank memory of a model under zero3, before launch.

`estimate_memory(model, world_size, config)` counts what an engine built with that
DeepSpeed config will hold on each rank, with the engine's own rules:
- every parameter has a flat shard of ceil(numel / world) elements in the compute dtype
  (on the host with `offload_param`; with its device "nvme" what `max_in_cpu` does not keep
  there is in swap files: `estimate_placement` shows which units), and those chosen resident by
  `stage3_param_persistence_threshold` / `stage3_model_persistence_threshold` are also
  held whole on every rank (on the device);
- each trainable parameter has a gradient shard and a master shard, fp32 (bf16 with
  bf16_master_weights_and_grads; the master is the compute shard itself when both have one
  dtype on the same device), and the optimizer's state per master: Adam/AdamW two tensors
  (fp32, bf16 with bf16_optimizer_states) and a step counter, SGD with momentum one, plain
  SGD none; with `offload_optimizer` all of these are on the host.
These are the tensors `engine.sharded_bytes()` reports once the optimizer has stepped and
while gradients are held. On top of them come the working set (the gathered fetch units,
reported as `gathered_unit`: the largest unit, in the compute dtype, held whole while it
runs, twice with prefetch) and activations, which depend on the batch and are not counted.
With checkpoint.async_save, `checkpoint_snapshot` is the host buffer an asynchronous save
copies a rank's shards, masters and optimizer state into (checkpoint/snapshot.py), held
from initialize on (pinned on a GPU machine; a save inside an accumulation window also
holds the gradient shards); it is counted in `host_total`. The engine's buffer aligns
each tensor to 64 bytes and holds each shard's own elements, not ceil(numel / world).

The model is an nn.Module (a model built on the meta device costs nothing), a Hugging
Face config (built on the meta device; needs the `hf` extra), or a parameter count.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zero3.config import Zero3Config, from_deepspeed
from zero3.params.units import persistent_indices
from zero3.placement.plan import Plan, PlanInputs, UnitSize, make_plan
from zero3.placement.sizes import (param_staging_bytes, state_bytes_per_element, state_group_bytes,
                                   working_set_bytes)

CATEGORIES = ("param_shards", "resident_params", "grad_shards", "masters", "optimizer_state")


@dataclass
class MemoryEstimate:
    """Bytes per rank, by category and by where they live ('device' or 'host')."""

    world_size: int
    dtype: torch.dtype
    parameters: int
    trainable: int
    resident: int  # parameters held whole on every rank
    device: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    gathered_unit: int | None = None  # bytes of the largest fetch unit gathered (None: unknown)
    checkpoint_snapshot: int = 0  # host bytes of the asynchronous save's buffer (0: saves are synchronous)

    def by_category(self) -> dict[str, int]:
        return {k: self.device.get(k, 0) + self.host.get(k, 0) for k in CATEGORIES}

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values()) + self.checkpoint_snapshot

    def as_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "dtype": str(self.dtype).replace("torch.", ""),
                "parameters": self.parameters, "trainable": self.trainable, "resident": self.resident,
                "device": dict(self.device), "host": dict(self.host), "device_total": self.device_total,
                "host_total": self.host_total, "gathered_unit": self.gathered_unit,
                "checkpoint_snapshot": self.checkpoint_snapshot}


@dataclass(frozen=True)
class _Tensor:
    name: str
    numel: int
    trainable: bool
    floating: bool = True


def estimate_memory(model: nn.Module | int, world_size: int, config: dict | str | Path | Zero3Config,
                    trainable: int | None = None, device_type: str = "cuda") -> MemoryEstimate:
    """The per-rank memory of `model` (a module, or a parameter count) under `config`.

    `trainable` (for a count only): how many of the parameters train (default: all).
    `device_type`: the accelerator the engine will run on ("cuda", or "cpu", where
    "device" and "host" are the same memory and an offloaded fp32 shard is its own master).
    """
    parsed = config if isinstance(config, Zero3Config) else from_deepspeed(config, world_size=world_size)
    if isinstance(model, int):
        tensors = _count_as_tensors(model, trainable)
        units = []  # a bare count has no module structure
    else:
        tensors = [_Tensor(n, p.numel(), p.requires_grad, p.is_floating_point()) for n, p in model.named_parameters()]
        units = _unit_sizes(model)
    return _estimate(tensors, units, world_size, parsed, device_type)


def _count_as_tensors(count: int, trainable: int | None) -> list[_Tensor]:
    if count < 1:
        raise ValueError(f"a parameter count must be positive, got {count}")
    trainable = count if trainable is None else trainable
    if not 0 <= trainable <= count:
        raise ValueError(f"trainable={trainable} must be between 0 and the parameter count {count}")
    parts = [_Tensor("trainable", trainable, True), _Tensor("frozen", count - trainable, False)]
    return [t for t in parts if t.numel]


def _unit_sizes(model: nn.Module) -> list[int]:
    """Elements per default fetch unit: each ModuleList element whole, other modules' own."""
    return [sum(numel for numel, _ in params) for _, params in _units(model)] or [0]


def _units(model: nn.Module) -> list[tuple[str, list[tuple[int, bool]]]]:
    """(name, [(numel, trainable) per parameter]) of each unit with parameters: each
    ModuleList element whole (as when the decoder layers are leaf units), other modules'
    own parameters. A tied parameter counts once, in the first unit holding it."""
    units: list[tuple[str, list[tuple[int, bool]]]] = []
    inside: set[int] = set()
    seen: set[int] = set()

    def take(params) -> list[tuple[int, bool]]:
        fresh = [p for p in params if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        return [(p.numel(), p.requires_grad) for p in fresh]

    for name, module in model.named_modules():
        if id(module) in inside:
            continue
        if isinstance(module, nn.ModuleList):
            for index, block in enumerate(module):
                units.append((f"{name}.{index}", take(block.parameters())))
                inside.update(id(m) for m in block.modules())
            continue
        units.append((name or "(root)", take(module.parameters(recurse=False))))
    return [(name, params) for name, params in units if params]


def _optimizer_states(parsed: Zero3Config) -> tuple[int, int]:
    """(fp32 state tensors per master, step-counter bytes per master) of the optimizer."""
    spec = parsed.optimizer
    kind = (spec.type if spec is not None else "adamw").lower()
    if kind in ("adam", "adamw", "fusedadam", "cpuadam"):
        return 2, 4
    if kind == "sgd":
        momentum = (spec.params or {}).get("momentum", 0) if spec is not None else 0
        return (1 if momentum else 0), 0
    raise ValueError(f"optimizer {spec.type!r}: estimate knows Adam, AdamW and SGD")


def _optimizer_widths(parsed: Zero3Config) -> tuple[int, int]:
    """(bytes of a master / gradient shard element, of an optimizer state element): 4 and 4,
    2 for each bf16 key (bf16_master_weights_and_grads, bf16_optimizer_states)."""
    precision = parsed.precision
    return (torch.empty(0, dtype=precision.master_dtype).element_size(),
            torch.empty(0, dtype=precision.optimizer_state_dtype).element_size())


def _estimate(tensors: list[_Tensor], units: list[int], world: int, parsed: Zero3Config,
              device_type: str) -> MemoryEstimate:
    zero, dtype = parsed.zero, parsed.precision.dtype
    width = torch.empty(0, dtype=dtype).element_size()
    master_w, state_w = _optimizer_widths(parsed)
    chosen = persistent_indices([t.numel for t in tensors], zero.param_persistence_threshold,
                                zero.model_persistence_threshold)
    resident = [t for i, t in enumerate(tensors) if i in chosen]
    shard = {t.name: math.ceil(t.numel / world) for t in tensors}
    host_params = zero.offload_param.enabled  # "cpu", or "nvme" (the host before the files)
    host_optim = zero.offload_optimizer.enabled  # "cpu", or "nvme" (the host before the files)
    states, step_bytes = _optimizer_states(parsed)

    def elem_width(t: _Tensor) -> int:
        return width if t.floating else 4

    param_shards = sum(shard[t.name] * elem_width(t) for t in tensors)
    # At world size 1 with device shards every parameter is its own shard (aliased): no
    # separate resident copy.
    aliased = world == 1 and not host_params
    resident_bytes = 0 if aliased else sum(t.numel * elem_width(t) for t in resident)
    train = [t for t in tensors if t.trainable]
    grads = sum(shard[t.name] * master_w for t in train)
    # The master is the compute shard itself when it has the shard's dtype and lives where the
    # optimizer runs (never in the offloaded mixed mode: bf16 masters, fp32 state).
    on_cpu = device_type == "cpu"
    master_is_shard = width == master_w == state_w and (on_cpu or host_params == host_optim)
    masters = 0 if master_is_shard else sum(shard[t.name] * master_w for t in train)
    optim = sum(shard[t.name] * state_w * states + step_bytes for t in train)
    device: dict[str, int] = {}
    host: dict[str, int] = {}
    (host if host_params else device)["param_shards"] = param_shards
    device["resident_params"] = resident_bytes
    for name, value in (("grad_shards", grads), ("masters", masters), ("optimizer_state", optim)):
        (host if host_optim else device)[name] = value
    return MemoryEstimate(
        world_size=world, dtype=dtype, parameters=sum(t.numel for t in tensors),
        trainable=sum(t.numel for t in train), resident=sum(t.numel for t in resident),
        device=device, host=host, gathered_unit=max(units) * width if units else None,
        checkpoint_snapshot=param_shards + masters + optim if parsed.checkpoint_async_save else 0,
    )


@dataclass
class PlacementEstimate:
    """The plan the engine would make (zero3/placement/plan.py) and the device peak it
    predicts: the plan's device bytes (the engine's own tensors, working set included) plus
    the activations given."""

    plan: Plan
    activation_bytes: int

    @property
    def predicted_peak(self) -> int:
        return self.plan.device_bytes + self.activation_bytes


def estimate_placement(model: nn.Module | int, world_size: int, config: dict | str | Path | Zero3Config,
                       budget: int | None, activation_bytes: int = 0, trainable: int | None = None
                       ) -> PlacementEstimate:
    """Which units' parameter shards and optimizer sides `config` with `budget` bytes of GPU
    memory (None: the config's offload alone) puts on the GPU, for one rank of `world_size`;
    units as when each ModuleList element is a leaf unit (a bare count is one unit).
    Raises PlacementError as the engine would."""
    parsed = config if isinstance(config, Zero3Config) else from_deepspeed(config, world_size=world_size)
    if isinstance(model, int):
        units = [("model", [(t.numel, t.trainable) for t in _count_as_tensors(model, trainable)])]
    else:
        units = _units(model)
    width = torch.empty(0, dtype=parsed.precision.dtype).element_size()
    reduce_width = torch.empty(0, dtype=parsed.gradient_reduce_dtype).element_size()
    master_width, state_width = _optimizer_widths(parsed)
    per_state = state_bytes_per_element(width, _optimizer_states(parsed)[0], master_width, state_width)
    numels = [n for _, params in units for n, _ in params]
    chosen = persistent_indices(numels, parsed.zero.param_persistence_threshold,
                                parsed.zero.model_persistence_threshold)
    sizes = tuple(UnitSize(name, sum(math.ceil(n / world_size) for n, _ in params) * width,
                           sum(math.ceil(n / world_size) for n, t in params if t) * per_state,
                           sum(n for n, _ in params) * width,
                           grad_bytes=sum(math.ceil(n / world_size) for n, t in params if t) * master_width,
                           swap_bytes=sum(math.ceil(n / world_size) for n, t in params if t) * (per_state - master_width),
                           param_numel=sum(math.ceil(n / world_size) for n, _ in params))
                  for name, params in units)
    working = working_set_bytes(
        [sum(n for n, _ in params) for _, params in units], sum(n for i, n in enumerate(numels) if i not in chosen),
        parsed.zero.max_live_parameters, width,
        sum(math.ceil(n / world_size) * world_size for _, params in units for n, t in params if t),
        parsed.zero.reduce_bucket_size, reduce_width)
    zero = parsed.zero
    # a bare count has no tensor sizes: its tensors are taken as no larger than a sub-group
    largest_trainable = 0 if isinstance(model, int) else max(
        (math.ceil(n / world_size) for _, params in units for n, t in params if t), default=0)
    plan = make_plan(PlanInputs(sizes, zero.offload_param.enabled, zero.offload_optimizer.enabled,
                                zero.offload_optimizer.ratio, budget, sum(numels[i] for i in chosen) * width,
                                working, "given" if budget is not None else "none",
                                accumulation_steps=parsed.gradient_accumulation_steps,
                                state_nvme=zero.offload_optimizer.nvme, host_budget=parsed.placement.host_budget,
                                params_nvme=zero.offload_param.nvme, max_in_cpu=zero.offload_param.max_in_cpu,
                                param_staging_bytes=param_staging_bytes(zero.offload_param, width,
                                                                        [u.param_bytes for u in sizes]),
                                state_staging_buffers=zero.offload_optimizer.buffer_count,
                                state_group_bytes=state_group_bytes(
                                    zero.sub_group_size, largest_trainable, per_state - master_width)))
    return PlacementEstimate(plan, activation_bytes)


def model_from_hf_config(path: str | Path) -> nn.Module:
    """A causal LM built on the meta device from a Hugging Face config.json (no weights)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as error:
        raise ImportError("--model-config needs transformers: pip install zero3[hf]") from error
    path = Path(path)
    values = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    model_type = values.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"{path}: no 'model_type' key; give a Hugging Face config.json")
    config = AutoConfig.for_model(model_type, **values)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)
