"""Building an engine's parts, in the order the Engine constructor calls them.

  model -> `prepare_module` (DeepSpeed zero.Init's partitions adopted, zero3.Init's shards
  claimed, dtype cast, rank 0's values broadcast) -> `shard_parameters` (ShardedParams; non-persistent ones released) ->
  `resolve_optimizer` (client's, a factory's, or the config's) -> `host_step_overlap`
  (whether the CPU update runs behind the next forward: then one `BackgroundStep` is made
  here and handed to everything that must wait for it) -> `build_reducer` ->
  `build_fetcher` -> `build_sharded_optimizer` -> `resolve_scheduler`.

Every collaborator gets what it needs at construction; nothing is patched in afterwards.
Each function is collective where it says so (every rank calls it, in this order).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from zero3.config import Zero3Config
from zero3.engine_parts.deepspeed_adopt import adopt_deepspeed_partitions
from zero3.engine_parts.errors import EngineError, EngineUsageError  # noqa: F401 - the engine's errors, named here too
from zero3.grads.reduce import GradReducer
from zero3.optim.host_step import BackgroundStep
from zero3.engine_parts.autocast import param_reduce_dtypes
from zero3.optim.masters import ShardedOptimizer
from zero3.optim.nvme_state import OptimizerSwap
from zero3.optim.precision import MasterPrecision
from zero3.optim.optimizers import build_optimizer, build_scheduler
from zero3.params.fetch import Fetcher
from zero3.params.fetch_unit import FetchUnit
from zero3.params.init import claim_init_shard, drop_forward_guards, init_shard_of
from zero3.params.partition import ShardedParam
from zero3.params.released import (
    guard_load_state_dict,
    guard_state_dict,
    refuse_released,
    release_storage,
    unseal,
)
from zero3.params.schedule import PrefetchPolicy
from zero3.params.units import choose_persistent
from zero3.params.wire import group_by_dtype
from zero3.placement.devices import Placement
from zero3.platform.collectives import Communicator

logger = logging.getLogger("zero3")

ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adamax,
    torch.optim.RMSprop, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Rprop, torch.optim.ASGD,
)


# ------------------------------------------------------------------ the model
def prepare_module(model: nn.Module, device: torch.device, compute_dtype: torch.dtype,
                   comm: Communicator) -> dict[nn.Parameter, torch.Tensor]:
    """Move `model` to `device`, parameters to `compute_dtype` (buffers keep theirs, as
    DeepSpeed), rank 0's values everywhere. Collective. Returns the shards of parameters
    partitioned by zero3.Init, or by DeepSpeed's zero.Init and adopted here first
    (deepspeed_adopt.py); those parameters are left empty; the caller owns the shards."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"zero3.initialize(model=...) expects an nn.Module, got {type(model).__name__}")
    adopt_deepspeed_partitions(model, comm)
    for name, p in model.named_parameters():
        if init_shard_of(p) is None:
            refuse_released(p, "zero3.initialize", name, fix="it was sharded by another engine or zero3.Init "
                            "context that no longer manages it; build the model afresh (or destroy() the "
                            "other engine first, which gathers its parameters back)")
    init_shards = claim_init_shards(model, device, compute_dtype, comm)
    drop_forward_guards(model)
    model.to(device)
    if compute_dtype != torch.float32:
        for p in model.parameters():
            if p.is_floating_point() and p not in init_shards:
                p.data = p.data.to(compute_dtype)
    built_full = [p for p in model.parameters() if p not in init_shards]
    for module in model.modules():
        guard_state_dict(module)  # module.state_dict() outside GatheredParameters: meta, not freed memory
        guard_load_state_dict(module)  # module.load_state_dict() into sharded parameters: refused whole
    broadcast_from_rank0(comm, built_full + list(model.buffers()))  # Init's shards are rank 0's already
    return init_shards


