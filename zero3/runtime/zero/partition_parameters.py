"""`deepspeed.runtime.zero.partition_parameters`: the names libraries import from it."""

from zero3.compat.param_status import ZeroParameter, ZeroParamStatus
from zero3.engine_parts.gathered import (
    GatheredParameters,
    register_external_parameter,
    unregister_external_parameter,
)
from zero3.params.init import Init

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "ZeroParameter", "register_external_parameter",
           "unregister_external_parameter"]
