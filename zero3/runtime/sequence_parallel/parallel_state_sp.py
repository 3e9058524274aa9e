"""`deepspeed.runtime.sequence_parallel.parallel_state_sp`: the `mpu` that
`UlyssesSPAttentionHF.register_with_transformers` returns and `initialize(mpu=...)` takes,
over zero3/platform/sequence_groups.py. The "sequence data parallel" group is the world:
ZeRO shards and averages over every rank."""

from __future__ import annotations

import torch.distributed as dist

from zero3.platform import sequence_groups


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Make the groups (every rank, the same size), as DeepSpeed's: a degree of 1 or one
    that does not divide the world is an error."""
    if not dist.is_initialized():
        raise RuntimeError("initialize_sequence_parallel: the process group is not initialized")
    if sequence_parallel_size <= 1:
        raise ValueError(f"sequence_parallel_size must be greater than 1, got {sequence_parallel_size}")
    if dist.get_world_size() % sequence_parallel_size:
        raise RuntimeError(f"world_size ({dist.get_world_size()}) is not divisible by sequence_parallel_size "
                           f"{sequence_parallel_size}")
    sequence_groups.initialize_sequence_parallel(sequence_parallel_size)


def _groups() -> sequence_groups.SequenceGroups:
    groups = sequence_groups.current()
    if groups is None:
        raise AssertionError("sequence parallel group is not initialized")
    return groups


def get_sequence_parallel_group() -> dist.ProcessGroup:
    return _groups().group


def get_sequence_parallel_world_size() -> int:
    return _groups().size


def get_sequence_parallel_rank() -> int:
    return _groups().rank


def get_sequence_data_parallel_group() -> dist.ProcessGroup:
    return dist.group.WORLD


def get_sequence_data_parallel_world_size() -> int:
    return dist.get_world_size()


def get_sequence_data_parallel_rank() -> int:
    return dist.get_rank()


get_model_parallel_rank = get_sequence_parallel_rank
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_group = get_sequence_parallel_group
