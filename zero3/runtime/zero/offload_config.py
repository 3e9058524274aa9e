"""`deepspeed.runtime.zero.offload_config`: the offload device names."""

from enum import Enum


class OffloadDeviceEnum(str, Enum):
    """Where `offload_param` / `offload_optimizer` put their tensors (zero3 refuses "nvme")."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


__all__ = ["OffloadDeviceEnum"]
