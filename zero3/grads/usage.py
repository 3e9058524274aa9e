"""Which trainable parameters got a gradient in an accumulation window, on any rank.

Plain PyTorch skips a parameter whose `.grad` is None at `optimizer.step()`: its state
(momentum, Adam's moments and `step`) is untouched and no weight decay is applied. DDP
keeps that for a parameter no rank used. zero3 matches it: a parameter that received no
gradient on any rank in any micro-step of the window is handed to the optimizer with
`.grad = None` (optim/masters.py).

Whether a parameter got a gradient somewhere is known without communication for most
parameters: gradients are reduce-scattered as they arrive, in the same collectives on
every rank, so `ShardedParam.grad_shard` is None on every rank exactly when no rank
produced one. The exception is a *leaf* unit's parameters (units.py, `GradReducer.defer`):
inside a leaf, ranks may use different parameters, so each rank reduces every parameter
of the leaf, with zeros for those it did not use, and a parameter that no rank used ends
up with a zero `grad_shard` on every rank. For those, each rank notes the parameters it
really got a gradient for (`note`), and the counts ride on the gradient-norm all-reduce
that the step runs anyway (`local_counts`, `unused_everywhere`): no extra collective, and
a rank reads the counts back (a host sync on a GPU) only when it reduced zeros for some
parameter itself (`has_padding`), since otherwise every parameter with a gradient shard
was used by this rank.

State: the ids of the leaf parameters noted since the last `reset` (owned here; the
gradient shards themselves are the sink's and the optimizer's, see grads/sink.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zero3.params.partition import ShardedParam


class GradUsage:
    """Per accumulation window: the leaf parameters this rank got a real gradient for."""

    def __init__(self) -> None:
        self.leaf_params: list[ShardedParam] = []
        self._leaf_ids: set[int] = set()
        self._used: set[int] = set()

    def add_leaf_params(self, params: list[ShardedParam]) -> None:
        """Trainable parameters whose gradients are reduced with zeros from the ranks that
        did not use them; added in an order that is the same on every rank."""
        for sp in params:
            if sp.requires_grad and id(sp) not in self._leaf_ids:
                self._leaf_ids.add(id(sp))
                self.leaf_params.append(sp)

    @property
    def size(self) -> int:
        """Elements this adds to the gradient-norm all-reduce (the same on every rank)."""
        return len(self.leaf_params)

    def note(self, sp: ShardedParam) -> None:
        """This rank produced a gradient for `sp` in the current window (hot path)."""
        if id(sp) in self._leaf_ids:
            self._used.add(id(sp))

    def note_restored(self) -> None:
        """After a checkpoint load inside a window: every restored gradient shard counts as
        used (a save drops the zero shards of the parameters no rank used first, see
        `drop_unused_everywhere`)."""
        self._used.update(id(sp) for sp in self.leaf_params if sp.grad_shard is not None)

    def has_padding(self) -> bool:
        """True if this rank holds a gradient shard for a leaf parameter it did not use."""
        return any(sp.grad_shard is not None and id(sp) not in self._used for sp in self.leaf_params)

    def local_counts(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """1 for each leaf parameter this rank used in the window, else 0 (summed over ranks
        by the caller's all-reduce)."""
        if len(self._used) == len(self.leaf_params):  # the usual case: no host-to-device copy
            return torch.ones(len(self.leaf_params), dtype=dtype, device=device)
        flags = [1.0 if id(sp) in self._used else 0.0 for sp in self.leaf_params]
        return torch.tensor(flags, dtype=dtype).to(device)

    def unused_everywhere(self, counts: torch.Tensor) -> list[ShardedParam]:
        """The leaf parameters with a gradient shard that no rank used, given `counts`
        (the all-reduced `local_counts`). Reads `counts` back only when this rank reduced
        zeros itself: a parameter no rank used was padded by every rank."""
        if not self.has_padding():
            return []
        used_somewhere = counts.tolist()
        return [sp for sp, count in zip(self.leaf_params, used_somewhere)
                if count == 0 and sp.grad_shard is not None]

    def drop_unused_everywhere(self, all_reduce: Callable[[torch.Tensor], None],
                               device: torch.device) -> list[ShardedParam]:
        """Outside a step (before a checkpoint is saved): drop the zero gradient shards of
        the leaf parameters no rank used, so that every shard left stands for a real
        gradient. `all_reduce` sums a tensor (on `device`, where the process group can
        reduce it) over ranks in place. A collective whenever there are leaf parameters:
        every rank calls this at the same point. Returns what was dropped."""
        if not self.leaf_params:
            return []
        counts = self.local_counts(torch.float64, device)
        all_reduce(counts)
        dropped = [sp for sp, count in zip(self.leaf_params, counts.tolist())
                   if count == 0 and sp.grad_shard is not None]
        for sp in dropped:
            sp.grad_shard = None
            sp.grad_sq_norm = None
        return dropped

    def reset(self) -> None:
        """A new window begins (after a step, or zero_grad)."""
        self._used.clear()