def claim_init_shards(model: nn.Module, device: torch.device, compute_dtype: torch.dtype,
                      comm: Communicator) -> dict[nn.Parameter, torch.Tensor]:
    """Take over the shards of parameters partitioned by zero3.Init, cast to the
    compute dtype; each such parameter is left empty, on the compute device."""
    shards: dict[nn.Parameter, torch.Tensor] = {}
    for name, p in model.named_parameters():
        record = claim_init_shard(p)
        if record is None:
            continue
        if (record.world_size, record.rank) != (comm.world_size, comm.rank):
            raise EngineError(
                f"parameter {name} was partitioned by zero3.Init as rank {record.rank} of "
                f"{record.world_size}, but this engine is rank {comm.rank} of "
                f"{comm.world_size}; build the model and the engine in the same process group")
        dtype = compute_dtype if p.is_floating_point() else p.dtype
        if p.device != device or p.dtype != dtype:
            unseal(p)
            p.data = torch.empty(p.shape, dtype=dtype, device=device)
            release_storage(p)
        shards[p] = record.shard.to(dtype)
    return shards


def broadcast_from_rank0(comm: Communicator, tensors: list[torch.Tensor]) -> None:
    """Rank 0's values everywhere: one broadcast per dtype over a flat copy. Collective."""
    if not comm.active:
        return
    with torch.no_grad():
        for _, group in group_by_dtype([t for t in tensors if t.numel()], lambda t: t.dtype):
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            comm.broadcast(flat, src=0)
            offset = 0
            for t in group:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


def shard_parameters(named_params: list[tuple[str, nn.Parameter]], init_shards: dict[nn.Parameter, torch.Tensor],
                     config: Zero3Config, comm: Communicator, device: torch.device
                     ) -> dict[nn.Parameter, ShardedParam]:
    """ShardedParams for every parameter, each shard where the config puts it (the host with
    offload_param); not yet released: engine_parts/placement.py settles each on its tier and
    releases, gathers or aliases it. Consumes `init_shards`."""
    zero = config.zero
    persistent = choose_persistent(named_params, zero.param_persistence_threshold, zero.model_persistence_threshold)
    offload = zero.offload_param.enabled  # "nvme": on the host until settled into the swap files
    shard_device = torch.device("cpu") if offload else device
    # with "nvme" pinned only once placed (engine_parts/placement.py): the NVMe tier's go to files
    pin = offload and zero.offload_param.pin_memory and not zero.offload_param.nvme
    table: dict[nn.Parameter, ShardedParam] = {}
    for name, p in named_params:
        init_shard = init_shards.pop(p, None)
        if init_shard is None:
            give_exclusive_storage(p)
        table[p] = ShardedParam(p, name, comm.rank, comm.world_size, id(p) in persistent, shard_device, pin,
                                shard=init_shard)
    return table


def give_exclusive_storage(p: nn.Parameter) -> None:
    """Make `p` the sole, contiguous owner of a resizable storage, so releasing it frees it
    (Transformers' from_pretrained leaves weights in file mappings, which cannot be resized)."""
    exclusive = (
        p.untyped_storage().resizable()
        and p.is_contiguous()
        and p.storage_offset() == 0
        and p.untyped_storage().nbytes() == p.numel() * p.element_size()
    )
    if not exclusive:
        p.data = p.data.clone(memory_format=torch.contiguous_format)


# ------------------------------------------------------------- the optimizer
def resolve_optimizer(config: Zero3Config, optimizer: Any, model_parameters: Iterable | None,
                      module: nn.Module) -> torch.optim.Optimizer | None:
    """The client optimizer (an instance, or a factory called on the parameters), or the
    config's; None when there is neither."""
    spec = config.optimizer
    if optimizer is not None and spec is not None:
        _warn_section_ignored("optimizer", f"optimizer of type {spec.type!r}", "optimizer")
        spec = None
    params = list(model_parameters) if model_parameters is not None else None
    if params is None:
        params = [p for p in module.parameters() if p.requires_grad]
    optimizer = client_or_config(optimizer, spec, _is_optimizer_factory, build_optimizer, lambda _: params)
    if optimizer is not None:
        check_optimizer_is_elementwise(config, optimizer)
    return optimizer


