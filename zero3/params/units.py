"""Which parameters are sharded, which stay resident, and how they group into fetch units.

- Persistent (resident) parameters: numel at or under `param_persistence_threshold`,
  taken smallest first while their total stays under `model_persistence_threshold`
  (DeepSpeed's two stage-3 keys). Zero-size parameters are always resident.
- Fetch units: a *leaf* module owns all parameters of its subtree and is gathered as one;
  any other module owns its direct parameters. Leaves are, as in DeepSpeed:
  declared with `set_z3_leaf_modules` (or its `_by_name` / `_by_suffix` forms, or the
  config's `zero_optimization.leaf_module`), or chosen by
  `stage3_module_granularity_threshold`: walking down from the root, the first module
  whose granularity (elements of its subtree // its layers) is at or under the
  threshold. Containers (ModuleList, Sequential, ...) are never leaves.
- The root module is always a unit, with or without parameters of its own, so that code
  in the model's top-level forward runs inside a unit.
- A tied parameter belongs to the first module (in `named_modules` order) that holds it.
  Every other module holding it gets a unit of its own with the parameter as a known
  external, so it is gathered only while that module runs (a tied lm_head), not for the
  whole forward of an enclosing unit.

A leaf is what makes control flow that differs between ranks safe: its children have no
hooks, so whichever children a rank calls, every rank gathers the same block.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from zero3.config import LeafModuleConfig
from zero3.params.fetch_unit import FetchUnit
from zero3.params.ownership import is_managed
from zero3.params.partition import ShardedParam

#: DeepSpeed never sets a module with more elements than this as a leaf by granularity.
MAX_LEAF_NUMEL = 1_000_000_000
_CONTAINERS = frozenset(torch.nn.modules.container.__all__)

# Modules marked as leaves. A weak set: marking adds nothing to the module itself, and a
# module that is garbage collected leaves no trace.
_leaf_modules: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


class LeafModuleError(ValueError):
    """set_z3_leaf_modules was called with arguments that select nothing, or too late."""


# ------------------------------------------------------------ leaf declarations
def _qualified_name(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _matches_class(module: nn.Module, classes: Sequence[type | str]) -> bool:
    for cls in classes:
        if isinstance(cls, type) and isinstance(module, cls):
            return True
        if isinstance(cls, str) and cls in (type(module).__name__, _qualified_name(module)):
            return True
    return False


def _refuse_if_managed(model: nn.Module, what: str) -> None:
    if any(is_managed(p) for p in model.parameters()):
        raise LeafModuleError(
            f"{what} was called on a model that zero3.initialize already manages: its fetch "
            "units are built and the call would have no effect. Call it before "
            "zero3.initialize (or build a new engine)"
        )


def _mark(modules: list[nn.Module], flag: bool) -> list[nn.Module]:
    for module in modules:
        if flag:
            _leaf_modules.add(module)
        else:
            _leaf_modules.discard(module)
    return modules


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: Sequence[type | str],
                        raise_if_not_found: bool = True) -> list[nn.Module]:
    """Declare the modules of these classes (inside `model`) fetch units gathered whole.

    Classes are types or names (`"MoEBlock"` or `"package.module.MoEBlock"`), as in
    DeepSpeed. Needed where a module's control flow differs between ranks (an MoE block
    routing each rank to different experts): the block is gathered as one, so every rank
    issues the same collectives. Must be called before zero3.initialize. Returns the
    modules so marked; raises if none matched (unless raise_if_not_found=False).
    """
    classes = _check_classes(leaf_module_classes)
    _refuse_if_managed(model, "set_z3_leaf_modules")
    found = [m for m in model.modules() if _matches_class(m, classes)]
    if not found and raise_if_not_found:
        raise LeafModuleError(
            f"set_z3_leaf_modules: no module of the classes {_class_names(classes)} in "
            f"{type(model).__name__}; check the class (or pass raise_if_not_found=False)"
        )
    return _mark(found, True)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: Sequence[type | str],
                          raise_if_not_found: bool = True) -> list[nn.Module]:
    """Undo set_z3_leaf_modules for these classes (before zero3.initialize)."""
    classes = _check_classes(leaf_module_classes)
    _refuse_if_managed(model, "unset_z3_leaf_modules")
    found = [m for m in model.modules() if _matches_class(m, classes)]
    if not found and raise_if_not_found:
        raise LeafModuleError(f"unset_z3_leaf_modules: no module of the classes {_class_names(classes)}")
    return _mark(found, False)


def set_z3_leaf_modules_by_name(model: nn.Module, module_names: Sequence[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Mark modules by their `named_modules()` names; returns (modules, missing names)."""
    _refuse_if_managed(model, "set_z3_leaf_modules_by_name")
    by_name = dict(model.named_modules())
    found = [by_name[n] for n in module_names if n in by_name]
    missing = [n for n in module_names if n not in by_name]
    if missing and raise_if_not_found:
        raise LeafModuleError(f"set_z3_leaf_modules_by_name: no module named {missing} in {type(model).__name__}")
    return _mark(found, flag), missing


