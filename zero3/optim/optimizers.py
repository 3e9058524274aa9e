"""The config's `optimizer` and `scheduler` sections, built as torch objects.

config.py resolves DeepSpeed's names ("Adam" is AdamW unless `adam_w_mode` is false) and
strips DeepSpeed-only params; this file only builds the objects.
"""

from __future__ import annotations

import torch

from zero3.config import ComponentSpec, ConfigError


def build_optimizer(spec: ComponentSpec, params: list) -> torch.optim.Optimizer:
    """The torch optimizer the config names (`spec.resolved`), over `params`."""
    cls = getattr(torch.optim, spec.resolved, None)
    if cls is None:
        raise ConfigError(f"optimizer type {spec.type!r} is not supported; use Adam, AdamW or SGD")
    try:
        return cls(params, **spec.kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"optimizer section {spec.type!r}: bad params {spec.params} ({exc})") from exc


def build_scheduler(spec: ComponentSpec, optimizer: torch.optim.Optimizer):
    from zero3.optim.lr_schedules import SCHEDULERS

    cls = SCHEDULERS.get(spec.type)
    if cls is None:
        raise ConfigError(
            f"scheduler type {spec.type!r} is not supported; use one of {sorted(SCHEDULERS)} "
            "or pass lr_scheduler= to zero3.initialize"
        )
    try:
        return cls(optimizer, **spec.kwargs)
    except TypeError as exc:
        raise ConfigError(f"scheduler section {spec.type!r}: bad params {spec.params} ({exc})") from exc
