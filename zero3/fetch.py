"""Gather-on-use: fetch units, module hooks, access discovery, release.

A *fetch unit* is a module that owns a set of parameters: its own, or with `leaf`
modules (declared by the user, or chosen by the granularity threshold) all of its
descendants' too. Gathering a unit is one coalesced all-gather per dtype, with a small
header that every rank checks (`divergence.py`): ranks whose control flow differs raise
`DivergenceError` naming the module instead of hanging or mixing up values.

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
  the next backward (or the next forward), since the caller may compute with it.
A parameter returned from an inner unit's forward is handed to the calling unit, and
registered as that unit's external, so its backward gathers it too.

Access discovery (the seed bug's fix): every module of the model has its `_parameters`
dict replaced by `TrackedParameters`, whose `__getitem__` is what `module.weight` goes
through. While the model runs (root forward, or a backward pass), every read registers
the parameter on the running unit, whatever its state, and gathers it if it is SHARDED.
The registration is remembered: the unit's pre-backward and later forwards gather its
externals with it. Nothing here ever asserts on an order: the order of units is only a
hint.

Structure: `TrackedParameters.__setitem__` and `TrackedAssignments` (each module's
`_modules`) note any parameter or module assigned after initialize; the next root forward
then hands the model to `on_structure_change` (the engine's late_params.py, which keeps
parameters it does not manage whole and names them once) and watches the new modules
too. No cost until something changes.

Safety net: a saved-tensor hook, pushed for the root forward, remembers which saved
tensors are views of managed parameters; if backward unpacks one that is not FULL, it is
gathered again ("late gather", counted in `late_gathers`).

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

from .comm import Communicator, Pending
from .divergence import HEADER_BYTES, HEADER_WORDS, GatherGuard, Names, Phase, Site
from .partition import ParamState, ShardedParam
from .schedule import PrefetchPolicy, Schedule

LOOKAHEAD_ENTRIES = 256  # how far prefetch and reuse look into the plan (unit entries)


class TrackedParameters(dict):
    """A module's `_parameters`: reports each read of a parameter and each assignment."""

    def __init__(self, original: dict, on_access: Callable[[nn.Parameter], None],
                 on_change: Callable[[], None]) -> None:
        super().__init__(original)
        self._on_access = on_access
        self._on_change = on_change

    def __getitem__(self, name: str) -> Any:
        value = super().__getitem__(name)
        if value is not None:
            self._on_access(value)
        return value

    def __setitem__(self, name: str, value: Any) -> None:
        super().__setitem__(name, value)
        self._on_change()

    def __reduce_ex__(self, protocol: Any):
        return dict, (dict(self.items()),)  # copies and pickles are plain dicts

    def untracked(self) -> dict:
        return dict(self.items())


class TrackedAssignments(dict):
    """A module's `_modules` (or, when nothing is ever gathered, its `_parameters`):
    reports an entry assigned after initialize; reads are plain dict reads."""

    def __init__(self, original: dict, on_change: Callable[[], None]) -> None:
        super().__init__(original)
        self._on_change = on_change

    def __setitem__(self, name: str, value: Any) -> None:
        super().__setitem__(name, value)
        self._on_change()

    def __reduce_ex__(self, protocol: Any):
        return dict, (dict(self.items()),)

    def untracked(self) -> dict:
        return dict(self.items())


