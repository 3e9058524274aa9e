"""Gather-on-use: fetch units, module hooks, access discovery, release.

A *fetch unit* is a module that owns a set of parameters: its own, or with
`leaf` modules (declared by the user, or chosen by the granularity threshold) all of its
descendants' too. Gathering a unit is one coalesced all-gather per dtype.

Holds: a parameter stays FULL while anything holds it; the last drop releases it (unless
it is persistent). Holders are
- a running forward *activation* (one per call of a unit; a stack, so nested and
  repeated calls are fine),
- a unit in backward (from its pre-backward hook to its post-backward hook), and
- the *loose* set: parameters needed in backward outside any unit; dropped when the
  backward ends.

Access discovery (the seed bug's fix): every module whose parameters we manage has its
`_parameters` dict replaced by `TrackedParameters`, whose `__getitem__` is what
`module.weight` goes through. While the model runs (root forward, or a backward pass),
every read registers the parameter on the running unit, whatever its state, and gathers
it if it is SHARDED. The registration is remembered: the unit's pre-backward and later
forwards gather its externals with it. Nothing here ever asserts on an order: the order
of units is only a hint.

Safety net: a saved-tensor hook, pushed for the root forward, remembers which saved
tensors are views of managed parameters; if backward unpacks one that is not FULL, it is
gathered again ("late gather", counted in `late_gathers`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .comm import Communicator
from .partition import ParamState, ShardedParam


class TrackedParameters(dict):
    """A module's `_parameters`, reporting each attribute read of a managed parameter."""

    def __init__(self, original: dict, on_access: Callable[[nn.Parameter], None]) -> None:
        super().__init__(original)
        self._on_access = on_access

    def __getitem__(self, name: str) -> Any:
        value = super().__getitem__(name)
        if value is not None:
            self._on_access(value)
        return value

    def untracked(self) -> dict:
        return dict(self.items())


@dataclasses.dataclass(eq=False)
class FetchUnit:
    """A module and the parameters gathered together with it."""

    module: nn.Module
    name: str
    params: list[ShardedParam]
    externals: dict[int, ShardedParam] = dataclasses.field(default_factory=dict)
    backward_holds: list[ShardedParam] = dataclasses.field(default_factory=list)
    backward_active: bool = False

    def owns(self, sp: ShardedParam) -> bool:
        return id(sp) in self._owned_ids

    def __post_init__(self) -> None:
        self._owned_ids = {id(sp) for sp in self.params}

    def gather_set(self) -> list[ShardedParam]:
        return self.params + list(self.externals.values())


