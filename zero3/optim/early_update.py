"""Host updates started in the window's last backward, exact whatever intervenes.

With the overlapped host step (optim/host_step.py) the CPU update of the host-tier sub-groups
runs behind the next forward, but none of it begins before `step()`. Here, in the window's
last backward, the gradient sink tells of each parameter whose slice was delivered
(grads/sink.py, `on_delivery`); once every parameter of a host-tier sub-group has its
gradient, the sub-group's masters and optimizer state are updated on the host-step worker at
once, while the backward goes on: *speculatively*, with the gradients unclipped and the
hyper-parameters as they were when the window's last backward began. Parameter shards are not
written (the backward may still read them): their write-back comes with `step()`, and a
sub-group whose master is its shard (fp32 compute, bf16 masters on a bf16 model) waits for it.

Exact: before a sub-group is updated early, its masters and optimizer state are copied (up to
`limit_bytes` of copies a window; sub-groups past it wait for `step()`). At `step()`
(`resolve`) an early update stands only where it is the update `step()` would make (a step
skipped for a gradient overflow drops the gradients through `zero_grad`, which puts every early
update back): the clipping coefficient is 1 (the fused kernels then divide by exactly 1, the other path
multiplies by exactly 1), the hyper-parameters are unchanged, no parameter of the sub-group
is found unused in the window (grads/usage.py) and no further slice of a gradient came after
the sub-group was updated. Otherwise its copies are put back and it is updated with the rest,
as without early updates. Leaving the window any other way (zero_grad, a checkpoint, another
backward: `abandon`) puts every early update back.

Only Adam-like optimizers (torch's SGD splits its calls by momentum-buffer age at `step()`,
optim/masters.py, so its sub-groups would not match), and not under fp16, whose gradients are
always divided by the loss scale at `step()`.

Memory ownership: the copies are this object's, from a sub-group's early update to `resolve`
or `abandon`. Threads: `delivered` runs on the thread running the backward, the updates on the
host-step worker; `resolve` and `abandon` run on the caller's thread once the worker is idle
(`stop` first, then the worker waited for).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from zero3.optim.host_step import BackgroundStep
from zero3.params.partition import ShardedParam
from zero3.placement.devices import Placement
from zero3.placement.plan import Tier


class EarlyOwner(Protocol):
    """What of the sharded optimizer (optim/masters.py) the early updates read."""

    optimizer: torch.optim.Optimizer
    params: list[ShardedParam]
    masters: list[torch.Tensor]
    placement: Placement
    background: BackgroundStep
    unit_order: Any
    precision: Any

    def sub_groups(self) -> list[list[int]]: ...

    def shadow_with(self, group: tuple[int, ...], hyper: list[dict], grad_scale: torch.Tensor | None = None
                    ) -> torch.optim.Optimizer: ...


@dataclass
class _Window:
    """One window's last backward: its host-tier sub-groups and what became of each."""

    groups: list[list[int]]  # indices into the optimizer's params
    hyper: list[dict[str, Any]]  # the client's param groups' hyper-parameters, when it began
    compared: list[dict[str, Any]]  # the same as plain values, to compare at step()
    group_of: dict[int, int] = field(default_factory=dict)  # id(ShardedParam) -> sub-group
    waiting: list[set[int]] = field(default_factory=list)  # ids still without their gradient
    submitted: set[int] = field(default_factory=set)
    started: set[int] = field(default_factory=set)
    late: set[int] = field(default_factory=set)  # another slice came after it was submitted
    saved: dict[int, list[tuple[torch.Tensor, torch.Tensor, dict | None]]] = field(default_factory=dict)
    copy_bytes: int = 0
    stopped: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class EarlyHostUpdates:
    """The early host updates of one ShardedOptimizer (see the module docstring)."""

    def __init__(self, optimizer: EarlyOwner, limit_bytes: int) -> None:
        self.optimizer = optimizer
        self.limit_bytes = max(int(limit_bytes), 0)
        self._window: _Window | None = None
        self.committed = 0  # sub-groups whose early update stood, over the run
        self.put_back = 0  # sub-groups whose early update was undone, over the run

    @property
    def enabled(self) -> bool:
        opt = self.optimizer
        fp16 = any(sp.shard.dtype == torch.float16 for sp in opt.params)  # loss-scaled: never unscaled
        return (self.limit_bytes > 0 and opt.unit_order is not None and not fp16
                and not isinstance(opt.optimizer, torch.optim.SGD) and not opt.precision.upcasts)

    # ------------------------------------------------------- the last backward
    def delivered(self, sp: ShardedParam, landed: Callable[[], None], window_ends: bool) -> None:
        """A slice of `sp`'s gradient was delivered; `landed` waits for it to be in its gradient
        shard; `window_ends`: in the window's last backward. There, starts the update of `sp`'s
        sub-group once all of it has its gradient; anywhere, marks a sub-group already
        submitted as late (its update read an incomplete gradient)."""
        window = self._window
        if window is None and window_ends:
            window = self._open()
        if window is None:
            return
        g = window.group_of.get(id(sp))
        if g is None:
            return
        if g in window.submitted:
            window.late.add(g)
            return
        if not window_ends:
            return
        window.waiting[g].discard(id(sp))
        if not window.waiting[g]:
            self._submit(window, g, landed)

    def _open(self) -> _Window | None:
        if not self.enabled:
            return None
        opt = self.optimizer
        # Host tier only, and no master that is its parameter shard (fp32 compute, or bf16 masters
        # on a bf16 model): the backward may still read a shard, so an early update writes none.
        groups = [g for g in opt.sub_groups() if opt.placement.state_tier(opt.params[g[0]]) is Tier.HOST
                  and all(opt.masters[i] is not opt.params[i].shard for i in g)]
        window = _Window(groups, hyper_parameters(opt.optimizer), _comparable(opt.optimizer))
        for g, group in enumerate(groups):
            window.waiting.append({id(opt.params[i]) for i in group})
            window.group_of.update({id(opt.params[i]): g for i in group})
        self._window = window
        return window

    def _submit(self, window: _Window, g: int, landed: Callable[[], None]) -> None:
        opt = self.optimizer
        group = window.groups[g]
        nbytes = sum(_bytes_of(opt.masters[i], opt.optimizer.state.get(opt.masters[i])) for i in group)
        if window.copy_bytes + nbytes > self.limit_bytes:
            return  # past the bound: this sub-group waits for step()
        window.copy_bytes += nbytes
        window.submitted.add(g)
        shadow = opt.shadow_with(tuple(group), window.hyper)
        opt.background.submit_early(lambda: self._update(window, g, shadow, landed))

    def _update(self, window: _Window, g: int, shadow: torch.optim.Optimizer, landed: Callable[[], None]) -> None:
        """On the worker: the sub-group's masters and state copied, then updated."""
        with window.lock:
            if window.stopped:
                return
            window.started.add(g)
        landed()
        opt = self.optimizer
        group = window.groups[g]
        state = opt.optimizer.state
        window.saved[g] = [(m, m.detach().clone(), _copy_state(state.get(m)))
                           for m in (opt.masters[i] for i in group)]
        for i in group:
            opt.masters[i].grad = opt.precision.master_grad(opt.params[i].grad_shard, opt.masters[i])
        try:
            shadow.step()
        finally:
            for i in group:
                opt.masters[i].grad = None

    # ------------------------------------------------------------ at step()
    def stop(self) -> None:
        """No early update starts from now on (those queued return at once)."""
        window = self._window
        if window is not None:
            with window.lock:
                window.stopped = True

    def resolve(self, unscaled: Callable[[], bool], unused: set[int],
                groups: set[tuple[int, ...]]) -> set[tuple[int, ...]]:
        """At `step()`, the worker idle: the sub-groups (as tuples of indices) whose early
        update stands; the others' are put back. `unscaled()`: the gradients are used as
        they are (no clipping below 1, no loss-scale divisor); `unused`: ids of parameters
        the step leaves without a gradient; `groups`: the sub-groups the step makes (an
        early sub-group that is not one of them, the unit order having changed, is put back)."""
        window, self._window = self._window, None
        if window is None or not window.started:
            return set()
        same = unscaled() and _comparable(self.optimizer.optimizer) == window.compared
        stands = set()
        for g in sorted(window.started):
            group = window.groups[g]
            if (same and g not in window.late and tuple(group) in groups
                    and not any(id(self.optimizer.params[i]) in unused for i in group)):
                stands.add(tuple(group))
                self.committed += 1
            else:
                _put_back(window.saved[g], self.optimizer.optimizer.state)
                self.put_back += 1
        return stands

    def abandon(self) -> None:
        """The window ends without `step()`: every early update put back (after the worker)."""
        window = self._window
        if window is None:
            return
        self.stop()
        self.optimizer.background.wait()
        self._window = None
        for g in sorted(window.started):
            _put_back(window.saved[g], self.optimizer.optimizer.state)
            self.put_back += 1


