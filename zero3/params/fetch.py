"""Gather-on-use: fetch units, module hooks, holds and release.

A *fetch unit* is a module that owns a set of parameters: its own, or with `leaf`
modules (declared by the user, or chosen by the granularity threshold) all of its
descendants' too. Gathering a unit is one coalesced all-gather per dtype through the
wire (`wire.py`), whose header every rank checks (`divergence.py`).

The Fetcher owns the holds and the hooks; three collaborators own the rest:
- `GatherWire` (wire.py): the all-gathers themselves, synchronous and prefetched;
- `AccessDiscovery` (discovery.py): the tracked parameter dicts that report reads, the
  structure check, the saved-tensor safety net;
- `LookAhead` (lookahead.py): prefetch and reuse holds, from the schedule (schedule.py).

Holds: a parameter stays FULL while anything holds it; the last drop releases it (unless
it is persistent). Holders are
- a running forward *call* of a unit (a stack, so nested and repeated calls are fine),
- a call in backward, from its pre-backward hook (on the call's outputs) to its
  post-backward (an autograd function on the call's inputs); one per call, so a module
  applied to several inputs keeps its parameters until the last of those calls is done,
- a unit's *recompute* holds: parameters gathered while activation checkpointing runs the
  unit's forward again inside backward, kept until the unit's backward is done,
- the *loose* holds: parameters needed in backward outside any unit (and the safety net's
  late gathers), dropped when the backward pass (graph task) that took them ends,
- *escaped* parameters: a parameter returned in the root's output, kept until the end of
  the next backward (or the next forward), since the caller may compute with it,
- the look-ahead's spare holds, handed over to the first holder that acquires.
A parameter returned from an inner unit's forward is handed to the calling unit, and
registered as that unit's external, so its backward gathers it too.

Discovery: while the model runs (root forward, or a backward pass), every read of a
parameter registers it on the running unit, whatever its state, and gathers it if it is
SHARDED. The registration is remembered: the unit's pre-backward and later forwards
gather its externals with it. The order of units is only a hint, never asserted.

Structure: assignments after initialize are noticed (discovery.py); the next root forward
hands the model to `on_structure_change` (the engine's late_params.py, which keeps
parameters it does not manage whole and names them once) and watches the new modules too.

Leaf units and gradients: inside a leaf, which parameters get gradients (and in which
order) may differ between ranks. When `on_leaf_backward` is given, it is called with the
leaf's parameters at a point that is the same on every rank (each leaf call's
post-backward, or the end of the backward pass), so that the gradient reducer can reduce
them in their fixed order, with zeros for the ones a rank did not use.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from zero3.params.discovery import AccessDiscovery
from zero3.params.divergence import GatherGuard, Names, Phase, Site
from zero3.params.fetch_unit import FetchUnit
from zero3.params.lookahead import LookAhead
from zero3.params.partition import ParamState, ShardedParam
from zero3.params.schedule import PrefetchPolicy, Schedule
from zero3.params.wire import GatherWire, group_by_dtype
from zero3.platform.collectives import Communicator


@dataclasses.dataclass(eq=False)
class Call:
    """One forward call of a unit: what it holds in forward, and in its backward."""

    unit: FetchUnit | None
    holds: list[ShardedParam] = dataclasses.field(default_factory=list)
    held_ids: set[int] = dataclasses.field(default_factory=set)
    backward_task: int = -1  # the graph task running this call's backward, -1 for none
    backward_holds: list[ShardedParam] = dataclasses.field(default_factory=list)

    def hold(self, sp: ShardedParam) -> bool:
        """Record a hold; False if this call already holds `sp`."""
        if id(sp) in self.held_ids:
            return False
        self.held_ids.add(id(sp))
        self.holds.append(sp)
        return True



def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


def current_task() -> int:
    return torch._C._current_graph_task_id()


def unwinding() -> bool:
    """True inside an `except` block: a forward is being aborted by an exception."""
    return sys.exc_info()[0] is not None


def output_tensors(value: Any) -> list[torch.Tensor]:
    """Tensors inside a module's output: tensors, containers, dataclasses, ModelOutputs."""
    found: list[torch.Tensor] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            stack.extend(getattr(item, f.name) for f in dataclasses.fields(item))
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return found


