"""`zero3.initialize`, with DeepSpeed's signature."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zero3.checkpointing.settings import apply_engine_config
from zero3.config import ConfigError, Zero3Config, from_deepspeed
from zero3.engine import Engine
from zero3.params.init import Init
from zero3.platform.device import choose_cuda_device, get_accelerator
from zero3.platform.process_group import init_distributed, register_exit_teardown


class InitializeArgumentError(ValueError, AssertionError):
    """A missing or unsupported initialize argument (an AssertionError too, as DeepSpeed's
    `assert model is not None` and config checks raise)."""


def initialize(args: Any = None, model: torch.nn.Module | None = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int | None = None, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Any = None, config: Any = None, config_params: Any = None, **_: Any):
    """Wrap `model` in a ZeRO-3 engine: returns (engine, optimizer, dataloader, lr_scheduler)."""
    if model is None:
        raise InitializeArgumentError("zero3.initialize needs model=")
    sequence_parallel = _sequence_parallel_of(mpu)
    config = config if config is not None else config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is None:
        raise InitializeArgumentError("zero3.initialize needs config= (a DeepSpeed config dict or a path to its JSON)")
    if not dist.is_initialized() and dist_init_required is not False:
        init_distributed()
    if dist.is_initialized():
        register_exit_teardown()
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    accelerator = get_accelerator()
    if accelerator.device_name() == "cuda":
        accelerator.set_device(choose_cuda_device())  # the device by the rule of device.py, the shard by RANK
    parsed = _parse_on_every_rank(config, world_size, sequence_parallel)
    apply_engine_config(parsed.activation_checkpointing)  # zero3.checkpointing's settings, unless configured
    with Init.paused():  # called inside zero3.Init: the model built there is adopted
        engine = Engine(model, parsed, optimizer=optimizer, model_parameters=model_parameters,
                        lr_scheduler=lr_scheduler)
    dataloader = None
    if training_data is not None:
        dataloader = _dataloader(training_data, parsed.train_micro_batch_size_per_gpu, collate_fn,
                                 parsed.dataloader_drop_last)
    client_optimizer = engine.optimizer.optimizer if engine.optimizer is not None else None
    return engine, client_optimizer, dataloader, engine.lr_scheduler


def _sequence_parallel_of(mpu: Any) -> int | None:
    """The sequence-parallel degree of DeepSpeed's `mpu` (parallel_state_sp's, which
    register_with_transformers returns); None without one. An mpu with tensor or pipeline
    parallelism is refused."""
    if mpu is None:
        return None
    if hasattr(mpu, "get_sequence_parallel_world_size") and not hasattr(mpu, "get_data_parallel_world_size"):
        return int(mpu.get_sequence_parallel_world_size())
    model_parallel = getattr(mpu, "get_model_parallel_world_size", lambda: 1)()
    raise ValueError(f"zero3.initialize: this mpu ({type(mpu).__name__}, model-parallel world size "
                     f"{model_parallel}) is a tensor/pipeline-parallel one, which zero3 does not implement. Pass "
                     "mpu=None, or the sequence-parallel mpu that UlyssesSPAttentionHF.register_with_transformers "
                     "returns.")


def _parse_on_every_rank(config: Any, world_size: int, sequence_parallel: int | None = None) -> Zero3Config:
    """The config, parsed on each rank; one rank's failure (a file missing on one machine, a
    key it refuses) is raised on every rank, here, before any other collective would wait
    for the failed rank. One small all-gather when the world has more than one rank."""
    try:
        parsed, problem = from_deepspeed(config, world_size=world_size, sequence_parallel_size=sequence_parallel), None
    except Exception as exc:  # noqa: BLE001 - re-raised below, on this rank as it was
        parsed, problem = None, exc
    if world_size > 1:
        reports: list = [None] * world_size
        dist.all_gather_object(reports, None if problem is None else f"{type(problem).__name__}: {problem}")
        failed = {rank: report for rank, report in enumerate(reports) if report is not None}
        if failed and problem is None:
            raise ConfigError("zero3.initialize: the config could not be read on "
                              + "; ".join(f"rank {rank} ({report})" for rank, report in failed.items())
                              + "; every rank must be given a readable, valid config")
    if problem is not None:
        raise problem
    return parsed


def _dataloader(dataset, micro_batch: int, collate_fn, drop_last: bool):
    sampler = None
    if dist.is_initialized() and dist.get_world_size() > 1:
        sampler = torch.utils.data.distributed.DistributedSampler(dataset)
    return torch.utils.data.DataLoader(dataset, batch_size=micro_batch, sampler=sampler,
                                       shuffle=False, collate_fn=collate_fn, drop_last=drop_last)
