"""Tiled compute along the sequence: DeepSpeed ALST's `TiledMLP`, `SequenceTiledCompute`
(`sequence_tiled_compute`) and `TiledFusedLogitsLoss`, with DeepSpeed's signatures.

Each runs a function over slices ("tiles") of the sequence so that only one tile's
intermediates exist at a time: an MLP's 3.5x-wide activations, or one tile of logits
(a 128K vocabulary makes the full fp32 logits of 32K tokens 15.7 GiB).

The contract with the engine: a parameter's gradient is complete only after the last tile.
Here each tile's parameter gradients are taken with `torch.autograd.grad` (nothing is
accumulated into `.grad`, no gradient hook fires), summed in fp32 over the tiles, and handed
to autograd once, at the end, with `torch.autograd.backward(parameters, sums)`: each
parameter's post-accumulate-grad hook (zero3's reduce-scatter) then fires exactly once, with
the whole gradient, as it would for the untiled computation. No per-tile reduction exists.
The parameters are found in each tile's graph (every leaf tensor that requires a gradient),
so `compute_params` needs not list them; a list given is accepted for DeepSpeed's signature.

Invariant (the caller's): `fn` depends on the tiled inputs and on leaf tensors (parameters,
buffers) only, not on other tensors that require a gradient. This holds for an MLP and for
an lm_head with its loss.

Memory: the fp32 gradient sums of the parameters `fn` uses live from the first tile until
the hand-over (one MLP's or one lm_head's parameters); the input's gradient is one tensor of
the input's size, written tile by tile.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

_REDUCTIONS = ("mean", "sum")


def grad_leaves(outputs: torch.Tensor, exclude: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
    """The leaf tensors that require a gradient in `outputs`' graph, in a fixed order (the
    graph's walk order, the same on every rank for the same graph), `exclude` left out."""
    excluded = {id(t) for t in exclude}
    found, seen, stack = [], set(), [outputs.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            if id(variable) not in excluded:
                found.append(variable)
            continue
        stack.extend(next_node for next_node, _ in reversed(node.next_functions))
    return found


class GradSums:
    """fp32 sums of the parameter gradients of the tiles, handed to autograd once."""

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self.sums: dict[int, torch.Tensor] = {}

    def add(self, params: list[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
        for param, grad in zip(params, grads):
            if grad is None:
                continue
            held = self.sums.get(id(param))
            if held is None:
                self.params.append(param)
                self.sums[id(param)] = grad.float() if grad.dtype != torch.float32 else grad.clone()
            else:
                held.add_(grad)

    def scale(self, factor: float | torch.Tensor) -> None:
        for held in self.sums.values():
            held.mul_(factor)

    def hand_over(self) -> None:
        """Accumulate each sum into its parameter's `.grad` through autograd (its hooks fire
        once), in the parameter's dtype; the sums are dropped."""
        if not self.params:
            return
        grads = [self.sums[id(p)].to(p.dtype) for p in self.params]
        params, self.params, self.sums = self.params, [], {}
        torch.autograd.backward(params, grads)


def tile_backward(output: torch.Tensor, tile_input: torch.Tensor, grad_output: torch.Tensor | None,
                  sums: GradSums) -> torch.Tensor | None:
    """One tile's backward: the input's gradient (returned, None if it needs none) and the
    parameters' gradients (added into `sums`)."""
    params = grad_leaves(output, exclude=(tile_input,))
    wrt = ([tile_input] if tile_input.requires_grad else []) + params
    if not wrt:
        return None
    grads = torch.autograd.grad(output, wrt, grad_output, allow_unused=True)
    input_grad = grads[0] if tile_input.requires_grad else None
    sums.add(params, grads[1:] if tile_input.requires_grad else grads)
    return input_grad


def _detached_like(x: torch.Tensor) -> torch.Tensor:
    return x.detach().requires_grad_(x.requires_grad)


class TiledMLP(torch.autograd.Function):
    """`fn(self, x)` over tiles of `x`'s tokens (a `[batch, seq, hidden]` or `[tokens, hidden]`
    input, flattened to `[tokens, hidden]`; `fn` must treat each token on its own, as an MLP
    does), recomputed tile by tile in backward.

    `TiledMLP.apply(fn, self, x, shards, compute_params)`: the output equals `fn(self, x)`;
    only one tile's intermediates are held at a time, in forward and in backward."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, module: Any, x: torch.Tensor, shards: int,
                compute_params: Any = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        ctx.fn, ctx.module, ctx.shards = fn, module, _check_shards(shards, flat.shape[0])
        ctx.save_for_backward(x)
        with torch.no_grad():
            out = torch.cat([fn(module, tile) for tile in torch.chunk(flat, ctx.shards, dim=0)], dim=0)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):
        (x,) = ctx.saved_tensors
        flat = x.detach().reshape(-1, x.shape[-1])
        flat_grad = grad_output.reshape(-1, grad_output.shape[-1])
        x_grad = torch.zeros_like(flat) if x.requires_grad else None
        sums, offset = GradSums(), 0
        for tile in torch.chunk(flat, ctx.shards, dim=0):
            rows, tile = tile.shape[0], tile.detach().requires_grad_(x.requires_grad)
            with torch.enable_grad():
                output = ctx.fn(ctx.module, tile)
            tile_grad = tile_backward(output, tile, flat_grad[offset:offset + rows], sums)
            if x_grad is not None and tile_grad is not None:
                x_grad[offset:offset + rows] = tile_grad
            offset += rows
        sums.hand_over()
        return None, None, None if x_grad is None else x_grad.view(x.shape), None, None


def _check_shards(shards: Any, length: int) -> int:
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards: must be a positive whole number (got {shards!r}).")
    return max(1, min(shards, length))


def sequence_tiled_compute(fn: Callable, seqlen: int, shards: int, kwargs_to_shard: dict,
                           kwargs_to_pass: dict, grad_requiring_tensor_key: str,
                           compute_params: Any = None, output_unshard_dimension: int = 1,
                           output_reduction: str | None = "mean") -> torch.Tensor:
    """`fn(**kwargs_to_shard sliced on dim 1, **kwargs_to_pass)` over `shards` tiles of the
    sequence (dim 1 of every tensor in `kwargs_to_shard`), outputs concatenated on
    `output_unshard_dimension` (0: each tile's output is a scalar, stacked) and reduced by
    `output_reduction` (None, "mean" or "sum"). Only `grad_requiring_tensor_key`'s tensor
    gets a gradient (besides the parameters)."""
    if output_reduction not in (None, *_REDUCTIONS):
        raise ValueError(f"output_reduction: must be None, \"mean\" or \"sum\" (got {output_reduction!r}).")
    if grad_requiring_tensor_key not in kwargs_to_shard:
        raise ValueError(f"grad_requiring_tensor_key: {grad_requiring_tensor_key!r} is not a key of "
                         f"kwargs_to_shard ({sorted(kwargs_to_shard)}). Name the tensor to be differentiated.")
    keys = list(kwargs_to_shard)
    return SequenceTiledCompute.apply(fn, seqlen, shards, keys, list(kwargs_to_pass), grad_requiring_tensor_key,
                                      compute_params, output_unshard_dimension, output_reduction,
                                      *kwargs_to_shard.values(), *kwargs_to_pass.values())


def _reduce(stacked: torch.Tensor, reduction: str | None) -> torch.Tensor:
    if reduction == "mean":
        return stacked.mean()
    if reduction == "sum":
        return stacked.sum()
    return stacked


class SequenceTiledCompute(torch.autograd.Function):
    """The generic tiled compute behind `sequence_tiled_compute` (use that: autograd
    functions take no dicts). Tiles are slices of dim 1 of every sharded tensor."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, seqlen: int, shards: int, keys_to_shard: list, keys_to_pass: list,
                grad_key: str, compute_params: Any, unshard_dim: int, reduction: str | None, *args: Any):
        sharded = dict(zip(keys_to_shard, args[:len(keys_to_shard)]))
        passed = dict(zip(keys_to_pass, args[len(keys_to_shard):]))
        ctx.fn, ctx.grad_key, ctx.unshard_dim, ctx.reduction = fn, grad_key, unshard_dim, reduction
        ctx.shards = _check_shards(shards, sharded[grad_key].shape[1])
        ctx.sharded, ctx.passed, ctx.count = sharded, passed, len(args)
        ctx.grad_index = keys_to_shard.index(grad_key)
        with torch.no_grad():
            joined = _joined([fn(**tile, **passed) for tile in _tiles(sharded, ctx.shards)], unshard_dim)
        ctx.joined_numel = joined.numel()
        return _reduce(joined, reduction)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):
        target = ctx.sharded[ctx.grad_key]
        target_grad = torch.zeros_like(target) if target.requires_grad else None
        sums, offset, out_offset = GradSums(), 0, 0
        for index, tile in enumerate(_tiles(ctx.sharded, ctx.shards)):
            tile_input = tile[ctx.grad_key].detach().requires_grad_(target.requires_grad)
            tile[ctx.grad_key] = tile_input
            with torch.enable_grad():
                output = ctx.fn(**tile, **ctx.passed)
            grad_out = _tile_grad_output(ctx, grad_output, output, index, out_offset)
            grad = tile_backward(output, tile_input, grad_out, sums)
            rows = tile_input.shape[1]
            if target_grad is not None and grad is not None:
                target_grad[:, offset:offset + rows] = grad
            offset += rows
            out_offset += output.shape[ctx.unshard_dim] if ctx.unshard_dim and output.dim() else 0
        sums.hand_over()
        grads = [None] * ctx.count
        grads[ctx.grad_index] = target_grad
        return (None,) * 9 + tuple(grads)


def _tiles(sharded: dict, shards: int) -> list[dict]:
    length = next(iter(sharded.values())).shape[1]
    step = math.ceil(length / shards)
    return [{k: v[:, start:start + step] for k, v in sharded.items()} for start in range(0, length, step)]


def _joined(outputs: list[torch.Tensor], dim: int) -> torch.Tensor:
    return torch.stack(outputs) if dim == 0 else torch.cat(outputs, dim=dim)


def _tile_grad_output(ctx: Any, grad_output: torch.Tensor, output: torch.Tensor, index: int,
                      offset: int) -> torch.Tensor:
    """The gradient that reaches tile `index`'s output from the joined, reduced output."""
    if ctx.reduction is None:
        if ctx.unshard_dim == 0:
            return grad_output[index]
        return grad_output.narrow(ctx.unshard_dim, offset, output.shape[ctx.unshard_dim])
    share = 1.0 if ctx.reduction == "sum" else 1.0 / ctx.joined_numel
    return (grad_output * share).expand_as(output)


class TiledFusedLogitsLoss(torch.autograd.Function):
    """A loss over tiles of the sequence that never holds more than one tile of logits:
    `TiledFusedLogitsLoss.apply(fn, self, x, y, mask, shards, compute_params, output_reduction)`
    returns the "mean" or "sum" over tiles of `fn(self, x_tile, y_tile[, mask_tile])`.

    As DeepSpeed's, each tile's backward runs in forward (the logits are made once); here its
    gradients are kept, not accumulated: in backward they are scaled by the incoming gradient
    (gradient accumulation's 1/N, a loss scale) and the parameters' sums handed to autograd
    once, so the engine sees one whole, correctly scaled gradient per parameter."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, module: Any, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None,
                shards: int, compute_params: Any = None, output_reduction: str = "mean") -> torch.Tensor:
        _check_loss_inputs(x, y, mask, output_reduction)
        rows = x.shape[0] * x.shape[1]
        shards = _check_shards(shards, rows)
        flat_x, flat_y = x.detach().reshape(rows, *x.shape[2:]), y.reshape(rows, *y.shape[2:])
        flat_mask = None if mask is None else mask.reshape(rows)
        wants_grad = x.requires_grad or _any_param_requires_grad(module)
        x_grad = torch.zeros_like(flat_x) if x.requires_grad else None
        sums, losses, offset = GradSums(), [], 0
        weight = torch.tensor(1.0 / shards if output_reduction == "mean" else 1.0, dtype=torch.float32)
        for index in range(shards):
            tile_x, tile_y, tile_mask = _loss_tile(flat_x, flat_y, flat_mask, shards, index)
            tile_x.requires_grad_(x.requires_grad)
            args = (module, tile_x, tile_y) + (() if tile_mask is None else (tile_mask,))
            with torch.enable_grad():
                loss = fn(*args)
            if wants_grad and loss.requires_grad:
                grad = tile_backward(loss, tile_x, weight.to(loss.device, loss.dtype), sums)
                if x_grad is not None and grad is not None:
                    x_grad[offset:offset + tile_x.shape[0]] = grad
            losses.append(loss.detach())
            offset += tile_x.shape[0]
        ctx.sums, ctx.x_shape = sums, x.shape
        ctx.x_grad = x_grad
        return _reduce(torch.stack(losses), output_reduction)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):
        sums, x_grad = ctx.sums, ctx.x_grad
        ctx.sums = ctx.x_grad = None
        if not bool(grad_output == 1.0):
            sums.scale(grad_output.float())
            if x_grad is not None:
                x_grad = x_grad * grad_output.to(x_grad.dtype)
        sums.hand_over()
        x_grad = None if x_grad is None else x_grad.view(ctx.x_shape)
        return None, None, x_grad, None, None, None, None, None


def _any_param_requires_grad(module: Any) -> bool:
    return isinstance(module, torch.nn.Module) and any(p.requires_grad for p in module.parameters())


def _loss_tile(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None, shards: int, index: int):
    step = math.ceil(x.shape[0] / shards)
    start, stop = index * step, min((index + 1) * step, x.shape[0])
    tile_mask = None if mask is None else mask[start:stop]
    return x[start:stop].detach(), y[start:stop], tile_mask


def _check_loss_inputs(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None, reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"output_reduction: must be \"mean\" or \"sum\" (got {reduction!r}).")
    if x.dim() < 2 or y.dim() < 2:
        raise ValueError(f"x and y must be at least 2-D [batch, seq, ...] (got x {tuple(x.shape)}, "
                         f"y {tuple(y.shape)}).")
    if x.shape[:2] != y.shape[:2]:
        raise ValueError(f"x and y must agree on [batch, seq] (got {tuple(x.shape[:2])} and {tuple(y.shape[:2])}).")
    if mask is not None and tuple(mask.shape) != tuple(x.shape[:2]):
        raise ValueError(f"mask must be [batch, seq] = {tuple(x.shape[:2])} (got {tuple(mask.shape)}).")
