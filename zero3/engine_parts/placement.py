"""The engine's placement: the plan made from its real units, and the pieces moved to it.

At initialize (`plan_placement`): each fetch unit's sizes on this rank (its parameter
shards; its gradient shards, masters and optimizer state from the client optimizer's
kind), the working set, the budget (zero3/placement/budget.py) -> a `Plan`
(zero3/placement/plan.py) -> a `Placement` every owner reads. `settle_parameters` then
puts each parameter shard on its tier and leaves each parameter sharded, resident or
aliased, and writes the NVMe tier's shards to their files. Under a measured budget,
`MeasuredPlacement` watches the first accumulation window and, at its boundary, makes the
plan and moves what now fits onto the device (`move_to_plan`): shards by their
ShardedParams, masters and optimizer state by the sharded optimizer, the host gradient
buffer by the gradient sink; at world size 1 what the plan keeps wholly on the device is
aliased to its shard, as at initialize. The second window may move more to the device,
none back; after it nothing moves unless `set_gpu_budget` asks.

Ownership: the tensors stay their owners'; this module only tells them where to go.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from zero3.config import Zero3Config
from zero3.grads.sink import GradSink
from zero3.optim.masters import ShardedOptimizer
from zero3.optim.state_moves import reshare
from zero3.params.fetch import Fetcher
from zero3.params.fetch_unit import FetchUnit
from zero3.params.nvme_shards import ParamSwap, attach_param_swap
from zero3.params.partition import ParamState, ShardedParam
from zero3.params.wire import gather_rows
from zero3.placement.budget import BudgetChoice, choose_budget, measured_budget
from zero3.placement.devices import Placement
from zero3.placement.plan import Plan, PlacementError, PlanInputs, Tier, UnitSize, make_plan, widened
from zero3.placement.sizes import param_staging_bytes, state_bytes_per_element, state_group_bytes, working_set_bytes
from zero3.platform.collectives import Communicator

logger = logging.getLogger("zero3")


def optimizer_state_elements(optimizer: torch.optim.Optimizer | None) -> int:
    """State tensors the client optimizer keeps per master element (an upper bound
    of 2 for a kind not listed)."""
    if optimizer is None:
        return 0
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 3 if group.get("amsgrad") else 2
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if group.get("momentum", 0) else 0
    if isinstance(optimizer, torch.optim.Adagrad):
        return 1
    if isinstance(optimizer, torch.optim.RMSprop):
        return 1 + bool(group.get("centered")) + bool(group.get("momentum", 0))
    return 2


@dataclass(frozen=True)
class SizeRules:
    """Bytes per element of each piece, from the config and the optimizer (placement/sizes.py)."""

    width: int  # compute dtype
    per_state_element: int  # gradient shard, master, optimizer state
    reduce_width: int
    grad_width: int  # a gradient shard's element (the master dtype), as a device accumulator holds it

    @classmethod
    def of(cls, config: Zero3Config, optimizer: torch.optim.Optimizer | None) -> "SizeRules":
        precision = config.precision
        width, reduce_width = _width(precision.dtype), _width(precision.reduce_dtype)
        per_state = state_bytes_per_element(width, optimizer_state_elements(optimizer), _width(precision.master_dtype),
                                            _width(precision.optimizer_state_dtype))
        return cls(width, per_state, reduce_width, _width(precision.master_dtype))


def _width(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def unit_sizes(units: list[FetchUnit], rules: SizeRules, trains: bool) -> tuple[UnitSize, ...]:
    """Each unit's bytes on this rank, in unit order (module order)."""
    sizes = []
    for unit in units:
        param_bytes = sum(sp.shard_numel * sp.param.element_size() for sp in unit.params)
        state_bytes = sum(sp.shard_numel for sp in unit.params if sp.requires_grad) * rules.per_state_element \
            if trains else 0
        gathered = sum(sp.numel * sp.param.element_size() for sp in unit.params)
        grads = sum(sp.shard_numel for sp in unit.params if sp.requires_grad) * rules.grad_width if trains else 0
        sizes.append(UnitSize(unit.name, param_bytes, state_bytes, gathered, grad_bytes=grads,
                              swap_bytes=state_bytes - grads, param_numel=sum(sp.shard_numel for sp in unit.params)))
    return tuple(sizes)


