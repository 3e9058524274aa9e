"""The order fetch units ran in last step, and where this step is in it: prefetch and reuse.

A *step* here is everything from one root forward to the next (a forward and, when
training, its backward, activation-checkpoint recomputation included). Each unit entry
(a pre-forward or pre-backward that gathers) is recorded as an `Entry`. The entries of
the previous step of the same kind (training, or forward under no_grad) are this step's
*plan*. While this step's entries equal the plan's so far, the step is *on plan*, and
the units ahead in the plan are known:
- prefetch gathers the next ones before they are entered (`stage3_prefetch_bucket_size`
  elements at most, `stage3_max_live_parameters` gathered elements in all);
- a unit whose parameters are entered again within `stage3_max_reuse_distance` elements
  of gathering keeps them instead of releasing them.

Invariant that keeps every rank's collectives matched: the plan is a function of the
previous step's entries, which every rank has verified to be the same (the divergence
guard checks the trace of entries with every gather), and the position is the number of
entries so far. So every rank that is on plan issues the same prefetches at the same
points; a rank whose control flow leaves the plan stops prefetching, and the guard's
headers report the difference at the next gather. Nothing here asserts on the order:
leaving the plan only stops the look-ahead until the next step.

Owns no tensors: units are referred to by index.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

logger = logging.getLogger("zero3")


@dataclasses.dataclass(frozen=True)
class PrefetchPolicy:
    """DeepSpeed's three look-ahead knobs, in elements (numel)."""

    bucket_numel: int = 0  # stage3_prefetch_bucket_size: 0 turns prefetch off
    max_live_numel: int = 0  # stage3_max_live_parameters: bound on gathered elements ahead of use
    reuse_distance_numel: int = 0  # stage3_max_reuse_distance: 0 always releases after use
    log_departures: bool = False  # log_trace_cache_warnings: log when a step leaves the recorded order

    @property
    def prefetches(self) -> bool:
        return self.bucket_numel > 0 and self.max_live_numel > 0

    @property
    def reuses(self) -> bool:
        return self.reuse_distance_numel > 0


Entry = tuple[bool, int]  # (in backward, unit index)


class Schedule:
    """The plan (last step's entries) and this step's progress through it."""

    def __init__(self, log_departures: bool = False) -> None:
        self.log_departures = log_departures
        self._recorded: dict[bool, list[Entry]] = {}
        self._kind = True
        self._entries: list[Entry] = []
        self._plan: list[Entry] = []
        self.on_plan = False

    def start_step(self, training: bool) -> None:
        """A root forward begins: the step that just ended becomes the plan of its kind."""
        if self._entries:
            self._recorded[self._kind] = self._entries
        self._kind = training
        self._entries = []
        self._plan = self._recorded.get(training, [])
        self.on_plan = bool(self._plan)

    def enter(self, backward: bool, unit: int) -> None:
        """Record a unit entry; leave the plan if it is not the planned one."""
        entry = (backward, unit)
        position = len(self._entries)
        self._entries.append(entry)
        if self.on_plan and (position >= len(self._plan) or self._plan[position] != entry):
            self.on_plan = False
            if self.log_departures:
                planned = self._plan[position] if position < len(self._plan) else "the end of the step"
                logger.warning("zero3: this step left last step's fetch order at entry %d (%s unit %d, planned "
                               "%s); prefetch stops until the next step, which re-records the order",
                               position, "backward" if backward else "forward", unit, planned)

    def upcoming(self, limit: int) -> Iterator[Entry]:
        """The planned entries after the current one (nothing when off plan), at most `limit`."""
        if not self.on_plan:
            return iter(())
        start = len(self._entries)
        return iter(self._plan[start:start + limit])

    def last_entries(self, training: bool = True) -> list[Entry]:
        """The entries of the latest step of this kind: the running one if it is of this
        kind and has entries, else the recorded one."""
        if self._kind == training and self._entries:
            return list(self._entries)
        return list(self._recorded.get(training, []))

    @property
    def position(self) -> int:
        return len(self._entries)
