"""`trainer_class(cls)`: any `transformers.Trainer` subclass, training with zero3.

    Trainer = zero3.hf.trainer_class(trl.SFTTrainer)
    trainer = Trainer(model=model, args=args, train_dataset=data, zero3_config="ds_config.json")

The Trainer keeps its loop, data, logging, callbacks and checkpoint folders; zero3's engine
takes the parts DeepSpeed takes when Transformers runs it through Accelerate:

- the model: `trainer.model_wrapped` is the engine (`trainer.model` stays the user's
  model, now sharded), built when training starts with the optimizer the Trainer creates
  (or the config's `optimizer` section) and the Trainer's scheduler (or the config's);
- the step: after each micro-batch's backward the engine's `step()` runs, with the
  Trainer's own accumulation boundary; at the boundary it clips by `max_grad_norm`, steps
  the optimizer and the scheduler. The Trainer's later optimizer / scheduler calls are
  no-ops on facades (facades.py), so each update happens once; `grad_norm` and
  `learning_rate` in the logs are the engine's;
- the loss: the Trainer divides it by the accumulation steps and calls `backward` on it
  (through Accelerate, with no DDP wrapper); the engine reduces those gradients into its
  shards without dividing again (`Engine.loss_divided_by_caller`);
- a reference model (TRL's `ref_model`: DPO and KTO without PEFT, GRPO with a KL term):
  sharded by an engine of its own that only runs forwards, and `sync_ref_model` mixing
  through zero3 (reference.py);
- checkpoints: the engine's checkpoint inside `checkpoint-N/` next to the Trainer's files,
  resumed by `train(resume_from_checkpoint=...)` (checkpoints.py); `save_model()` gathers
  the 16-bit weights to rank 0, which writes the adapter (PEFT) or the whole model. With
  checkpoint.async_save the `save_steps` saves are asynchronous: zero3 applies
  `save_total_limit` itself (never deleting a folder still being written or the last
  committed one) and `train()` returns once the last save is committed.

The zero3_config is DeepSpeed's JSON with Hugging Face's "auto" values (config_fill.py).
Options zero3 cannot honour are refused in the constructor (options.py).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import transformers
from transformers.trainer import _is_peft_model

from zero3.api import initialize
from zero3.engine import Engine
from zero3.hf import checkpoints, config_fill, options, reference, sequence_parallel
from zero3.hf.callbacks import GatheredEvaluationCallbacks
from zero3.hf.facades import EngineOptimizer, EngineScheduler


class Zero3TrainerMixin:
    """The methods that put zero3's engine under a Trainer (see the module docstring).

    State it adds: `zero3_engine` (None until training or evaluation starts) and the
    config filled from the arguments. The engine owns the model's shards, the optimizer
    and the scheduler; the Trainer holds facades of the latter two."""

    def __init__(self, *args: Any, zero3_config: dict | str | os.PathLike | None = None, **kwargs: Any) -> None:
        if zero3_config is None:
            raise TypeError(f"{type(self).__name__} needs zero3_config= (a DeepSpeed JSON path or dict, "
                            "\"auto\" values allowed)")
        raw_config = config_fill.load_config(zero3_config)
        given_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if given_args is not None:
            options.check_arguments(given_args, raw_config)
            options.check_reference_precompute(given_args, kwargs.get("model", args[0] if args else None))
        self.zero3_engine: Engine | None = None
        super().__init__(*args, **kwargs)
        options.check_arguments(self.args, raw_config)
        options.check_model(self.model)
        options.check_accelerator(self.accelerator)
        self.zero3_config = config_fill.fill_from_arguments(raw_config, self.args)
        self.callback_handler = GatheredEvaluationCallbacks(self.callback_handler, lambda: self.zero3_engine)
        reference.shard_reference_model(self)

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        """The engine owns precision (Accelerate adds no autocast and no grad scaler) and
        gradient reduction (every micro-batch's backward reduces into the shards, so the
        Trainer must not enter the model's no_sync(), which ZeRO-3 refuses)."""
        plugin = kwargs.get("gradient_accumulation_plugin")
        if plugin is not None:
            kwargs["gradient_accumulation_plugin"] = dataclasses.replace(plugin, sync_each_batch=True)
        accelerator_args = super()._build_accelerator_args(**kwargs)
        accelerator_args["mixed_precision"] = "no"
        accelerator_args.pop("parallelism_config", None)  # sequence parallelism is the engine's (get_sp_size)
        return accelerator_args

    def get_sp_size(self) -> int:
        """The Ulysses degree of the arguments' ParallelismConfig (the engine runs it, not Accelerate)."""
        return sequence_parallel.sp_size_of(self.args)

    def _move_model_to_device(self, model: Any, device: Any) -> None:
        """Nothing: the engine places the model on its device (a model built inside
        zero3.zero.Init holds empty partitioned parameters that must not be moved)."""

    # ------------------------------------------------------------------ the engine
    @property
    def _zero3_is_peft(self) -> bool:
        return _is_peft_model(self.model)

    def _zero3_build_engine(self, max_steps: int, training: bool) -> Engine:
        """The engine over `self.model`; for training with the Trainer's (or the config's)
        optimizer and scheduler."""
        if not training:
            config = config_fill.fill_for_inference(self.zero3_config, self.args, self.model)
            engine, _, _, _ = initialize(model=self.model, config=config)
            return self._zero3_compiled(engine)
        config = config_fill.fill_from_model(self.zero3_config, self.args, self.model, max_steps)
        optimizer = scheduler_factory = None
        if "optimizer" not in config:
            optimizer = _without_empty_groups(self.create_optimizer())
        if "scheduler" not in config:
            scheduler_factory = functools.partial(self._zero3_trainer_scheduler, max_steps)
        engine, _, _, _ = initialize(model=self.model, optimizer=optimizer, lr_scheduler=scheduler_factory,
                                     config=config)
        return self._zero3_compiled(engine)

    def _zero3_compiled(self, engine: Engine) -> Engine:
        """TrainingArguments.torch_compile (with its backend and mode): each fetch unit's
        forward compiled by the engine, its gathers and releases eager around it."""
        if self.args.torch_compile and not engine.is_compiled:
            mode = self.args.torch_compile_mode
            engine.compile(backend=self.args.torch_compile_backend or "inductor",
                           compile_kwargs={"mode": mode} if mode is not None else {})
        return engine

    def _zero3_trainer_scheduler(self, max_steps: int, optimizer: Any) -> Any:
        return self.create_scheduler(num_training_steps=max_steps, optimizer=optimizer)

    def _zero3_training_engine(self, max_steps: int) -> Engine:
        """The engine for train(): built once (an evaluation-only engine is replaced)."""
        engine = self.zero3_engine
        if engine is not None and engine.optimizer is not None:
            return engine
        if engine is not None:
            engine.destroy()
        self.lr_scheduler = None
        self.zero3_engine = self._zero3_build_engine(max_steps, training=True)
        self.optimizer = EngineOptimizer(self.zero3_engine)
        self.lr_scheduler = EngineScheduler(self.zero3_engine)
        return self.zero3_engine

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: str | None):
        """The engine instead of Accelerate's prepare; the checkpoint loaded into it."""
        engine = self._zero3_training_engine(max_steps)
        self.model_wrapped = engine
        if resume_from_checkpoint is not None:
            checkpoints.load_training_state(engine, resume_from_checkpoint, frozen_may_be_missing=self._zero3_is_peft)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        train_dataloader = sequence_parallel.wrap_loader(train_dataloader, engine.device)
        self.callback_handler.train_dataloader = train_dataloader
        return engine, train_dataloader

    def compute_loss(self, model: Any, inputs: dict, return_outputs: bool = False, num_items_in_batch: Any = None):
        """Under Ulysses sequence parallelism (training), the sequences' loss from the slices'
        (hf/sequence_parallel.py); otherwise the Trainer's."""
        if sequence_parallel.sp_size_of(self.args) > 1 and model.training:
            return sequence_parallel.compute_loss(model, inputs, return_outputs)
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def _wrap_model(self, model: Any, training: bool = True, dataloader: Any = None) -> Any:
        """Evaluation and prediction run through the engine (built for them if training has not)."""
        if self.zero3_engine is None:
            self.zero3_engine = self._zero3_build_engine(0, training=False)
        return self.zero3_engine

    # ------------------------------------------------------------------ the step
    def training_step(self, model: Any, inputs: dict, num_items_in_batch: Any = None) -> Any:
        """The Trainer's forward and backward, then the engine's step (an update at the
        Trainer's accumulation boundary)."""
        engine = self.zero3_engine
        with engine.loss_divided_by_caller():
            loss = super().training_step(model, inputs, num_items_in_batch)
        boundary = bool(self.accelerator.sync_gradients)
        engine.set_gradient_accumulation_boundary(boundary)
        if boundary:
            self.lr_scheduler.record_rates()
        engine.step()
        return loss

    def _clip_grad_norm(self, model: Any) -> float | None:
        """The engine clipped at its step (max_grad_norm is its gradient_clipping): its norm."""
        return self._zero3_grad_norm()

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> float | None:
        return self._zero3_grad_norm() if grad_norm is None else float(grad_norm)

    def _zero3_grad_norm(self) -> float | None:
        norm = self.zero3_engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    # ------------------------------------------------------------------ checkpoints
    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's train(); returns once the last checkpoint is committed (an
        asynchronous save's error is raised here), the save_total_limit applied again."""
        output = super().train(*args, **kwargs)
        if self.zero3_engine is not None:
            self.zero3_engine.wait_for_checkpoint()
            self._zero3_rotate(self.args.output_dir)
        return output

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's checkpoint, with its save_total_limit applied by zero3's rule
        (checkpoints.rotate_checkpoints) instead of the Trainer's."""
        limit = self.args.save_total_limit
        self.args.save_total_limit = None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        self._zero3_rotate(self._get_output_dir(trial=trial))

    def _zero3_rotate(self, run_dir: str) -> None:
        if self.args.should_save and self.zero3_engine is not None:
            checkpoints.rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint,
                                           self.zero3_engine.checkpointer.in_flight)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Nothing before the engine exists: _prepare_for_training loads the checkpoint into it."""

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        checkpoints.save_training_state(self.zero3_engine, output_dir, exclude_frozen=self._zero3_is_peft,
                                        writes_files=self.args.should_save)

    def _load_best_model(self) -> None:
        checkpoints.load_model_weights(self.zero3_engine, self.state.best_model_checkpoint,
                                       frozen_may_be_missing=self._zero3_is_peft)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The adapter in PEFT's format (PEFT model) or the whole model as safetensors that
        from_pretrained loads: 16-bit weights gathered to rank 0, which writes (a collective).
        A checkpoint of a full model writes the weights only with the config's
        stage3_gather_16bit_weights_on_model_save (the engine's checkpoint holds them)."""
        engine = self.zero3_engine
        if engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        peft = self._zero3_is_peft
        if _internal_call and not peft and not engine.zero_gather_16bit_weights_on_model_save():
            return None
        state_dict = checkpoints.gathered_16bit_state_dict(engine, trainable_only=peft)
        if self.args.should_save:
            self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
        return None


def _without_empty_groups(optimizer: Any) -> Any:
    """The Trainer's optimizer without its empty param groups (a LoRA model has no parameter
    in the Trainer's no-weight-decay group), as DeepSpeed keeps it: so the groups of a
    checkpoint that DeepSpeed wrote match this optimizer's."""
    optimizer.param_groups[:] = [group for group in optimizer.param_groups if group["params"]]
    return optimizer


@functools.cache
def trainer_class(cls: type) -> type:
    """A subclass of the Trainer class `cls` (transformers.Trainer or any subclass: TRL's
    SFTTrainer, DPOTrainer, a user's own) that trains with zero3; its constructor takes
    one more argument, `zero3_config`. The same class is returned for the same `cls`."""
    if not (isinstance(cls, type) and issubclass(cls, transformers.Trainer)):
        raise TypeError(f"zero3.hf.trainer_class expects transformers.Trainer or a subclass of it, got {cls!r}")
    return type(f"Zero3{cls.__name__}", (Zero3TrainerMixin, cls),
                {"__module__": cls.__module__, "__doc__": f"{cls.__name__} training with zero3 (zero3_config=)."})
