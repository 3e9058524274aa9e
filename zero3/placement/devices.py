"""Where each managed parameter's two pieces live now: a tier, and so a device.

`Placement` maps every ShardedParam (by identity) to the tier of its parameter shard and
the tier of its optimizer side (gradient shard, master, optimizer state), and marks the
ones off the device whose gradient is accumulated on the device (plan.py); a tier's device
is the compute device (DEVICE) or the CPU (HOST, and NVME: a piece on NVMe is read into host
memory to step, zero3/optim/nvme_state.py). On a CPU run both tiers are the same memory,
but the tiers still decide where each piece steps (on the device tier in `step()`, on the
host tier behind the next forward), so the plan's logic runs there too.

The engine fills it from a `Plan` (engine_parts/placement.py) and changes it only between
steps, when it moves the pieces; the gradient sink, the sharded optimizer and the
checkpoint loader read it. It holds no tensors and no references to the parameters.
"""

from __future__ import annotations

from typing import Any

import torch

from zero3.placement.plan import Plan, Tier

HOST = torch.device("cpu")


class Placement:
    """Parameter-shard and optimizer-side tiers of each parameter, keyed by identity.
    A parameter it does not know (one attached after initialize) is on the device tier."""

    def __init__(self, compute_device: torch.device, plan: Plan | None = None) -> None:
        self.compute_device = compute_device
        self.plan = plan
        self._params: dict[int, Tier] = {}
        self._states: dict[int, Tier] = {}
        self._accumulate_on_device: set[int] = set()

    def device_of(self, tier: Tier) -> torch.device:
        return self.compute_device if tier is Tier.DEVICE else HOST

    def assign(self, sp: Any, params: Tier, state: Tier, accumulator: Tier | None = None) -> None:
        """`accumulator`: where the window's gradient sum lives (None: with the optimizer side)."""
        self._params[id(sp)] = params
        self._states[id(sp)] = state
        if state is not Tier.DEVICE and accumulator is Tier.DEVICE:
            self._accumulate_on_device.add(id(sp))
        else:
            self._accumulate_on_device.discard(id(sp))

    def params_tier(self, sp: Any) -> Tier:
        return self._params.get(id(sp), Tier.DEVICE)

    def state_tier(self, sp: Any) -> Tier:
        return self._states.get(id(sp), Tier.DEVICE)

    def param_device(self, sp: Any) -> torch.device:
        return self.device_of(self.params_tier(sp))

    def state_device(self, sp: Any) -> torch.device:
        """Where `sp`'s gradient shard, master and optimizer state live."""
        return self.device_of(self.state_tier(sp))

    def accumulates_on_device(self, sp: Any) -> bool:
        """`sp`'s optimizer side is off the device but its gradient is summed on the device
        until the window's last backward (grads/sink.py)."""
        return id(sp) in self._accumulate_on_device

    @property
    def any_state_on_host(self) -> bool:
        """Some optimizer side steps on the host (the host tier, or NVMe behind it)."""
        return any(tier is not Tier.DEVICE for tier in self._states.values())

    @property
    def any_state_on_nvme(self) -> bool:
        return any(tier is Tier.NVME for tier in self._states.values())