def unclipped(clip: float, squared_norm: torch.Tensor) -> bool:
    """Whether clipping leaves the gradients as they are: its coefficient, computed as the
    step computes it (optim/masters.py), is exactly 1 (waits for the norm)."""
    if clip <= 0:
        return True
    return float((clip / (squared_norm.sqrt() + 1e-6)).clamp(max=1.0)) == 1.0


def hyper_parameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's entries but its parameters, tensors cloned (a scheduler may change a
    tensor lr in place while an update still reads the copy)."""
    return [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in group.items() if k != "params"}
            for group in optimizer.param_groups]


def _comparable(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """`hyper_parameters` with tensors as Python values, so that two can be compared."""
    return [{k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in group.items() if k != "params"}
            for group in optimizer.param_groups]


def _bytes_of(master: torch.Tensor, state: dict | None) -> int:
    tensors = [master] + [v for v in (state or {}).values() if isinstance(v, torch.Tensor)]
    if not state:  # the first update makes the state: Adam's two moments, like the master
        tensors += [master, master]
    return sum(t.numel() * t.element_size() for t in tensors)


def _copy_state(state: dict | None) -> dict | None:
    if not state:
        return None
    return {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def _put_back(saved: list[tuple[torch.Tensor, torch.Tensor, dict | None]], state: dict) -> None:
    """Masters and state as copied (in place: every holder keeps its tensors); a state the
    early update created is removed."""
    with torch.no_grad():
        for master, copy, kept in saved:
            master.copy_(copy)
            if kept is None:
                state.pop(master, None)
                continue
            current = state[master]
            for k, v in kept.items():
                if isinstance(v, torch.Tensor) and isinstance(current.get(k), torch.Tensor):
                    current[k].copy_(v)
                else:
                    current[k] = v
