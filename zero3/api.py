"""`zero3.initialize` and `zero3.init_distributed`, with DeepSpeed's signatures."""

from __future__ import annotations

import atexit
import datetime
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from .accelerator import get_accelerator, local_rank
from .config import from_deepspeed
from .engine import Engine


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
    if accelerator.device_name() == "cuda" and "LOCAL_RANK" in os.environ:
        accelerator.set_device(local_rank())  # the device by LOCAL_RANK, the shard by RANK
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


def initialize(args: Any = None, model: torch.nn.Module | None = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int | None = None, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Any = None, config: Any = None, config_params: Any = None, **_: Any):
    """Wrap `model` in a ZeRO-3 engine: returns (engine, optimizer, dataloader, lr_scheduler)."""
    if model is None:
        raise ValueError("zero3.initialize needs model=")
    if mpu is not None:
        raise ValueError("zero3.initialize: mpu (model parallelism) is not supported; pass mpu=None")
    config = config if config is not None else config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is None:
        raise ValueError("zero3.initialize needs config= (a DeepSpeed config dict or a path to its JSON)")
    if not dist.is_initialized() and dist_init_required is not False:
        init_distributed()
    if dist.is_initialized():
        register_exit_teardown()
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    accelerator = get_accelerator()
    if accelerator.device_name() == "cuda" and "LOCAL_RANK" in os.environ:
        accelerator.set_device(local_rank())
    parsed = from_deepspeed(config, world_size=world_size)
    engine = Engine(model, parsed, optimizer=optimizer, model_parameters=model_parameters,
                    lr_scheduler=lr_scheduler)
    dataloader = None
    if training_data is not None:
        dataloader = _dataloader(training_data, parsed.train_micro_batch_size_per_gpu, collate_fn,
                                 parsed.dataloader_drop_last)
    client_optimizer = engine.optimizer.optimizer if engine.optimizer is not None else None
    return engine, client_optimizer, dataloader, engine.lr_scheduler


def _dataloader(dataset, micro_batch: int, collate_fn, drop_last: bool):
    sampler = None
    if dist.is_initialized() and dist.get_world_size() > 1:
        sampler = torch.utils.data.distributed.DistributedSampler(dataset)
    return torch.utils.data.DataLoader(dataset, batch_size=micro_batch, sampler=sampler,
                                       shuffle=False, collate_fn=collate_fn, drop_last=drop_last)
