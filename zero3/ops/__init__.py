"""`deepspeed.ops`'s optimizer names (`zero3.ops.adam`), as torch optimizers."""

from zero3.ops import adam

__all__ = ["adam"]
