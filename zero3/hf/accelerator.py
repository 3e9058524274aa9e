"""`zero3.hf.Accelerator`: an Accelerate custom loop on zero3, as Accelerate runs it on DeepSpeed.

    from zero3.hf import Accelerator            # instead of: from accelerate import Accelerator
    accelerator = Accelerator(zero3_config="ds_zero3.json", gradient_accumulation_steps=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

DeepSpeed need not be installed. The DeepSpeed JSON comes from `zero3_config=`, or from a
`deepspeed_plugin=` (Accelerate's `DeepSpeedPlugin`, parsed by Accelerate itself), or from the
Accelerate DeepSpeed yaml the process was launched with (`zero3 launch --config_file
ds_zero3.yaml train.py`, or `accelerate launch` where DeepSpeed is installed: the launcher's
`ACCELERATE_DEEPSPEED_*` environment). Accelerate itself then runs as a plain multi-process
setup; zero3's engine takes what DeepSpeed takes under Accelerate 1.16:

- `prepare`: data loaders are Accelerate's; the model (with the optimizer and scheduler beside
  it) becomes a zero3 engine, the config's "auto" values filled as Accelerate fills them (the
  micro batch from the loaders, accumulation from the Accelerator, `gradient_clipping` 1.0,
  the hidden-size keys from `model.config`, bf16 / fp16 from `mixed_precision`, DummyOptim /
  DummyScheduler from the config's sections), with Accelerate's errors for an optimizer or
  scheduler given twice;
- `backward(loss)`: the engine's backward with Accelerate's accumulation boundary, and the
  engine's step at the boundary (the loss is divided by the accumulation steps there, once);
  the optimizer's `step` / `zero_grad` are then no-ops, as are a config scheduler's; a torch
  scheduler is Accelerate's AcceleratedScheduler over the engine's optimizer;
- `clip_grad_norm_` returns the norm the engine clipped by (its `gradient_clipping`);
  `optimizer.step_was_skipped` / `accelerator.optimizer_step_was_skipped` read the engine's
  overflow flag;
- `save_state` / `load_state`: the engine's checkpoint under `<dir>/pytorch_model` (DeepSpeed's
  tag under Accelerate) beside Accelerate's own files (RNG states, samplers, custom objects),
  so a resume is exact; `get_state_dict` gathers whole 16-bit tensors to rank 0 where the
  config asks for it (`stage3_gather_16bit_weights_on_model_save`, Accelerate's error
  otherwise), and `save_model` writes them; `unwrap_model` gives the user's module;
  `free_memory` destroys the engines.

Owns: the engines it built (until `free_memory`); the DeepSpeed config, filled in place.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from typing import Any

import accelerate
import torch
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import DeepSpeedPlugin
from accelerate.utils.deepspeed import DeepSpeedOptimizerWrapper, DeepSpeedSchedulerWrapper, DummyOptim, DummyScheduler
from torch import nn

from zero3.api import initialize
from zero3.engine import Engine
from zero3.engine_parts.build import rebind_scheduler
from zero3.hf import config_fill
from zero3.runtime import lr_schedules

MODEL_NAME = "pytorch_model"  # the tag Accelerate gives DeepSpeed's checkpoint of its first model
_HIDDEN_SIZE_KEYS = ("zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                     "zero_optimization.stage3_param_persistence_threshold")


class Zero3AcceleratorError(ValueError):
    """A loop or config zero3's Accelerator cannot run as given; the message names the fix."""


