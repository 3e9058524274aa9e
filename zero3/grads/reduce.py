"""Gradient hooks, bucketed reduce-scatter into shard gradients, accumulation.

When autograd has accumulated a parameter's full gradient (post-accumulate-grad hook),
the gradient is copied into the pending bucket and `param.grad` is set to None at once,
so no full gradient outlives its hook. A bucket is reduce-scattered (a sum, scaled to the mean over ranks)
when it reaches `bucket_numel` elements and at the end of every backward; each rank adds
its slice into `ShardedParam.grad_shard` (fp32, or bf16 with bf16 masters: `GradSink`), which therefore
accumulates over the micro-steps of a gradient-accumulation window.

Memory ownership: the bucket's staging buffer is owned here and lives only during a
flush; `grad_shard` tensors are placed by the sink (grads/sink.py: fresh per window on the
gradient's own device, views of one persistent pinned buffer on the host) and dropped
(set to None) by the optimizer after a step.

Collective order: buckets fill in autograd's execution order, which is the same on every
rank for the same graph, so every rank issues the same reduce-scatters in the same order.

Overlap (unless overlap_comm is false): a full bucket's reduce-scatter is asynchronous (on CUDA it runs on the process
group's own stream): backward goes on computing while it runs. The staging buffer lives
until the collective is drained (`Communicator.drain`, before the next collective or at
`flush`), when the rank's slice is added into `grad_shard`. `flush()` waits for all of
them, and for the sink's host copies: after it, every `grad_shard` is complete.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zero3.grads.sink import GradSink
from zero3.grads.usage import GradUsage
from zero3.params.partition import ShardedParam
from zero3.params.wire import group_by_dtype
from zero3.placement.devices import Placement
from zero3.platform.collectives import Communicator


class GradReducer:
    """Turns full parameter gradients into averaged shard gradients (fp32 or bf16, GradSink)."""

    def __init__(
        self,
        params: list[ShardedParam],
        comm: Communicator,
        bucket_numel: int,
        reduce_dtype: torch.dtype | None,
        placement: Placement,
        prescale: bool = False,
        predivide_factor: float = 1.0,
        overlap: bool = True,
        fence: Callable[[], None] | None = None,
        grad_dtype: torch.dtype = torch.float32,
        param_reduce_dtypes: dict[int, torch.dtype] | None = None,
    ) -> None:
        """`overlap` (DeepSpeed's overlap_comm): False waits for each bucket's
        reduce-scatter before backward goes on (less memory in flight, no overlap).
        `fence`: called before a gradient shard is written (GradSink). `grad_dtype`: the
        gradient shards' dtype (GradSink). `param_reduce_dtypes`: id(ShardedParam) -> the
        dtype its gradient is reduced in, over `reduce_dtype` (torch_autocast's
        lower_precision_safe_modules, engine_parts/autocast.py)."""
        self.comm = comm
        self.overlap = overlap
        self.prescale = prescale
        self.predivide_factor = float(predivide_factor)
        self.bucket_numel = max(int(bucket_numel), 1)
        self.reduce_dtype = reduce_dtype
        self.placement = placement
        self.sink = GradSink(params, placement, staging_bytes=4 * 2 * self.bucket_numel, fence=fence,
                             grad_dtype=grad_dtype)
        self.param_reduce_dtypes = param_reduce_dtypes or {}
        self.pending: list[tuple[ShardedParam, torch.Tensor]] = []
        self.deferred_ids: set[int] = set()
        self.deferred: dict[int, torch.Tensor] = {}
        self.pending_numel = 0
        # Gradients of a backward the engine did not start (a direct loss.backward()) are
        # divided by this as they are reduced: the accumulation divisor that
        # engine.backward puts on the loss. engine.backward sets it to 1 while it runs.
        self.backward_divisor = 1.0
        # engine.coalesce_grad_reduction: every gradient is held (summed) on its rank until
        # end_coalescing reduces them all at once.
        self.coalescing = False
        self.table = {sp.param: sp for sp in params}
        self.usage = GradUsage()  # which leaf parameters got a real gradient this window
        self._handles = [
            sp.param.register_post_accumulate_grad_hook(self._on_grad_accumulated)
            for sp in params
            if sp.requires_grad
        ]

    def _accumulate_unsharded(self, group: list[tuple[ShardedParam, torch.Tensor]]) -> None:
        """World size 1: the shard is the whole gradient (shard_numel == numel); no
        staging, nothing but the fp32 accumulation itself."""
        divisor = self.backward_divisor
        self.sink.deliver_many([(sp, (grad if divisor == 1.0 else grad / divisor).reshape(-1)) for sp, grad in group])

    def _pre_scale(self, staging: torch.Tensor) -> None:
        """DeepSpeed's prescale_gradients / gradient_predivide_factor: divide before the
        sum (less overflow risk in 16-bit), multiply the rest after, so the result is
        always the mean over ranks."""
        if self.prescale:
            staging.div_(self.comm.world_size)
        elif self.predivide_factor != 1.0:
            staging.mul_(1.0 / self.predivide_factor)

    def _post_scale(self, reduced: torch.Tensor, divisor: float) -> None:
        """After the sum: the rest of the mean over ranks, and `divisor` (backward_divisor
        when the bucket was reduced)."""
        factor = 1.0 if self.prescale else self.predivide_factor / self.comm.world_size
        factor /= divisor
        if factor != 1.0:
            reduced.mul_(factor)

    def remove(self) -> None:
        """Hooks off, the sink's add worker stopped (engine.destroy)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.sink.close()

    def clear(self) -> None:
        """Forget every gradient not yet reduced (engine.zero_grad)."""
        self.comm.drain()
        self.sink.finish()
        self.pending.clear()
        self.pending_numel = 0
        self.deferred.clear()
        self.usage.reset()

    def defer(self, params: list[ShardedParam]) -> None:
        """Gradients of these parameters (a leaf unit's) wait for `reduce_deferred`.

        Inside a leaf, which parameters get gradients, and in which order, may differ
        between ranks (MoE routing); reducing them as they arrive would pair different
        parameters in one collective. They are held (summed) until the leaf's backward is
        done, then reduced together in their fixed order.
        """
        self.deferred_ids.update(id(sp) for sp in params)
        self.usage.add_leaf_params(params)

    def reduce_deferred(self, params: list[ShardedParam], held_only: bool = True,
                        zeros_dtype: torch.dtype | None = None) -> None:
        """Reduce a leaf's gradients in the leaf's parameter order, with zeros (of the
        parameter's dtype, or `zeros_dtype`: the held gradients' own) for the parameters this
        rank did not use, so every rank issues the same collectives.
        (`held_only=False`: every parameter given, not only the declared leaves'.)"""
        if self.coalescing:
            return
        for sp in params:
            if not sp.requires_grad or (held_only and id(sp) not in self.deferred_ids):
                continue
            grad = self.deferred.pop(id(sp), None)
            if grad is None:
                grad = torch.zeros(sp.shape, dtype=zeros_dtype or sp.dtype, device=sp.param.device)
            self.pending.append((sp, grad))
            self.pending_numel += sp.padded_numel
        self._reduce_pending()

    def _on_grad_accumulated(self, param: torch.nn.Parameter) -> None:
        sp = self.table[param]
        grad = param.grad
        param.grad = None
        if grad is None:
            return
        self.usage.note(sp)
        if self.coalescing:  # held in fp32 for end_coalescing, with this backward's divisor applied now
            self._hold_in_fp32(sp, grad)
            return
        if id(sp) in self.deferred_ids:
            held = self.deferred.get(id(sp))
            self.deferred[id(sp)] = grad if held is None else held + grad
            return
        self.pending.append((sp, grad))
        self.pending_numel += sp.padded_numel
        if self.pending_numel >= self.bucket_numel or self._to_host_unreduced(sp, grad):
            self._reduce_pending()

    def _hold_in_fp32(self, sp: ShardedParam, grad: torch.Tensor) -> None:
        """Add one backward's gradient into the sum held while coalescing. The sum is fp32,
        as grad_shard accumulates the uncoalesced path's reductions, so a bf16/fp16 model
        loses no precision over the window (memory: 4 bytes per element of every
        parameter with a gradient, until end_coalescing); it is reduced in fp32."""
        grad = grad.float() if grad.dtype != torch.float32 else grad
        if self.backward_divisor != 1.0:
            grad = grad / self.backward_divisor
        held = self.deferred.get(id(sp))
        self.deferred[id(sp)] = grad if held is None else held + grad

    def _to_host_unreduced(self, sp: ShardedParam, grad: torch.Tensor) -> bool:
        """World size 1 with `sp`'s gradient shard on the host: there is no collective to
        batch, so each such gradient starts its copy to the host at once, behind the rest
        of backward."""
        return (not self.comm.active and grad.device.type != "cpu"
                and self.placement.state_device(sp).type == "cpu")

    def begin_coalescing(self) -> None:
        self.flush()
        self.coalescing = True

    def end_coalescing(self) -> None:
        """Reduce every gradient held since begin_coalescing, in the parameters' fixed order
        (zeros where this rank has none, so every rank issues the same collectives)."""
        self.coalescing = False
        trainable = [sp for sp in self.table.values() if sp.requires_grad]
        held = torch.tensor([float(id(sp) in self.deferred) for sp in trainable])
        self.comm.all_reduce(held)  # a parameter no rank holds a gradient for stays without one
        divisor, self.backward_divisor = self.backward_divisor, 1.0  # applied while holding
        reduce_dtype, self.reduce_dtype = self.reduce_dtype, torch.float32  # the fp32 sums, unrounded
        per_param, self.param_reduce_dtypes = self.param_reduce_dtypes, {}
        try:
            self.reduce_deferred([sp for sp, anywhere in zip(trainable, held.tolist()) if anywhere],
                                 held_only=False, zeros_dtype=torch.float32)
            self.flush()
        finally:
            self.backward_divisor = divisor
            self.reduce_dtype = reduce_dtype
            self.param_reduce_dtypes = per_param

    def flush(self) -> None:
        """Reduce every pending gradient and wait: afterwards each `grad_shard` is complete
        (while coalescing, gradients stay held and nothing is reduced)."""
        if self.coalescing:
            return
        if self.deferred:  # leaf gradients whose reduce point never came: in their fixed order
            leftovers = [sp for sp in self.table.values() if id(sp) in self.deferred]
            self.reduce_deferred(leftovers)
        self._reduce_pending()
        self.comm.drain()
        self.sink.finish()

    def _reduce_pending(self) -> None:
        """Start the reduce-scatter of the pending bucket, one collective per gradient dtype."""
        if not self.pending:
            return
        pending, self.pending, self.pending_numel = self.pending, [], 0
        for dtype, group in group_by_dtype(pending, self._reduce_dtype_of):
            self._reduce_group(group, dtype)

    def _reduce_dtype_of(self, item: tuple[ShardedParam, torch.Tensor]) -> torch.dtype:
        """The dtype `item`'s gradient is reduced in: its parameter's own (torch_autocast), else
        `reduce_dtype`, else the gradient's."""
        return self.param_reduce_dtypes.get(id(item[0])) or self.reduce_dtype or item[1].dtype

    def _reduce_group(self, group: list[tuple[ShardedParam, torch.Tensor]], dtype: torch.dtype) -> None:
        if not self.comm.active:
            self._accumulate_unsharded(group)
            return
        world = self.comm.world_size
        total = sum(sp.shard_numel for sp, _ in group)
        device = group[0][1].device
        staging = torch.zeros(world, total, dtype=dtype, device=device)
        offset = 0
        for sp, grad in group:
            sp.pack_rows(grad, staging[:, offset:offset + sp.shard_numel])
            offset += sp.shard_numel
        reduced = torch.empty(total, dtype=dtype, device=device)
        self._pre_scale(staging)
        params = [sp for sp, _ in group]
        del group  # the full gradients are in `staging` now: free them before the collective ends
        divisor = self.backward_divisor
        self.comm.reduce_scatter_sum_async(
            reduced, staging.view(-1), lambda: self._accumulate_reduced(params, reduced, staging, divisor))
        if not self.overlap:
            self.comm.drain()

    def _accumulate_reduced(self, params: list[ShardedParam], reduced: torch.Tensor,
                            staging: torch.Tensor, divisor: float) -> None:
        """The bucket's reduce-scatter is done: add this rank's slice into each `grad_shard`.

        `staging` is only kept alive until here (the collective reads it).
        """
        del staging
        self._post_scale(reduced, divisor)
        pieces, offset = [], 0
        for sp in params:
            pieces.append((sp, reduced[offset:offset + sp.shard_numel]))
            offset += sp.shard_numel
        self.sink.deliver_many(pieces)
