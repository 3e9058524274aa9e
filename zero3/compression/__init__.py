"""`deepspeed.compression`'s module-path helpers that scripts use to find and replace layers
(`zero3.compression.helper`: DeepSpeed-Chat's LoRA conversion imports them). zero3 has no
compression (quantization, pruning) itself.

May import: nothing of zero3's (plain torch). Must not import the engine, hf or the
command line.
"""

from zero3.compression import helper

__all__ = ["helper"]
