"""What a torch optimizer's per-master state will hold before the optimizer has stepped.

torch optimizers create a parameter's state (Adam's `exp_avg`, `exp_avg_sq`, `step`, ...)
lazily, at the first step that sees its gradient. The host buffer of asynchronous saves
(checkpoint/snapshot.py) is sized at initialize, before that step, so it asks here what
that state will be: `foreseen_state` steps a fresh optimizer of the client's class, with
one param group's hyper-parameters, over a 2-element probe tensor (the master's dtype and
device) with a zero gradient, and reads the state that step created. A state tensor shaped
like the probe is elementwise (it will be shaped like each master); any other keeps the
probe's shape (a scalar `step`).

Memory: the probes and their optimizers are a few bytes each, dropped on return; the
foreseen state is meta tensors (shape and dtype, no storage). The client optimizer is only
read: its state, param groups and counters are left as they are (torch's global optimizer
step hooks, if any are registered, do see the probes' steps).
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch

logger = logging.getLogger("zero3")

PROBE_NUMEL = 2


class _Slot(NamedTuple):
    """One state tensor a first step creates: elementwise (shaped like its master) or not."""

    elementwise: bool
    shape: torch.Size
    dtype: torch.dtype


def foreseen_state(optimizer: torch.optim.Optimizer, step_dtype: torch.dtype | None = None
                   ) -> dict[Any, dict[str, Any]]:
    """`optimizer.state` (a new dict, its values the optimizer's own) with, for every param
    that has no state yet, the state its first step will create, as meta tensors.
    `step_dtype`: the dtype params are stepped in when it is not their own (bf16 masters
    lifted to fp32 for the step, optim/precision.py)."""
    state: dict[Any, dict[str, Any]] = {param: values for param, values in optimizer.state.items() if values}
    probes: dict[tuple, dict[str, _Slot]] = {}
    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if param in state:
                continue
            dtype = step_dtype or param.dtype
            key = (index, dtype, param.device)
            if key not in probes:
                probes[key] = _probe(type(optimizer), group, dtype, param.device)
            state[param] = {name: torch.empty(param.shape if slot.elementwise else slot.shape,
                                              dtype=slot.dtype, device="meta")
                            for name, slot in probes[key].items()}
    return state


def _probe(kind: type[torch.optim.Optimizer], group: dict[str, Any], dtype: torch.dtype,
           device: torch.device) -> dict[str, _Slot]:
    """The tensors of the state a first step of `kind` creates with `group`'s hyper-parameters;
    empty (with a log line) when such an optimizer cannot be built or stepped on a probe."""
    probe = torch.zeros(PROBE_NUMEL, dtype=dtype, device=device, requires_grad=True)
    probe.grad = torch.zeros_like(probe)
    hyper = {name: value for name, value in group.items() if name != "params"}
    try:
        fresh = kind([{**hyper, "params": [probe]}])
        fresh.step()
    except Exception as exc:  # noqa: BLE001 - a guess only: the first save sizes what is missed
        logger.info("zero3: cannot foresee the state of %s (%s: %s); the first asynchronous save "
                    "allocates its share of the snapshot buffer", kind.__name__, type(exc).__name__, exc)
        return {}
    return {str(name): _Slot(value.shape == probe.shape, value.shape, value.dtype)
            for name, value in fresh.state[probe].items() if isinstance(value, torch.Tensor)}
