"""`deepspeed.runtime.zero.utils`: the exception class scripts name in `except` clauses."""

from __future__ import annotations


class ZeRORuntimeException(Exception):
    """DeepSpeed's ZeRO runtime error. DeepSpeed raises it for a client optimizer with
    `offload_optimizer` under `zero_force_ds_cpu_optimizer` and for an elastic checkpoint
    loaded at another world size; zero3 accepts both (README, "Remaining differences"), so
    nothing in zero3 raises it: it is here so that code naming it imports."""


__all__ = ["ZeRORuntimeException"]