def _warn_section_ignored(section: str, what: str, argument: str) -> None:
    """DeepSpeed's rule: the client's object wins over the config's section, which is ignored."""
    if _is_rank_zero():
        logger.warning("zero3: the config's %r section (%s) is ignored: the %s passed to initialize is used, "
                       "as DeepSpeed does", section, what, argument)


def _is_rank_zero() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _is_optimizer_factory(value: Any) -> bool:
    return callable(value) and not isinstance(value, torch.optim.Optimizer)


def client_or_config(client: Any, spec: Any, is_factory: Callable[[Any], bool], build: Callable[[Any, Any], Any],
                     argument: Callable[[bool], Any]) -> Any:
    """What the client gave (an instance as it is, or a factory called on the argument),
    else what the config's section `spec` builds (`build(spec, argument)`); None when
    there is neither. `argument(from_config)` is asked for on those two paths only, and
    may refuse with an error naming the path."""
    if client is None:
        return None if spec is None else build(spec, argument(True))
    return client(argument(False)) if is_factory(client) else client


def check_optimizer_is_elementwise(config: Zero3Config, optimizer: torch.optim.Optimizer) -> None:
    """A client optimizer must update each element from its own state only: zero3
    hands it flat shards, so an optimizer that uses a whole tensor's shape or norm
    (Adafactor, LAMB, Shampoo, Muon) would be silently wrong."""
    if isinstance(optimizer, ELEMENTWISE_OPTIMIZERS) or config.zero_allow_untested_optimizer:
        return
    raise EngineError(
        f"optimizer {type(optimizer).__name__} is not one zero3 knows to be elementwise "
        f"({', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}); it will see each "
        "rank's flat 1-D shard, not the whole tensor. If it updates every element from "
        "that element's own state only, set \"zero_allow_untested_optimizer\": true"
    )


def host_step_overlap(config: Zero3Config, optimizer: torch.optim.Optimizer | None,
                      device: torch.device) -> BackgroundStep | None:
    """The worker that runs the CPU optimizer update behind the next forward
    (optim/host_step.py), or None when the update runs in step().

    It needs offload_optimizer on the CPU (the host-tier sub-groups of the placement run
    there; device-tier ones step in step()), and a torch optimizer (stepped by shadow
    optimizers of its class, optim/masters.py). "auto" turns it on when the
    compute device is a GPU (on a CPU it would compete with the forward for the cores)."""
    zero = config.zero
    setting = zero.offload_optimizer.overlap_step
    if optimizer is None or setting is False:
        return None
    problems = []
    if not zero.offload_optimizer.enabled:
        problems.append("it needs offload_optimizer on the CPU (got "
                        f"offload_optimizer.device={zero.offload_optimizer.device!r})")
    if type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
        problems.append(f"it needs one of torch's optimizers ({', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}), "
                        f"got {type(optimizer).__module__}.{type(optimizer).__name__}")
    if setting == "auto":
        return BackgroundStep() if not problems and device.type == "cuda" else None
    if problems:
        raise EngineError("zero_optimization.offload_optimizer.overlap_step is true, but "
                          + "; ".join(problems) + '; set it to "auto" or false')
    return BackgroundStep()


