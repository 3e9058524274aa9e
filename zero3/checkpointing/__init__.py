"""`deepspeed.checkpointing` (DeepSpeed's `runtime.activation_checkpointing.checkpointing`):
activation checkpointing for Megatron-style scripts.

    zero3.checkpointing.configure(mpu, deepspeed_config=cfg)   # or keyword settings
    out = zero3.checkpointing.checkpoint(block, hidden, mask)  # reentrant, RNG preserved

One file per concern: settings.py (the settings, `configure`, what each one does in zero3),
function.py (`checkpoint` on `torch.utils.checkpoint`), offload.py (cpu_checkpointing's
pinned host copies), rng.py (the device RNG tracker). Layer: DeepSpeed adapters; may import
`zero3.config` and `zero3.platform`.
"""

from __future__ import annotations

from zero3.checkpointing.function import checkpoint
from zero3.checkpointing.rng import (
    CudaRNGStatesTracker,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
    model_parallel_reconfigure_tp_seed,
)
from zero3.checkpointing.settings import configure, is_configured
from zero3.checkpointing.settings import set_number_checkpoints as set_num_layers
from zero3.checkpointing.settings import set_partition_activations as partition_activations_in_checkpoint


def reset() -> None:
    """DeepSpeed's `reset()` frees its contiguous buffers after forwards with no backward
    (evaluation); zero3 has no such buffers, so there is nothing to free."""


__all__ = [
    "CudaRNGStatesTracker", "checkpoint", "configure", "get_cuda_rng_tracker", "is_configured",
    "model_parallel_cuda_manual_seed", "model_parallel_reconfigure_tp_seed",
    "partition_activations_in_checkpoint", "reset", "set_num_layers",
]
