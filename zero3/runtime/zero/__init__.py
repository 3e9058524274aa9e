"""`deepspeed.runtime.zero`: GatheredParameters, Init, ZeroParamStatus and
unwrap_model_for_generation, thin over zero3's own code."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from ...gathered import GatheredParameters, register_external_parameter, unregister_external_parameter
from ...generation import gathered_for_generation
from ...init import Init
from ...param_status import ZeroParamStatus


@contextmanager
def unwrap_model_for_generation(model: nn.Module) -> Iterator[nn.Module]:
    """Every parameter of the engine `model` gathered once for generation (no per-token
    collective), sharded again on exit; yields `model`. A collective on entry and exit."""
    with gathered_for_generation(model, eval_mode=False):
        yield model


__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter", "unwrap_model_for_generation"]
