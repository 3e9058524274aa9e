"""Which parameters a live engine manages: parameter -> its owner, held weakly.

The parameter layer needs to know only *that* a parameter is managed (a leaf-module
declaration after initialize is refused, for example); what manages it, and what that
owner offers, is the engine's business (`zero3.engine_parts.owner`). So this registry
stores an opaque owner object, which answers one question of this layer:
`owner.sharded(param)`, its `ShardedParam` (read by `status.py` for `param.ds_status`).

Ownership and lifetime: keys are held weakly (a registered parameter is never kept
alive by being registered) and so are owners (an engine dropped without `destroy()`
leaves no entry behind once it is collected).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

_owner_of: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register(params: Iterable[nn.Parameter], owner: object) -> None:
    """Every parameter in `params` is managed by `owner` from now on."""
    ref = weakref.ref(owner)
    for param in params:
        _owner_of[param] = ref


def unregister(params: Iterable[nn.Parameter], owner: object) -> None:
    """`params` are no longer managed by `owner` (those another owner took are left)."""
    for param in params:
        ref = _owner_of.get(param)
        if ref is not None and ref() is owner:
            del _owner_of[param]


def owner_ref(param: nn.Parameter) -> object | None:
    """The live owner of `param`, or None when nothing manages it."""
    ref = _owner_of.get(param)
    return ref() if ref is not None else None


def is_managed(param: nn.Parameter) -> bool:
    """True while a live engine manages `param`."""
    return owner_ref(param) is not None
