"""Every rank must start from the same config and the same model: checked at initialize.

Ranks that disagree on the config or the model do not fail cleanly on their own: a
different `gradient_clipping` or learning rate trains silently divergent replicas, a
different persistence threshold or bucket size makes collectives of different sizes (a
gloo abort), a different `gradient_accumulation_steps` a hang until the process-group
timeout. So, before any other collective, each rank fingerprints

  - the normalized config (every field of `Zero3Config`, as parsed),
  - the client optimizer's class and the hyper-parameters of each param group,
  - every parameter of the model: name, shape, dtype, requires_grad, and whether DeepSpeed's
    zero.Init partitioned it (deepspeed_adopt.py gathers those: a collective),

and the ranks compare a 32-byte digest of it in one all-gather. Only when digests
differ are the items themselves gathered, to name the keys or parameters that differ and
each rank's value; `RankMismatchError` is then raised on every rank.

Fields that may differ per rank, since they change only what a rank logs or prints and
never a collective or a value (`PER_RANK_FIELDS`): `raw` (the config as given, which may
hold per-rank local paths such as a tensorboard or csv output folder; its effective keys
are compared in their normalized form), `steps_per_print`, `log_level`, `dump_state`,
`memory_breakdown`, `disable_python_gc`, `zero.log_trace_cache_warnings`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import torch
from torch import nn

from zero3.engine_parts.deepspeed_adopt import deepspeed_mark
from zero3.platform.collectives import Communicator

PER_RANK_FIELDS = frozenset({
    "raw", "steps_per_print", "log_level", "dump_state", "memory_breakdown", "disable_python_gc",
    "zero.log_trace_cache_warnings",
})
MAX_LISTED = 20  # differing items named in the error; the count of the rest is given


class RankMismatchError(RuntimeError):
    """Ranks passed different configs or models to zero3.initialize."""


def config_items(config: Any, prefix: str = "") -> dict[str, str]:
    """`config.<field path>` -> repr of the value, for every compared field of a dataclass tree."""
    items: dict[str, str] = {}
    for field in dataclasses.fields(config):
        path = prefix + field.name
        if path in PER_RANK_FIELDS:
            continue
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            items.update(config_items(value, path + "."))
        else:
            items[f"config.{path}"] = stable_repr(value)
    return items


def stable_repr(value: Any) -> str:
    """repr with dict keys sorted (a JSON file's key order must not count as a difference)
    and tensors by value and dtype (each rank's tensors live on its own device)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {stable_repr(v)}" for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))) + "}"
    if isinstance(value, torch.Tensor):  # e.g. a capturable optimizer's lr: values, not the device
        shown = value.detach().cpu().tolist() if value.numel() <= 16 else f"shape {tuple(value.shape)}"
        return f"tensor({shown}, {value.dtype})"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(stable_repr(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    return repr(value)


def optimizer_items(optimizer: Any) -> dict[str, str]:
    """A client torch optimizer's class and each param group's hyper-parameters (not its params)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return {"optimizer": type(optimizer).__name__ if optimizer is not None else "None"}
    items = {"optimizer": type(optimizer).__name__}
    for index, group in enumerate(optimizer.param_groups):
        items[f"optimizer.param_groups[{index}].params"] = str(len(group["params"]))
        for key, value in group.items():
            if key != "params":
                items[f"optimizer.param_groups[{index}].{key}"] = stable_repr(value)
    return items


def model_items(model: nn.Module) -> dict[str, str]:
    """`param <name>` -> its shape, dtype and requires_grad, for every parameter (tied ones once),
    and whether DeepSpeed's zero.Init partitioned it (its adoption is a collective)."""
    return {f"param {name}": f"shape={tuple(p.shape)} dtype={str(p.dtype).replace('torch.', '')} "
                             f"requires_grad={p.requires_grad}"
                             + (" partitioned by DeepSpeed's zero.Init" if deepspeed_mark(p) else "")
            for name, p in model.named_parameters()}


def fingerprint(items: dict[str, str]) -> bytes:
    text = "\n".join(f"{key}={value}" for key, value in sorted(items.items()))
    return hashlib.sha256(text.encode()).digest()


def check_ranks_agree(comm: Communicator, device: torch.device, items: dict[str, str]) -> None:
    """A collective: RankMismatchError on every rank unless every rank has the same `items`."""
    if not comm.active:
        return
    mine = torch.tensor(list(fingerprint(items)), dtype=torch.uint8, device=device)
    every = torch.empty(comm.world_size * mine.numel(), dtype=torch.uint8, device=device)
    comm.all_gather_into(every, mine)
    digests = every.view(comm.world_size, -1).cpu()
    if all(torch.equal(digests[r], digests[0]) for r in range(comm.world_size)):
        return
    raise RankMismatchError(describe_differences(comm.gather_objects(items)))


def describe_differences(by_rank: list[dict[str, str]]) -> str:
    """The keys whose values differ between ranks, each with every rank's value."""
    keys = sorted(set().union(*by_rank))
    lines = []
    for key in keys:
        values = [items.get(key, "<absent>") for items in by_rank]
        if any(v != values[0] for v in values):
            lines.append(f"{key}: " + ", ".join(f"rank {r}: {v}" for r, v in enumerate(values)))
    shown = lines[:MAX_LISTED] + ([f"... and {len(lines) - MAX_LISTED} more"] if len(lines) > MAX_LISTED else [])
    return ("zero3.initialize: ranks were given different configs or models, so training would diverge, "
            "abort or hang; every rank must pass the same config, optimizer settings and model. "
            f"Differences ({len(lines)}):\n  " + "\n  ".join(shown))
