"""Engine: forward / backward / step over a ZeRO-3 sharded model, DeepSpeed's API.

Construction (engine_parts/build.py, in this order, on every rank): the model on its device
and dtype, rank 0's values broadcast -> ShardedParams (each rank keeps its shard;
non-persistent parameters released) -> fetch units -> the optimizer resolved and, for
the overlapped CPU update, the one background worker -> gradient reducer -> fetcher
(hooks) -> optimizer on fp32 master shards -> lr scheduler.

The data path of one optimizer step, top to bottom:
1. forward: each unit's pre-forward hook gathers its parameters (fetch.py -> wire.py:
   one guarded all-gather per dtype, prefetched ahead by lookahead.py); reads of other
   units' parameters are found by discovery.py and gathered too; the post-forward hook
   drops the holds, which releases the full tensors.
2. backward: each unit's pre-backward hook gathers again; each parameter's gradient is
   taken by the reducer (reduce.py) as it is produced, bucketed, reduce-scattered and
   added into the fp32 gradient shard (grads/sink.py, on the master device); the end of
   the outermost backward pass (`_end_backward`, the one place a backward ends) flushes
   the last buckets. Accumulation micro-steps add into the same shards.
3. step at the boundary (optim/masters.py): gradient norm over all ranks, clipping, the client
   optimizer on the fp32 master shards (or on the CPU, behind the next forward:
   optim/host_step.py), masters cast into the parameter shards; resident parameters refreshed
   from every rank's shard (`wire.gather_rows`); the lr scheduler steps.

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

from zero3.checkpoint import export
from zero3.checkpoint import save_load as checkpoint_io
from zero3.checkpoint.arrival import check_in
from zero3.checkpoint.async_save import engine_checkpointer
from zero3.compat.engine_surface import EngineSurface
from zero3.compat.param_status import mark_managed
from zero3.config import Zero3Config
from zero3.engine_parts import build, diagnostics, generation, progress
from zero3.engine_parts import placement as placement_parts
from zero3.engine_parts.autocast import autocast_of
from zero3.engine_parts.build import EngineError, EngineUsageError
from zero3.engine_parts.counters import StepCounters
from zero3.engine_parts.owner import ParamOwner, register, unregister
from zero3.engine_parts.state_offload import StateOffload
from zero3.engine_parts.rank_agreement import check_ranks_agree, config_items, model_items, optimizer_items
from zero3.engine_parts.timers import StepTimers, ThroughputTimer
from zero3.engine_parts.views import OptimizerAccess, ShardedModel
from zero3.monitor import MonitorMaster
from zero3.monitor.flops_profiler import EngineSizes, FlopsProfiler
from zero3.optim.loss_scaler import LossScaler
from zero3.optim.masters import settle
from zero3.params.compiled import CompiledUnits, take_requests
from zero3.params.late_params import LateParameters
from zero3.params.partition import ParamState
from zero3.params.units import build_units, declare_config_leaves
from zero3.sequence import long_context
from zero3.sequence import setup as sequence_setup
from zero3.params.wire import gather_rows, group_by_dtype
from zero3.platform.collectives import Communicator
from zero3.platform.device import get_accelerator

logger = logging.getLogger("zero3")


class Engine(EngineSurface, nn.Module):
    """A model trained with ZeRO stage 3; `engine(batch)` runs its forward.

    Like DeepSpeed's engine it is an `nn.Module` whose one child is the client's model,
    `engine.module`: `parameters()` / `named_parameters()` / `named_buffers()` are the
    model's (names prefixed `module.`), `train()` / `eval()` reach it, and an attribute
    the engine does not own is read from the model. The engine's own state lives in its
    collaborators (fetcher, reducer, optimizer), built here and owned by the engine; code
    outside the step (checkpoints, exports, gathering, generation) is handed typed views
    of them (`sharded_model`, `optimizer_access`, `param_owner`: engine_parts/views.py, engine_parts/owner.py).
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
        self.autocast = autocast_of(config.precision, self.device)  # the forward's torch_autocast region
        self.loss_scaler = LossScaler.from_precision(config.precision) if config.precision.fp16 else None
        self._init_counters()
        compile_requests = []
        if isinstance(model, nn.Module):
            model, compile_requests = take_requests(model)  # compiled per unit below, hooks eager
        build.refuse_scheduler_without_optimizer_instance(lr_scheduler, optimizer)  # before anything is sharded
        if isinstance(model, nn.Module):  # before any other collective: ranks that disagree fail here
            check_ranks_agree(self.comm, self.device, {
                **config_items(config), **optimizer_items(optimizer), **model_items(model)})
        self._gc_disabled_here = diagnostics.apply_process_settings(config)
        self.long_sequence = sequence_setup.prepare(model, config)  # SP groups, Ulysses, tiled pieces
        init_shards = build.prepare_module(model, self.device, self.compute_dtype, self.comm)
        self.module = model
        self.named_params = list(self.module.named_parameters())
        self.table = build.shard_parameters(self.named_params, init_shards, config, self.comm, self.device)
        self.units = build_units(self.module, self.table, config.zero.module_granularity_threshold,
                                 leaf_module=config.zero.leaf_module)
        client_optimizer = build.resolve_optimizer(config, optimizer, model_parameters, self.module)
        self.placement, budget_choice = placement_parts.agreed_placement(
            config, self.table, self.units, client_optimizer, self.device, self.comm)
        self.param_swap = placement_parts.settle_parameters(self.table, self.units, self.placement, self.comm, config,
                                                            provisional=budget_choice.measure_first)
        mark_managed(self.table)  # DeepSpeed's read-only ds_status / ds_shape / ds_numel
        self.param_names = {sp.param: sp.name for sp in self.table.values()}
        declare_config_leaves(self.module, config.zero.leaf_module)
        background = build.host_step_overlap(config, client_optimizer, self.device)
        self.reducer = build.build_reducer(config, self.table, self.units, self.comm, self.placement, background, model)
        self.late_params = LateParameters(self.table, self.device, self.compute_dtype, self.comm.rank)
        self.fetcher = build.build_fetcher(config, self.module, self.table, self.units, self.comm, self.device,
                                           self._end_backward, self.reducer, self.late_params.adopt, background)
        self.optimizer = build.build_sharded_optimizer(config, client_optimizer, self.table, self.comm,
                                                       self.placement, self.fetcher, self.reducer, background)
        self.lr_scheduler = build.resolve_scheduler(config, lr_scheduler, self.optimizer)
        self.placement_watch = placement_parts.MeasuredPlacement(placement_parts.PlacementOwners(
            config, self.table, self.units, self.placement, self.optimizer, self.reducer.sink, client_optimizer,
            self.comm), budget_choice, self.comm.rank)  # moves what fits to the device after a measured first window
        self.compiled_units = CompiledUnits(self.units, lambda: self.fetcher.root_forwards)
        for request in compile_requests:
            self.compiled_units.apply(request)
        self._build_views()
        self.checkpointer = engine_checkpointer(self._training_state(), config.checkpoint_async_save)
        register(self.param_owner)
        self._destroyed = False
        diagnostics.report_config(config, self.comm.rank)

    def _build_views(self) -> None:
        """The typed views that checkpoints, exports, GatheredParameters, generation and
        the parameter accessors read (engine_parts/views.py, engine_parts/owner.py), over the parts built above."""
        self.sharded_model = ShardedModel(self.module, self.table, self.comm, self.device, self.compute_dtype)
        self.optimizer_access = OptimizerAccess(self.optimizer)
        self.state_offload = StateOffload(self.sharded_model, self.optimizer_access)
        self.param_owner = ParamOwner(self.sharded_model, self.optimizer_access, self.fetcher, self.reducer.flush,
                                      self.placement)

    def _init_counters(self) -> None:
        """DeepSpeed's counters and timers, and the per-call flags of backward and step."""
        config = self.config
        self.counters = StepCounters()
        self._boundary_override: bool | None = None  # set_gradient_accumulation_boundary
        self._step_applied = False
        self._in_engine_backward = False
        self._backward_ended = False  # set by _end_backward, the one place a backward ends
        self._loss_scaled_by_client = False  # engine.scale(loss) was called for the next backward
        self.timers = StepTimers(enabled=config.wall_clock_breakdown)
        self.monitor = MonitorMaster(config.monitor)  # DeepSpeed's engine.monitor (zero3/monitor/)
        self.flops_profiler = FlopsProfiler(config.flops_profiler, self.comm.rank, lambda: EngineSizes(
            self.comm.world_size, self.dp_world_size, config.train_micro_batch_size_per_gpu))
        self.tput_timer = ThroughputTimer(
            config.throughput_timer_enabled, config.throughput_timer_synchronized, config.train_batch_size,
            config.steps_per_print, report=lambda line: self.comm.rank == 0 and logger.info(line))

    # DeepSpeed's counter attributes, kept in `self.counters` (engine_parts/counters.py)
    global_steps = property(lambda self: self.counters.global_steps,
                            lambda self, value: setattr(self.counters, "global_steps", value))
    micro_steps = property(lambda self: self.counters.micro_steps,
                           lambda self, value: setattr(self.counters, "micro_steps", value))
    global_samples = property(lambda self: self.counters.global_samples,
                              lambda self, value: setattr(self.counters, "global_samples", value))
    skipped_steps = property(lambda self: self.counters.skipped_steps,
                             lambda self, value: setattr(self.counters, "skipped_steps", value))

    # ------------------------------------------------------------ training API
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_trainable()
        if self.config.precision.auto_cast:
            args, kwargs = _cast_floating((args, kwargs), self.compute_dtype)
        self.tput_timer.start()
        self.reducer.sink.window_ends = self.is_gradient_accumulation_boundary()  # this micro-step's backward
        with self._phase("forward"), self.autocast.region():
            output = self.module(*args, **kwargs)
        if self.loss_scaler is not None and torch.is_grad_enabled():
            _hook_output_tensors(output, self._on_backward_start)
        return output

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate `loss` (divided by the accumulation steps, as DeepSpeed does).

        Returns what DeepSpeed's returns: the loss divided by gradient_accumulation_steps
        (when `scale_wrt_gas`), without the fp16 loss scale."""
        self._check_trainable()
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            raise EngineUsageError(
                f"engine.backward(loss) needs a scalar tensor that requires grad, got {type(loss).__name__}"
                + (" without grad" if isinstance(loss, torch.Tensor) else "")
                + "; did the forward run under torch.no_grad() or eval-only code?"
            )
        if loss.numel() != 1:
            raise EngineUsageError(f"engine.backward(loss) needs a scalar tensor, got shape {tuple(loss.shape)}; "
                                   "reduce the loss (e.g. .mean()) or call backward(grad) on the output yourself")
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
                self._backward_ended = False
                scaled.backward(retain_graph=retain_graph)
                if not self._backward_ended:  # the loss reached no hooked output of the model
                    self._end_backward()
        finally:
            self._in_engine_backward = False
            self.reducer.backward_divisor = float(steps)
        return loss / steps if scale_wrt_gas else loss

    @contextlib.contextmanager
    def loss_divided_by_caller(self) -> Iterator[None]:
        """Direct `loss.backward()` calls inside take the loss as already divided by the
        accumulation steps (the Hugging Face Trainer divides it itself): their gradients
        are reduced without the engine's own division. Not for fp16, whose loss must be
        scaled through engine.backward / engine.scale."""
        self._check_alive()
        previous, self.reducer.backward_divisor = self.reducer.backward_divisor, 1.0
        try:
            yield
        finally:
            self.reducer.backward_divisor = previous

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss multiplied by the fp16 loss scale, for `engine.scale(loss).backward()`.

        DeepSpeed 0.19's way to call backward yourself: `loss.backward()` on an engine's
        output works as `engine.backward(loss)` does (the accumulation divisor is applied to
        the gradients as they are reduced); under fp16 the loss must go through `scale`
        first, and a backward that skips it is refused before any gradient is kept.
        """
        if self.optimizer is None:
            raise EngineUsageError("engine.scale(loss) needs an optimizer: pass optimizer= to zero3.initialize "
                                   "or add an 'optimizer' config section")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.grad_fn is None:
            raise EngineUsageError(f"engine.scale(loss) needs a scalar tensor with a grad_fn, got "
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
        self._backward_ended = True
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
        self._check_trainable()
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
            progress.report_step(self)  # the monitors' events, steps_per_print
            self.placement_watch.after_boundary()
            diagnostics.collect_garbage(self._gc_disabled_here)
        self.tput_timer.stop(global_step=boundary)
        self.micro_steps += 1

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        """One of forward / backward / step: timed (wall_clock_breakdown), with memory
        logged around it (memory_breakdown)."""
        if self.config.memory_breakdown:
            diagnostics.log_memory(f"before {name}", self.comm.rank)
        with self.timers.time(name), self.flops_profiler.phase(name, self.global_steps, self.module):
            yield
        if self.config.memory_breakdown:
            diagnostics.log_memory(f"after {name}", self.comm.rank)

    def _optimizer_step(self, lr_kwargs: dict | None) -> bool:
        """Run the optimizer on the reduced gradients; False when an overflow skipped it."""
        with self.timers.time("backward_allreduce"):  # the reductions still in flight
            self.reducer.flush()
        self.reducer.sink.ship_held()
        divisor = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        stepped = self.optimizer.step(grad_divisor=divisor)
        self.optimizer.overflow = not stepped
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

    def _refresh_resident(self) -> None:
        """Resident parameters get their new values from every rank's updated shard."""
        resident = [sp for sp in self.optimizer.params if sp.persistent and sp.numel and not sp.aliased]
        self.optimizer.background.wait_for(resident)  # their sub-group runs first
        for _, group in group_by_dtype(resident):
            rows = gather_rows(self.comm, torch.cat([sp.shard.to(self.device) for sp in group]), self.device)
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
        collectives; sharded again on exit (zero3/engine_parts/generation.py)."""
        self._check_alive()
        return generation.gathered_model(self.sharded_model, self.fetcher, self.units, eval_mode)

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False, async_save: bool | None = None) -> bool:
        """Save the training state under `save_dir/<tag>` (a collective). Inside a
        gradient-accumulation window the gradients accumulated so far are saved too, and
        a load goes on from the same micro-step.

        With `async_save` (default: the config's checkpoint.async_save) it returns once a
        host snapshot is taken; the files are written and committed in the background
        (checkpoint/async_save.py). Either way it first waits for a save still in flight
        and raises that save's error, if it failed."""
        if save_dir is None or (isinstance(save_dir, str) and not save_dir.strip()):
            raise ValueError(f"save_checkpoint(save_dir={save_dir!r}): save_dir must name a directory "
                             "(e.g. \"checkpoints\"); nothing was written")
        self._check_alive()
        self.checkpointer.wait()
        check_in("save_checkpoint", self.comm.rank, self.comm.world_size, self.config.checkpoint_arrival_timeout)
        self._settle()
        self.reducer.flush()
        # Zero gradient shards of leaf parameters no rank used are not gradients: dropped
        # before they are saved, so a load goes on as this engine does (grads/usage.py).
        self.reducer.usage.drop_unused_everywhere(self.comm.all_reduce, self.device)
        use_async = self.config.checkpoint_async_save if async_save is None else bool(async_save)
        save = self.checkpointer.save if use_async else checkpoint_io.save
        return save(self._training_state(), save_dir, tag, client_state or {}, save_latest, exclude_frozen_parameters,
                    self.config.checkpoint_tag_validation, self.config.zero.gather_16bit_weights_on_model_save)

    def wait_for_checkpoint(self) -> None:
        """Return once the last save is committed; raise its error (on every rank) if it failed."""
        self.checkpointer.wait()

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False):
        self._check_alive()
        self.checkpointer.wait()
        check_in("load_checkpoint", self.comm.rank, self.comm.world_size, self.config.checkpoint_arrival_timeout)
        self._settle()
        loaded = checkpoint_io.load(
            self._training_state(), load_dir, tag, load_module_strict, load_optimizer_states,
            load_lr_scheduler_states, load_module_only, self.config.gradient_accumulation_steps,
            load_rng_state=self.config.checkpoint_load_rng_state,
        )
        self.reducer.usage.note_restored()  # gradients saved inside a window were used somewhere
        return loaded

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.safetensors",
                         exclude_frozen_parameters: bool = False) -> bool:
        self._check_alive()
        self._settle()
        return export.save_16bit_model(self.sharded_model, self.optimizer_access, save_dir, save_filename,
                                       exclude_frozen_parameters)

    def _training_state(self) -> checkpoint_io.TrainingState:
        """What a checkpoint saves and restores, as the engine holds it now (the scheduler
        is read at each call: it may be replaced after initialize)."""
        return checkpoint_io.TrainingState(self.sharded_model, self.optimizer_access, self.lr_scheduler,
                                           self.counters, self.loss_scaler, self.placement, self.zero_grad,
                                           self.config.raw)

    # -------------------------------------------------------------- lifetime
    def destroy(self) -> None:
        """Remove every hook; let go of the optimizer side (the client optimizer's state is
        cleared) and gather the parameters back, whole, so the module is plain again. A save
        being written is waited for first; its error, if any, is raised once taken down."""
        if self._destroyed:
            return
        try:
            self.checkpointer.close()
        finally:
            self._take_down()

    def _take_down(self) -> None:
        if self.optimizer is not None:
            try:
                self.optimizer.background.close()
            finally:
                self.optimizer.swap.close()  # the NVMe tier's swap files removed
            self.optimizer.let_go()  # the device's optimizer side freed before the gathers below
        self.fetcher.release_all()
        placement_parts.gather_back(self.fetcher, self.table, self.param_swap)  # NVMe swap files removed
        self.fetcher.remove()
        self.compiled_units.remove()
        self.reducer.remove()
        long_context.revert(self.long_sequence)
        self.monitor.close()
        unregister(self.param_owner)
        diagnostics.restore_process_settings(self._gc_disabled_here)
        self._destroyed = True

    def _settle(self) -> None:
        """Wait for an optimizer update still running behind the forward, if any."""
        settle(self.optimizer)

    def _check_alive(self) -> None:
        if self._destroyed:
            raise EngineError("this engine was destroyed; build a new one with zero3.initialize")

    def _check_trainable(self) -> None:
        """Alive, and with no state offloaded by offload_states()."""
        self._check_alive()
        if self.state_offload.offloaded:
            raise EngineUsageError(f"the states {sorted(self.state_offload.offloaded)} are offloaded "
                                   "(engine.offload_states()); call engine.reload_states() before training on")


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
