"""`deepspeed.runtime.zero.offload_config`: the offload device names and the state kinds."""

from enum import Enum


class OffloadDeviceEnum(str, Enum):
    """Where `offload_param` / `offload_optimizer` put their tensors ("nvme": swap files past the host's share)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """The state kinds `engine.offload_states(include=...)` moves (engine_parts/state_offload.py)."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum"]
