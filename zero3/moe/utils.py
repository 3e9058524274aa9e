"""`deepspeed.moe.utils`: splitting parameters and optimizer groups into expert and shared ones.

DeepSpeed's MoE layer marks each expert parameter with `allreduce = False` (its gradient is
reduced over the expert-data-parallel group, not the whole world) and a `group_name`; these
functions put such parameters into groups of their own (`"moe": True`). zero3 trains every
parameter data-parallel and has no MoE layer, so for a model without marked parameters the
groups come back as they were given (as lists), and a marked parameter is refused, naming
it, rather than trained with the wrong reduction.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

# DeepSpeed's default max_group_size (elements per expert group), kept for the signature.
DEFAULT_MAX_GROUP_SIZE = 178956971


class ExpertParameterError(ValueError):
    """A parameter marked as an expert one (DeepSpeed's `allreduce = False`): zero3 has no
    expert parallelism."""


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether `param` is marked as DeepSpeed's MoE layer marks expert parameters
    (an `allreduce` attribute that is false)."""
    return not getattr(param, "allreduce", True)


def has_moe_layers(model: nn.Module) -> tuple[bool, int]:
    """(whether `model` holds DeepSpeed's MoE layer, its expert count): never, under zero3."""
    return False, 0


def split_params_into_shared_and_expert_params(
        params: Iterable[nn.Parameter]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(shared parameters, expert parameters), in the order given."""
    params = list(params)
    return [p for p in params if not is_moe_param(p)], [p for p in params if is_moe_param(p)]


def split_params_grads_into_shared_and_expert_params(
        group: Iterable[nn.Parameter]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The gradients (in each parameter's dtype) of the shared and of the expert parameters
    of `group` that have one."""
    shared, expert = split_params_into_shared_and_expert_params(p for p in group if p.grad is not None)
    return [p.grad.to(p.dtype) for p in shared], [p.grad.to(p.dtype) for p in expert]


def _as_group_list(param_groups: Any) -> list[dict[str, Any]]:
    if isinstance(param_groups, dict):
        return [param_groups]
    if isinstance(param_groups, (list, tuple)):
        return list(param_groups)
    raise ValueError(f"param groups must be a dict, a list or a tuple of dicts, got {type(param_groups).__name__}")


def _refuse_experts(groups: list[dict[str, Any]]) -> None:
    marked = [(index, position) for index, group in enumerate(groups)
              for position, p in enumerate(group["params"]) if is_moe_param(p)]
    if marked:
        index, position = marked[0]
        more = f" (and {len(marked) - 1} more)" if len(marked) > 1 else ""
        raise ExpertParameterError(
            f"param group {index}, parameter {position}{more} is marked as an expert parameter "
            "(allreduce=False, as DeepSpeed's MoE layer marks them); zero3 has no expert "
            "parallelism and trains every parameter data-parallel: build the experts as plain modules "
            "(remove the mark), or train this model with DeepSpeed")


def split_params_into_different_moe_groups_for_optimizer(
        param_groups: Any, max_group_size: int | float | None = DEFAULT_MAX_GROUP_SIZE) -> list[dict[str, Any]]:
    """`param_groups` (a group dict, or a list or tuple of them) as a list of groups for the
    optimizer, each group's `params` a list. Without expert parameters that is the groups
    given; an expert parameter raises ExpertParameterError."""
    groups = _as_group_list(param_groups)
    for group in groups:
        group["params"] = list(group["params"])
    _refuse_experts(groups)
    return groups


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    """Whether the group was made for expert parameters (`"moe": True`)."""
    return bool(param_group.get("moe", False))


def configure_moe_param_groups(model_parameters: list) -> list[dict[str, Any]]:
    """Optimizer groups for `model_parameters`: a list of parameters (one group named
    "dense-params") or of group dicts (kept as they are when one already says "moe")."""
    if not isinstance(model_parameters, list):
        raise TypeError(f"model_parameters must be a list, got {type(model_parameters).__name__}")
    for item in model_parameters:
        if not isinstance(item, (torch.Tensor, dict)):
            raise TypeError("model_parameters must hold tensors or param group dicts, got "
                            f"{type(item).__name__}")
    if model_parameters and isinstance(model_parameters[0], torch.Tensor):
        return split_params_into_different_moe_groups_for_optimizer(
            {"params": model_parameters, "name": "dense-params"})
    if any("moe" in group for group in model_parameters):
        return model_parameters
    return split_params_into_different_moe_groups_for_optimizer(model_parameters)
