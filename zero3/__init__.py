"""zero3: a ZeRO stage 3 training engine for PyTorch with DeepSpeed's config and engine API.

    import zero3 as deepspeed
    from zero3.accelerator import get_accelerator
"""

from __future__ import annotations


from . import comm, ops, runtime, utils, zero
from .version import __version__
from .api import initialize
from .distributed import add_config_arguments, init_distributed
from .checkpoint import CheckpointError
from .config import ConfigError
from .engine import Engine, EngineError
from .estimate import estimate_memory
from .gathered import GatheredParameters, register_external_parameter
from .generation import gathered_for_generation
from .divergence import DivergenceError
from .units import set_z3_leaf_modules, set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix, unset_z3_leaf_modules
from .zero import Init

DeepSpeedEngine = Engine

__all__ = [
    "CheckpointError", "ConfigError", "add_config_arguments", "comm", "ops", "runtime", "utils", "DivergenceError", "DeepSpeedEngine", "Engine", "EngineError",
    "GatheredParameters", "Init", "estimate_memory", "gathered_for_generation", "init_distributed", "initialize",
    "register_external_parameter", "set_z3_leaf_modules", "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix", "unset_z3_leaf_modules", "zero",
]