def build_sharded_optimizer(config: Zero3Config, client: torch.optim.Optimizer | None,
                            table: dict[nn.Parameter, ShardedParam], comm: Communicator,
                            placement: Placement, fetcher: Fetcher, reducer: GradReducer,
                            background: BackgroundStep | None) -> ShardedOptimizer | None:
    """The client optimizer over master shards (None without one); the reducer's usage tells
    it which parameters got no gradient in a window (grads/usage.py), its sink tells it of the
    gradients of the window's last backward (optim/early_update.py). With offload_optimizer
    "nvme" it holds the NVMe tier (optim/nvme_state.py; a collective: every rank checks its
    swap folder)."""
    if client is None:
        return None
    zero = config.zero
    swap = OptimizerSwap(zero.offload_optimizer, config.aio) if zero.offload_optimizer.nvme else None
    optimizer = ShardedOptimizer(
        client, table, comm, placement, config.gradient_clipping,
        check_overflow=config.precision.check_grad_overflow,
        pin_memory=zero.offload_optimizer.enabled and zero.offload_optimizer.pin_memory,
        sub_group_numel=zero.sub_group_size,
        unit_order=fetcher.params_in_forward_order if background is not None else None,
        usage=reducer.usage,
        background=background,
        leaf_modules={unit.module: unit.params for unit in fetcher.units if unit.leaf},
        swap=swap,
        precision=MasterPrecision.of(config.precision),
        early_update_bytes=early_update_bytes(config),
    )
    reducer.sink.on_delivery = optimizer.early.delivered if optimizer.early.enabled else None
    return optimizer


def early_update_bytes(config: Zero3Config) -> int:
    """placement.early_update_bytes: "auto" (None) is 2 GiB of copies a window, 0 turns the
    host updates in the last backward off (optim/early_update.py)."""
    chosen = config.placement.early_update_bytes
    return 2 << 30 if chosen is None else chosen


def resolve_scheduler(config: Zero3Config, lr_scheduler: Any, optimizer: ShardedOptimizer | None) -> Any:
    """The client's scheduler (an instance, or a factory called on the optimizer), or the
    config's; None when there is neither."""
    spec = config.scheduler
    if lr_scheduler is not None and spec is not None:
        _warn_section_ignored("scheduler", f"scheduler of type {spec.type!r}", "lr_scheduler")
        spec = None

    def client_optimizer(from_config: bool) -> torch.optim.Optimizer:
        if optimizer is None:
            raise EngineError("the config's 'scheduler' section needs an optimizer" if from_config
                              else "an lr_scheduler factory needs an optimizer")
        return optimizer.optimizer

    scheduler = client_or_config(lr_scheduler, spec, _is_scheduler_factory, build_scheduler, client_optimizer)
    if scheduler is lr_scheduler and optimizer is not None:
        rebind_scheduler(scheduler, optimizer.optimizer)
    return scheduler


def refuse_scheduler_without_optimizer_instance(lr_scheduler: Any, optimizer: Any) -> None:
    """DeepSpeed's assert, with its condition: a scheduler instance of torch's old
    `_LRScheduler` base with no optimizer instance given. Called before anything is sharded,
    so the refusal leaves the model as it was. Other scheduler instances built on an optimizer
    the engine does not step are rebound to it (`rebind_scheduler`)."""
    if isinstance(lr_scheduler, torch.optim.lr_scheduler._LRScheduler) and \
            not isinstance(optimizer, torch.optim.Optimizer):
        raise EngineUsageError(
            f"initialize(lr_scheduler=...): the {type(lr_scheduler).__name__} is an instance but the "
            f"optimizer is {type(optimizer).__name__} (not an instance), so the scheduler drives an "
            "optimizer the engine never steps; pass the optimizer it was built on as optimizer=, or "
            "pass a factory (lr_scheduler=lambda optimizer: ...) that builds it on the engine's")


