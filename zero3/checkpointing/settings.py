"""The process-wide settings of `zero3.checkpointing` (DeepSpeed's module globals), and
`configure()`, which sets them.

What each setting does in zero3:

- ``partition_activations``: DeepSpeed splits each checkpoint's saved inputs across the
  model-parallel group of the ``mpu`` and all-gathers them for the recomputation. zero3 is
  data-parallel only: with no mpu, or an mpu whose model-parallel group has one rank, there
  is nothing to split, so the setting is accepted and the inputs are kept whole (as
  DeepSpeed's split over one rank keeps them). With a larger model-parallel group it is
  refused, naming the group size.
- ``contiguous_memory_optimization`` / ``number_checkpoints``: DeepSpeed copies the partitions
  into buffers preallocated for ``number_checkpoints`` checkpoints, to keep them from
  fragmenting device memory. zero3 makes no partition copies (the saved inputs are the
  tensors autograd already holds), so there is nothing to pack: both are validated as
  DeepSpeed validates them (contiguous needs partitioning and a count) and have no other
  effect.
- ``cpu_checkpointing`` (``checkpoint_in_cpu``): the saved inputs go to pinned host memory
  (offload.py) and come back for the recomputation.
- ``synchronize_checkpoint_boundary`` (``synchronize``): the device is synchronized before and
  after each checkpoint's forward and recomputation.
- ``profile``: each forward and recomputation is timed and logged on rank 0.

The settings are one immutable ``ActivationCheckpointingConfig`` swapped whole; nothing here
holds tensors. ``configure()`` marks checkpointing configured (``is_configured()``);
``apply_engine_config`` (``zero3.initialize``) applies a config's section only while the
script has not called ``configure()``, and leaves ``is_configured()`` as it is.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any

import torch.distributed as dist

from zero3.config import (
    ActivationCheckpointingConfig,
    ConfigError,
    Zero3Config,
    activation_checkpointing_of,
    checked_activation_checkpointing,
)

logger = logging.getLogger("zero3")

_current = ActivationCheckpointingConfig()
_configured = False
_mpu: Any = None


def current() -> ActivationCheckpointingConfig:
    """The settings `checkpoint()` runs with now."""
    return _current


def is_configured() -> bool:
    """True once `configure()` has been called (DeepSpeed's meaning)."""
    return _configured


def model_parallel_world_size(mpu: Any) -> int:
    """The size of `mpu`'s (tensor) model-parallel group; 1 with no mpu."""
    if mpu is None:
        return 1
    for name in ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size"):
        if hasattr(mpu, name):
            return int(getattr(mpu, name)())
    raise ConfigError(f"checkpointing.configure: mpu {type(mpu).__name__} has neither "
                      "get_tensor_model_parallel_world_size() nor get_model_parallel_world_size(). "
                      "Pass Megatron's mpu, or None.")


def model_parallel_rank(mpu: Any) -> int:
    """This rank's index in `mpu`'s (tensor) model-parallel group; 0 with no mpu."""
    if mpu is None:
        return 0
    for name in ("get_tensor_model_parallel_rank", "get_model_parallel_rank"):
        if hasattr(mpu, name):
            return int(getattr(mpu, name)())
    return 0


def current_mpu() -> Any:
    """The mpu last given to `configure()` (None: no model parallelism)."""
    return _mpu


def _check_flag(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"checkpointing.configure: {name} must be True, False or None "
                          f"(got {value!r}). Pass a bool.")


def _overrides(args: dict[str, Any]) -> dict[str, Any]:
    """configure()'s keyword arguments that were given, by the config field they set."""
    fields = {"partition_activations": "partition_activations",
              "contiguous_checkpointing": "contiguous_memory_optimization",
              "num_checkpoints": "number_checkpoints", "checkpoint_in_cpu": "cpu_checkpointing",
              "synchronize": "synchronize_checkpoint_boundary", "profile": "profile"}
    for name, value in args.items():
        if name == "num_checkpoints":
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"checkpointing.configure: num_checkpoints must be a positive int or None "
                                  f"(got {value!r}). Pass the number of checkpointed blocks in a forward.")
        else:
            _check_flag(name, value)
    return {fields[name]: value for name, value in args.items() if value is not None}