def working_set(config: Zero3Config, table: dict, units: list[FetchUnit], rules: SizeRules) -> int:
    """The working set of this engine's units (placement/sizes.py)."""
    return working_set_bytes(
        [sum(sp.numel for sp in u.params) for u in units],
        sum(sp.numel for sp in table.values() if not sp.persistent_by_config), config.zero.max_live_parameters,
        rules.width,
        sum(sp.padded_numel for sp in table.values() if sp.requires_grad), config.zero.reduce_bucket_size,
        rules.reduce_width)


def resident_bytes(table: dict) -> int:
    """Bytes of the parameters resident by the config (an aliased one is its unit's shard,
    charged there)."""
    return sum(sp.numel * sp.param.element_size() for sp in table.values() if sp.persistent_by_config)


def plan_inputs(config: Zero3Config, table: dict, units: list[FetchUnit], optimizer: torch.optim.Optimizer | None,
                choice: BudgetChoice, current: Placement | None = None) -> PlanInputs:
    """What the plan is made from; `current`: the placement a re-plan starts from (its NVMe
    units stay on NVMe and no other joins them: the NVMe tier is fixed at initialize)."""
    rules = SizeRules.of(config, optimizer)
    nvme = nvme_params = None
    if current is not None and current.plan is not None:
        if config.zero.offload_optimizer.nvme:
            nvme = tuple(u.name for u in current.plan.units if u.state is Tier.NVME)
        if config.zero.offload_param.nvme:
            nvme_params = tuple(u.name for u in current.plan.units if u.params is Tier.NVME)
    zero = config.zero
    sizes = unit_sizes(units, rules, trains=optimizer is not None)
    return PlanInputs(
        units=sizes,
        param_offload=zero.offload_param.enabled,
        state_offload=zero.offload_optimizer.enabled,
        ratio=zero.offload_optimizer.ratio,
        budget=choice.budget,
        resident_bytes=resident_bytes(table),
        working_bytes=working_set(config, table, units, rules) if choice.charges_working_set else 0,
        budget_source=choice.source,
        accumulation_steps=config.gradient_accumulation_steps,
        state_nvme=zero.offload_optimizer.nvme,
        host_budget=config.placement.host_budget,
        nvme_units=nvme,
        reserve=choice.reserve,
        params_nvme=zero.offload_param.nvme,
        max_in_cpu=zero.offload_param.max_in_cpu,
        param_staging_bytes=param_staging_bytes(zero.offload_param, rules.width, [u.param_bytes for u in sizes]),
        nvme_param_units=nvme_params,
        state_staging_buffers=zero.offload_optimizer.buffer_count,
        state_group_bytes=state_group_bytes(
            zero.sub_group_size, max((sp.shard_numel for sp in table.values() if sp.requires_grad), default=0),
            rules.per_state_element - rules.grad_width),
    )


def plan_placement(config: Zero3Config, table: dict, units: list[FetchUnit], optimizer: torch.optim.Optimizer | None,
                   device: torch.device) -> tuple[Placement, BudgetChoice]:
    """The placement at initialize (the config's alone when the budget is measured later)."""
    choice = choose_budget(config, device)
    try:
        plan = make_plan(plan_inputs(config, table, units, optimizer, choice))
    except PlacementError:
        if not choice.measure_first:
            raise
        choice = replace(choice, budget=None, source="auto: the config's placement until the first window is "
                         "measured (half the card cannot hold the working set)")
        plan = make_plan(plan_inputs(config, table, units, optimizer, choice))
    return placement_of(plan, units, device), choice