class Accelerator(accelerate.Accelerator):
    """Accelerate's Accelerator with zero3's engine where Accelerate would run DeepSpeed's
    (see the module docstring). One more argument: `zero3_config`."""

    def __init__(self, *args: Any, zero3_config: dict | str | os.PathLike | None = None, **kwargs: Any) -> None:
        plugin = _deepspeed_plugin(zero3_config, kwargs.pop("deepspeed_plugin", None),
                                   kwargs.pop("deepspeed_plugins", None))
        mixed = kwargs.get("mixed_precision") or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        kwargs["mixed_precision"] = "no"  # the engine owns precision: no autocast, no grad scaler
        configured = plugin.deepspeed_config.get("gradient_accumulation_steps")
        if isinstance(configured, int) and "gradient_accumulation_steps" not in kwargs \
                and "gradient_accumulation_plugin" not in kwargs:
            kwargs["gradient_accumulation_steps"] = configured
        launched = os.environ.get("ACCELERATE_USE_DEEPSPEED")
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "false"  # Accelerate's own DeepSpeed path stays off
        try:
            super().__init__(*args, **kwargs)
        finally:  # a later Accelerator in this process reads the launcher's settings again
            if launched is None:
                del os.environ["ACCELERATE_USE_DEEPSPEED"]
            else:
                os.environ["ACCELERATE_USE_DEEPSPEED"] = launched
        plugin.set_mixed_precision(str(mixed))
        self.zero3_plugin = plugin
        self.zero3_mixed_precision = str(mixed)
        self.zero3_engines: list[Engine] = []
        self.zero3_optimizers: list[DeepSpeedOptimizerWrapper] = []
        self.zero3_engine: Engine | None = None  # the one accelerator.backward() drives
        self.register_save_state_pre_hook(self._zero3_save_engines)
        self.register_load_state_pre_hook(self._zero3_load_engines)

    @property
    def mixed_precision(self) -> str:
        """The precision the engine trains in (the config's bf16 / fp16 sections)."""
        return self.zero3_mixed_precision

    @property
    def deepspeed_config(self) -> dict:
        return self.zero3_plugin.deepspeed_config

    # ------------------------------------------------------------ prepare
    def prepare(self, *args: Any, device_placement: Any = None) -> Any:
        models = [obj for obj in args if isinstance(obj, nn.Module)]
        if len(models) > 1:
            raise Zero3AcceleratorError(
                f"prepare() got {len(models)} models; under zero3 (as under DeepSpeed) prepare each model in "
                "a call of its own, the one you train with its optimizer and scheduler")
        batch_sizes = [obj.batch_size for obj in args if isinstance(obj, torch.utils.data.DataLoader)]
        result = list(args)
        for i, obj in enumerate(args):
            if not _engine_part(obj):
                result[i] = super().prepare(obj, device_placement=device_placement and [device_placement[i]])
        if models:
            self._zero3_prepare_model(result, args, batch_sizes)
        return result[0] if len(result) == 1 else tuple(result)

    def _zero3_prepare_model(self, result: list, args: tuple, batch_sizes: list[int | None]) -> None:
        model = next(obj for obj in args if isinstance(obj, nn.Module))
        optimizer = next((obj for obj in args if isinstance(obj, (torch.optim.Optimizer, DummyOptim))), None)
        scheduler = next((obj for obj in args if _is_scheduler(obj)), None)
        if isinstance(model, Engine):  # built by zero3.initialize already: adopted with what it owns
            self._zero3_adopt(model, result, args, optimizer, scheduler)
            return
        config = self._zero3_fill(model, optimizer, scheduler, batch_sizes)
        client_scheduler = None
        if isinstance(scheduler, DummyScheduler):
            client_scheduler = scheduler.lr_scheduler_callable
        elif scheduler is not None and type(scheduler).__name__ in lr_schedules.VALID_LR_SCHEDULES:
            client_scheduler = scheduler  # DeepSpeed's own kinds: stepped by the engine
        engine, _, _, engine_scheduler = initialize(
            model=model, optimizer=None if isinstance(optimizer, DummyOptim) else optimizer,
            model_parameters=optimizer.params if isinstance(optimizer, DummyOptim) else None,
            lr_scheduler=client_scheduler, config=config)
        engine_optimizer = engine.optimizer  # DeepSpeed's ZeRO optimizer surface (param_groups, overflow)
        wrapped_optimizer = DeepSpeedOptimizerWrapper(engine_optimizer) if engine_optimizer is not None else None
        wrapped_scheduler = None
        if scheduler is not None and engine_scheduler is None:  # a torch scheduler: the loop steps it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # built on the client optimizer, as expected here
                rebind_scheduler(scheduler, engine_optimizer.optimizer)
            wrapped_scheduler = AcceleratedScheduler(scheduler, wrapped_optimizer,
                                                     step_with_optimizer=self.step_scheduler_with_optimizer,
                                                     split_batches=self.split_batches)
        elif engine_scheduler is not None:
            wrapped_scheduler = DeepSpeedSchedulerWrapper(engine_scheduler, wrapped_optimizer)
        self._zero3_register(engine, wrapped_optimizer)
        if scheduler is not None and engine_scheduler is None:
            self._schedulers.append(wrapped_scheduler)  # the loop's torch scheduler: Accelerate saves it
        _substitute(result, args, [(model, engine), (optimizer, wrapped_optimizer), (scheduler, wrapped_scheduler)])

    def _zero3_adopt(self, engine: Engine, result: list, args: tuple, optimizer: Any, scheduler: Any) -> None:
        """An engine from `zero3.initialize` (what `deepspeed.initialize` returns, handed to
        prepare as Accelerate's DeepSpeed path allows): its optimizer and scheduler are the
        ones initialize returned; its config's accumulation steps become the Accelerator's."""
        inner = engine.optimizer.optimizer if engine.optimizer is not None else None
        if optimizer is not None and optimizer is not inner and optimizer is not engine.optimizer:
            raise Zero3AcceleratorError(
                "prepare() got a zero3 engine and an optimizer it does not step; pass the optimizer "
                "zero3.initialize returned (or none)")
        if scheduler is not None and scheduler is not engine.lr_scheduler:
            raise Zero3AcceleratorError(
                "prepare() got a zero3 engine and a scheduler it does not step; give the scheduler to "
                "zero3.initialize(lr_scheduler=...) and pass the one it returned (or none)")
        accumulation = engine.gradient_accumulation_steps()
        if accumulation != self.gradient_accumulation_steps:
            warnings.warn(f"gradient accumulation: the Accelerator has {self.gradient_accumulation_steps}, the "
                          f"engine's config {accumulation}; using the engine's (as Accelerate does)", UserWarning)
            self.gradient_accumulation_steps = accumulation
        wrapped_optimizer = DeepSpeedOptimizerWrapper(engine.optimizer) if engine.optimizer is not None else None
        wrapped_scheduler = DeepSpeedSchedulerWrapper(engine.lr_scheduler, wrapped_optimizer) \
            if engine.lr_scheduler is not None else None
        self._zero3_register(engine, wrapped_optimizer)
        _substitute(result, args, [(optimizer, wrapped_optimizer), (scheduler, wrapped_scheduler)])

    def _zero3_register(self, engine: Engine, wrapped_optimizer: Any) -> None:
        self.zero3_engines.append(engine)
        if wrapped_optimizer is not None:
            if self.zero3_engine is not None:
                raise Zero3AcceleratorError(
                    "a second model with an optimizer was prepared; accelerator.backward() drives one engine. "
                    "Use a second Accelerator for the second model, as Accelerate's DeepSpeed path asks")
            self.zero3_engine = engine
            self.zero3_optimizers.append(wrapped_optimizer)  # saved by the engine, not by Accelerate

    def _zero3_fill(self, model: nn.Module, optimizer: Any, scheduler: Any, batch_sizes: list[int | None]) -> dict:
        """The DeepSpeed config with Accelerate's "auto" values (its _prepare_deepspeed rules)."""
        plugin = self.zero3_plugin
        config = plugin.deepspeed_config
        _refuse_twice(config, optimizer, scheduler)
        plugin.fill_match("gradient_accumulation_steps", must_match=False,
                          gradient_accumulation_steps=self.gradient_accumulation_steps)
        accumulation = plugin.get_value("gradient_accumulation_steps")
        if accumulation != self.gradient_accumulation_steps:
            warnings.warn(f"gradient accumulation: the Accelerator has {self.gradient_accumulation_steps}, the "
                          f"DeepSpeed config {accumulation}; using the config's (as Accelerate does)", UserWarning)
            self.gradient_accumulation_steps = accumulation
        values: dict[str, Any] = {"gradient_clipping": 1.0,
                                  "zero_optimization.stage3_gather_16bit_weights_on_model_save": False}
        micro = self._zero3_micro_batch(batch_sizes)
        if micro is not None:
            values["train_micro_batch_size_per_gpu"] = micro
            values["train_batch_size"] = micro * accumulation * self.num_processes
        auto_hidden = [key for key in _HIDDEN_SIZE_KEYS if plugin.is_auto(key)]
        if auto_hidden:
            hidden = config_fill.model_hidden_size(model)
            if hidden is None:
                raise Zero3AcceleratorError(
                    f"{', '.join(auto_hidden)} are \"auto\", but the model has no config.hidden_size or "
                    "hidden_sizes to fill them from; write numbers for them in the DeepSpeed config")
            values.update(zip(_HIDDEN_SIZE_KEYS, (hidden * hidden, int(0.9 * hidden * hidden), 10 * hidden)))
        if isinstance(optimizer, DummyOptim):
            values.update({"optimizer.params.lr": optimizer.lr, "optimizer.params.weight_decay": optimizer.weight_decay})
        if isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is None:
            values.update(self._zero3_dummy_scheduler_values(scheduler))
        if isinstance(optimizer, torch.optim.Optimizer):
            config["zero_allow_untested_optimizer"] = True
        plugin.deepspeed_config_process(must_match=False, **values)
        return config

    def _zero3_micro_batch(self, batch_sizes: list[int | None]) -> int | None:
        plugin = self.zero3_plugin
        if not plugin.is_auto("train_micro_batch_size_per_gpu"):
            return plugin.get_value("train_micro_batch_size_per_gpu")
        if not batch_sizes:
            return None
        if any(size is None for size in batch_sizes):
            raise Zero3AcceleratorError(
                "train_micro_batch_size_per_gpu is \"auto\" but a DataLoader has no batch_size (a batch sampler); "
                "write an integer train_micro_batch_size_per_gpu in the DeepSpeed config")
        if self.split_batches:
            batch_sizes = [size // self.num_processes for size in batch_sizes]
        return min(batch_sizes) if plugin.is_train_batch_min else max(batch_sizes)

    def _zero3_dummy_scheduler_values(self, scheduler: DummyScheduler) -> dict[str, Any]:
        defaults = getattr(scheduler.optimizer, "defaults", None)
        max_lr = getattr(scheduler.optimizer, "lr", None) if defaults is None else defaults["lr"]
        values = {"scheduler.params.warmup_min_lr": 0, "scheduler.params.warmup_max_lr": max_lr,
                  "scheduler.params.warmup_num_steps": max(1, scheduler.warmup_num_steps)}
        if scheduler.total_num_steps is not None:
            total = scheduler.total_num_steps
            values["scheduler.params.total_num_steps"] = total if self.split_batches else math.ceil(total / self.num_processes)
        return values

    # ------------------------------------------------------------ the step
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """The engine's backward (it divides by the accumulation steps) and, at Accelerate's
        accumulation boundary, its step."""
        engine = self.zero3_engine
        if engine is None:
            return super().backward(loss, **kwargs)
        engine.set_gradient_accumulation_boundary(bool(self.sync_gradients))
        engine.backward(loss, **kwargs)
        if self.sync_gradients:
            engine.step()
        return None

    def no_sync(self, model: Any) -> Any:
        """A zero3 engine reduces every backward into its shards: nothing to suspend."""
        if isinstance(model, Engine):
            return contextlib.nullcontext()
        return super().no_sync(model)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        """The engine clipped at its step by the config's gradient_clipping; its global norm."""
        if self.zero3_engine is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        norm = self.zero3_engine.get_global_grad_norm()
        return norm.item() if hasattr(norm, "item") else norm

    # ------------------------------------------------------------ state
    def _zero3_save_engines(self, models: list, weights: list, output_dir: str) -> None:
        for i, engine in enumerate(self.zero3_engines):
            engine.save_checkpoint(output_dir, tag=MODEL_NAME if i == 0 else f"{MODEL_NAME}_{i}")

    def _zero3_load_engines(self, models: list, input_dir: str) -> None:
        for i, engine in enumerate(self.zero3_engines):
            engine.load_checkpoint(input_dir, tag=MODEL_NAME if i == 0 else f"{MODEL_NAME}_{i}")

    def unwrap_model(self, model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> Any:
        if isinstance(model, Engine):
            return model.module
        return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    def get_state_dict(self, model: Any, unwrap: bool = True) -> dict[str, torch.Tensor] | None:
        """Whole 16-bit tensors on rank 0 (None elsewhere): a collective."""
        if not isinstance(model, Engine):
            return super().get_state_dict(model, unwrap)
        if not model.zero_gather_16bit_weights_on_model_save():
            raise Zero3AcceleratorError(
                "cannot gather 16-bit model weights: stage3_gather_16bit_weights_on_model_save is false in the "
                "DeepSpeed config. Set it to true (zero3_save_16bit_model: true in the Accelerate yaml), or save "
                "the sharded checkpoint with accelerator.save_state(dir) and export it with `zero3 checkpoint`")
        return model._zero3_consolidated_16bit_state_dict()

    def free_memory(self, *objects: Any) -> Any:
        """The engines destroyed (their shards, gradients and optimizer state freed), then Accelerate's."""
        for engine in self.zero3_engines:
            engine.destroy()
        self.zero3_engines, self.zero3_engine, self.zero3_optimizers = [], None, []
        return super().free_memory(*objects)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return any(opt.step_was_skipped for opt in [*self._optimizers, *self.zero3_optimizers])


def _substitute(result: list, args: tuple, replacements: list[tuple[Any, Any]]) -> None:
    """In `result`, at each position of `args` holding one of the originals, its replacement."""
    for original, replacement in replacements:
        for i, obj in enumerate(args):
            if original is not None and obj is original:
                result[i] = replacement


def _engine_part(obj: Any) -> bool:
    return isinstance(obj, (nn.Module, torch.optim.Optimizer, DummyOptim)) or _is_scheduler(obj)


def _is_scheduler(obj: Any) -> bool:
    return isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, DummyScheduler)) or \
        type(obj).__name__ in lr_schedules.VALID_LR_SCHEDULES