def _from_config(deepspeed_config: Any) -> ActivationCheckpointingConfig:
    if deepspeed_config is None:
        return ActivationCheckpointingConfig()
    if isinstance(deepspeed_config, Zero3Config):
        return deepspeed_config.activation_checkpointing
    if not isinstance(deepspeed_config, (dict, str, os.PathLike)):
        raise ConfigError(f"checkpointing.configure: deepspeed_config must be a dict, a JSON path or an "
                          f"engine's config (got {type(deepspeed_config).__name__}).")
    return activation_checkpointing_of(deepspeed_config)


def _check_model_parallel(settings: ActivationCheckpointingConfig, mpu: Any) -> None:
    size = model_parallel_world_size(mpu)
    if settings.partition_activations and size > 1:
        raise ConfigError(f"checkpointing.configure: partition_activations with a model-parallel group of "
                          f"{size} ranks: zero3 has no model parallelism, so it does not split activations "
                          "across such a group. Set partition_activations false (or model parallel size 1).")


def configure(mpu_: Any, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """DeepSpeed's `deepspeed.checkpointing.configure`: start from the defaults, read the
    ``activation_checkpointing`` section of `deepspeed_config` (a dict, a JSON path, or an
    engine's ``engine.config``) if given, then apply each keyword argument that is not None.
    Invalid values raise ConfigError naming the argument; nothing changes then."""
    global _current, _configured, _mpu
    base = _from_config(deepspeed_config)
    given = _overrides({"partition_activations": partition_activations,
                        "contiguous_checkpointing": contiguous_checkpointing,
                        "num_checkpoints": num_checkpoints, "checkpoint_in_cpu": checkpoint_in_cpu,
                        "synchronize": synchronize, "profile": profile})
    settings = checked_activation_checkpointing(replace(base, **given))
    mpu = mpu_ if mpu_ is not None else _mpu
    _check_model_parallel(settings, mpu)
    _current, _configured, _mpu = settings, True, mpu
    _log(settings)


def apply_engine_config(settings: ActivationCheckpointingConfig) -> None:
    """What `zero3.initialize` does with the config's section: DeepSpeed's engine only parses
    it (a script's `configure(mpu, deepspeed_config=...)` gives it effect); zero3 applies it
    too, so the keys have their effect, unless `configure()` was called, which stays the
    authority. `is_configured()` is left as it is."""
    global _current
    if _configured or settings == _current:
        return
    _check_model_parallel(settings, _mpu)
    _current = settings
    _log(settings)


def set_partition_activations(flag: bool) -> None:
    """DeepSpeed's `partition_activations_in_checkpoint`."""
    global _current
    _check_flag("partition_activations", flag)
    settings = checked_activation_checkpointing(replace(_current, partition_activations=bool(flag)))
    _check_model_parallel(settings, _mpu)
    _current = settings


def set_number_checkpoints(count: int) -> None:
    """DeepSpeed's `set_num_layers`."""
    global _current
    _overrides({"num_checkpoints": count})
    _current = replace(_current, number_checkpoints=count)


def reset_to_defaults() -> None:
    """Back to the state before any `configure()` (for tests and new runs in one process)."""
    global _current, _configured, _mpu
    _current, _configured, _mpu = ActivationCheckpointingConfig(), False, None


def _log(settings: ActivationCheckpointingConfig) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info("zero3: activation checkpointing: partition_activations=%s cpu_checkpointing=%s "
                    "contiguous_memory_optimization=%s number_checkpoints=%s synchronize=%s profile=%s",
                    settings.partition_activations, settings.cpu_checkpointing,
                    settings.contiguous_memory_optimization, settings.number_checkpoints,
                    settings.synchronize_checkpoint_boundary, settings.profile)