@dataclasses.dataclass(eq=False)
class Activation:
    """One running forward call of a unit and what it holds."""

    unit: FetchUnit | None
    holds: list[ShardedParam] = dataclasses.field(default_factory=list)
    held_ids: set[int] = dataclasses.field(default_factory=set)

    def hold(self, sp: ShardedParam) -> bool:
        """Record a hold; False if this activation already holds `sp`."""
        if id(sp) in self.held_ids:
            return False
        self.held_ids.add(id(sp))
        self.holds.append(sp)
        return True


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


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
    """Identity on a unit's inputs; its backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx, fetcher: "Fetcher", unit: FetchUnit, *tensors: torch.Tensor):
        ctx.fetcher, ctx.unit = fetcher, unit
        return tensors if len(tensors) != 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.fetcher.post_backward(ctx.unit)
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
    ) -> None:
        self.root = root
        self.table = table
        self.units = units
        self.comm = comm
        self.compute_device = compute_device
        self.on_backward_end = on_backward_end
        self.stack: list[Activation] = []
        self.loose: list[ShardedParam] = []
        self.forward_depth = 0
        self.late_gathers = 0
        self.discoveries = 0
        self.forward_order: list[str] = []
        self._storage_owner: dict[int, ShardedParam] = {}
        self._saved_hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._backward_callback_queued = False
        self._handles: list[Any] = []
        self._tracked: list[nn.Module] = []
        self._root_unit = next(u for u in units if u.module is root)
        self._install()

    # ------------------------------------------------------------------ setup
    def _install(self) -> None:
        for sp in self.table.values():
            self._storage_owner[sp.param.untyped_storage()._cdata] = sp
        for module in self.root.modules():
            if any(p in self.table for p in module._parameters.values() if p is not None):
                module._parameters = TrackedParameters(module._parameters, self.on_access)
                self._tracked.append(module)
        for unit in self.units:
            self._handles.append(
                unit.module.register_forward_pre_hook(self._pre_forward_hook(unit), with_kwargs=True)
            )
            self._handles.append(
                unit.module.register_forward_hook(self._post_forward_hook(unit), always_call=True)
            )

    def remove(self) -> None:
        """Undo every hook and `_parameters` replacement (the model becomes plain again)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module in self._tracked:
            if isinstance(module._parameters, TrackedParameters):
                module._parameters = module._parameters.untracked()
        self._tracked.clear()

    # ------------------------------------------------------- gather / release
    def gather(self, params: Iterable[ShardedParam]) -> None:
        """Make every given parameter FULL: one coalesced all-gather per dtype."""
        by_dtype: dict[torch.dtype, list[ShardedParam]] = {}
        for sp in params:
            if sp.state is ParamState.SHARDED:
                by_dtype.setdefault(sp.dtype, []).append(sp)
        for dtype, group in by_dtype.items():
            self._gather_group(group, dtype)

    def _gather_group(self, group: list[ShardedParam], dtype: torch.dtype) -> None:
        sizes = [sp.shard_numel for sp in group]
        total = sum(sizes)
        send = torch.cat([sp.shard.to(self.compute_device, non_blocking=True) for sp in group])
        recv = torch.empty(self.comm.world_size * total, dtype=dtype, device=self.compute_device)
        self.comm.all_gather_into(recv, send)
        rows = recv.view(self.comm.world_size, total)
        offset = 0
        for sp, size in zip(group, sizes):
            sp.begin_gather()
            sp.finish_gather(rows[:, offset:offset + size])
            offset += size

    def acquire(self, params: list[ShardedParam]) -> None:
        self.gather(params)
        for sp in params:
            sp.holds += 1

    def drop(self, params: list[ShardedParam]) -> None:
        for sp in params:
            sp.holds -= 1
            if sp.holds <= 0:
                sp.holds = 0
                if not sp.persistent and sp.state is ParamState.FULL:
                    sp.release()

    def release_all(self) -> None:
        """Drop every hold and release every non-persistent parameter (phase reset)."""
        for sp in self.table.values():
            sp.holds = 0
            if not sp.persistent and sp.state is ParamState.FULL:
                sp.release()
        self.stack.clear()
        self.loose.clear()
        for unit in self.units:
            unit.backward_holds.clear()
            unit.backward_active = False

    # ------------------------------------------------------- access discovery
    def model_running(self) -> bool:
        return self.forward_depth > 0 or in_backward()

    def on_access(self, param: nn.Parameter) -> None:
        """A managed parameter was read through its module attribute."""
        sp = self.table.get(param)
        if sp is None or not self.model_running():
            return
        activation = self.stack[-1] if self.stack else None
        unit = activation.unit if activation else None
        if unit is not None and not unit.owns(sp) and id(sp) not in unit.externals:
            unit.externals[id(sp)] = sp
            self.discoveries += 1
        if sp.persistent:
            return
        if in_backward():
            holders = unit.backward_holds if unit is not None else self.loose
            if sp.state is not ParamState.FULL or sp.holds == 0:
                self.acquire([sp])
                holders.append(sp)
        elif activation is not None and activation.hold(sp):
            self.acquire([sp])

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
        if unit is self._root_unit and not backward:
            self._begin_root_forward()
        activation = Activation(unit)
        params = [sp for sp in unit.gather_set() if not sp.persistent]
        for sp in params:
            activation.hold(sp)
        self.acquire(activation.holds)
        self.stack.append(activation)
        if not backward:
            self.forward_order.append(unit.name)
        if torch.is_grad_enabled():
            return self._wrap_inputs_for_post_backward(unit, args, kwargs)
        return None

    def post_forward(self, unit: FetchUnit, output: Any) -> Any:
        activation = self._pop_activation(unit)
        tensors = output_tensors(output)
        if torch.is_grad_enabled():
            self._register_pre_backward(unit, tensors)
        if in_backward():
            # Recomputation inside backward (activation checkpointing): the values are
            # about to be used by this unit's backward, so keep them until it ends.
            unit.backward_holds.extend(activation.holds)
        else:
            self._keep_escaping_params(activation, tensors)
            self.drop(activation.holds)
        if unit is self._root_unit and not in_backward():
            self._end_root_forward()
        return None

    def _pop_activation(self, unit: FetchUnit) -> Activation:
        while self.stack:
            activation = self.stack.pop()
            if activation.unit is unit:
                return activation
            # A unit whose forward raised never ran its post-forward: drop its holds.
            self.drop(activation.holds)
        return Activation(unit)

    def _keep_escaping_params(self, activation: Activation, tensors: list[torch.Tensor]) -> None:
        """A parameter returned in the output is handed to the caller's activation."""
        for tensor in tensors:
            sp = self._storage_owner.get(tensor.untyped_storage()._cdata)
            if sp is None or sp.persistent:
                continue
            parent = self.stack[-1] if self.stack else None
            if parent is not None and parent.hold(sp):
                sp.holds += 1

    def _begin_root_forward(self) -> None:
        if self.forward_depth == 0:
            self.forward_order = []
            if self.stack or any(sp.holds for sp in self.table.values()):
                self.release_all()  # a previous forward raised half way
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._saved_hooks.__enter__()
        self.forward_depth += 1

    def _end_root_forward(self) -> None:
        self.forward_depth -= 1
        if self.forward_depth == 0 and self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None

    # ------------------------------------------------------------ backward
    def _wrap_inputs_for_post_backward(self, unit: FetchUnit, args: tuple, kwargs: dict):
        flat, spec = tree_flatten((args, kwargs))
        positions = [
            i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad
        ]
        if not positions:
            return None
        wrapped = _PostBackward.apply(self, unit, *(flat[i] for i in positions))
        if isinstance(wrapped, torch.Tensor):
            wrapped = (wrapped,)
        for i, tensor in zip(positions, wrapped):
            flat[i] = tensor
        return spec.unflatten(flat)

    def _register_pre_backward(self, unit: FetchUnit, tensors: list[torch.Tensor]) -> None:
        for tensor in tensors:
            if tensor.requires_grad:
                tensor.register_hook(self._pre_backward_hook(unit))

    def _pre_backward_hook(self, unit: FetchUnit):
        def hook(grad: torch.Tensor) -> None:
            self.pre_backward(unit)

        return hook

    def pre_backward(self, unit: FetchUnit) -> None:
        if not self._backward_callback_queued:
            self._backward_callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)
        if unit.backward_active:
            return
        unit.backward_active = True
        params = [sp for sp in unit.gather_set() if not sp.persistent]
        self.acquire(params)
        unit.backward_holds.extend(params)

    def post_backward(self, unit: FetchUnit) -> None:
        unit.backward_active = False
        holds, unit.backward_holds = unit.backward_holds, []
        self.drop(holds)

    def end_backward(self) -> None:
        """End of a backward pass: drop what backward still holds, then finish gradients."""
        self._backward_callback_queued = False
        for unit in self.units:
            if unit.backward_holds or unit.backward_active:
                self.post_backward(unit)
        loose, self.loose = self.loose, []
        self.drop(loose)
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
            self.acquire([sp])
            self.loose.append(sp)
        return tensor
