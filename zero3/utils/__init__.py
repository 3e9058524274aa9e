"""`deepspeed.utils`'s names, thin over zero3's own code.

The leaf-module functions (units.py), DeepSpeed's `safe_get_full_*` / `safe_set_full_*` /
`safe_get_local_*` / `safe_set_local_*` / `safe_update_full_grad_vectorized` accessors
(compat/param_access.py: their semantics, collectives and ownership are written there),
`logger` and `log_dist`; `zero3.utils.torch.required_torch_version`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch.distributed as dist

from zero3.compat.param_access import (
    get_full_fp32_param as safe_get_full_fp32_param,
)
from zero3.compat.param_access import (
    get_full_grad as safe_get_full_grad,
)
from zero3.compat.param_access import (
    get_full_optimizer_state as safe_get_full_optimizer_state,
)
from zero3.compat.param_access import (
    get_local_fp32_param as safe_get_local_fp32_param,
)
from zero3.compat.param_access import (
    get_local_grad as safe_get_local_grad,
)
from zero3.compat.param_access import (
    get_local_optimizer_state as safe_get_local_optimizer_state,
)
from zero3.compat.param_access import (
    set_full_fp32_param as safe_set_full_fp32_param,
)
from zero3.compat.param_access import (
    set_full_grad as safe_set_full_grad,
)
from zero3.compat.param_access import (
    set_full_optimizer_state as safe_set_full_optimizer_state,
)
from zero3.compat.param_access import (
    set_local_fp32_param as safe_set_local_fp32_param,
)
from zero3.compat.param_access import (
    set_local_grad as safe_set_local_grad,
)
from zero3.compat.param_access import (
    set_local_optimizer_state as safe_set_local_optimizer_state,
)
from zero3.compat.param_access import (
    update_full_grad_vectorized as safe_update_full_grad_vectorized,
)
from zero3.params.units import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)

logger = logging.getLogger("zero3")


def log_dist(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """Log `message` on the given ranks (all when None or containing -1), as DeepSpeed's."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    wanted = None if ranks is None else set(ranks)
    if wanted is None or -1 in wanted or rank in wanted:
        logger.log(level, "[Rank %d] %s", rank, message)


__all__ = [
    "get_z3_leaf_modules", "log_dist", "logger", "safe_get_full_fp32_param", "safe_get_full_grad",
    "safe_get_full_optimizer_state", "safe_get_local_fp32_param", "safe_get_local_grad",
    "safe_get_local_optimizer_state", "safe_set_full_fp32_param", "safe_set_full_grad",
    "safe_set_full_optimizer_state", "safe_set_local_fp32_param", "safe_set_local_grad",
    "safe_set_local_optimizer_state", "safe_update_full_grad_vectorized", "set_z3_leaf_module", "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix", "unset_z3_leaf_modules",
    "z3_leaf_module", "z3_leaf_parameter",
]
