"""Access discovery: how zero3 learns which parameters a running module touches.

Every module of the model has its `_parameters` dict replaced by `TrackedParameters`,
whose `__getitem__` is what `module.weight` goes through: each read is reported to the
fetcher (`on_access`), which registers the parameter on the running unit and gathers it
if it is SHARDED. This is the fix for reads of a parameter outside its own module (the
PEFT `x.to(self.lora_A.weight.dtype)` case): nothing waits for a parameter to be
unavailable to find out, and nothing asserts on a recorded order.

Structure: `TrackedParameters.__setitem__` and `TrackedAssignments` (each module's
`_modules`) note any parameter or module assigned after initialize; the next root forward
then calls `check_structure`, which hands the model to `on_structure_change` (the
engine's late_params.py: parameters zero3 does not manage are kept whole and named once)
and watches the new modules too. No cost until something changes.

Safety net: `saved_tensor_hooks()` (pushed by the fetcher for the root forward) remembers
which saved tensors are views of managed parameters; if backward unpacks one that is not
FULL, `on_late_use` gathers it again ("late gather", counted in `late_gathers`).

Owns no tensors; `remove()` gives every module its plain dicts back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zero3.params.partition import ParamState, ShardedParam


class TrackedParameters(dict):
    """A module's `_parameters`: reports each read of a parameter and each assignment."""

    def __init__(self, original: dict, on_access: Callable[[nn.Parameter], None],
                 on_change: Callable[[], None]) -> None:
        super().__init__(original)
        self._on_access = on_access
        self._on_change = on_change

    def __getitem__(self, name: str) -> Any:
        value = super().__getitem__(name)
        if value is not None and not torch.compiler.is_compiling():
            self._on_access(value)  # not while dynamo traces: compiled.py keeps discovery eager
        return value

    def __setitem__(self, name: str, value: Any) -> None:
        super().__setitem__(name, value)
        self._on_change()

    def __reduce_ex__(self, protocol: Any):
        return dict, (dict(self.items()),)  # copies and pickles are plain dicts

    def untracked(self) -> dict:
        return dict(self.items())


class TrackedAssignments(dict):
    """A module's `_modules`: reports an entry assigned after initialize; reads are plain
    dict reads."""

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


class ResidentParameters(TrackedAssignments):
    """A module's `_parameters` when nothing is ever gathered (every parameter resident):
    assignments are noticed, reads are plain dict reads."""


# What a module's `_parameters` is while an engine watches it (DeepSpeed's ZeROOrderedDict's role).
PARAMETER_DICTS = (TrackedParameters, ResidentParameters)


class AccessDiscovery:
    """The tracked dicts of one model, its structure check and the saved-tensor safety net.

    `track_reads` False (world size 1, every parameter resident): parameter reads stay
    plain dict reads; only assignments are noticed.
    """

    def __init__(self, root: nn.Module, table: dict[nn.Parameter, ShardedParam], track_reads: bool,
                 on_access: Callable[[nn.Parameter], None],
                 on_late_use: Callable[[ShardedParam], None],
                 on_structure_change: Callable[[nn.Module], object] | None = None) -> None:
        self.root = root
        self.table = table
        self.track_reads = track_reads
        self._on_access = on_access
        self._on_late_use = on_late_use
        self._on_structure_change = on_structure_change
        self._storage_owner: dict[int, ShardedParam] = {}  # storage (_cdata) -> its parameter
        self._storage_of: dict[int, int] = {}  # id(ShardedParam) -> its storage's _cdata
        for sp in table.values():
            self.storage_moved(sp)
        self._wrapped: dict[int, nn.Module] = {}
        self.structure_changed = False
        self.late_gathers = 0

    # -------------------------------------------------------------- dicts
    def wrap_all(self) -> None:
        for module in self.root.modules():
            self._wrap(module)

    def _wrap(self, module: nn.Module) -> None:
        if id(module) in self._wrapped:
            return
        if self.track_reads:
            module._parameters = TrackedParameters(module._parameters, self._on_access, self.note_change)
        else:
            module._parameters = ResidentParameters(module._parameters, self.note_change)
        module._modules = TrackedAssignments(module._modules, self.note_change)
        self._wrapped[id(module)] = module

    def remove(self) -> None:
        """Undo every dict replacement (the model's modules get plain dicts again)."""
        for module in self._wrapped.values():
            if isinstance(module._parameters, (TrackedParameters, TrackedAssignments)):
                module._parameters = module._parameters.untracked()
            if isinstance(module._modules, TrackedAssignments):
                module._modules = module._modules.untracked()
        self._wrapped.clear()

    def note_change(self) -> None:
        self.structure_changed = True

    def check_structure(self) -> None:
        """Modules or parameters were assigned since the last forward: the model goes to
        `on_structure_change` (late_params.py keeps parameters zero3 does not manage
        whole), and every module of the model is watched from now on."""
        if self._on_structure_change is not None:
            self._on_structure_change(self.root)
        self.wrap_all()
        self.structure_changed = False

    # ------------------------------------------------------ storage owners
    def storage_moved(self, sp: ShardedParam) -> None:
        """`sp`'s parameter is on a new storage (released.py moved it): views of that one are its."""
        old = self._storage_of.get(id(sp))
        if old is not None and self._storage_owner.get(old) is sp:
            del self._storage_owner[old]
        key = sp.param.untyped_storage()._cdata
        self._storage_owner[key] = sp
        self._storage_of[id(sp)] = key

    def owner_of(self, tensor: torch.Tensor) -> ShardedParam | None:
        """The managed parameter whose storage `tensor` lives on (a view of it), if any."""
        return self._storage_owner.get(tensor.untyped_storage()._cdata)

    def saved_tensor_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The safety net, to be entered for a root forward and exited at its end."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        sp = self.owner_of(tensor)
        return (sp, tensor) if sp is not None else tensor

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, tuple):
            return packed
        sp, tensor = packed
        if sp.state is not ParamState.FULL:
            self.late_gathers += 1
            self._on_late_use(sp)
        return tensor
