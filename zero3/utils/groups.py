"""`deepspeed.utils.groups`' private getters that Transformers, Accelerate and user scripts
call for sequence parallelism (over zero3/platform/sequence_groups.py).

Without sequence parallelism the sequence-parallel world is 1 and asking for its group is
DeepSpeed's KeyError. The data-parallel and sequence-data-parallel groups are the world:
zero3 shards and averages over every rank.
"""

from __future__ import annotations

import torch.distributed as dist

from zero3.platform import sequence_groups


def _get_sequence_parallel_group() -> dist.ProcessGroup:
    groups = sequence_groups.current()
    if groups is None:
        raise KeyError("No sequence parallel group found")
    return groups.group


def _get_sequence_parallel_world_size() -> int:
    return sequence_groups.world_size()


def _get_sequence_parallel_rank() -> int:
    groups = sequence_groups.current()
    return groups.rank if groups is not None else 0


def _get_sequence_data_parallel_group() -> dist.ProcessGroup:
    return dist.group.WORLD


def _get_sequence_data_parallel_world_size() -> int:
    return dist.get_world_size()


def _get_sequence_data_parallel_rank() -> int:
    return dist.get_rank()


def _get_data_parallel_group() -> dist.ProcessGroup:
    return dist.group.WORLD


def _get_data_parallel_world_size() -> int:
    return dist.get_world_size()


def _get_data_parallel_rank() -> int:
    return dist.get_rank()


def _get_model_parallel_world_size() -> int:
    return 1
