"""Moving one parameter's optimizer side (its fp32 master and optimizer state) between the
device and the host, when the placement changes between steps.

The master keeps its identity (`master.data` is replaced): the client optimizer's param
groups and its `state` dict are keyed by it, and shadow optimizers hold it. A master that
is the parameter shard itself (fp32 compute) moves with it; the shard's owner then finds it
already there. The state's tensors follow, except a `step` counter that torch keeps on the
CPU for an implementation that is neither fused nor capturable. `reshare` makes a master
the shard again once both sit on one device.
"""

from __future__ import annotations

from typing import Any

import torch

from zero3.optim.precision import MasterPrecision
from zero3.params.partition import ShardedParam
from zero3.platform.pinned import pinned_copy


def move_master(master: torch.Tensor, state: dict[str, Any], group: dict[str, Any], device: torch.device,
                pin_memory: bool) -> None:
    """`master` and its `state` to `device` (pinned on the host when `pin_memory` and CUDA
    is there); `group` is the client param group it belongs to."""
    if master.device == device:
        return
    old = master.device
    with torch.no_grad():
        if pin_memory and device.type == "cpu" and torch.cuda.is_available():
            moved = pinned_copy(master.detach())
        else:
            moved = master.detach().to(device, copy=True)
        master.data = moved
    step_follows = bool(group.get("fused") or group.get("capturable"))
    for key, value in list(state.items()):
        if isinstance(value, torch.Tensor) and value.device == old and (key != "step" or step_follows):
            state[key] = value.to(device)


def reshare(sp: ShardedParam, master: torch.Tensor | None, precision: MasterPrecision) -> None:
    """A master next to its shard, of the shard's dtype, becomes the shard again (one copy,
    the master's identity kept) where `precision` lets a master be its shard."""
    if (master is not None and master is not sp.shard and not sp.aliased and sp.backing is None
            and master.dtype == sp.shard.dtype and precision.shares_storage(sp.shard, master.device)):
        with torch.no_grad():
            master.copy_(sp.shard)
        sp.adopt_shard(master)
