"""Which parameters are sharded, which stay resident, and how they group into fetch units.

- Persistent (resident) parameters: numel at or under `param_persistence_threshold`,
  taken smallest first while their total stays under `model_persistence_threshold`
  (DeepSpeed's two stage-3 keys). Zero-size parameters are always resident.
- Fetch units: a *leaf* module (declared with `set_z3_leaf_modules`, or chosen because its
  subtree holds fewer than `module_granularity_threshold` elements) owns all parameters
  of its subtree and is gathered as one; any other module owns its direct parameters.
  The root module is always a unit, with or without parameters of its own, so that code
  in the model's top-level forward runs inside a unit. A tied parameter belongs to the
  first module (in `named_modules` order) that holds it; other holders reach it through
  access discovery.
"""

from __future__ import annotations

import weakref

from torch import nn

from .fetch import FetchUnit
from .partition import ShardedParam

_declared_leaf_classes: "weakref.WeakKeyDictionary[nn.Module, tuple[type, ...]]" = (
    weakref.WeakKeyDictionary()
)


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: list[type]) -> list[nn.Module]:
    """Declare modules of these classes (inside `model`) as fetch units gathered whole.

    Needed where a module's control flow differs between ranks (an MoE block routing each
    rank to different experts): the block is gathered as one, so every rank issues the
    same collectives. Returns the modules so marked.
    """
    classes = tuple(leaf_module_classes)
    if not classes or not all(isinstance(c, type) for c in classes):
        raise TypeError(f"set_z3_leaf_modules expects a list of module classes, got {leaf_module_classes!r}")
    _declared_leaf_classes[model] = _declared_leaf_classes.get(model, ()) + classes
    return [m for m in model.modules() if isinstance(m, classes)]


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    classes = _declared_leaf_classes.get(model, ())
    return [m for m in model.modules() if classes and isinstance(m, classes)]


def choose_persistent(
    named: list[tuple[str, nn.Parameter]],
    param_threshold: int,
    model_threshold: int,
) -> set[int]:
    """ids of the parameters that stay resident on every rank."""
    small = sorted((p.numel(), i) for i, (_, p) in enumerate(named) if p.numel() <= param_threshold)
    chosen: set[int] = {id(p) for _, p in named if p.numel() == 0}
    total = 0
    for numel, index in small:
        if total + numel > model_threshold:
            break
        total += numel
        chosen.add(id(named[index][1]))
    return chosen


def build_units(
    root: nn.Module,
    table: dict[nn.Parameter, ShardedParam],
    granularity_threshold: int,
) -> list[FetchUnit]:
    leaves = set(get_z3_leaf_modules(root))
    subtree_numel = _subtree_numels(root) if granularity_threshold > 0 else {}
    claimed: set[int] = set()
    units: list[FetchUnit] = []

    def take(params) -> list[ShardedParam]:
        owned = []
        for p in params:
            sp = table.get(p)
            if sp is not None and id(sp) not in claimed:
                claimed.add(id(sp))
                owned.append(sp)
        return owned

    def visit(module: nn.Module, name: str) -> None:
        is_leaf = module in leaves or (
            module is not root and 0 < subtree_numel.get(module, 0) < granularity_threshold
        )
        if is_leaf:
            owned = take(module.parameters())
        else:
            owned = take(p for p in module._parameters.values() if p is not None)
        if owned or module is root:
            units.append(FetchUnit(module=module, name=name or "<root>", params=owned))
        if not is_leaf:
            for child_name, child in module.named_children():
                visit(child, f"{name}.{child_name}" if name else child_name)

    visit(root, "")
    return units


def _subtree_numels(root: nn.Module) -> dict[nn.Module, int]:
    return {m: sum(p.numel() for p in m.parameters()) for m in root.modules()}
