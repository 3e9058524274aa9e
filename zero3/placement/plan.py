"""The placement planner: per fetch unit, device, host or NVMe, under byte budgets.

A unit's state comes in two pieces, placed separately:
- its *parameter shards* (this rank's slice of every parameter the unit owns, in the compute
  dtype): read by every forward and backward gather;
- its *optimizer side* (fp32 gradient shards, fp32 masters unless the master is the shard
  itself, and the optimizer state): touched once per optimizer step.
With gradient accumulation, a unit whose optimizer side is on the host may also get an
*accumulator* on the device: its fp32 gradient shard is summed there over the window's
micro-steps and goes down once, in the window's last backward, instead of crossing the bus
and being added on the CPU at every micro-step.

Rules, in this order:
1. What the config does not offload is on the device (`offload_param.device: "none"` puts
   every parameter shard there; `offload_optimizer.device: "none"` every optimizer side).
2. Without a budget, what the config offloads is on the host, except the optimizer sides
   that DeepSpeed's `offload_optimizer.ratio` keeps on the device: of the units holding
   trainable parameters, in module order, the first `int((1 - ratio) * n)` (DeepSpeed keeps its
   first sub-groups on the accelerator and offloads the last ones).
3. With a budget, the fixed part (what rule 1 pins to the device, the resident parameters
   held whole, the working set of gathered units and gradient buckets) must fit it, else
   `PlacementError` names the largest unit, its size and the budget. Then, while bytes are
   left, parameter shards come to the device first, frozen units before trainable ones
   (a frozen unit costs its shard only and is read on every micro-step); of a group that
   does not fit whole, the fewest shards stay on the host, spread evenly through the
   forward order (each host unit's copy then overlaps the compute of the device units
   before it); then, with gradient accumulation (more than one micro-step a window),
   accumulators for the units whose optimizer side is on the host, in forward order (4
   bytes a trainable element save a host add and a copy of the gradient at every
   micro-step but the last: more per byte than an optimizer side saves); then optimizer
   sides, in forward order, of units whose parameter shards are on the device (a unit
   stepped on the device needs its shard there to write the update; its side holds its
   gradient, so it costs its side less the accumulator it replaces). A `ratio` given with a
   budget decides the optimizer sides by rule 2; the budget then only checks that they fit.
4. With the optimizer side offloaded to NVMe (`state_nvme`), the optimizer sides left on the
   host stay there, in forward order, while they fit `host_budget` (None: none do, all go to
   NVMe, as DeepSpeed puts all of it there); the rest are on the NVMe tier: their masters
   (unless the master is the shard itself) and optimizer state live in swap files, their
   gradient shards on the host (`UnitSize.swap_bytes` is the part in files); the host also
   holds `state_staging_buffers` staging buffers of the largest swap group, charged in
   `host_bytes` at its bound (`state_group_bytes`; an upper bound: with the overlapped host step
   sub-groups also end at unit boundaries) while `host_budget` bounds the optimizer sides alone.
5. With the parameter shards offloaded to NVMe (`params_nvme`, offload_param.device "nvme"),
   the parameter shards left on the host stay there, whole units in forward order, while
   their elements fit `max_in_cpu` (DeepSpeed's count of parameter elements kept in host
   memory; a unit that does not fit goes to NVMe, a later smaller one may still fit); the
   rest are on the NVMe tier: their shards live in swap files and are read into staging
   buffers (`param_staging_bytes` of host memory) ahead of each gather. Each section's third
   tier has its own host bound, in its own DeepSpeed-style unit: `max_in_cpu` (elements) for
   parameter shards, `placement.host_budget` (bytes) for optimizer sides; neither counts the
   other's pieces. A frozen unit on NVMe says HOST for its (absent) optimizer side.
   A re-plan keeps the NVMe tiers as initialize made them (`nvme_units`, `nvme_param_units`).

Invariant: `Plan.device_bytes <= Plan.budget` whenever a budget is given, and the host bytes
of the optimizer sides on the host tier <= `host_budget` when one is given; `device_bytes`
counts every tensor of the engine's own that the plan puts on the device, with the working
set. What fits stays where the plan puts it: a plan changes only when the budget does
(engine_parts/placement.py moves the pieces then, at a step boundary).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

GIB = 1 << 30


class Tier(str, enum.Enum):
    DEVICE = "device"
    HOST = "host"
    # optimizer sides: stepped on the host, masters and state in swap files; parameter shards:
    # in swap files, read into host staging buffers ahead of their gathers
    NVME = "nvme"


class PlacementError(ValueError):
    """The budget cannot hold what must be on the device."""


@dataclass(frozen=True)
class UnitSize:
    """One fetch unit's bytes on this rank.

    `param_bytes`: its parameter shards (compute dtype). `state_bytes`: its optimizer side
    (0 for a frozen unit). `gathered_bytes`: its parameters gathered whole, while it runs.
    `grad_bytes`: its gradient shards, the part of `state_bytes` an accumulator holds.
    `swap_bytes`: the part of `state_bytes` the NVMe tier keeps in files (masters that are
    not the shards, optimizer state); the gradient shards stay in memory. `param_numel`: the
    elements of its parameter shards (what `max_in_cpu` counts)."""

    name: str
    param_bytes: int
    state_bytes: int
    gathered_bytes: int
    grad_bytes: int = 0
    swap_bytes: int = 0
    param_numel: int = 0

    @property
    def frozen(self) -> bool:
        return self.state_bytes == 0


@dataclass(frozen=True)
class UnitPlacement:
    """`accumulator`: where the unit's gradient is summed over a window's micro-steps (its
    optimizer side's tier, or DEVICE for a host-side unit granted an accumulator).
    `trainable`: the unit has an optimizer side (a frozen unit's `state` is its shard's tier)."""

    name: str
    params: Tier
    state: Tier
    accumulator: Tier | None = None
    trainable: bool = True

    def __post_init__(self) -> None:
        if self.accumulator is None:
            object.__setattr__(self, "accumulator", self.state)

    @property
    def accumulates_on_device(self) -> bool:
        """The optimizer side is off the device (host or NVMe: its gradient shard is in host
        memory), the window's gradient sum on the device."""
        return self.state is not Tier.DEVICE and self.accumulator is Tier.DEVICE


@dataclass(frozen=True)
class PlanInputs:
    """What the planner decides from (all bytes are this rank's).

    `units` in forward order (module order before the first forward). `param_offload` /
    `state_offload`: the config offloads that piece (offload_param / offload_optimizer on
    the CPU). `ratio`: DeepSpeed's offload_optimizer.ratio when the config gives one.
    `budget`: the device bytes the engine's own tensors may hold, or None (no budget).
    `resident_bytes`: parameters held whole on every rank between steps (always on the
    device). `working_bytes`: gathered units and gradient buckets in flight.
    `accumulation_steps`: micro-steps a window (accumulators are placed only above 1)."""

    units: tuple[UnitSize, ...]
    param_offload: bool
    state_offload: bool
    ratio: float | None = None
    budget: int | None = None
    resident_bytes: int = 0
    working_bytes: int = 0
    budget_source: str = ""
    accumulation_steps: int = 1
    state_nvme: bool = False
    host_budget: int | None = None
    nvme_units: tuple[str, ...] | None = None  # a re-plan: these stay on NVMe, no other joins
    reserve: int = 0  # device bytes the budget leaves outside the plan (activations; budget.BudgetChoice)
    params_nvme: bool = False  # offload_param.device "nvme" (rule 5)
    max_in_cpu: int = 0  # parameter elements the host keeps with params_nvme
    param_staging_bytes: int = 0  # the staging buffers' host bytes with params_nvme
    nvme_param_units: tuple[str, ...] | None = None  # a re-plan: their shards stay on NVMe, no other joins
    state_staging_buffers: int = 0  # offload_optimizer.buffer_count with state_nvme
    state_group_bytes: int | None = None  # bound on one swap group (sizes.state_group_bytes; None: none)


@dataclass(frozen=True)
class Plan:
    """Each unit's tiers and the bytes they add up to."""

    units: tuple[UnitPlacement, ...]
    budget: int | None
    device_bytes: int
    host_bytes: int
    fixed_bytes: int
    budget_source: str = ""
    nvme_bytes: int = 0
    nvme_param_bytes: int = 0
    working_bytes: int = 0
    reserve: int = 0
    state_staging_bytes: int = 0  # host bytes of the optimizer NVMe tier's staging buffers (in host_bytes)
    by_name: dict[str, UnitPlacement] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.by_name.update({u.name: u for u in self.units})

    def params_tier(self, unit: str) -> Tier:
        return self.by_name[unit].params

    @property
    def state_bytes_on_device(self) -> int:
        """The device bytes that stay there between steps: `device_bytes` less the working set."""
        return self.device_bytes - self.working_bytes

    @property
    def predicted_peak(self) -> int:
        """The device peak the plan predicts: its bytes and the reserve the budget left
        (activations, and the working set when the reserve was measured). With no known
        reserve (an explicit budget) it is the engine's own bytes alone."""
        return self.device_bytes + self.reserve

    def state_tier(self, unit: str) -> Tier:
        return self.by_name[unit].state

    def counts(self) -> dict[str, int]:
        """How many units have each piece on the device (optimizer sides: of the trainable units)."""
        return {"units": len(self.units), "trainable": sum(u.trainable for u in self.units),
                "params_on_device": sum(u.params is Tier.DEVICE for u in self.units),
                "state_on_device": sum(u.state is Tier.DEVICE and u.trainable for u in self.units),
                "accumulators_on_device": sum(u.accumulates_on_device for u in self.units),
                "state_on_nvme": sum(u.state is Tier.NVME for u in self.units),
                "params_on_nvme": sum(u.params is Tier.NVME for u in self.units)}

    def describe(self) -> str:
        """One line: the budget, what sits where, the predicted bytes."""
        c = self.counts()
        budget = "no budget" if self.budget is None else f"budget {self.budget / GIB:.2f} GiB ({self.budget_source})"
        accumulators = (f", gradient accumulators of {c['accumulators_on_device']} host-side units"
                        if c["accumulators_on_device"] else "")
        return (f"placement: {budget}; parameter shards of {c['params_on_device']}/{c['units']} units and "
                f"optimizer state of {c['state_on_device']}/{c['trainable']} trainable units{accumulators} on the "
                f"device; predicted "
                f"device {self.device_bytes / GIB:.2f} GiB (fixed {self.fixed_bytes / GIB:.2f} GiB"
                + (f"; peak {self.predicted_peak / GIB:.2f} GiB with the {self.reserve / GIB:.2f} GiB reserve"
                   if self.reserve else "") + "), "
                f"host {self.host_bytes / GIB:.2f} GiB"
                + (f"; optimizer state of {c['state_on_nvme']}/{c['trainable']} trainable units on NVMe, "
                   f"{self.nvme_bytes / GIB:.2f} GiB in swap files (staged through at "
                   f"most {self.state_staging_bytes / GIB:.2f} GiB of host buffers)" if c["state_on_nvme"] else "")
                + (f"; parameter shards of {c['params_on_nvme']}/{c['units']} units on NVMe, "
                   f"{self.nvme_param_bytes / GIB:.2f} GiB in swap files" if c["params_on_nvme"] else ""))


def make_plan(inputs: PlanInputs) -> Plan:
    """The placement under `inputs` (the rules in the module docstring)."""
    units = inputs.units
    params = {u.name: Tier.HOST if inputs.param_offload else Tier.DEVICE for u in units}
    params.update({name: Tier.NVME for name in inputs.nvme_param_units or ()})
    state = {u.name: Tier.HOST if inputs.state_offload else Tier.DEVICE for u in units}
    if inputs.state_offload and inputs.ratio is not None:
        state.update(_ratio_tiers(units, inputs.ratio))
    fixed = _fixed_bytes(inputs, params, state)
    accumulators: set[str] = set()
    if inputs.budget is not None:
        _check_fixed_fits(inputs, fixed)
        left = inputs.budget - fixed
        if inputs.param_offload:
            left = _fill_params(units, params, left)
        if inputs.state_offload and inputs.accumulation_steps > 1:
            left = _fill_accumulators(units, state, accumulators, left)
        if inputs.state_offload and inputs.ratio is None:
            _fill_states(units, params, state, accumulators, left, set(inputs.nvme_units or ()))
    if inputs.params_nvme and inputs.nvme_param_units is None:
        _spill_params_to_nvme(units, params, inputs.max_in_cpu)
    for unit in units:
        if unit.frozen:  # no optimizer side: say it is where the shard is (the host for NVMe)
            state[unit.name] = Tier.HOST if params[unit.name] is Tier.NVME else params[unit.name]
    if inputs.nvme_units is not None:
        state.update({name: Tier.NVME for name in inputs.nvme_units})
    elif inputs.state_nvme:
        _spill_to_nvme(units, state, inputs.host_budget or 0)
    return _counted(inputs, params, state, accumulators, fixed)


def _spill_to_nvme(units: tuple[UnitSize, ...], state: dict[str, Tier], host_budget: int) -> None:
    """Rule 4: host optimizer sides kept in forward order while they fit, the rest to NVMe."""
    left = host_budget
    for unit in units:
        if unit.frozen or state[unit.name] is not Tier.HOST:
            continue
        if unit.state_bytes <= left:
            left -= unit.state_bytes
        else:
            state[unit.name] = Tier.NVME


def _spill_params_to_nvme(units: tuple[UnitSize, ...], params: dict[str, Tier], max_in_cpu: int) -> None:
    """Rule 5: host parameter shards kept in forward order while their elements fit, the rest to NVMe."""
    left = max_in_cpu
    for unit in units:
        if params[unit.name] is not Tier.HOST:
            continue
        if unit.param_numel <= left:
            left -= unit.param_numel
        else:
            params[unit.name] = Tier.NVME


def _host_and_nvme_bytes(units: tuple[UnitSize, ...], params: dict[str, Tier],
                         state: dict[str, Tier]) -> tuple[int, int]:
    """Host bytes (NVMe units' gradient shards among them) and bytes in swap files."""
    nvme = sum(u.swap_bytes for u in units if state[u.name] is Tier.NVME)
    in_memory = sum(u.state_bytes - u.swap_bytes for u in units if state[u.name] is Tier.NVME)
    return _bytes_on(units, params, state, Tier.HOST) + in_memory, nvme


def widened(current: Plan, proposed: Plan, inputs: PlanInputs) -> Plan:
    """`current` with every piece `proposed` puts on the device brought there too, and
    nothing taken off it (what sits on the device never moves back); bytes recounted, under
    `inputs.budget` as its budget."""
    params = {u.name: u.params if u.params is Tier.NVME  # fixed at initialize too
              else Tier.DEVICE if Tier.DEVICE in (u.params, proposed.params_tier(u.name)) else Tier.HOST
              for u in current.units}
    state = {u.name: u.state if u.state is Tier.NVME  # the NVMe tier is fixed at initialize
             else Tier.DEVICE if Tier.DEVICE in (u.state, proposed.state_tier(u.name)) else Tier.HOST
             for u in current.units}
    accumulators = {u.name for u in current.units + proposed.units if u.accumulates_on_device}
    return _counted(inputs, params, state, accumulators, current.fixed_bytes)


def _counted(inputs: PlanInputs, params: dict[str, Tier], state: dict[str, Tier], accumulators: set[str],
             fixed: int) -> Plan:
    """The plan of these tiers, with its device and host bytes."""
    units = inputs.units
    placed = tuple(UnitPlacement(u.name, params[u.name], state[u.name],
                                 Tier.DEVICE if u.name in accumulators else state[u.name], not u.frozen)
                   for u in units)
    held = sum(u.grad_bytes for u, p in zip(units, placed) if p.accumulates_on_device)
    device = inputs.resident_bytes + inputs.working_bytes + _bytes_on(units, params, state, Tier.DEVICE) + held
    host, nvme = _host_and_nvme_bytes(units, params, state)
    nvme_params = sum(u.param_bytes for u in units if params[u.name] is Tier.NVME)
    if nvme_params:
        host += inputs.param_staging_bytes
    staging = _state_staging_bytes(inputs, nvme)
    return Plan(placed, inputs.budget, device, host + staging, fixed, inputs.budget_source, nvme, nvme_params,
                inputs.working_bytes, inputs.reserve, staging)


def _state_staging_bytes(inputs: PlanInputs, nvme: int) -> int:
    """The optimizer NVMe tier's staging buffers: `buffer_count` of the largest swap group,
    which is at most the group bound and at most what the swap files hold."""
    if not nvme:
        return 0
    group = nvme if inputs.state_group_bytes is None else min(nvme, inputs.state_group_bytes)
    return inputs.state_staging_buffers * group


def _ratio_tiers(units: tuple[UnitSize, ...], ratio: float) -> dict[str, Tier]:
    """DeepSpeed's rule: of n trainable units the first int((1 - ratio) * n) on the device."""
    trainable = [u for u in units if not u.frozen]
    keep = int((1 - ratio) * len(trainable))
    return {u.name: Tier.DEVICE if i < keep else Tier.HOST for i, u in enumerate(trainable)}


def _fixed_bytes(inputs: PlanInputs, params: dict[str, Tier], state: dict[str, Tier]) -> int:
    """Device bytes before the budget places anything: the resident parameters, the
    working set, and every piece already on the device by the config (or the ratio)."""
    return inputs.resident_bytes + inputs.working_bytes + _bytes_on(inputs.units, params, state, Tier.DEVICE)


def _bytes_on(units: tuple[UnitSize, ...], params: dict[str, Tier], state: dict[str, Tier], tier: Tier) -> int:
    return sum((u.param_bytes if params[u.name] is tier else 0) + (u.state_bytes if state[u.name] is tier else 0)
               for u in units)


def _check_fixed_fits(inputs: PlanInputs, fixed: int) -> None:
    budget = inputs.budget
    assert budget is not None
    if fixed <= budget:
        return
    largest = max(inputs.units, key=lambda u: u.gathered_bytes, default=None)
    unit = (f"the largest unit, {largest.name!r}, is {largest.gathered_bytes / GIB:.3f} GiB gathered"
            if largest is not None else "the model has no units")
    pinned = fixed - inputs.resident_bytes - inputs.working_bytes
    raise PlacementError(
        f"the GPU memory budget of {budget / GIB:.3f} GiB ({inputs.budget_source or 'given'}) cannot hold "
        f"what must be on the device: {fixed / GIB:.3f} GiB = working set {inputs.working_bytes / GIB:.3f} GiB "
        f"(gathered units and gradient buckets; {unit}) + resident parameters "
        f"{inputs.resident_bytes / GIB:.3f} GiB + state the config keeps on the device {pinned / GIB:.3f} GiB. "
        "Raise placement.gpu_budget, offload more (offload_param / offload_optimizer to \"cpu\", a higher "
        "offload_optimizer.ratio), or lower stage3_max_live_parameters / reduce_bucket_size / "
        "stage3_param_persistence_threshold")


def _fill_params(units: tuple[UnitSize, ...], params: dict[str, Tier], left: int) -> int:
    """Parameter shards onto the device: frozen units first, then the others; in each group
    the shards left on the host are spread evenly through the forward order (`_spread_host`).
    Returns the bytes still free."""
    for group in ([u for u in units if u.frozen], [u for u in units if not u.frozen]):
        candidates = [u for u in group if params[u.name] is Tier.HOST]
        for unit in _spread_host(candidates, left):
            params[unit.name] = Tier.DEVICE
            left -= unit.param_bytes
    return left


def _spread_host(group: list[UnitSize], left: int) -> list[UnitSize]:
    """The units of `group` (forward order) whose shards come to the device within `left`
    bytes: all if they fit; else the fewest host units, at evenly spaced positions, that let
    the rest fit, then any host unit that still fits, in forward order. Spread host units
    let each one's copy to the device overlap the compute of the device units before it;
    a run of host units in a row would wait on the bus one after another."""
    total = sum(u.param_bytes for u in group)
    if total <= left:
        return list(group)
    n = len(group)

    def host_slots(h: int) -> list[int]:
        return sorted({int((i + 0.5) * n / h) for i in range(h)})

    def fits(h: int) -> bool:
        return total - sum(group[i].param_bytes for i in host_slots(h)) <= left

    low, high = 1, n  # the fewest host units that fit (bisected: sizes alike, more host units free more)
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(middle) else (middle + 1, high)
    while not fits(low):  # units of unlike sizes: step on until it fits (h = n always does)
        low += 1
    host = host_slots(low)
    on_host = set(host)
    chosen = [u for i, u in enumerate(group) if i not in on_host]
    spent = total - sum(group[i].param_bytes for i in host)
    for i in host:
        if group[i].param_bytes <= left - spent:
            chosen.append(group[i])
            spent += group[i].param_bytes
    return chosen


def _fill_accumulators(units: tuple[UnitSize, ...], state: dict[str, Tier], accumulators: set[str],
                       left: int) -> int:
    """Gradient accumulators onto the device while they fit, in forward order, for the
    trainable units whose optimizer side is on the host. Returns the bytes still free."""
    for unit in units:
        if unit.frozen or state[unit.name] is Tier.DEVICE or unit.grad_bytes > left:
            continue
        accumulators.add(unit.name)
        left -= unit.grad_bytes
    return left


def _fill_states(units: tuple[UnitSize, ...], params: dict[str, Tier], state: dict[str, Tier],
                 accumulators: set[str], left: int, keep: set[str] = frozenset()) -> int:
    """Optimizer sides onto the device while they fit, in forward order, for units whose
    parameter shards are there (none of `keep`); a side replaces the unit's accumulator,
    whose bytes it takes over. Returns the bytes still free."""
    for unit in units:
        if unit.frozen or state[unit.name] is Tier.DEVICE or params[unit.name] is not Tier.DEVICE \
                or unit.name in keep:
            continue
        cost = unit.state_bytes - (unit.grad_bytes if unit.name in accumulators else 0)
        if cost <= left:
            state[unit.name] = Tier.DEVICE
            accumulators.discard(unit.name)
            left -= cost
    return left
