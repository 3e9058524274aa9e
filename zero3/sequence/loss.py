"""The loss of whole sequences from the sequence-parallel slices' losses.

Each rank of a sequence-parallel group computes the mean loss over the non-ignored tokens of
its slice. The sequence's loss is the token-weighted mean of those: sum(loss_r * tokens_r) /
sum(tokens_r), a slice without tokens counting zero (its mean is NaN or 0). The all-gathers
are torch.distributed.nn's, differentiable: each rank's backward reaches every rank's slice
loss, so after the engine averages gradients over the world, they equal those of the same
sequences without sequence parallelism (as DeepSpeed's and HF's Trainer aggregation does).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

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
    losses = _GatherScalars.apply(loss.reshape(1), group)
    counts = _gather_counts(tokens.reshape(1), group)
    safe = torch.where(counts > 0, losses, torch.zeros_like(losses))
    return (safe * counts).sum() / counts.sum()


class _GatherScalars(torch.autograd.Function):
    """Every rank's one-element tensor, stacked in group-rank order; backward: each rank's
    element gets the sum over the group of the gradients reaching it."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        pieces = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, value.contiguous(), group=group)
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)].reshape(1), None


def _gather_counts(value: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    pieces = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, value.contiguous(), group=group)
    return torch.cat(pieces)
