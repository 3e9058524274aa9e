"""Joining the process group: `zero3.init_distributed` (also `zero3.comm.init_distributed`).

The device comes from LOCAL_RANK and the shard from RANK, so a multi-node torchrun
launch (`--nnodes`, c10d rendezvous) works as a single-node one.
"""

from __future__ import annotations

import atexit
import datetime
import os
import time
from typing import Any

import torch.distributed as dist

from zero3.platform.device import choose_cuda_device, get_accelerator


def init_distributed(dist_backend: str | None = None, timeout: datetime.timedelta | None = None,
                     init_method: str | None = None, rank: int = -1, world_size: int = -1,
                     **_: Any) -> None:
    """Join the process group from torchrun's environment; a second call is a no-op.

    Without torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR) a single-process group
    is made, so scripts run unchanged with `python script.py`.
    """
    if dist.is_initialized():
        return
    accelerator = get_accelerator()
    backend = dist_backend or accelerator.communication_backend_name()
    if accelerator.device_name() == "cuda":
        accelerator.set_device(choose_cuda_device())  # the device by the rule of device.py, the shard by RANK
    if "RANK" not in os.environ and init_method is None and rank < 0:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
        rank, world_size = 0, 1
    kwargs: dict[str, Any] = {"backend": backend}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if init_method is not None:
        kwargs["init_method"] = init_method
    if rank >= 0:
        kwargs["rank"] = rank
    if world_size > 0:
        kwargs["world_size"] = world_size
    dist.init_process_group(**kwargs)
    register_exit_teardown()


def _destroy_process_group_at_exit() -> None:
    """Tear the process group down, and let gloo's worker threads finish, before finalization.

    A gloo worker thread drops its reference to a finished collective only once it gets the
    GIL; if the interpreter starts finalizing first, that thread is killed while it holds a
    tensor and the process aborts ("terminate called without an active exception") after
    the script has finished. Destroying the group and then waiting a moment with the GIL
    released lets the workers drop those references while Python is still alive.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    time.sleep(_EXIT_GRACE_SECONDS)


_EXIT_GRACE_SECONDS = 0.05
_exit_teardown_registered = False


def register_exit_teardown() -> None:
    """Register `_destroy_process_group_at_exit` once per process."""
    global _exit_teardown_registered
    if not _exit_teardown_registered:
        atexit.register(_destroy_process_group_at_exit)
        _exit_teardown_registered = True


def add_config_arguments(parser):
    """DeepSpeed's `add_config_arguments`: `--deepspeed` and `--deepspeed_config` (the
    latter is what `zero3.initialize(args=...)` reads when `config=` is not given)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="train with zero3")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON configuration file")
    return parser
