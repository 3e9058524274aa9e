"""`deepspeed.runtime.activation_checkpointing`: DeepSpeed's module path of
`zero3.checkpointing` (as `checkpointing`)."""

from zero3.runtime.activation_checkpointing import checkpointing

__all__ = ["checkpointing"]
