"""The loss of whole sequences from the sequence-parallel slices' losses.

Each rank of a sequence-parallel group computes the mean loss over the non-ignored tokens of
its slice. The sequence's loss is the token-weighted mean of those: sum(loss_r * tokens_r) /
sum(tokens_r), a slice without tokens counting zero (its mean is NaN or 0). The all-gathers
are torch.distributed.nn's, differentiable: each rank's backward reaches every rank's slice
loss, so after the engine averages gradients over the world, they equal those of the same
sequences without sequence parallelism (as DeepSpeed's and HF's Trainer aggregation does).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn

from zero3.platform import sequence_groups

IGNORE_INDEX = -100


def sequence_parallel_loss(loss: torch.Tensor, shift_labels: torch.Tensor,
                           group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The module docstring's weighted mean over the group (`group`: the sequence-parallel
    group in force); without sequence parallelism, `loss` itself."""
    if group is None:
        groups = sequence_groups.current()
        if groups is None:
            return loss
        group = groups.group
    tokens = (shift_labels != IGNORE_INDEX).sum().to(device=loss.device, dtype=loss.dtype)
    losses = torch.stack(dist_fn.all_gather(loss.reshape(()), group=group))
    counts = torch.stack(dist_fn.all_gather(tokens.reshape(()), group=group))
    safe = torch.where(counts > 0, losses, torch.zeros_like(losses))
    return (safe * counts).sum() / counts.sum()
