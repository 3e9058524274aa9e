"""Engine: forward / backward / step over a ZeRO-3 sharded model, DeepSpeed's API.

Construction (in this order, on every rank):
  config -> device and dtype -> rank 0's initial values broadcast -> ShardedParams
  (each rank keeps its shard; non-persistent parameters released) -> fetch units and
  hooks -> gradient reducer -> optimizer on fp32 master shards -> lr scheduler.

Counters follow DeepSpeed: `micro_steps` counts engine.step() calls, `global_steps`
optimizer steps, `global_samples` samples; `is_gradient_accumulation_boundary()` is
true on the micro-step whose step() runs the optimizer.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from . import checkpoint as checkpoint_io
from . import diagnostics, export, generation
from .accelerator import get_accelerator
from .arrival import check_in
from .comm import Communicator
from .config import Zero3Config
from .engine_surface import EngineSurface
from .fetch import Fetcher
from .gathered import register_engine, unregister_engine
from .optim import ShardedOptimizer
from .optimizers import build_optimizer, build_scheduler
from .init import claim_init_shard, drop_forward_guards, init_shard_of
from .released import guard_state_dict, refuse_released
from .param_status import mark_managed
from .partition import ParamState, ShardedParam
from .precision import LossScaler
from .timers import StepTimers, ThroughputTimer
from .rank_agreement import check_ranks_agree, config_items, model_items, optimizer_items
from .reduce import GradReducer
from .schedule import PrefetchPolicy
from .units import build_units, choose_persistent

logger = logging.getLogger("zero3")


ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adamax,
    torch.optim.RMSprop, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Rprop, torch.optim.ASGD,
)


class EngineError(RuntimeError):
    """Misuse of the engine (wrong call order, missing optimizer, ...)."""


class Engine(EngineSurface, nn.Module):
    """A model trained with ZeRO stage 3; `engine(batch)` runs its forward.

    Like DeepSpeed's engine it is an `nn.Module` whose one child is the client's model,
    `engine.module`: `parameters()` / `named_parameters()` / `named_buffers()` are the
    model's (names prefixed `module.`), `train()` / `eval()` reach it, and an attribute
    the engine does not own is read from the model. The engine's own state lives in its
    collaborators (fetcher, reducer, optimizer), built here and owned by the engine.
    """

    def __init__(
        self,
        model: nn.Module,
        config: Zero3Config,
        optimizer: torch.optim.Optimizer | Callable | None = None,
        model_parameters: Iterable | None = None,
        lr_scheduler: Any = None,
        comm: Communicator | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.comm = comm or Communicator()
        self.accelerator = get_accelerator()
        self.device = self.accelerator.device()
        self.compute_dtype = config.precision.dtype
        self.loss_scaler = (
            LossScaler.from_precision(config.precision) if self.compute_dtype == torch.float16 else None
        )
        self._init_counters()
        if isinstance(model, nn.Module):  # before any other collective: ranks that disagree fail here
            check_ranks_agree(self.comm, self.device, {
                **config_items(config), **optimizer_items(optimizer), **model_items(model)})
        self._gc_disabled_here = diagnostics.apply_process_settings(config)
        self.module = self._prepare_module(model)
        self.named_params = list(self.module.named_parameters())
        self.table = self._shard_parameters()
        self.param_names = {sp.param: sp.name for sp in self.table.values()}
        self.units = build_units(self.module, self.table, config.zero.module_granularity_threshold,
                                 leaf_module=config.zero.leaf_module)
        self.master_device = (
            torch.device("cpu") if config.zero.offload_optimizer.device == "cpu" else self.device
        )
        self.reducer = self._build_reducer()
        self.fetcher = self._build_fetcher()
        self.optimizer = self._build_optimizer(optimizer, model_parameters)
        self.lr_scheduler = self._resolve_scheduler(lr_scheduler)
        register_engine(self)
        self._destroyed = False
        diagnostics.report_config(config, self.comm.rank)

    def _init_counters(self) -> None:
        """DeepSpeed's counters and timers, and the per-call flags of backward and step."""
        config = self.config
        self.global_steps = 0
        self.micro_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self._boundary_override: bool | None = None  # set_gradient_accumulation_boundary
        self._step_applied = False
        self._in_engine_backward = False
        self._loss_scaled_by_client = False  # engine.scale(loss) was called for the next backward
        self.timers = StepTimers(enabled=config.wall_clock_breakdown)
        self.tput_timer = ThroughputTimer(
            config.throughput_timer_enabled, config.throughput_timer_synchronized, config.train_batch_size,
            config.steps_per_print, report=lambda line: self.comm.rank == 0 and logger.info(line))

    def _build_reducer(self) -> GradReducer:
        config = self.config
        reducer = GradReducer(
            list(self.table.values()),
            self.comm,
            bucket_numel=config.zero.reduce_bucket_size,
            reduce_dtype=config.precision.reduce_dtype,
            grad_device=self.master_device,
            prescale=config.prescale_gradients,
            predivide_factor=config.gradient_predivide_factor,
            overlap=config.zero.overlap_comm,
        )
        reducer.backward_divisor = float(config.gradient_accumulation_steps)
        for unit in self.units:
            if unit.leaf:
                reducer.defer(unit.params)
        return reducer

    def _build_fetcher(self) -> Fetcher:
        zero = self.config.zero
        return Fetcher(
            self.module, self.table, self.units, self.comm, self.device, self._end_backward,
            on_leaf_backward=self.reducer.reduce_deferred,
            policy=PrefetchPolicy(
                bucket_numel=zero.prefetch_bucket_size,
                max_live_numel=zero.max_live_parameters,
                reuse_distance_numel=zero.max_reuse_distance,
                log_departures=zero.log_trace_cache_warnings,
            ),
        )

    def _build_optimizer(self, optimizer, model_parameters) -> ShardedOptimizer | None:
        """The client optimizer over fp32 master shards; with the overlapped host step, the
        fetcher and the gradient sink wait for the update in flight where they must."""
        client_optimizer = self._resolve_optimizer(optimizer, model_parameters)
        if client_optimizer is None:
            return None
        zero = self.config.zero
        overlap = self._overlaps_host_step(client_optimizer)
        sharded = ShardedOptimizer(
            client_optimizer, self.table, self.comm, self.master_device, self.config.gradient_clipping,
            check_overflow=self.config.precision.check_grad_overflow,
            pin_memory=zero.offload_optimizer.device == "cpu" and zero.offload_optimizer.pin_memory,
            sub_group_numel=zero.sub_group_size,
            unit_order=self.fetcher.params_in_forward_order if overlap else None,
        )
        if overlap:
            self.fetcher.shard_fence = sharded.background.wait_for
            self.reducer.sink.fence = sharded.background.wait
        return sharded

    # ------------------------------------------------------------------ setup
    def _prepare_module(self, model: nn.Module) -> nn.Module:
        if not isinstance(model, nn.Module):
            raise TypeError(f"zero3.initialize(model=...) expects an nn.Module, got {type(model).__name__}")
        for name, p in model.named_parameters():
            if init_shard_of(p) is None:
                refuse_released(p, "zero3.initialize", name, fix="it was sharded by another engine or zero3.Init "
                                "context that no longer manages it; build the model afresh (or destroy() the "
                                "other engine first, which gathers its parameters back)")
        self.init_shards = self._claim_init_shards(model)
        drop_forward_guards(model)
        model.to(self.device)
        if self.compute_dtype != torch.float32:
            # Parameters only, as DeepSpeed: buffers keep their dtype.
            for p in model.parameters():
                if p.is_floating_point() and p not in self.init_shards:
                    p.data = p.data.to(self.compute_dtype)
        built_full = [p for p in model.parameters() if p not in self.init_shards]
        for module in model.modules():
            guard_state_dict(module)  # module.state_dict() outside GatheredParameters: meta, not freed memory
        self._broadcast_from_rank0(built_full + list(model.buffers()))  # Init's shards are rank 0's already
        return model

    def _claim_init_shards(self, model: nn.Module) -> dict[nn.Parameter, torch.Tensor]:
        """Take over the shards of parameters partitioned by zero3.Init, cast to the
        compute dtype; each such parameter is left empty, on the compute device."""
        shards: dict[nn.Parameter, torch.Tensor] = {}
        for name, p in model.named_parameters():
            record = claim_init_shard(p)
            if record is None:
                continue
            if (record.world_size, record.rank) != (self.comm.world_size, self.comm.rank):
                raise EngineError(
                    f"parameter {name} was partitioned by zero3.Init as rank {record.rank} of "
                    f"{record.world_size}, but this engine is rank {self.comm.rank} of "
                    f"{self.comm.world_size}; build the model and the engine in the same process group")
            dtype = self.compute_dtype if p.is_floating_point() else p.dtype
            if p.device != self.device or p.dtype != dtype:
                p.data = torch.empty(p.shape, dtype=dtype, device=self.device)
                p.untyped_storage().resize_(0)
            shards[p] = record.shard.to(dtype)
        return shards

    def _broadcast_from_rank0(self, tensors: list[torch.Tensor]) -> None:
        """Rank 0's values everywhere: one broadcast per dtype over a flat copy."""
        if not self.comm.active:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            if t.numel():
                by_dtype.setdefault(t.dtype, []).append(t)
        with torch.no_grad():
            for group in by_dtype.values():
                flat = torch.cat([t.detach().reshape(-1) for t in group])
                self.comm.broadcast(flat, src=0)
                offset = 0
                for t in group:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()

    def _shard_parameters(self) -> dict[nn.Parameter, ShardedParam]:
        """ShardedParams for every parameter; non-persistent ones released.

        At world size 1 with the shards on the compute device there is nothing to shard:
        every parameter is aliased to its shard (partition.py) and stays resident, so no
        gather, copy or hook work is ever done for it."""
        zero = self.config.zero
        persistent = choose_persistent(
            self.named_params, zero.param_persistence_threshold, zero.model_persistence_threshold
        )
        offload = zero.offload_param.device == "cpu"
        shard_device = torch.device("cpu") if offload else self.device
        pin = offload and zero.offload_param.pin_memory
        alias = self.comm.world_size == 1 and not offload
        table: dict[nn.Parameter, ShardedParam] = {}
        for name, p in self.named_params:
            init_shard = self.init_shards.pop(p, None)
            if init_shard is None:
                _give_exclusive_storage(p)
            sp = ShardedParam(
                p, name, self.comm.rank, self.comm.world_size, alias or id(p) in persistent, shard_device, pin,
                shard=init_shard,
            )
            if sp.state is ParamState.FULL and not sp.persistent:
                sp.release()
            elif sp.state is ParamState.SHARDED and sp.persistent:
                self._gather_resident(sp)  # partitioned by zero3.Init, resident by the config
            if alias:
                sp.alias_shard()
            mark_managed(p)
            table[p] = sp
        return table

    def _gather_resident(self, sp: ShardedParam) -> None:
        """SHARDED -> FULL for good: a persistent parameter that arrived partitioned."""
        rows = torch.empty(sp.world_size, sp.shard_numel, dtype=sp.dtype, device=self.device)
        self.comm.all_gather_into(rows.view(-1), sp.shard.to(self.device))
        sp.begin_gather()
        sp.finish_gather(rows)

    def _resolve_optimizer(self, optimizer, model_parameters) -> torch.optim.Optimizer | None:
        spec = self.config.optimizer
        if optimizer is not None and spec is not None:
            raise EngineError(
                "both a client optimizer and the config's 'optimizer' section were given; "
                "remove one of them (DeepSpeed refuses this too)"
            )
        params = list(model_parameters) if model_parameters is not None else None
        if params is None:
            params = [p for p in self.module.parameters() if p.requires_grad]
        if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
            optimizer = optimizer(params)
        if optimizer is None and spec is not None:
            optimizer = build_optimizer(spec, params)
        if optimizer is not None:
            self._check_optimizer_is_elementwise(optimizer)
        return optimizer

    def _check_optimizer_is_elementwise(self, optimizer: torch.optim.Optimizer) -> None:
        """A client optimizer must update each element from its own state only: zero3
        hands it flat shards, so an optimizer that uses a whole tensor's shape or norm
        (Adafactor, LAMB, Shampoo, Muon) would be silently wrong."""
        if isinstance(optimizer, ELEMENTWISE_OPTIMIZERS) or self.config.zero_allow_untested_optimizer:
            return
        raise EngineError(
            f"optimizer {type(optimizer).__name__} is not one zero3 knows to be elementwise "
            f"({', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}); it will see each "
            "rank's flat 1-D shard, not the whole tensor. If it updates every element from "
            "that element's own state only, set \"zero_allow_untested_optimizer\": true"
        )

    def _overlaps_host_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the CPU optimizer update runs behind the next forward (host_step.py):
        it needs the masters and the parameter shards on the CPU, and a torch optimizer
        (stepped by shadow optimizers of its class, optim.py). "auto" turns it on when the
        compute device is a GPU (on a CPU it would compete with the forward for the cores)."""
        zero = self.config.zero
        setting = zero.offload_optimizer.overlap_step
        if setting is False:
            return False
        problems = []
        if not (zero.offload_optimizer.enabled and zero.offload_param.enabled):
            problems.append("it needs offload_optimizer and offload_param both on the CPU (got "
                            f"offload_optimizer.device={zero.offload_optimizer.device!r}, "
                            f"offload_param.device={zero.offload_param.device!r})")
        if type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
            problems.append(f"it needs one of torch's optimizers ({', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}), "
                            f"got {type(optimizer).__module__}.{type(optimizer).__name__}")
        if setting == "auto":
            return not problems and self.device.type == "cuda"
        if problems:
            raise EngineError("zero_optimization.offload_optimizer.overlap_step is true, but "
                              + "; ".join(problems) + '; set it to "auto" or false')
        return True

    def _resolve_scheduler(self, lr_scheduler):
        spec = self.config.scheduler
        if lr_scheduler is not None and spec is not None:
            raise EngineError(
                "both a client lr_scheduler and the config's 'scheduler' section were given; "
                "remove one of them"
            )
        if lr_scheduler is None and spec is not None:
            if self.optimizer is None:
                raise EngineError("the config's 'scheduler' section needs an optimizer")
            return build_scheduler(spec, self.optimizer.optimizer)
        if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            if self.optimizer is None:
                raise EngineError("an lr_scheduler factory needs an optimizer")
            return lr_scheduler(self.optimizer.optimizer)
        return lr_scheduler

    # ------------------------------------------------------------ training API
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_alive()
        if self.config.precision.auto_cast:
            args, kwargs = _cast_floating((args, kwargs), self.compute_dtype)
        self.tput_timer.start()
        with self._phase("forward"):
            output = self.module(*args, **kwargs)
        if self.loss_scaler is not None and torch.is_grad_enabled():
            _hook_output_tensors(output, self._on_backward_start)
        return output

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate `loss` (divided by the accumulation steps, as DeepSpeed does)."""
        self._check_alive()
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            raise EngineError(
                f"engine.backward(loss) needs a tensor that requires grad, got {type(loss).__name__}"
                + (" without grad" if isinstance(loss, torch.Tensor) else "")
                + "; did the forward run under torch.no_grad() or eval-only code?"
            )
        self._settle()  # this backward's gradients overwrite what an update in flight reads
        scaled = loss
        steps = self.config.gradient_accumulation_steps
        if scale_wrt_gas and steps > 1:
            scaled = loss / steps
        if self.loss_scaler is not None:
            scaled = scaled * self.loss_scaler.scale
        self._in_engine_backward = True
        self.reducer.backward_divisor = 1.0  # the loss itself carries the accumulation divisor
        try:
            with self._phase("backward"):
                scaled.backward(retain_graph=retain_graph)
                self.reducer.flush()
        finally:
            self._in_engine_backward = False
            self.reducer.backward_divisor = float(steps)
        return loss

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss multiplied by the fp16 loss scale, for `engine.scale(loss).backward()`.

        DeepSpeed 0.19's way to call backward yourself: `loss.backward()` on an engine's
        output works as `engine.backward(loss)` does (the accumulation divisor is applied to
        the gradients as they are reduced); under fp16 the loss must go through `scale`
        first, and a backward that skips it is refused before any gradient is kept.
        """
        if self.optimizer is None:
            raise EngineError("engine.scale(loss) needs an optimizer: pass optimizer= to zero3.initialize "
                              "or add an 'optimizer' config section")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.grad_fn is None:
            raise EngineError(f"engine.scale(loss) needs a scalar tensor with a grad_fn, got "
                              f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
        self._loss_scaled_by_client = True
        return loss * self.loss_scaler.scale if self.loss_scaler is not None else loss

    def _on_backward_start(self) -> None:
        """fp16 only: a backward that reaches the model's outputs must carry the loss scale."""
        if self._in_engine_backward:
            return
        scaled, self._loss_scaled_by_client = self._loss_scaled_by_client, False
        if not scaled:
            raise EngineError(
                "fp16 training needs the loss scaled before backward, but loss.backward() was called "
                "on an unscaled loss; call engine.backward(loss) or engine.scale(loss).backward()")

    def _end_backward(self) -> None:
        """End of every backward (engine.backward or a direct loss.backward()): every
        gradient of it is reduced into its shard."""
        self.reducer.flush()
        if self.config.zero.enable_sanity_checks:
            self._check_after_backward()

    def _check_after_backward(self) -> None:
        """enable_sanity_checks: after a whole backward every non-resident parameter is
        released with no hold left, and every gradient shard has its shard's size."""
        problems = [f"{sp.name} is {sp.state.name} with {sp.holds} holds" for sp in self.table.values()
                    if not sp.persistent and (sp.state is not ParamState.SHARDED or sp.holds)]
        problems += [f"{sp.name} has a gradient shard of {sp.grad_shard.numel()} elements, expected "
                     f"{sp.shard_numel}" for sp in self.table.values()
                     if sp.grad_shard is not None and sp.grad_shard.numel() != sp.shard_numel]
        if problems:
            raise EngineError("zero_optimization.enable_sanity_checks: after backward " + "; ".join(problems[:10])
                              + ". This is an engine fault: please report it with the model")

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next step() runs the optimizer: the value given to
        set_gradient_accumulation_boundary, else every gradient_accumulation_steps-th call."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override the micro-step counter, as Accelerate does: set False before the
        micro-batches of a window and True before its last, and call step() only then."""
        self._boundary_override = bool(is_boundary)

    def was_step_applied(self) -> bool:
        """Whether the last step() updated the parameters (False between boundaries and
        on a skipped overflow step)."""
        return self._step_applied

    def step(self, lr_kwargs: dict | None = None) -> None:
        """End of a micro-step; at the accumulation boundary, the optimizer steps.

        Counters as DeepSpeed 0.19.8: `micro_steps` counts step() calls; `global_steps`
        and `global_samples` (by train_batch_size) advance at each boundary, skipped
        overflow steps included."""
        self._check_alive()
        if self.reducer.coalescing:
            raise EngineError("engine.step() inside coalesce_grad_reduction(): call it after the block, "
                              "whose exit reduces the gradients the step needs")
        self._step_applied = False
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            if self.optimizer is None:
                raise EngineError(
                    "engine.step() at an accumulation boundary needs an optimizer: pass "
                    "optimizer= to zero3.initialize or add an 'optimizer' config section"
                )
            with self._phase("step"):
                self._step_applied = self._optimizer_step(lr_kwargs)
            self.global_steps += 1
            self.global_samples += self.config.train_batch_size
            self._report_progress()
            diagnostics.collect_garbage(self._gc_disabled_here)
        self.tput_timer.stop(global_step=boundary)
        self.micro_steps += 1

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        """One of forward / backward / step: timed (wall_clock_breakdown), with memory
        logged around it (memory_breakdown)."""
        if self.config.memory_breakdown:
            diagnostics.log_memory(f"before {name}", self.comm.rank)
        with self.timers.time(name):
            yield
        if self.config.memory_breakdown:
            diagnostics.log_memory(f"after {name}", self.comm.rank)

    def _optimizer_step(self, lr_kwargs: dict | None) -> bool:
        """Run the optimizer on the reduced gradients; False when an overflow skipped it."""
        self.reducer.flush()
        divisor = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        stepped = self.optimizer.step(grad_divisor=divisor)
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow=not stepped)
        if not stepped:
            self.skipped_steps += 1
            if self.comm.rank == 0:
                logger.warning("zero3: gradient overflow (norm %s) at step %d; step skipped%s",
                               self.optimizer.last_grad_norm, self.global_steps,
                               f", loss scale now {self.loss_scaler.scale:g}" if self.loss_scaler else "")
            return False
        self._refresh_resident()
        if self.lr_scheduler is not None:
            try:
                self.lr_scheduler.step(**(lr_kwargs or {}))
            except TypeError:
                # DeepSpeed's fallback for schedulers whose step() takes the batch size.
                self.lr_scheduler.step(self.config.train_batch_size)
        return True

    def _report_progress(self) -> None:
        """DeepSpeed's steps_per_print: rank 0 logs step, lr and (with
        wall_clock_breakdown) the mean forward / backward / step times."""
        every = self.config.steps_per_print
        if not every or self.global_steps % every or self.comm.rank != 0:
            return
        message = (f"zero3: step={self.global_steps} skipped={self.skipped_steps} "
                   f"lr={self.get_lr()} grad_norm={self.get_global_grad_norm()}")
        if self.loss_scaler is not None:
            message += f" loss_scale={self.loss_scaler.scale:g}"
        if self.timers.enabled:
            message += " " + self.timers.summary_and_reset()
        logger.info(message)
        print(message, flush=True)

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def loss_scaler_state(self) -> dict | None:
        return self.loss_scaler.state_dict() if self.loss_scaler is not None else None

    def load_loss_scaler_state(self, state: dict) -> None:
        if self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(state)

    def _refresh_resident(self) -> None:
        """Resident parameters get their new values from every rank's updated shard."""
        resident = [sp for sp in self.optimizer.params if sp.persistent and sp.numel and not sp.aliased]
        self.optimizer.background.wait_for(resident)  # their sub-group runs first
        by_dtype: dict[torch.dtype, list[ShardedParam]] = {}
        for sp in resident:
            by_dtype.setdefault(sp.dtype, []).append(sp)
        for dtype, group in by_dtype.items():
            total = sum(sp.shard_numel for sp in group)
            send = torch.cat([sp.shard.to(self.device) for sp in group])
            recv = torch.empty(self.comm.world_size * total, dtype=dtype, device=self.device)
            self.comm.all_gather_into(recv, send)
            rows = recv.view(self.comm.world_size, total)
            offset = 0
            for sp in group:
                sp.refresh(rows[:, offset:offset + sp.shard_numel])
                offset += sp.shard_numel

    @contextlib.contextmanager
    def coalesce_grad_reduction(self) -> Iterator[None]:
        """DeepSpeed's one-reduction window: the backwards inside keep their gradients on
        this rank (summed, whole: more memory) and one reduction runs on exit; step() goes
        after the block. Results equal reducing after every backward, up to rounding."""
        self._check_alive()
        if self.reducer.coalescing:
            raise EngineError("coalesce_grad_reduction() cannot be nested")
        self.reducer.begin_coalescing()
        try:
            yield
        finally:
            self.reducer.end_coalescing()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Refused, as in DeepSpeed at stage 3: gradients are partitioned as they are made."""
        raise EngineError("no_sync() is incompatible with ZeRO stage 3, whose gradients are reduce-scattered "
                          "into shards during backward (DeepSpeed refuses it too); use "
                          "engine.coalesce_grad_reduction() to reduce once for several backwards")
        yield  # pragma: no cover - a generator for the context manager protocol

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop accumulated gradients (the optimizer step does this by itself)."""
        self._settle()
        self.reducer.clear()
        for sp in self.table.values():
            sp.grad_shard = None
            sp.grad_sq_norm = None
            sp.param.grad = None

    def gathered_for_generation(self, eval_mode: bool = True):
        """Context: every parameter gathered once, for generate() without per-token
        collectives; sharded again on exit (zero3/generation.py)."""
        self._check_alive()
        return generation.gathered_for_generation(self, eval_mode)

    # --------------------------------------------------------------- queries
    def comm_stats(self) -> dict[str, tuple[int, int]]:
        """op name -> (calls, bytes), cumulative since initialize."""
        return self.comm.counters.snapshot()

    @property
    def late_gathers(self) -> int:
        """Gathers the backward safety net had to make (zero on ordinary models)."""
        return self.fetcher.late_gathers

    def sharded_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer state."""
        return export.held_bytes(self)

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """Save the training state under `save_dir/<tag>` (a collective). Inside a
        gradient-accumulation window the gradients accumulated so far are saved too, and
        a load goes on from the same micro-step."""
        if save_dir is None or (isinstance(save_dir, str) and not save_dir.strip()):
            raise ValueError(f"save_checkpoint(save_dir={save_dir!r}): save_dir must name a directory "
                             "(e.g. \"checkpoints\"); nothing was written")
        self._check_alive()
        check_in("save_checkpoint", self.comm.rank, self.comm.world_size, self.config.checkpoint_arrival_timeout)
        self._settle()
        self.reducer.flush()
        return checkpoint_io.save(self, save_dir, tag, client_state or {}, save_latest,
                                  exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False):
        self._check_alive()
        check_in("load_checkpoint", self.comm.rank, self.comm.world_size, self.config.checkpoint_arrival_timeout)
        self._settle()
        return checkpoint_io.load(
            self, load_dir, tag, load_module_strict, load_optimizer_states,
            load_lr_scheduler_states, load_module_only,
        )

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.safetensors",
                         exclude_frozen_parameters: bool = False) -> bool:
        self._check_alive()
        self._settle()
        return export.save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    # -------------------------------------------------------------- lifetime
    def destroy(self) -> None:
        """Remove every hook; gather the parameters back so the module is plain again."""
        if self._destroyed:
            return
        if self.optimizer is not None:
            self.optimizer.background.close()
        self.fetcher.release_all()
        self.fetcher.gather(self.table.values())
        self.fetcher.remove()
        self.reducer.remove()
        unregister_engine(self)
        diagnostics.restore_process_settings(self._gc_disabled_here)
        self._destroyed = True

    def _settle(self) -> None:
        """Wait for an optimizer update still running behind the forward, if any."""
        if self.optimizer is not None:
            self.optimizer.wait()

    def _check_alive(self) -> None:
        if self._destroyed:
            raise EngineError("this engine was destroyed; build a new one with zero3.initialize")


def _give_exclusive_storage(p: nn.Parameter) -> None:
    """Make `p` the sole, contiguous owner of its storage, so releasing it frees it."""
    exclusive = (
        p.is_contiguous()
        and p.storage_offset() == 0
        and p.untyped_storage().nbytes() == p.numel() * p.element_size()
    )
    if not exclusive:
        p.data = p.data.clone(memory_format=torch.contiguous_format)


def _hook_output_tensors(output: Any, on_first: Callable[[], None]) -> None:
    """Call `on_first` once, when a backward first reaches any tensor of `output`
    (tensors, lists, tuples and dicts such as Hugging Face's ModelOutput)."""
    tensors = [t for t in _tensors_in(output) if t.grad_fn is not None]
    if not tensors:
        return
    fired = [False]

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if not fired[0]:
            fired[0] = True
            on_first()
        return grad

    for tensor in tensors:
        tensor.register_hook(hook)


def _tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_in(v)]
    return []


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """fp16.auto_cast: floating-point tensors in the forward inputs cast to `dtype`."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_floating(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floating(v, dtype) for k, v in value.items()}
    return value
