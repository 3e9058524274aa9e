"""`deepspeed.runtime.zero.partition_parameters`: the names libraries import from it."""

from ...gathered import GatheredParameters, register_external_parameter, unregister_external_parameter
from ...init import Init
from ...param_status import ZeroParamStatus, ZeroParameter

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "ZeroParameter", "register_external_parameter",
           "unregister_external_parameter"]
