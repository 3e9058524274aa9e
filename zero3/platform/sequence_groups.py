"""Sequence-parallel process groups: which ranks split one sequence between them.

With sequence parallelism of degree `sp`, the world's ranks are cut into blocks of `sp`
consecutive ranks (ranks `k*sp .. k*sp + sp - 1`): each block is one *sequence-parallel
group*, whose ranks hold consecutive slices of the same sequences and exchange attention
heads with all-to-alls (zero3/sequence/). The ranks with the same position in their block
form the data-parallel dimension (`world // sp` of them), each block reading its own batch.
ZeRO still shards parameters, gradients and optimizer state over the whole world (DeepSpeed's
"sequence data parallel" group is the world), and gradients are averaged over it.

This module owns the one `SequenceGroups` of the process (made once by
`initialize_sequence_parallel`, read by `current()`); the groups live until the process
group is destroyed. Every rank must call `initialize_sequence_parallel` with the same size,
as `torch.distributed.new_group` requires.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


class SequenceParallelError(ValueError):
    """A sequence-parallel degree the world cannot be split by, or a second, different one."""


@dataclass(frozen=True)
class SequenceGroups:
    """This rank's place in the sequence-parallel layout."""

    size: int                      # ranks per sequence-parallel group
    rank: int                      # this rank's index in its group
    group: dist.ProcessGroup       # its group (the block of `size` consecutive ranks)
    ranks: tuple[int, ...]         # the global ranks of that group

    @property
    def data_parallel_size(self) -> int:
        """How many groups read distinct batches: world // size."""
        return dist.get_world_size() // self.size

    @property
    def data_parallel_rank(self) -> int:
        """Which of those batches this rank's group reads."""
        return dist.get_rank() // self.size


_CURRENT: SequenceGroups | None = None


def initialize_sequence_parallel(size: int) -> SequenceGroups:
    """Make the sequence-parallel groups of degree `size` (on every rank, collectively).

    A second call with the same size returns the groups made by the first; another size is
    an error (the groups are a property of the process, as the process group is)."""
    global _CURRENT
    if not dist.is_initialized():
        raise SequenceParallelError("sequence parallelism needs the process group: call "
                                    "zero3.init_distributed() (or torch.distributed.init_process_group) first")
    world = dist.get_world_size()
    check_degree(size, world)
    if _CURRENT is not None:
        if _CURRENT.size != size:
            raise SequenceParallelError(
                f"sequence_parallel_size: the sequence-parallel groups were made with size {_CURRENT.size}, "
                f"and now {size} is asked for. Use one size per process (the config's sequence_parallel_size "
                "and the one given to register_with_transformers must agree).")
        return _CURRENT
    rank, mine = dist.get_rank(), None
    for start in range(0, world, size):
        ranks = tuple(range(start, start + size))
        group = dist.new_group(list(ranks))  # every rank takes part in making every group
        if rank in ranks:
            mine = SequenceGroups(size=size, rank=rank - start, group=group, ranks=ranks)
    _CURRENT = mine
    return mine


def check_degree(size: int, world: int) -> None:
    """`size` must be a positive whole number that divides the world."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise SequenceParallelError(f"sequence_parallel_size: must be a positive whole number (got {size!r}).")
    if world % size:
        raise SequenceParallelError(
            f"sequence_parallel_size: {size} does not divide the world size {world}. Launch a multiple of "
            f"{size} ranks, or pick a degree that divides {world}.")


def current() -> SequenceGroups | None:
    """The groups made by `initialize_sequence_parallel` (None before, or at degree 1)."""
    return _CURRENT if _CURRENT is not None and _CURRENT.size > 1 else None


def world_size() -> int:
    """The sequence-parallel degree in force (1 without sequence parallelism)."""
    groups = current()
    return groups.size if groups is not None else 1


def forget() -> None:
    """Drop the groups (the process group was destroyed; tests that build a new one)."""
    global _CURRENT
    _CURRENT = None