def agreed_placement(config: Zero3Config, table: dict, units: list[FetchUnit],
                     optimizer: torch.optim.Optimizer | None, device: torch.device,
                     comm: Communicator) -> tuple[Placement, BudgetChoice]:
    """`plan_placement` on every rank, its failure raised on every rank (an "auto" budget
    differs between ranks, so one rank alone may not fit), the plan logged by rank 0.
    Collective: one small all-gather."""
    try:
        placement, choice = plan_placement(config, table, units, optimizer, device)
        error = None
    except PlacementError as exc:
        placement, choice, error = None, None, str(exc)
    errors = [(rank, e) for rank, e in enumerate(comm.gather_objects(error)) if e is not None]
    if errors:
        rank, first = errors[0]
        raise PlacementError(first if error == first else f"rank {rank}: {first}")
    assert placement is not None and choice is not None
    log_plan(placement.plan, comm.rank)
    return placement, choice


def placement_of(plan: Plan, units: list[FetchUnit], device: torch.device) -> Placement:
    placement = Placement(device, plan)
    for unit in units:
        for sp in unit.params:
            placed = plan.by_name[unit.name]
            placement.assign(sp, placed.params, placed.state, placed.accumulator)
    return placement


def settle_parameters(table: dict[torch.nn.Parameter, ShardedParam], units: list[FetchUnit], placement: Placement,
                      comm: Communicator, config: Zero3Config, provisional: bool = False) -> ParamSwap | None:
    """Each shard onto its tier; then, at world size 1 without collectives, a parameter whose
    shard and optimizer side are both on the compute device is aliased to its shard
    (resident, stepped in place) unless the placement is `provisional` (the measured plan
    that follows moves pieces either way; it aliases what it keeps on the device); other
    non-persistent parameters are released and persistent ones that arrived partitioned are
    gathered. Last, the shards of the NVMe tier go to their swap files (params/nvme_shards.py;
    returned, None without the tier). Collective (those gathers, the swap folder's checks)."""
    device = placement.compute_device
    offload = config.zero.offload_param
    for sp in table.values():
        pin = offload.enabled and offload.pin_memory and placement.params_tier(sp) is not Tier.NVME
        sp.move_shard(placement.param_device(sp), pin)
        if not provisional and may_alias(sp, placement, comm):
            alias(sp, comm, device)
        elif sp.state is ParamState.FULL and not sp.persistent:
            sp.release()
        elif sp.state is ParamState.SHARDED and sp.persistent:
            sp.begin_gather()  # partitioned by zero3.Init, resident by the config
            sp.finish_gather(gather_rows(comm, sp.shard, device))
    on_nvme = [[sp for sp in unit.params if not sp.persistent and placement.params_tier(sp) is Tier.NVME]
               for unit in units]
    return attach_param_swap(offload, config.aio, on_nvme, comm, device)


def may_alias(sp: ShardedParam, placement: Placement, comm: Communicator) -> bool:
    """World size 1 without collectives, the shard on the parameter's own device, and the
    parameter's shard and optimizer side both on the device tier: it may be aliased to its
    shard (a host-side update would write a parameter the compute stream reads)."""
    return (not comm.active and sp.backing is None and sp.shard.device == sp.param.device
            and placement.state_tier(sp) is Tier.DEVICE and placement.params_tier(sp) is Tier.DEVICE)


def alias(sp: ShardedParam, comm: Communicator, device: torch.device, master: torch.Tensor | None = None) -> None:
    """`sp` gathered if it is not (one local copy at world size 1), then aliased to its shard
    (`master`: the master that is its shard, which follows it: ShardedParam.alias_shard)."""
    if sp.state is ParamState.SHARDED:
        sp.begin_gather()
        sp.finish_gather(gather_rows(comm, sp.shard, device))
    sp.alias_shard(master)


def gather_back(fetcher: Fetcher, table: dict[torch.nn.Parameter, ShardedParam], swap: ParamSwap | None) -> None:
    """Teardown: every parameter gathered whole again, then the NVMe tier's swap files
    removed. After a failed write of the tier its shards' values are lost: those parameters
    stay released (a warning says so)."""
    lost = swap is not None and swap.lost
    if lost:
        logger.warning("zero3: an NVMe swap write failed earlier; the parameters on the NVMe tier are left "
                       "released (their values are lost): load the last checkpoint into a new engine")
    try:
        fetcher.gather(sp for sp in table.values() if not (lost and sp.backing is not None))
    finally:
        if swap is not None:
            swap.close()


