"""Look-ahead: prefetch the units the plan enters next, keep the ones it re-enters soon.

Works from the schedule (schedule.py): while a step is on plan, the units ahead are
known on every rank alike, so every rank issues the same prefetches at the same points.

Holds: each prefetched or retained parameter takes one *spare* hold (`ShardedParam.holds`),
recorded here. The spare hold is handed over to the first holder that acquires the
parameter (`hand_over`), or dropped at the end of the step (`drop_spares`). A prefetch in
flight is completed before anything gathers or reads the parameters it covers
(`complete`). Owns no tensors: the wire owns the buffers of a prefetch in flight, the
parameters their storage.
"""

from __future__ import annotations

from collections.abc import Callable

from zero3.params.fetch_unit import FetchUnit
from zero3.params.partition import ParamState, ShardedParam
from zero3.params.schedule import PrefetchPolicy, Schedule
from zero3.params.wire import GatherWire, group_by_dtype
from zero3.platform.collectives import Communicator, Pending

LOOKAHEAD_ENTRIES = 256  # how far prefetch and reuse look into the plan (unit entries)


class LookAhead:
    """The prefetch and reuse holds of one Fetcher."""

    def __init__(self, units: list[FetchUnit], schedule: Schedule, policy: PrefetchPolicy,
                 wire: GatherWire, comm: Communicator, drop: Callable[[list[ShardedParam]], None]) -> None:
        self.units = units
        self.schedule = schedule
        self.policy = policy
        self.wire = wire
        self.comm = comm
        self._drop = drop  # the owner's release of holds
        self._spare: dict[int, tuple[ShardedParam, bool]] = {}  # id(sp) -> (sp, taken by a prefetch)
        self._inflight: dict[int, Pending] = {}  # id(sp) -> the prefetch gathering it
        self._ahead_numel = 0  # elements prefetched and not yet used
        self.prefetched_units = 0
        self.reused_units = 0
        # NVMe-tier shards (nvme_shards.py): their reads are started ahead, as far as the staging buffers go
        self._reads_ahead = max((sp.backing.staging_buffers for unit in units for sp in unit.params
                                 if sp.backing is not None), default=0)

    @property
    def busy(self) -> bool:
        """True while a spare hold or a prefetch in flight exists."""
        return bool(self._spare or self._inflight)

    # ------------------------------------------------------------ holders
    def complete(self, params: list[ShardedParam]) -> None:
        """Finish the prefetches that cover any of `params` (before they are gathered)."""
        if self._inflight:
            for sp in params:
                pending = self._inflight.get(id(sp))
                if pending is not None:
                    self.comm.complete(pending)

    def hand_over(self, params: list[ShardedParam]) -> None:
        """`params` were just acquired: their spare holds go to that holder."""
        if not self._spare:
            return
        for sp in params:
            spare = self._spare.pop(id(sp), None)
            if spare is not None:
                sp.holds -= 1
                if spare[1]:
                    self._ahead_numel -= sp.numel

    def drop_spares(self) -> None:
        """End of a step: finish the prefetches and drop every spare hold."""
        if self._inflight:
            self.comm.drain()
        if self._spare:
            spare, self._spare = self._spare, {}
            self._ahead_numel = 0
            self._drop([sp for sp, _ in spare.values()])

    def forget(self) -> None:
        """Teardown: the caller releases every parameter itself; just forget the holds."""
        self._spare.clear()
        self._inflight.clear()
        self._ahead_numel = 0

    # ------------------------------------------------------------ prefetch
    def prefetch(self) -> None:
        """Start gathering the next planned units: up to the policy's bucket of elements
        ahead of use, within its bound on live elements, one asynchronous all-gather per
        unit and dtype. Each prefetched parameter takes a spare hold. Before that, the reads
        of NVMe-tier shards of the units ahead are started (`read_ahead`)."""
        self.read_ahead()
        if not self.policy.prefetches or not self.schedule.on_plan:
            return
        if not self.comm.active and not self.wire.shards_on_host:
            return  # world size 1: only a host-to-device copy is worth starting early
        for unit, fresh in self._pick_units():
            for _, group in group_by_dtype(fresh):
                self._issue(unit, group)
            self.prefetched_units += 1

    def read_ahead(self) -> None:
        """Start reading the NVMe-tier shards of the next planned units into free staging
        buffers (never waits), so that their gathers find them in host memory: at most as
        many units as there are buffers, stopping at the first that finds none free."""
        if not self._reads_ahead or not self.schedule.on_plan:
            return
        units = 0
        for _, index in self.schedule.upcoming(LOOKAHEAD_ENTRIES):
            backed = [sp for sp in self.units[index].fetch_list()
                      if sp.backing is not None and sp.state is ParamState.SHARDED]
            if not backed:
                continue
            if not backed[0].backing.prefetch(backed):
                return
            units += 1
            if units >= self._reads_ahead:
                return

    def _pick_units(self) -> list[tuple[FetchUnit, list[ShardedParam]]]:
        policy = self.policy
        ahead, picked = self._ahead_numel, 0
        chosen: list[tuple[FetchUnit, list[ShardedParam]]] = []
        seen: set[int] = set()
        for _, index in self.schedule.upcoming(LOOKAHEAD_ENTRIES):
            if ahead >= policy.bucket_numel:
                break
            unit = self.units[index]
            fresh = [sp for sp in unit.fetch_list() if sp.state is ParamState.SHARDED and id(sp) not in seen]
            if not fresh or not self._worth_prefetching(fresh):
                continue
            numel = sum(sp.numel for sp in fresh)
            if chosen and ahead + numel > policy.bucket_numel:
                break
            if self.wire.live_numel + picked + numel > policy.max_live_numel:
                break
            seen.update(id(sp) for sp in fresh)
            chosen.append((unit, fresh))
            ahead += numel
            picked += numel
        return chosen

    def _worth_prefetching(self, fresh: list[ShardedParam]) -> bool:
        """Across ranks every gather is worth starting early. At world size 1 only a host
        shard's copy to the device is (a shard in a swap file counts as one on the host): a
        unit whose shards all sit on the device is passed over (gathered where it is used, a
        local copy), so the look-ahead reaches the next host unit and its copy overlaps the
        compute of the device units before it."""
        return self.comm.active or any(sp.backing is not None or sp.shard.device.type == "cpu" for sp in fresh)

    def _issue(self, unit: FetchUnit, group: list[ShardedParam]) -> None:
        def landed() -> None:
            for sp in group:
                self._inflight.pop(id(sp), None)

        pending = self.wire.gather_async(group, group[0].dtype, unit.index, landed)
        for sp in group:
            sp.holds += 1
            self._spare[id(sp)] = (sp, True)
            self._inflight[id(sp)] = pending
        self._ahead_numel += sum(sp.numel for sp in group)

    # --------------------------------------------------------------- reuse
    def retain(self, unit: FetchUnit) -> None:
        """Keep `unit`'s parameters gathered if the plan enters it again within the reuse
        distance (elements gathered in between), as DeepSpeed's stage3_max_reuse_distance."""
        policy = self.policy
        if (not policy.reuses or not self.schedule.on_plan or self.wire.live_numel > policy.max_live_numel
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
