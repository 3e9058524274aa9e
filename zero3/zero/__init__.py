"""`zero3.zero`: the names DeepSpeed scripts spell `deepspeed.zero.*`."""

from zero3.engine_parts.gathered import (
    GatheredParameters,
    register_external_parameter,
    unregister_external_parameter,
)
from zero3.params.init import Init

__all__ = ["GatheredParameters", "Init", "register_external_parameter", "unregister_external_parameter"]