def log_plan(plan: Plan | None, rank: int) -> None:
    if plan is not None and rank == 0:
        logger.info("zero3: %s", plan.describe())


# ------------------------------------------------------------- moving to a new plan
@dataclass
class PlacementOwners:
    """Who holds the pieces the placement moves, and what a new plan is made from."""

    config: Zero3Config
    table: dict[torch.nn.Parameter, ShardedParam]
    units: list[FetchUnit]
    placement: Placement
    optimizer: ShardedOptimizer | None
    sink: GradSink
    client_optimizer: torch.optim.Optimizer | None
    comm: Communicator


def move_to_plan(owners: PlacementOwners, plan: Plan) -> int:
    """Every piece whose tier `plan` changes, moved there, between steps (no update in
    flight, no gradient held); the placement then says `plan`, and at world size 1 what it
    keeps wholly on the device is aliased (an aliased parameter it moves off becomes a copy
    again). Returns the parameters moved."""
    if owners.optimizer is not None:
        owners.optimizer.wait()
    _refuse_nvme_moves(owners.placement, owners.units, plan)
    placement, moved = owners.placement, 0
    pin = owners.config.zero.offload_param.pin_memory
    for unit in owners.units:
        placed = plan.by_name[unit.name]
        for sp in unit.params:
            if (placement.params_tier(sp), placement.state_tier(sp)) == (placed.params, placed.state):
                placement.assign(sp, placed.params, placed.state, placed.accumulator)  # its accumulator may move
                continue
            master = owners.optimizer.master_of(sp) if owners.optimizer is not None and sp.requires_grad else None
            if master is not None:
                owners.optimizer.move_side(sp, placement.device_of(placed.state))
            _move_shard(sp, placement.device_of(placed.params), pin, master)
            placement.assign(sp, placed.params, placed.state, placed.accumulator)
            if master is not None:
                reshare(sp, master, owners.optimizer.precision)
            moved += 1
    placement.plan = plan
    _alias_device_tier(owners)
    for unit in owners.units:
        unit.residency_changed()
    owners.sink.placement_changed()
    if owners.optimizer is not None:
        owners.optimizer.placement_changed()
    return moved


def _move_shard(sp: ShardedParam, device: torch.device, pin: bool, master: torch.Tensor | None) -> None:
    """The shard to `device`; an aliased one (on the device tier, which the plan now leaves)
    becomes a copy there, and the parameter is released unless it is resident. A master
    still on the parameter's storage (it was the aliased shard, and its tier's device did
    not change) takes a copy of its own first: the release would free its values."""
    if not sp.aliased:
        sp.move_shard(device, pin)
        return
    sp.unalias_shard(device, pin)
    if master is not None and master.untyped_storage().data_ptr() == sp.param.untyped_storage().data_ptr():
        with torch.no_grad():
            master.data = master.detach().clone()
    if not sp.persistent:
        sp.release()


def _alias_device_tier(owners: PlacementOwners) -> None:
    """At world size 1, each parameter the plan keeps wholly on the device tier is aliased
    to its shard, as `settle_parameters` does at initialize: no copy at each use, no
    gathered copy beside the shard. A master that is its shard (same dtype and device) moves
    onto the parameter's storage with it. Left as they are: one in use (held by a gather),
    a non-contiguous one."""
    device = owners.placement.compute_device
    for sp in owners.table.values():
        master = owners.optimizer.master_of(sp) if owners.optimizer is not None and sp.requires_grad else None
        in_use = sp.holds > 0 or (sp.state is ParamState.FULL and not sp.persistent)
        if sp.aliased or in_use or not sp.param.is_contiguous() or not may_alias(sp, owners.placement, owners.comm):
            continue
        alias(sp, owners.comm, device, master if master is sp.shard else None)