def rebind_scheduler(lr_scheduler: Any, stepped: torch.optim.Optimizer) -> None:
    """Point a client scheduler instance built on another optimizer at the one the engine
    steps, carrying its per-group `lr` and `initial_lr` over, so its learning rates reach
    training (DeepSpeed keeps such a scheduler on the stray optimizer, where they have no
    effect). The group counts must match; the scheduler owns nothing else of the optimizer."""
    scheduled = getattr(lr_scheduler, "optimizer", None)
    if not isinstance(scheduled, torch.optim.Optimizer) or scheduled is stepped:
        return
    theirs, ours = scheduled.param_groups, stepped.param_groups
    if len(theirs) != len(ours):
        raise EngineUsageError(
            f"initialize(lr_scheduler=...): the {type(lr_scheduler).__name__} was built on a "
            f"{type(scheduled).__name__} with {len(theirs)} parameter groups, the engine steps a "
            f"{type(stepped).__name__} with {len(ours)}; pass the optimizer the scheduler was built on "
            "as optimizer=, or a factory (lr_scheduler=lambda optimizer: ...) that builds it on the engine's")
    _track_steps_as_schedulers_do(stepped)
    for group, source in zip(ours, theirs):
        for key in ("lr", "initial_lr"):
            if key in source:
                group[key] = source[key]
    lr_scheduler.optimizer = stepped
    warnings.warn(
        f"initialize(lr_scheduler=...): the {type(lr_scheduler).__name__} was built on a "
        f"{type(scheduled).__name__} the engine does not step; it now drives the engine's "
        f"{type(stepped).__name__} (learning rates {[g['lr'] for g in ours]}). Build it on the optimizer "
        "you pass, or pass a factory, to silence this", UserWarning, stacklevel=3)


def _track_steps_as_schedulers_do(optimizer: torch.optim.Optimizer) -> None:
    """torch's schedulers wrap their optimizer's `step` at construction to check the call order;
    a scheduler rebound later needs the same wrapper. A factor-1 ConstantLR installs it through
    torch's own code and leaves every learning rate as it was."""
    torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)


def _is_scheduler_factory(value: Any) -> bool:
    return callable(value) and not hasattr(value, "step")


# --------------------------------------------------- gradients and gathering
def build_reducer(config: Zero3Config, table: dict[nn.Parameter, ShardedParam], units: list[FetchUnit],
                  comm: Communicator, placement: Placement,
                  background: BackgroundStep | None, module: nn.Module | None = None) -> GradReducer:
    """The gradient reducer; leaf units' gradients deferred to a point every rank shares;
    gradient shards in the master dtype; under torch_autocast the lower-precision-safe
    modules of `module` reduced in the autocast dtype (engine_parts/autocast.py)."""
    per_param = param_reduce_dtypes(module, table, config.precision) if module is not None else {}
    reducer = GradReducer(
        list(table.values()),
        comm,
        bucket_numel=config.zero.reduce_bucket_size,
        reduce_dtype=config.gradient_reduce_dtype,
        placement=placement,
        prescale=config.prescale_gradients,
        predivide_factor=config.gradient_predivide_factor,
        overlap=config.zero.overlap_comm,
        fence=background.wait_step if background is not None else None,
        grad_dtype=MasterPrecision.of(config.precision).grad_dtype,
        param_reduce_dtypes=per_param,
    )
    reducer.backward_divisor = float(config.gradient_accumulation_steps)
    for unit in units:
        if unit.leaf:
            reducer.defer(unit.params)
    return reducer


def build_fetcher(config: Zero3Config, module: nn.Module, table: dict[nn.Parameter, ShardedParam],
                  units: list[FetchUnit], comm: Communicator, device: torch.device,
                  on_backward_end: Callable[[], None], reducer: GradReducer,
                  on_structure_change: Callable[[], None], background: BackgroundStep | None) -> Fetcher:
    """The fetcher; `on_structure_change` adopts modules attached after initialize (late_params.py)."""
    zero = config.zero
    return Fetcher(
        module, table, units, comm, device, on_backward_end,
        on_leaf_backward=reducer.reduce_deferred,
        policy=PrefetchPolicy(
            bucket_numel=zero.prefetch_bucket_size,
            max_live_numel=zero.max_live_parameters,
            reuse_distance_numel=zero.max_reuse_distance,
            log_departures=zero.log_trace_cache_warnings,
        ),
        on_structure_change=on_structure_change,
        shard_fence=background.wait_for if background is not None else None,
    )