@dataclasses.dataclass(eq=False)
class FetchUnit:
    """A module and the parameters gathered together with it.

    `params` are owned (this unit is where they are gathered for their module);
    `externals` are parameters owned elsewhere that this unit was seen to use.
    """

    module: nn.Module
    name: str
    params: list[ShardedParam]
    index: int = -1
    leaf: bool = False
    externals: dict[int, ShardedParam] = dataclasses.field(default_factory=dict)
    recompute_holds: list[ShardedParam] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self._owned_ids = {id(sp) for sp in self.params}
        self._fetch: list[ShardedParam] | None = None
        self._fetch_numel = 0

    def owns(self, sp: ShardedParam) -> bool:
        return id(sp) in self._owned_ids

    def add_external(self, sp: ShardedParam) -> bool:
        """Register `sp` as used by this unit; False if it is owned or already known."""
        if id(sp) in self._owned_ids or id(sp) in self.externals:
            return False
        self.externals[id(sp)] = sp
        self._fetch = None
        return True

    def gather_set(self) -> list[ShardedParam]:
        return self.params + list(self.externals.values())

    def fetch_list(self) -> list[ShardedParam]:
        """The non-persistent parameters to gather for this unit (cached)."""
        if self._fetch is None:
            self._fetch = [sp for sp in self.gather_set() if not sp.persistent]
            self._fetch_numel = sum(sp.numel for sp in self._fetch)
        return self._fetch

    def fetch_numel(self) -> int:
        """Elements of `fetch_list()`."""
        self.fetch_list()
        return self._fetch_numel


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
    """Owns the units, the hooks on them and every gather and release of parameters."""

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
        on_structure_change: Callable[[nn.Module], object] | None = None,
    ) -> None:
        self.root = root
        self.table = table
        self.units = units
        self.comm = comm
        self.compute_device = compute_device
        self.on_backward_end = on_backward_end
        self.on_leaf_backward = on_leaf_backward
        self.on_structure_change = on_structure_change
        self.stack: list[Call] = []
        self.loose: list[tuple[int, ShardedParam]] = []  # (graph task, parameter)
        self.escaped: list[ShardedParam] = []
        self.forward_depth = 0
        self.late_gathers = 0
        self.discoveries = 0
        self.forward_order: list[str] = []
        self._param_index = {id(sp): i for i, sp in enumerate(table.values())}
        self._storage_owner: dict[int, ShardedParam] = {}
        self._saved_hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._open_tasks: set[int] = set()
        self._backward_calls: dict[int, Call] = {}  # id(call) -> call whose backward runs
        self._recomputed: dict[int, FetchUnit] = {}  # units holding recompute holds
        self._handles: list[Any] = []
        self._wrapped: dict[int, nn.Module] = {}
        self._structure_changed = False
        self.policy = policy
        self.schedule = Schedule(log_departures=policy.log_departures)
        # False while every parameter is held (gathered_for_generation): forwards are then not
        # recorded in the divergence trace or the schedule, since ranks may run different numbers.
        self.tracking = True
        self.live_numel = 0  # elements of non-persistent parameters FULL or GATHERING
        self._init_prefetch_state()
        self._side_stream = torch.cuda.Stream(compute_device) if compute_device.type == "cuda" else None
        self._shards_ready: torch.cuda.Event | None = None
        # Called with a group before its shards are read for a gather: an optimizer update
        # running behind the forward (host_step.py) publishes shards one sub-group at a time.
        self.shard_fence: Callable[[list[ShardedParam]], None] | None = None
        self._shards_on_host = self._side_stream is not None and any(
            sp.shard.device.type == "cpu" for sp in table.values())
        self._root_unit = next(u for u in units if u.module is root)
        # World size 1 with every parameter resident (aliased to its shard): nothing is
        # ever gathered, so only the root's hooks run (structure checks, backward end);
        # no per-module hook, access registration or saved-tensor hook.
        self.all_resident = comm.world_size == 1 and all(sp.persistent for sp in table.values())
        names = Names(root, [u.name for u in units], [sp.name for sp in table.values()])
        self.guard = GatherGuard(names, comm.gather_objects, comm.rank, comm.world_size)
        self.guard.seed(self._static_sites())
        self._install()

    # ------------------------------------------------------------------ setup
    def _init_prefetch_state(self) -> None:
        # one hold each, taken by a prefetch (True) or kept for reuse (False)
        self._spare: dict[int, tuple[ShardedParam, bool]] = {}
        self._inflight: dict[int, Pending] = {}  # id(sp) -> the prefetch gathering it
        self._ahead_numel = 0  # elements prefetched and not yet used
        self.prefetched_units = 0
        self.reused_units = 0

    def _install(self) -> None:
        for sp in self.table.values():
            self._storage_owner[sp.param.untyped_storage()._cdata] = sp
        for module in self.root.modules():
            self._wrap(module)
        for unit in [self._root_unit] if self.all_resident else self.units:
            self._handles.append(
                unit.module.register_forward_pre_hook(self._pre_forward_hook(unit), with_kwargs=True)
            )
            self._handles.append(
                unit.module.register_forward_hook(self._post_forward_hook(unit), always_call=True)
            )

    def _wrap(self, module: nn.Module) -> None:
        if id(module) in self._wrapped:
            return
        if self.all_resident:  # no access needs noticing: parameter reads stay plain dict reads
            module._parameters = TrackedAssignments(module._parameters, self._note_change)
        else:
            module._parameters = TrackedParameters(module._parameters, self.on_access, self._note_change)
        module._modules = TrackedAssignments(module._modules, self._note_change)
        self._wrapped[id(module)] = module

    def remove(self) -> None:
        """Undo every hook and dict replacement (the model becomes plain again)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module in self._wrapped.values():
            if isinstance(module._parameters, (TrackedParameters, TrackedAssignments)):
                module._parameters = module._parameters.untracked()
            if isinstance(module._modules, TrackedAssignments):
                module._modules = module._modules.untracked()
        self._wrapped.clear()

    # ------------------------------------------------------- gather / release
    def gather(self, params: Iterable[ShardedParam], phase: Phase = Phase.OTHER,
               unit: FetchUnit | None = None) -> None:
        """Make every given parameter FULL: one coalesced all-gather per dtype.

        Parameters a prefetch is gathering are completed, not gathered again."""
        params = list(params)
        if self._inflight:
            for sp in params:
                pending = self._inflight.get(id(sp))
                if pending is not None:
                    self.comm.complete(pending)
        for dtype, group in self._dtype_groups(sp for sp in params if sp.state is ParamState.SHARDED):
            self._gather_group(group, dtype, phase, unit)

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

    @staticmethod
    def _dtype_groups(params: Iterable[ShardedParam]) -> list[tuple[torch.dtype, list[ShardedParam]]]:
        by_dtype: dict[torch.dtype, list[ShardedParam]] = {}
        for sp in params:
            by_dtype.setdefault(sp.dtype, []).append(sp)
        return list(by_dtype.items())

    def _site(self, group: list[ShardedParam], dtype: torch.dtype, phase: Phase,
              unit: FetchUnit | None) -> Site:
        return Site(phase, unit.index if unit is not None else -1, self._param_index.get(id(group[0]), -1),
                    len(group), sum(sp.shard_numel for sp in group) * dtype.itemsize)

    def _gather_group(self, group: list[ShardedParam], dtype: torch.dtype, phase: Phase,
                      unit: FetchUnit | None) -> None:
        """One all-gather of these shards, guarded (divergence.py): the values land in each
        parameter's own storage; the send / receive buffers are temporaries of this call."""
        site = self._site(group, dtype, phase, unit)
        if not self.comm.active:  # world size 1: the concatenated shards are the values
            values = self._concat(group, dtype, 0).view(dtype).view(1, -1)
        else:
            values = self._guarded_all_gather(site, group, dtype)
        self.live_numel += sum(sp.numel for sp in group)
        offset = 0
        for sp in group:
            sp.begin_gather()
            sp.finish_gather(values[:, offset:offset + sp.shard_numel])
            offset += sp.shard_numel

    def _guarded_all_gather(self, site: Site, group: list[ShardedParam], dtype: torch.dtype) -> torch.Tensor:
        """[world_size, elements] of every rank's shards, after the headers agreed.

        Every rank sends a payload of the predicted size (the same on every rank): its
        shards if its site is the predicted one, zeros otherwise; a shared misprediction
        costs a second all-gather with the real payload.
        """
        world = self.comm.world_size
        own = self.guard.header(site)
        predicted = self.guard.predict()
        hit = predicted == site
        if predicted is None:
            self._all_gather_headers(own)
        else:
            send = self._concat(group if hit else None, dtype, predicted.nbytes, own)
            rows = self._all_gather(send, world).view(world, -1)
            self.guard.check(rows[:, :HEADER_BYTES].contiguous().view(torch.int64), own, now=not hit)
        if not hit:
            self.guard.mispredicted += 1
            rows = self._all_gather(self._concat(group, dtype, site.nbytes), world).view(world, -1)
            self.guard.observe(site)
            return rows.view(dtype)
        self.guard.observe(site)
        return rows[:, HEADER_BYTES:].view(dtype)

    def _concat(self, group: list[ShardedParam] | None, dtype: torch.dtype, nbytes: int,
                header: list[int] | None = None) -> torch.Tensor:
        """A uint8 send buffer: [header] + the group's shards (or `nbytes` zeros if None)."""
        head = HEADER_BYTES if header is not None else 0
        if group is not None:
            nbytes = sum(sp.shard_numel for sp in group) * dtype.itemsize
            if self.shard_fence is not None:
                self.shard_fence(group)
        send = torch.empty(head + nbytes, dtype=torch.uint8, device=self.compute_device)
        if header is not None:
            send[:head].view(torch.int64).copy_(torch.tensor(header, dtype=torch.int64))
        if group is None:
            send[head:].zero_()
        elif group[0].shard.device.type == "cpu" and self.compute_device.type != "cpu":
            payload = send[head:].view(dtype)  # host shards: each copied straight into place
            offset = 0
            for sp in group:
                payload[offset:offset + sp.shard_numel].copy_(sp.shard, non_blocking=True)
                offset += sp.shard_numel
        else:
            torch.cat([sp.shard.to(self.compute_device, non_blocking=True) for sp in group],
                      out=send[head:].view(dtype))
        return send

    def _all_gather(self, send: torch.Tensor, world: int) -> torch.Tensor:
        recv = torch.empty(world * send.numel(), dtype=send.dtype, device=send.device)
        self.comm.all_gather_into(recv, send)
        return recv

    def _all_gather_headers(self, own: list[int]) -> None:
        """A header-only all-gather (fixed size), checked at once."""
        send = torch.tensor(own, dtype=torch.int64, device=self.compute_device)
        rows = self._all_gather(send, self.comm.world_size).view(self.comm.world_size, HEADER_WORDS)
        self.guard.check(rows, own, now=True)

    def _check_in(self) -> None:
        """Units entered since the last gather (resident parameters only) must match too."""
        site = Site(Phase.CHECK, self._root_unit.index, -1, 0, 0)
        own = self.guard.header(site)
        predicted = self.guard.predict()
        if predicted is None:
            self._all_gather_headers(own)
        else:
            rows = self._all_gather(self._concat(None, torch.uint8, predicted.nbytes, own), self.comm.world_size)
            rows = rows.view(self.comm.world_size, -1)
            self.guard.check(rows[:, :HEADER_BYTES].contiguous().view(torch.int64), own,
                             now=predicted != site)
        self.guard.observe(site)

    def _static_sites(self) -> list[Site]:
        """The gathers of a first step if units run in the order they were built: every
        unit's forward, then every unit's backward in reverse (the root first both times)."""
        def sites(unit: FetchUnit, phase: Phase) -> list[Site]:
            return [self._site(group, dtype, phase, unit) for dtype, group in self._dtype_groups(unit.fetch_list())]

        root, others = self._root_unit, [u for u in self.units if u is not self._root_unit]
        forward = [s for u in [root, *others] for s in sites(u, Phase.FORWARD)]
        backward = [s for u in [root, *reversed(others)] for s in sites(u, Phase.BACKWARD)]
        return forward + backward

    def acquire(self, params: list[ShardedParam], phase: Phase = Phase.OTHER,
                unit: FetchUnit | None = None) -> None:
        self.gather(params, phase, unit)
        for sp in params:
            sp.holds += 1
        if self._spare:  # a prefetch or reuse hold is handed over to this holder
            for sp in params:
                spare = self._spare.pop(id(sp), None)
                if spare is not None:
                    sp.holds -= 1
                    if spare[1]:
                        self._ahead_numel -= sp.numel

    def drop(self, params: list[ShardedParam]) -> None:
        for sp in params:
            sp.holds -= 1
            if sp.holds <= 0:
                sp.holds = 0
                if not sp.persistent and sp.state is ParamState.FULL:
                    sp.release()
                    self.live_numel -= sp.numel

    def release_all(self) -> None:
        """Drop every hold and release every non-persistent parameter (engine teardown)."""
        self.comm.drain()
        self._spare.clear()
        self._inflight.clear()
        self._ahead_numel = 0
        self.live_numel = 0
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
        self._drop_spare()
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

    # ------------------------------------------------------------- look-ahead
    def _prefetch_ahead(self) -> None:
        """Start gathering the next planned units (schedule.py): up to the policy's bucket
        of elements ahead of use, within its bound on live elements, one asynchronous
        all-gather per unit and dtype. Each prefetched parameter takes a spare hold, handed
        over when its unit is entered (or dropped at the end of the step)."""
        policy = self.policy
        if not policy.prefetches or not self.schedule.on_plan:
            return
        if not self.comm.active and not self._shards_on_host:
            return  # world size 1: only a host-to-device copy is worth starting early
        ahead = self._ahead_numel
        picked = 0
        chosen: list[tuple[FetchUnit, list[ShardedParam]]] = []
        seen: set[int] = set()
        for _, index in self.schedule.upcoming(LOOKAHEAD_ENTRIES):
            if ahead >= policy.bucket_numel:
                break
            unit = self.units[index]
            fresh = [sp for sp in unit.fetch_list() if sp.state is ParamState.SHARDED and id(sp) not in seen]
            if not fresh:
                continue
            numel = sum(sp.numel for sp in fresh)
            if chosen and ahead + numel > policy.bucket_numel:
                break
            if self.live_numel + picked + numel > policy.max_live_numel:
                break
            seen.update(id(sp) for sp in fresh)
            chosen.append((unit, fresh))
            ahead += numel
            picked += numel
        for unit, fresh in chosen:
            for dtype, group in self._dtype_groups(fresh):
                self._issue_prefetch(unit, group, dtype)
            self.prefetched_units += 1

    def _issue_prefetch(self, unit: FetchUnit, group: list[ShardedParam], dtype: torch.dtype) -> None:
        """One asynchronous, guarded all-gather of `group`; finished by `_finish_prefetch`.

        A correctly predicted site sends its header with the payload (checked when the
        gather completes); otherwise the headers are agreed first, synchronously, and the
        payload follows alone. On CUDA the send buffer is built, and the collective issued,
        on a side stream, so neither waits for the compute queued on the current stream.
        """
        header = self._prefetch_header(unit, group, dtype) if self.comm.active else None
        numel = sum(sp.numel for sp in group)
        for sp in group:
            sp.begin_gather()
            sp.holds += 1
            self._spare[id(sp)] = (sp, True)
        self.live_numel += numel
        self._ahead_numel += numel
        stream = self._side_stream
        if stream is not None:
            if self._shards_ready is not None:
                stream.wait_event(self._shards_ready)
            with torch.cuda.stream(stream):
                send = self._concat(group, dtype, 0, header)
                recv = self._receive_buffer(send)
                pending = self.comm.all_gather_into_async(
                    recv, send, lambda: self._finish_prefetch(group, dtype, send, recv, header))
        else:
            send = self._concat(group, dtype, 0, header)
            recv = self._receive_buffer(send)
            pending = self.comm.all_gather_into_async(
                recv, send, lambda: self._finish_prefetch(group, dtype, send, recv, header))
        for sp in group:
            self._inflight[id(sp)] = pending

    def _receive_buffer(self, send: torch.Tensor) -> torch.Tensor:
        """The all-gather output for `send`; at world size 1 that is `send` itself."""
        if not self.comm.active:
            return send
        return torch.empty(self.comm.world_size * send.numel(), dtype=torch.uint8, device=send.device)

    def _prefetch_header(self, unit: FetchUnit, group: list[ShardedParam], dtype: torch.dtype) -> list[int] | None:
        """The header to send with a prefetch, or None when it was agreed on beforehand."""
        site = Site(Phase.PREFETCH, unit.index, self._param_index.get(id(group[0]), -1), len(group),
                    sum(sp.shard_numel for sp in group) * dtype.itemsize)
        own = self.guard.header(site)
        predicted = self.guard.predict()
        hit = predicted == site
        if not hit:
            self._agree_headers(own, predicted)
            self.guard.mispredicted += 1
        self.guard.observe(site)
        return own if hit else None

    def _agree_headers(self, own: list[int], predicted: Site | None) -> None:
        """Exchange and check headers now (a site that was not predicted)."""
        if predicted is None:
            self._all_gather_headers(own)
            return
        rows = self._all_gather(self._concat(None, torch.uint8, predicted.nbytes, own), self.comm.world_size)
        rows = rows.view(self.comm.world_size, -1)
        self.guard.check(rows[:, :HEADER_BYTES].contiguous().view(torch.int64), own, now=True)

    def _finish_prefetch(self, group: list[ShardedParam], dtype: torch.dtype, send: torch.Tensor,
                         recv: torch.Tensor, header: list[int] | None) -> None:
        """A prefetch completed: check its headers, write the values into the parameters.

        Runs on the current stream, which `drain`/`complete` made wait for the gather; the
        buffers were allocated on the side stream and are marked used here, so the
        allocator does not hand them out again before this stream is done with them."""
        if self._side_stream is not None:
            current = torch.cuda.current_stream(recv.device)
            send.record_stream(current)
            recv.record_stream(current)
        rows = recv.view(self.comm.world_size, -1)
        if header is not None:
            self.guard.check(rows[:, :HEADER_BYTES].contiguous().view(torch.int64), header, now=False)
            rows = rows[:, HEADER_BYTES:]
        values = rows.view(dtype)
        offset = 0
        for sp in group:
            self._inflight.pop(id(sp), None)
            sp.finish_gather(values[:, offset:offset + sp.shard_numel])
            offset += sp.shard_numel

    def _retain_for_reuse(self, unit: FetchUnit) -> None:
        """Keep `unit`'s parameters gathered if the plan enters it again within the reuse
        distance (elements gathered in between), as DeepSpeed's stage3_max_reuse_distance."""
        policy = self.policy
        if (not policy.reuses or not self.schedule.on_plan or self.live_numel > policy.max_live_numel
                or not unit.fetch_list()):
            return
        distance = 0
        for _, index in self.schedule.upcoming(LOOKAHEAD_ENTRIES):
            if index == unit.index:
                for sp in unit.fetch_list():
                    if sp.state is ParamState.FULL and id(sp) not in self._spare:
                        sp.holds += 1
                        self._spare[id(sp)] = (sp, False)
                self.reused_units += 1
                return
            distance += self.units[index].fetch_numel()
            if distance > policy.reuse_distance_numel:
                return

    def drop_spares(self) -> None:
        """Finish the prefetches and drop the prefetch and reuse holds (between steps)."""
        self._drop_spare()

    def _drop_spare(self) -> None:
        """End of a step: finish the prefetches and drop every spare hold."""
        if self._inflight:
            self.comm.drain()
        if self._spare:
            spare, self._spare = self._spare, {}
            self._ahead_numel = 0
            self.drop([sp for sp, _ in spare.values()])

    # ------------------------------------------------------- access discovery
    def model_running(self) -> bool:
        return self.forward_depth > 0 or in_backward()

    def on_access(self, param: nn.Parameter) -> None:
        """A parameter was read through its module attribute."""
        if self.all_resident:
            return
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

    def _note_change(self) -> None:
        self._structure_changed = True

    def _check_structure(self) -> None:
        """Modules or parameters were assigned since the last forward: parameters zero3 does
        not manage go to `on_structure_change` (kept whole, late_params.py), and every
        module of the model is watched from now on."""
        if self.on_structure_change is not None:
            self.on_structure_change(self.root)
        for module in self.root.modules():
            self._wrap(module)
        self._structure_changed = False

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
                self._prefetch_ahead()
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
            self._retain_for_reuse(unit)
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

    def _keep_escaping_params(self, tensors: list[torch.Tensor]) -> None:
        """A parameter (or a view of one) in a call's output stays FULL for whoever gets it.

        Inside the model it is handed to the calling unit, and registered as its
        external so that the caller's backward gathers it too; out of the root it is
        kept until the next backward ends (or the next forward begins).
        """
        for tensor in tensors:
            sp = self._storage_owner.get(tensor.untyped_storage()._cdata)
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

    def _begin_root_forward(self) -> None:
        if self.forward_depth == 0:
            self.forward_order = []
            if self.tracking:
                self.guard.start_forward()
            if self._structure_changed:
                self._check_structure()
            if (self.stack or self._backward_calls or self.loose or self.escaped or self._recomputed
                    or self._spare or self._inflight):
                self._drop_own_holds()  # the last backward never ran, or something raised
            if self.tracking:
                self.schedule.start_step(torch.is_grad_enabled())
            if self._side_stream is not None:
                self._shards_ready = torch.cuda.Event()
                self._shards_ready.record()
            if not self.all_resident:
                self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
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
            self._drop_spare()  # no backward follows
        if torch.is_grad_enabled() and self.comm.active and self.guard.trace_unsent():
            # Units entered after the last gather (resident parameters only) must match
            # too, before gradient reductions depend on them.
            self._check_in()
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
        self._prefetch_ahead()

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
            self._retain_for_reuse(call.unit)
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
        self._drop_spare()
        escaped, self.escaped = self.escaped, []
        self.drop(escaped)
        self.guard.flush()
        self.on_backward_end()

    # ---------------------------------------------------- saved-tensor safety net
    def _pack(self, tensor: torch.Tensor) -> Any:
        sp = self._storage_owner.get(tensor.untyped_storage()._cdata)
        return (sp, tensor) if sp is not None else tensor

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, tuple):
            return packed
        sp, tensor = packed
        if sp.state is not ParamState.FULL:
            self.late_gathers += 1
            self.acquire([sp], Phase.SAFETY_NET, None)
            self.loose.append((current_task(), sp))
        return tensor