def _refuse_nvme_moves(placement: Placement, units: list[FetchUnit], plan: Plan) -> None:
    """The NVMe tier is fixed at initialize: a plan that takes a unit's optimizer side or
    parameter shards onto it or off it is refused before anything moves."""
    for unit in units:
        for sp in unit.params[:1]:
            for piece, now, new, keys in (
                    ("optimizer state", placement.state_tier(sp), plan.state_tier(unit.name),
                     "placement.host_budget, offload_optimizer.device"),
                    ("parameter shards", placement.params_tier(sp), plan.params_tier(unit.name),
                     "offload_param.max_in_cpu, offload_param.device")):
                if now is not new and Tier.NVME in (now, new):
                    raise PlacementError(
                        f"the new placement moves the {piece} of unit {unit.name!r} from {now.value} to "
                        f"{new.value}; the NVMe tier is decided at initialize ({keys}) and does not change "
                        "while training: keep the budget, or save a checkpoint and load it into an engine "
                        "built with the new one")


class MeasuredPlacement:
    """The "auto" budget with a measured activation reserve: the first accumulation
    window runs under the config's placement with the device's peak recorded; at its
    boundary the plan is made from what that window used, and what fits moves to the
    device. The second window, under that plan, is measured too (its transients are the
    placed run's own: fewer host copies than the first window's): where it leaves more room,
    more pieces move to the device once more, none back (budget.py says how each budget is
    computed). Does nothing in any other case."""

    ROUNDS = 2

    def __init__(self, owners: PlacementOwners, choice: BudgetChoice, rank: int) -> None:
        self.owners = owners
        self.rank = rank
        measuring = choice.measure_first and owners.placement.compute_device.type == "cuda"
        self.rounds_left = self.ROUNDS if measuring else 0
        self.allocated_at_start = 0
        if measuring:
            self._start_window(owners.placement.compute_device)

    def _start_window(self, device: torch.device) -> None:
        """The peak is measured from here, above what is allocated now."""
        torch.cuda.reset_peak_memory_stats(device)
        self.allocated_at_start = torch.cuda.memory_allocated(device)

    @property
    def pending(self) -> bool:
        return self.rounds_left > 0

    def after_boundary(self) -> None:
        """Called after each optimizer step: the first two place the state."""
        if not self.rounds_left:
            return
        self.rounds_left -= 1
        device = self.owners.placement.compute_device
        before = self.owners.placement.plan
        choice = measured_budget(device, torch.cuda.max_memory_allocated(device), self.allocated_at_start)
        if self.rounds_left == self.ROUNDS - 1:
            self._place(choice)  # the provisional plan replaced: pieces move either way
        elif before is not None and before.budget is not None and choice.budget > before.budget:
            self._widen(before, replace(choice, source=choice.source + " (second window)"))
        self._start_window(device)

    def _widen(self, current: Plan, choice: BudgetChoice) -> None:
        """More on the device under the larger budget of `choice`, nothing back to the
        host; kept as it is when the union would not fit."""
        owners = self.owners
        inputs = plan_inputs(owners.config, owners.table, owners.units, owners.client_optimizer, choice,
                             owners.placement)
        plan = widened(current, make_plan(inputs), inputs)
        if plan.device_bytes <= choice.budget and plan.counts() != current.counts():
            moved = move_to_plan(owners, plan)
            if self.rank == 0:
                logger.info("zero3: %s (%d parameters moved)", plan.describe(), moved)

    def place_under(self, budget: int, source: str) -> Plan:
        """A plan under `budget` (the working set charged), and the pieces moved to it.
        Raises PlacementError, moving nothing, when it cannot hold what must be on the device."""
        return self._place(BudgetChoice(budget, False, True, source))

    def _place(self, choice: BudgetChoice) -> Plan:
        owners = self.owners
        plan = make_plan(plan_inputs(owners.config, owners.table, owners.units, owners.client_optimizer, choice,
                                     owners.placement))
        moved = move_to_plan(owners, plan)
        if self.rank == 0:
            logger.info("zero3: %s (%d parameters moved)", plan.describe(), moved)
        return plan
