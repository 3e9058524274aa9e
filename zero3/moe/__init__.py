"""`deepspeed.moe`'s helpers that scripts call while building their optimizer groups
(`zero3.moe.utils`), with DeepSpeed's meaning for a model without experts.

zero3 has no expert parallelism (the config refuses it): DeepSpeed's MoE layer is not
provided, so no parameter is an expert one unless the script marks it as DeepSpeed's MoE
layer does, and such a parameter is refused by name where groups are built.

May import: nothing of zero3's (plain torch). Must not import the engine, hf or the
command line.
"""

from zero3.moe import utils

__all__ = ["utils"]
