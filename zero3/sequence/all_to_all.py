"""The all-to-all of Ulysses sequence parallelism, differentiable.

`exchange(x, group, scatter_dim, gather_dim)`: `x` is cut into `group size` equal pieces
along `scatter_dim`; piece j goes to the group's rank j, and the pieces received from every
rank are joined along `gather_dim` in rank order. Its backward is the inverse exchange
(scatter on `gather_dim`, gather on `scatter_dim`), so gradients travel the same way back.

Ownership: the send buffer (the pieces stacked, contiguous) and the receive buffer are made
here and freed when the call returns; the result is a fresh tensor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _exchange(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    world = dist.get_world_size(group)
    if x.shape[scatter_dim] % world:
        raise ValueError(f"sequence parallelism: dimension {scatter_dim} of a {tuple(x.shape)} tensor "
                         f"does not split into {world} equal pieces")
    send = torch.stack(torch.chunk(x, world, dim=scatter_dim)).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _exchange(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _exchange(grad.contiguous(), ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def exchange(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """The differentiable all-to-all described in the module docstring."""
    return _Exchange.apply(x, group, scatter_dim, gather_dim)