def set_z3_leaf_modules_by_suffix(model: nn.Module, module_name_suffixes: Sequence[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Mark modules whose `named_modules()` name ends with one of the suffixes."""
    _refuse_if_managed(model, "set_z3_leaf_modules_by_suffix")
    found, missing = _by_suffix(model, module_name_suffixes)
    if missing and raise_if_not_found:
        raise LeafModuleError(f"set_z3_leaf_modules_by_suffix: no module name ends with {missing}")
    return _mark(found, flag), missing


def z3_leaf_module(module: nn.Module) -> bool:
    """True if `module` was declared a leaf."""
    return module in _leaf_modules


def set_z3_leaf_module(module: nn.Module, flag: bool) -> None:
    """Declare (or undeclare) this one module a leaf (before zero3.initialize)."""
    _refuse_if_managed(module, "set_z3_leaf_module")
    _mark([module], flag)


def z3_leaf_parameter(param: nn.Parameter) -> bool:
    """True if `param` belongs to a module declared a leaf."""
    return any(any(p is param for p in module.parameters()) for module in list(_leaf_modules))


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules inside `model` declared as leaves."""
    return [m for m in model.modules() if m in _leaf_modules]


def _check_classes(classes: Sequence[type | str]) -> tuple[type | str, ...]:
    classes = tuple(classes)
    if not classes or not all(isinstance(c, (type, str)) for c in classes):
        raise TypeError(f"expected a list of module classes or class names, got {classes!r}")
    return classes


def _class_names(classes: Iterable[type | str]) -> list[str]:
    return [c.__name__ if isinstance(c, type) else c for c in classes]


def _by_suffix(model: nn.Module, suffixes: Sequence[str]) -> tuple[list[nn.Module], list[str]]:
    found: dict[int, nn.Module] = {}
    missing = []
    for suffix in suffixes:
        matched = [m for n, m in model.named_modules() if n.endswith(suffix)]
        found.update((id(m), m) for m in matched)
        if not matched:
            missing.append(suffix)
    return list(found.values()), missing


def declare_config_leaves(root: nn.Module, leaf_config) -> None:
    """At initialize: the config's leaf modules are declared as set_z3_leaf_modules declares
    them, so z3_leaf_module reports them (as DeepSpeed's initialize does). build_units itself
    leaves the model unmarked."""
    _mark(config_leaves(root, leaf_config), True)


def config_leaves(root: nn.Module, leaf_config) -> list[nn.Module]:
    """Modules selected by the config's `zero_optimization.leaf_module` (a LeafModuleConfig).

    Matches are by class name (short or fully qualified), module name and name suffix;
    nothing matching is fine (the defaults name transformers' MoE classes).
    """
    if leaf_config is None:
        return []
    by_name = dict(root.named_modules())
    chosen: dict[int, nn.Module] = {}
    if leaf_config.classes:
        chosen.update((id(m), m) for m in root.modules() if _matches_class(m, leaf_config.classes))
    chosen.update((id(by_name[n]), by_name[n]) for n in leaf_config.names if n in by_name)
    if leaf_config.name_suffixes:
        chosen.update((id(m), m) for m in _by_suffix(root, leaf_config.name_suffixes)[0])
    return list(chosen.values())


# ------------------------------------------------------------------ granularity
def granularity(root: nn.Module) -> dict[nn.Module, int]:
    """DeepSpeed's module granularity: elements of the subtree // its layers.

    Layers: a module without children counts 1 (if it has parameters), any other
    non-container module counts 1 plus its children's layers. Modules without
    parameters, childless modules, containers and subtrees over MAX_LEAF_NUMEL elements
    get sys.maxsize (never a leaf by threshold).
    """
    values: dict[nn.Module, int] = {}

    def visit(module: nn.Module) -> tuple[int, int]:
        if next(module.parameters(), None) is None:
            values[module] = sys.maxsize
            return 0, 0
        numel = sum(p.numel() for p in module.parameters(recurse=False))
        children = list(module.children())
        if not children:
            values[module] = sys.maxsize
            return 1, numel
        layers = 0
        for child in children:
            child_layers, child_numel = visit(child)
            layers += child_layers
            numel += child_numel
        if type(module).__name__ in _CONTAINERS:
            values[module] = sys.maxsize
            return layers, numel
        layers += 1
        values[module] = numel // layers if numel <= MAX_LEAF_NUMEL else sys.maxsize
        return layers, numel

    visit(root)
    return values


def threshold_leaves(root: nn.Module, threshold: int) -> list[nn.Module]:
    """Leaves chosen by stage3_module_granularity_threshold (parents first), as DeepSpeed."""
    if threshold <= 0:
        return []
    values = granularity(root)
    leaves: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if next(module.parameters(), None) is None:
            return
        if values.get(module, sys.maxsize) <= threshold:
            leaves.append(module)
            return
        for child in module.children():
            visit(child)

    visit(root)
    return leaves


# ------------------------------------------------------------------ persistence
def block_leaves(root: nn.Module) -> list[nn.Module]:
    """The default fetch units when none are declared: every element of a ModuleList
    (a transformer's layers) that holds parameters is gathered whole, with one coalesced
    all-gather, as FSDP2's `fully_shard` per block does. Nested lists are not split."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for module in root.modules():
        if id(module) in inside or not isinstance(module, nn.ModuleList):
            continue
        for child in module:
            if any(True for _ in child.parameters()):
                found.append(child)
                inside.update(id(m) for m in child.modules())
    return found


def choose_persistent(
    named: list[tuple[str, nn.Parameter]],
    param_threshold: int,
    model_threshold: int,
) -> set[int]:
    """ids of the parameters that stay resident on every rank."""
    chosen = persistent_indices([p.numel() for _, p in named], param_threshold, model_threshold)
    return {id(named[i][1]) for i in chosen}


def persistent_indices(numels: list[int], param_threshold: int, model_threshold: int) -> set[int]:
    """Indices of the resident tensors: zero-size ones, then the smallest of those at most
    `param_threshold` elements, while their total stays within `model_threshold`."""
    small = sorted((numel, i) for i, numel in enumerate(numels) if numel <= param_threshold)
    chosen = {i for i, numel in enumerate(numels) if numel == 0}
    total = 0
    for numel, index in small:
        if total + numel > model_threshold:
            break
        total += numel
        chosen.add(index)
    return chosen


# ------------------------------------------------------------------------ units
def chosen_leaves(root: nn.Module, granularity_threshold: int, leaf_module=None) -> set[int]:
    """ids of the modules gathered whole: those declared (set_z3_leaf_modules, the config's
    leaf_module, the granularity threshold); when the only ones declared are of DeepSpeed's
    default MoE classes (Mixtral's sparse MoE block and the like, which the default
    leaf_module names), the blocks of `block_leaves` with those MoE modules inside their
    block's unit, and any outside a block on their own; with nothing declared, the blocks."""
    declared = {id(m) for m in get_z3_leaf_modules(root)}
    declared |= {id(m) for m in config_leaves(root, leaf_module)}
    declared |= {id(m) for m in threshold_leaves(root, granularity_threshold)}
    default_moe = {id(m) for m in config_leaves(root, LeafModuleConfig())}
    if declared - default_moe:
        return declared
    blocks = block_leaves(root)
    inside = {id(m) for block in blocks for m in block.modules()}
    return {id(b) for b in blocks} | {key for key in declared if key not in inside}


def build_units(
    root: nn.Module,
    table: dict[nn.Parameter, ShardedParam],
    granularity_threshold: int,
    leaf_module=None,
) -> list[FetchUnit]:
    """The fetch units of `root`, in `named_modules` order (the same on every rank).

    `leaf_module` is the config's LeafModuleConfig (zero_optimization.leaf_module), or
    None. Leaves come from set_z3_leaf_modules, from it, and from the threshold.
    """
    leaves = chosen_leaves(root, granularity_threshold, leaf_module)
    claimed: set[int] = set()
    visited: set[int] = set()
    units: list[FetchUnit] = []

    def take(params: Iterable[nn.Parameter]) -> tuple[list[ShardedParam], list[ShardedParam]]:
        """(newly owned, already owned elsewhere) managed parameters among `params`."""
        owned, shared = [], []
        for p in params:
            sp = table.get(p)
            if sp is None:
                continue
            (shared if id(sp) in claimed else owned).append(sp)
            claimed.add(id(sp))
        return owned, shared

    def visit(module: nn.Module, name: str) -> None:
        if id(module) in visited:
            return  # one module reachable under two names: one unit, under its first name
        visited.add(id(module))
        is_leaf = id(module) in leaves
        direct = module.parameters() if is_leaf else (p for p in module._parameters.values() if p is not None)
        owned, shared = take(direct)
        if owned or shared or module is root:
            unit = FetchUnit(module=module, name=name or "<root>", params=owned, index=len(units), leaf=is_leaf)
            for sp in shared:
                unit.add_external(sp)
            units.append(unit)
        if not is_leaf:
            for child_name, child in module.named_children():
                visit(child, f"{name}.{child_name}" if name else child_name)

    visit(root, "")
    return units