class _PostBackward(torch.autograd.Function):
    """Identity on a call's inputs; its backward runs once the call's backward is done."""

    @staticmethod
    def forward(ctx, fetcher: "Fetcher", call: Call, *tensors: torch.Tensor):
        ctx.fetcher, ctx.call = fetcher, call
        return tensors if len(tensors) != 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.fetcher.post_backward(ctx.call)
        return (None, None) + grads


class Fetcher:
    """Owns the units, the hooks on them, and every hold on (and release of) parameters."""

    def __init__(
        self,
        root: nn.Module,
        table: dict[nn.Parameter, ShardedParam],
        units: list[FetchUnit],
        comm: Communicator,
        compute_device: torch.device,
        on_backward_end: Callable[[], None],
        on_leaf_backward: Callable[[list[ShardedParam]], None] | None = None,
        policy: PrefetchPolicy = PrefetchPolicy(),
        shard_fence: Callable[[list[ShardedParam]], None] | None = None,
        on_structure_change: Callable[[nn.Module], object] | None = None,
    ) -> None:
        """`shard_fence(group)`: called before a group's shards are read for a gather (an
        optimizer update running behind the forward publishes them one sub-group at a time).
        `on_structure_change(root)`: called at the next root forward after a module or
        parameter was assigned (late_params.py keeps unmanaged ones whole)."""
        self.root = root
        self.table = table
        self.units = units
        self.comm = comm
        self.on_backward_end = on_backward_end
        self.on_leaf_backward = on_leaf_backward
        self.on_structure_change = on_structure_change
        self.stack: list[Call] = []
        self.loose: list[tuple[int, ShardedParam]] = []  # (graph task, parameter)
        self.escaped: list[ShardedParam] = []
        self.forward_depth = 0
        self.root_forwards = 0  # root forwards begun (compiled.py: a unit's first one runs eagerly)
        self.discoveries = 0
        self.forward_order: list[str] = []
        self._saved_hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._open_tasks: set[int] = set()
        self._backward_calls: dict[int, Call] = {}  # id(call) -> call whose backward runs
        self._recomputed: dict[int, FetchUnit] = {}  # units holding recompute holds
        self._handles: list[Any] = []
        self.schedule = Schedule(log_departures=policy.log_departures)
        # False while every parameter is held (gathered_for_generation): forwards are then not
        # recorded in the divergence trace or the schedule, since ranks may run different numbers.
        self.tracking = True
        self._root_unit = next(u for u in units if u.module is root)
        # World size 1 with every parameter resident (aliased to its shard): nothing is
        # ever gathered, so only the root's hooks run (structure checks, backward end);
        # no per-module hook, access registration or saved-tensor hook.
        self.all_resident = not comm.active and all(sp.persistent for sp in table.values())
        names = Names(root, [u.name for u in units], [sp.name for sp in table.values()])
        self.guard = GatherGuard(names, comm.gather_objects, comm.rank, comm.world_size)
        param_index = {id(sp): i for i, sp in enumerate(table.values())}
        self.wire = GatherWire(comm, compute_device, self.guard, param_index,
                               any(sp.shard.device.type == "cpu" or sp.backing is not None for sp in table.values()),
                               shard_fence)
        self.lookahead = LookAhead(units, self.schedule, policy, self.wire, comm, self.drop)
        self.discovery = AccessDiscovery(root, table, not self.all_resident, self.on_access, self._late_use,
                                         on_structure_change)
        self.guard.seed(self._static_sites())
        self._install()

    # ---------------------------------------------------------------- counters
    @property
    def live_numel(self) -> int:
        """Elements of non-persistent parameters FULL or GATHERING."""
        return self.wire.live_numel

    @property
    def late_gathers(self) -> int:
        return self.discovery.late_gathers

    @property
    def prefetched_units(self) -> int:
        return self.lookahead.prefetched_units

    @property
    def reused_units(self) -> int:
        return self.lookahead.reused_units

    # ------------------------------------------------------------------ setup
    def _install(self) -> None:
        self.discovery.wrap_all()
        for unit in [self._root_unit] if self.all_resident else self.units:
            self._handles.append(
                unit.module.register_forward_pre_hook(self._pre_forward_hook(unit), with_kwargs=True)
            )
            self._handles.append(
                unit.module.register_forward_hook(self._post_forward_hook(unit), always_call=True)
            )

    def remove(self) -> None:
        """Undo every hook and dict replacement (the model becomes plain again)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.discovery.remove()

    def _static_sites(self) -> list[Site]:
        """The gathers of a first step if units run in the order they were built: every
        unit's forward, then every unit's backward in reverse (the root first both times)."""
        def sites(unit: FetchUnit, phase: Phase) -> list[Site]:
            return [self.wire.site(group, dtype, phase, unit.index)
                    for dtype, group in group_by_dtype(unit.fetch_list())]

        root, others = self._root_unit, [u for u in self.units if u is not self._root_unit]
        forward = [s for u in [root, *others] for s in sites(u, Phase.FORWARD)]
        backward = [s for u in [root, *reversed(others)] for s in sites(u, Phase.BACKWARD)]
        return forward + backward

    def params_in_forward_order(self) -> list[list[ShardedParam]]:
        """Each unit's parameters, the units in the order the latest training forward first
        entered them (units it did not enter follow, in module order)."""
        order: list[FetchUnit] = []
        seen: set[int] = set()
        for backward, index in self.schedule.last_entries(training=True):
            if not backward and index not in seen:
                seen.add(index)
                order.append(self.units[index])
        order += [unit for unit in self.units if unit.index not in seen]
        return [unit.fetch_list() for unit in order]

    # ------------------------------------------------------- gather / release
    def gather(self, params: Iterable[ShardedParam], phase: Phase = Phase.OTHER,
               unit: FetchUnit | None = None) -> None:
        """Make every given parameter FULL: one coalesced all-gather per dtype.

        Parameters a prefetch is gathering are completed, not gathered again."""
        params = list(params)
        self.lookahead.complete(params)
        index = unit.index if unit is not None else -1
        for dtype, group in group_by_dtype(sp for sp in params if sp.state is ParamState.SHARDED):
            self.wire.gather(group, dtype, phase, index)

    def acquire(self, params: list[ShardedParam], phase: Phase = Phase.OTHER,
                unit: FetchUnit | None = None) -> None:
        self.gather(params, phase, unit)
        for sp in params:
            sp.holds += 1
        self.lookahead.hand_over(params)

    def drop(self, params: list[ShardedParam], keep_aliases: bool = False) -> None:
        """Drop a hold on each; the last one releases it (`keep_aliases`: GatheredParameters,
        tensors taken from it keep their values, released.py)."""
        for sp in params:
            sp.holds -= 1
            if sp.holds <= 0:
                sp.holds = 0
                if not sp.persistent and sp.state is ParamState.FULL:
                    if sp.release(keep_aliases):
                        self.discovery.storage_moved(sp)
                    self.wire.live_numel -= sp.numel

    def drop_spares(self) -> None:
        """Finish the prefetches and drop the prefetch and reuse holds (between steps)."""
        self.lookahead.drop_spares()

    def release_all(self) -> None:
        """Drop every hold and release every non-persistent parameter (engine teardown)."""
        self.comm.drain()
        self.lookahead.forget()
        self.wire.live_numel = 0
        for sp in self.table.values():
            sp.holds = 0
            if not sp.persistent and sp.state is ParamState.FULL:
                sp.release()
        self.stack.clear()
        self.loose.clear()
        self.escaped.clear()
        self._backward_calls.clear()
        self._open_tasks.clear()
        for unit in self.units:
            unit.recompute_holds.clear()
        self._recomputed.clear()

    def _drop_own_holds(self) -> None:
        """Drop what this fetcher's holders still hold (after an aborted forward or backward).

        Holds taken by others (GatheredParameters) are left alone.
        """
        self.lookahead.drop_spares()
        for call in self.stack:
            self.drop(call.holds)
        self.stack.clear()
        for call in self._backward_calls.values():
            self.drop(call.backward_holds)
            call.backward_holds = []
        self._backward_calls.clear()
        self._open_tasks.clear()
        self._drop_recompute_holds()
        loose, self.loose = self.loose, []
        self.drop([sp for _, sp in loose])
        escaped, self.escaped = self.escaped, []
        self.drop(escaped)

    def _drop_recompute_holds(self, unit: FetchUnit | None = None) -> None:
        units = [unit] if unit is not None else list(self._recomputed.values())
        for u in units:
            if u.recompute_holds:
                holds, u.recompute_holds = u.recompute_holds, []
                self.drop(holds)
            self._recomputed.pop(id(u), None)

    # ------------------------------------------------------- access discovery
    def model_running(self) -> bool:
        return self.forward_depth > 0 or in_backward()

    def on_access(self, param: nn.Parameter) -> None:
        """A parameter was read through its module attribute."""
        sp = self.table.get(param)
        if sp is None or not self.model_running():
            return
        call = self.stack[-1] if self.stack else None
        unit = call.unit if call is not None else None
        if unit is not None and unit.add_external(sp):
            self.discoveries += 1
        if sp.persistent:
            return
        if call is not None:
            if call.hold(sp):
                self.acquire([sp], Phase.ACCESS, unit)
        elif in_backward() and (sp.state is not ParamState.FULL or sp.holds == 0):
            self.acquire([sp], Phase.ACCESS, None)
            self.loose.append((current_task(), sp))

    def _late_use(self, sp: ShardedParam) -> None:
        """Backward unpacked a saved view of `sp` while it was not FULL: gather it again."""
        self.acquire([sp], Phase.SAFETY_NET, None)
        self.loose.append((current_task(), sp))

    def _keep_escaping_params(self, tensors: list[torch.Tensor]) -> None:
        """A parameter (or a view of one) in a call's output stays FULL for whoever gets it.

        Inside the model it is handed to the calling unit, and registered as its
        external so that the caller's backward gathers it too; out of the root it is
        kept until the next backward ends (or the next forward begins).
        """
        for tensor in tensors:
            sp = self.discovery.owner_of(tensor)
            if sp is None or sp.persistent:
                continue
            parent = self.stack[-1] if self.stack else None
            if parent is None:
                if all(sp is not e for e in self.escaped):
                    self.acquire([sp])
                    self.escaped.append(sp)
                continue
            if parent.unit is not None and parent.unit.add_external(sp):
                self.discoveries += 1
            if parent.hold(sp):
                self.acquire([sp], Phase.ACCESS, parent.unit)

    # ------------------------------------------------------------- forward
    def _pre_forward_hook(self, unit: FetchUnit):
        def hook(module: nn.Module, args: tuple, kwargs: dict):
            return self.pre_forward(unit, args, kwargs)

        return hook

    def _post_forward_hook(self, unit: FetchUnit):
        def hook(module: nn.Module, args: tuple, output: Any):
            return self.post_forward(unit, output)

        return hook

    def pre_forward(self, unit: FetchUnit, args: tuple, kwargs: dict):
        backward = in_backward()
        root = unit is self._root_unit and not backward
        if root:
            self._begin_root_forward()
        try:
            if self.tracking:
                self.guard.enter(Phase.FORWARD, unit.index)
            call = Call(unit)
            for sp in unit.fetch_list():
                call.hold(sp)
            self.acquire(call.holds, Phase.FORWARD, unit)
            if self.tracking:
                self.schedule.enter(backward, unit.index)
                self.lookahead.prefetch()
        except BaseException:
            if root:
                self._end_root_forward()  # the post-forward will find no call to end
            raise
        self.stack.append(call)
        if not backward:
            self.forward_order.append(unit.name)
        if torch.is_grad_enabled():
            return self._wrap_inputs_for_post_backward(call, args, kwargs)
        return None

    def post_forward(self, unit: FetchUnit, output: Any) -> Any:
        call = self._pop_call(unit)
        if call is None:
            return None  # this unit's pre-forward raised: it holds nothing
        tensors = output_tensors(output)
        backward = in_backward()
        if torch.is_grad_enabled():
            self._register_pre_backward(call, tensors)
        if backward:
            # Recomputation inside backward (activation checkpointing): the values are
            # about to be used by this unit's backward, so keep them until it is done.
            unit.recompute_holds.extend(call.holds)
            self._recomputed[id(unit)] = unit
        else:
            self._keep_escaping_params(tensors)
            self.lookahead.retain(unit)
            self.drop(call.holds)
        if unit is self._root_unit and not backward:
            self._end_root_forward()
        return None

    def _pop_call(self, unit: FetchUnit) -> Call | None:
        """The innermost running call of `unit`, off the stack; None if it has none.

        Calls above it never ran their post-forward (their forward raised): their holds
        are dropped.
        """
        for depth in range(len(self.stack) - 1, -1, -1):
            if self.stack[depth].unit is unit:
                call = self.stack[depth]
                for stale in self.stack[depth + 1:]:
                    self.drop(stale.holds)
                del self.stack[depth:]
                return call
        return None

    def _begin_root_forward(self) -> None:
        if self.forward_depth == 0:
            self.root_forwards += 1
            self.forward_order = []
            if self.tracking:
                self.guard.start_forward()
            if self.discovery.structure_changed:
                self.discovery.check_structure()
            if (self.stack or self._backward_calls or self.loose or self.escaped or self._recomputed
                    or self.lookahead.busy):
                self._drop_own_holds()  # the last backward never ran, or something raised
            if self.tracking:
                self.schedule.start_step(torch.is_grad_enabled())
            self.wire.mark_shards_ready()
            if not self.all_resident:
                self._saved_hooks = self.discovery.saved_tensor_hooks()
                self._saved_hooks.__enter__()
        self.forward_depth += 1

    def _end_root_forward(self) -> None:
        self.forward_depth -= 1
        if self.forward_depth != 0:
            return
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None
        if unwinding():
            return  # no collective while an exception propagates: other ranks may not be here
        if not torch.is_grad_enabled():
            self.lookahead.drop_spares()  # no backward follows
        if torch.is_grad_enabled() and self.comm.active and self.guard.trace_unsent():
            # Units entered after the last gather (resident parameters only) must match
            # too, before gradient reductions depend on them.
            self.wire.check_in(self._root_unit.index)
        self.guard.flush()

    # ------------------------------------------------------------ backward
    def _wrap_inputs_for_post_backward(self, call: Call, args: tuple, kwargs: dict):
        flat, spec = tree_flatten((args, kwargs))
        positions = [
            i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad
        ]
        if not positions:
            return None
        wrapped = _PostBackward.apply(self, call, *(flat[i] for i in positions))
        if isinstance(wrapped, torch.Tensor):
            wrapped = (wrapped,)
        for i, tensor in zip(positions, wrapped):
            flat[i] = tensor
        return spec.unflatten(flat)

    def _register_pre_backward(self, call: Call, tensors: list[torch.Tensor]) -> None:
        hook = None
        for tensor in tensors:
            # Not on leaf tensors (a returned parameter): a hook there would outlive the graph.
            if tensor.requires_grad and tensor.grad_fn is not None:
                hook = hook or self._pre_backward_hook(call)
                tensor.register_hook(hook)

    def _pre_backward_hook(self, call: Call):
        def hook(grad: torch.Tensor) -> None:
            self.pre_backward(call)

        return hook

    def pre_backward(self, call: Call) -> None:
        task = current_task()
        if task not in self._open_tasks:
            self._open_tasks.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self.end_backward(task))
        if call.backward_task == task:
            return
        call.backward_task = task
        unit = call.unit
        self.guard.enter(Phase.BACKWARD, unit.index)
        params = unit.fetch_list()
        self.acquire(params, Phase.BACKWARD, unit)
        call.backward_holds = list(params)
        self._backward_calls[id(call)] = call
        self.schedule.enter(True, unit.index)
        self.lookahead.prefetch()

    def post_backward(self, call: Call) -> None:
        """A call's backward is done: drop its holds (and its unit's recompute holds)."""
        finished = self._finish_call(call)
        if call.unit is not None:
            self._drop_recompute_holds(call.unit)
            if finished and call.unit.leaf and self.on_leaf_backward is not None:
                self.on_leaf_backward(call.unit.params)

    def _finish_call(self, call: Call) -> bool:
        if self._backward_calls.pop(id(call), None) is None:
            return False
        holds, call.backward_holds = call.backward_holds, []
        if call.unit is not None:
            self.lookahead.retain(call.unit)
        self.drop(holds)
        return True

    def end_backward(self, task: int) -> None:
        """End of a backward pass (graph task): drop what it still holds.

        At the end of the outermost pass (not a reentrant checkpoint's inner one) the
        remaining holds go too, and gradients are finished.
        """
        self._open_tasks.discard(task)
        for call in [c for c in self._backward_calls.values() if c.backward_task == task]:
            self._finish_call(call)
            if call.unit.leaf and self.on_leaf_backward is not None:
                self.on_leaf_backward(call.unit.params)
        mine = [sp for t, sp in self.loose if t == task]
        self.loose = [(t, sp) for t, sp in self.loose if t != task]
        self.drop(mine)
        if self._open_tasks:
            return
        self._drop_recompute_holds()
        self.lookahead.drop_spares()
        escaped, self.escaped = self.escaped, []
        self.drop(escaped)
        self.guard.flush()
        self.on_backward_end()
