"""The config's `optimizer` and `scheduler` sections, built as torch objects.

DeepSpeed's names: "Adam" is Adam with decoupled weight decay (AdamW) unless
`adam_w_mode` is false; "AdamW" is AdamW; "SGD" is SGD. `torch_adam` and `fused` choose an
implementation in DeepSpeed; here torch's own (foreach) implementation always runs.
"""

from __future__ import annotations

from typing import Any

import torch

from .config import ComponentSpec, ConfigError

_IMPLEMENTATION_CHOICES = ("torch_adam", "fused", "adam_w_mode")


def build_optimizer(spec: ComponentSpec, params: list) -> torch.optim.Optimizer:
    kind = spec.type.lower()
    kwargs: dict[str, Any] = {k: v for k, v in spec.params.items() if k not in _IMPLEMENTATION_CHOICES}
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    try:
        if kind == "adam":
            decoupled = bool(spec.params.get("adam_w_mode", True))
            cls = torch.optim.AdamW if decoupled else torch.optim.Adam
            return cls(params, **kwargs)
        if kind == "adamw":
            return torch.optim.AdamW(params, **kwargs)
        if kind == "sgd":
            return torch.optim.SGD(params, **kwargs)
    except TypeError as exc:
        raise ConfigError(f"optimizer section {spec.type!r}: bad params {spec.params} ({exc})") from exc
    raise ConfigError(f"optimizer type {spec.type!r} is not supported; use Adam, AdamW or SGD")


def build_scheduler(spec: ComponentSpec, optimizer: torch.optim.Optimizer):
    from .lr_schedules import SCHEDULERS

    cls = SCHEDULERS.get(spec.type)
    if cls is None:
        raise ConfigError(
            f"scheduler type {spec.type!r} is not supported; use one of {sorted(SCHEDULERS)} "
            "or pass lr_scheduler= to zero3.initialize"
        )
    try:
        return cls(optimizer, **spec.params)
    except TypeError as exc:
        raise ConfigError(f"scheduler section {spec.type!r}: bad params {spec.params} ({exc})") from exc
