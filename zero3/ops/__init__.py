"""`deepspeed.ops`'s optimizer names (`zero3.ops.adam`), as torch optimizers."""

from . import adam

__all__ = ["adam"]
