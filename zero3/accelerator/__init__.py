"""`deepspeed.accelerator`: `get_accelerator()` and the Accelerator it returns.

A thin adapter over `zero3.platform.device`, where the device rule lives.
"""

from zero3.platform.device import Accelerator, get_accelerator, local_rank, local_world_size

__all__ = ["Accelerator", "get_accelerator", "local_rank", "local_world_size"]
