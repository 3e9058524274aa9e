"""`deepspeed.runtime.zero`: GatheredParameters, Init, ZeroParamStatus and
unwrap_model_for_generation, thin over zero3's own code."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from zero3.compat.param_status import ZeroParamStatus
from zero3.engine_parts.gathered import (
    GatheredParameters,
    register_external_parameter,
    unregister_external_parameter,
)
from zero3.engine_parts.generation import gathered_for_generation
from zero3.params.init import Init


@contextmanager
def unwrap_model_for_generation(model: nn.Module) -> Iterator[nn.Module]:
    """Every parameter of the engine `model` gathered once for generation (no per-token
    collective), sharded again on exit; yields `model`. A collective on entry and exit."""
    with gathered_for_generation(model, eval_mode=False):
        yield model


__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter", "unwrap_model_for_generation"]
