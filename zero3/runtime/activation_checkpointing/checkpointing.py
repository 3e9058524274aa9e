"""`deepspeed.runtime.activation_checkpointing.checkpointing`: `zero3.checkpointing`'s names."""

from zero3.checkpointing import (
    CudaRNGStatesTracker,
    checkpoint,
    configure,
    get_cuda_rng_tracker,
    is_configured,
    model_parallel_cuda_manual_seed,
    model_parallel_reconfigure_tp_seed,
    partition_activations_in_checkpoint,
    reset,
    set_num_layers,
)

__all__ = [
    "CudaRNGStatesTracker", "checkpoint", "configure", "get_cuda_rng_tracker", "is_configured",
    "model_parallel_cuda_manual_seed", "model_parallel_reconfigure_tp_seed",
    "partition_activations_in_checkpoint", "reset", "set_num_layers",
]
