"""A fetch unit: a module and the parameters gathered together with it.

Units are built once (units.py) and read by the fetcher (fetch.py), the look-ahead
(lookahead.py) and the reducer; a unit's `externals` grow as access discovery sees the
unit read parameters owned elsewhere. A unit owns no tensor: its lists hold the
engine's `ShardedParam` objects.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from zero3.params.partition import ShardedParam


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

    def residency_changed(self) -> None:
        """A parameter of this unit became resident or stopped being resident (aliased at
        world size 1 by a new placement): the fetch list is made anew at its next use."""
        self._fetch = None

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
