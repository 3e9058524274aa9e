"""`zero3.zero`: the names DeepSpeed scripts spell `deepspeed.zero.*`."""

from ..gathered import GatheredParameters, register_external_parameter, unregister_external_parameter
from ..init import Init

__all__ = ["GatheredParameters", "Init", "register_external_parameter", "unregister_external_parameter"]