def _refuse_twice(config: dict, optimizer: Any, scheduler: Any) -> None:
    """Accelerate's rules: an optimizer or scheduler in the config and in the code is an error."""
    if optimizer is not None:
        if "optimizer" in config and not isinstance(optimizer, DummyOptim):
            raise Zero3AcceleratorError(
                "an optimizer is in the DeepSpeed config and in the code: remove the config's optimizer "
                "section, or pass accelerate.utils.DummyOptim(params) to prepare()")
        if "optimizer" not in config and isinstance(optimizer, DummyOptim):
            raise Zero3AcceleratorError("a DummyOptim needs an optimizer section in the DeepSpeed config")
    if scheduler is not None:
        if "scheduler" in config and not isinstance(scheduler, DummyScheduler):
            raise Zero3AcceleratorError(
                "a scheduler is in the DeepSpeed config and in the code: remove the config's scheduler "
                "section, or pass accelerate.utils.DummyScheduler(optimizer) to prepare()")
        if "scheduler" not in config and isinstance(scheduler, DummyScheduler) and \
                scheduler.lr_scheduler_callable is None:
            raise Zero3AcceleratorError("a DummyScheduler needs a scheduler section in the DeepSpeed config "
                                        "or its lr_scheduler_callable")
    if isinstance(optimizer, DummyOptim) and scheduler is not None and not isinstance(scheduler, DummyScheduler):
        raise Zero3AcceleratorError("with a DummyOptim the scheduler must be a DummyScheduler (Accelerate's rule)")


def _deepspeed_plugin(zero3_config: Any, plugin: Any, plugins: Any) -> DeepSpeedPlugin:
    """The DeepSpeed settings: zero3_config=, a DeepSpeedPlugin, or the launcher's environment."""
    if plugins is not None:
        raise Zero3AcceleratorError("deepspeed_plugins (several DeepSpeed configs) is not supported by zero3's "
                                    "Accelerator; pass one zero3_config= or deepspeed_plugin=")
    if zero3_config is not None and plugin is not None:
        raise Zero3AcceleratorError("pass zero3_config= or deepspeed_plugin=, not both")
    if zero3_config is not None:
        return DeepSpeedPlugin(hf_ds_config=config_fill.load_config(zero3_config))
    if plugin is not None:
        return plugin
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        return DeepSpeedPlugin()  # Accelerate reads its launcher's ACCELERATE_DEEPSPEED_* variables
    raise Zero3AcceleratorError(
        "zero3.hf.Accelerator needs a DeepSpeed config: pass zero3_config=\"ds_config.json\" (or a dict), a "
        "deepspeed_plugin=, or launch with an Accelerate DeepSpeed yaml (zero3 launch --config_file ds.yaml train.py)")
