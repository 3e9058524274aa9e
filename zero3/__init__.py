"""zero3: a ZeRO stage 3 training engine for PyTorch with DeepSpeed's config and engine API.

    import zero3 as deepspeed
    from zero3.accelerator import get_accelerator     # or, as DeepSpeed allows, from zero3
"""

from __future__ import annotations

from zero3 import checkpointing, comm, compression, moe, ops, runtime, utils, zero
from zero3.accelerator import get_accelerator
from zero3.api import initialize
from zero3.checkpoint.errors import CheckpointError
from zero3.config import ConfigError, DeepSpeedConfigError
from zero3.engine import Engine, EngineError
from zero3.engine_parts.gathered import GatheredParameters, register_external_parameter
from zero3.engine_parts.generation import gathered_for_generation
from zero3.estimate import estimate_memory
from zero3.params.divergence import DivergenceError
from zero3.params.units import (
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
)
from zero3.placement.plan import PlacementError
from zero3.platform.process_group import add_config_arguments, init_distributed
from zero3.version import __version__
from zero3.zero import Init

DeepSpeedEngine = Engine

__all__ = [
    "CheckpointError", "ConfigError", "checkpointing", "compression", "DeepSpeedConfigError", "add_config_arguments", "comm", "ops", "runtime", "utils", "DivergenceError", "DeepSpeedEngine", "Engine", "EngineError",
    "GatheredParameters", "Init", "PlacementError", "estimate_memory", "get_accelerator", "moe",
    "gathered_for_generation", "init_distributed", "initialize",
    "register_external_parameter", "set_z3_leaf_modules", "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix", "unset_z3_leaf_modules", "zero",
]
