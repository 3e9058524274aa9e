"""The parts of DeepSpeed's engine API that are views of the engine's state, not steps.

`EngineSurface` is a mixin of `Engine` (engine.py keeps the training path): the model
pass-through DeepSpeed's engine gives (`engine.id` reads `engine.module.id`), the state
dict of the whole model, DeepSpeed's config queries and the optimizer queries that
Accelerate and the Hugging Face Trainer call by name, the loss scale, `no_sync`'s
refusal, and the engine's counters (collectives, late gathers, bytes held). Nothing here owns state: every
method reads or writes the engine's collaborators (`module`, `config`, `optimizer`,
`comm`, `table`).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from zero3.checkpoint.export import consolidate, held_bytes
from zero3.compat import param_access
from zero3.engine_parts.build import EngineError
from zero3.params.compiled import CompileError, CompileRequest, compiler_for
from zero3.platform.device import get_accelerator


class EngineSurface:
    """DeepSpeedEngine's module-like and query methods (mixed into Engine)."""

    # ------------------------------------------------------------ the wrapped model
    def __getattr__(self, name: str) -> Any:
        """An attribute the engine does not own is the model's (as DeepSpeed's engine)."""
        try:
            return super().__getattr__(name)  # nn.Module: parameters, buffers, children
        except AttributeError:
            pass
        module = self.__dict__.get("_modules", {}).get("module")
        if module is None or name.startswith("__"):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        return getattr(module, name)

    # ----------------------------------------------------------------- compile
    def compile(self, backend: Any = None, compile_kwargs: dict | None = None, schedule: Any = None,
                compiled_autograd_enabled: bool = False) -> None:
        """DeepSpeed's `engine.compile()`: torch.compile each fetch unit's forward (a block
        gathered whole, an embedding, a head) with `backend` and `compile_kwargs`; the
        gathers, releases and access discovery stay eager at the units' boundaries
        (params/compiled.py). Once per engine; `is_compiled` tells."""
        self._check_alive()
        if self.is_compiled:
            raise CompileError("engine.compile(): this engine is compiled already (by engine.compile, or by a "
                               "model compiled before zero3.initialize); compile it once")
        if schedule is not None or compiled_autograd_enabled:
            raise CompileError("engine.compile(): schedule= and compiled_autograd_enabled= belong to DeepSpeed's "
                               "DeepCompile, which zero3 does not have; leave them unset (zero3 compiles each "
                               "fetch unit's forward)")
        backend = backend if backend is not None else self.accelerator.get_compile_backend()
        compiler = compiler_for(backend, compile_kwargs, "engine.compile()")
        self.compiled_units.apply(CompileRequest(self.module, compiler, "engine.compile()"))

    @property
    def is_compiled(self) -> bool:
        """Whether the model's fetch units run compiled (engine.compile, or compiled before initialize)."""
        return self.compiled_units.active

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The model's `generate()` with every parameter gathered once (gathered_for_generation):
        no collective per token, so ranks may stop at different lengths (each at its own
        end-of-sequence), as DeepSpeed users get from TRL's `ds3_gather_for_generation`.
        Memory: the whole model in the compute dtype while it runs. With `synced_gpus=True`
        the model generates sharded instead, all ranks in lockstep, one gather per unit per
        token, never holding the whole model. The module's train / eval mode is kept."""
        generate = getattr(self.module, "generate")
        if kwargs.get("synced_gpus"):
            return generate(*args, **kwargs)
        with self.gathered_for_generation(eval_mode=False):
            return generate(*args, **kwargs)

    def _apply(self, fn: Callable, recurse: bool = True) -> "EngineSurface":
        """`engine.to()`, `.cuda()`, `.half()`, ...: a no-op where nothing would change.

        Moving or casting would replace the parameters' storage behind the shards' back,
        so any real change is refused: the engine picks the device (LOCAL_RANK) and the
        dtype (the config's bf16 / fp16) itself."""
        probe = torch.empty(0, dtype=self.compute_dtype, device=self.device)
        moved = fn(probe)
        if moved.device == probe.device and moved.dtype == probe.dtype:
            return self
        raise RuntimeError(
            f"the zero3 engine's parameters are sharded on {self.device} in {self.compute_dtype}; moving "
            f"them to {moved.device} / {moved.dtype} with .to() / .cuda() / .half() is not possible. "
            "Choose the dtype in the config (\"bf16\" / \"fp16\") and the device through LOCAL_RANK, "
            "or move the model before zero3.initialize")

    def state_dict(self, *args: Any, destination: dict | None = None, prefix: str = "",
                   keep_vars: bool = False) -> dict[str, torch.Tensor]:
        """The model's state dict under `module.` keys, every parameter whole (compute dtype,
        CPU), on every rank. A collective: call it on every rank. (DeepSpeed's gives the
        partitioned parameters' empty placeholders here; use save_checkpoint for training
        state and `_zero3_consolidated_16bit_state_dict` for rank 0 only.)"""
        if args:
            raise TypeError("engine.state_dict() takes keyword arguments only (destination=, prefix=)")
        values = param_access.full_state_dict(self.sharded_model, self.optimizer_access, prefix + "module.")
        if destination is not None:
            destination.update(values)
            return destination
        return values

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True,
                        assign: bool = False) -> Any:
        """Load whole values (keys as engine.state_dict() gives them) into the shards, the
        fp32 masters and the buffers. Every rank passes the same values; no collective."""
        if assign:
            raise RuntimeError("engine.load_state_dict(assign=True) would replace sharded parameters; "
                               "use assign=False")
        missing, unexpected = param_access.load_full_state_dict(self.sharded_model, self.optimizer_access, state_dict,
                                                                "module.", strict)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                             ) -> dict[str, torch.Tensor] | None:
        """The whole model in the compute dtype on rank 0 (CPU), None on other ranks. A
        collective (Hugging Face's Trainer and Accelerate call it by this name)."""
        values = consolidate(self.sharded_model, self.optimizer_access, dtype=self.compute_dtype,
                             exclude_frozen=exclude_frozen_parameters)
        return values if self.comm.rank == 0 else None

    # --------------------------------------------------------- DeepSpeed's config queries
    def zero_optimization(self) -> bool:
        return True

    def zero_optimization_stage(self) -> int:
        return 3

    def zero_optimization_partition_weights(self) -> bool:
        return True

    def zero_optimization_partition_gradients(self) -> bool:
        return True

    def zero_offload_optimizer(self) -> bool:
        return self.config.zero.offload_optimizer.enabled

    def zero_offload_param(self) -> bool:
        return self.config.zero.offload_param.enabled

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return self.config.zero.gather_16bit_weights_on_model_save

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def bfloat16_enabled(self) -> bool:
        return self.compute_dtype == torch.bfloat16

    def fp16_enabled(self) -> bool:
        return self.compute_dtype == torch.float16

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def steps_per_print(self) -> int | None:
        return self.config.steps_per_print

    # ------------------------------------------------------------- optimizer queries
    def _optimizer_param(self, key: str) -> list[Any]:
        if self.optimizer is None:
            return []
        return [group.get(key, 0.0) for group in self.optimizer.optimizer.param_groups]

    def get_lr(self) -> list[float]:
        return self._optimizer_param("lr")

    def get_mom(self) -> list[Any]:
        """Each param group's momentum (SGD, RMSprop) or betas (Adam-like), as DeepSpeed."""
        if self.optimizer is not None and type(self.optimizer.optimizer).__name__ in ("SGD", "RMSprop"):
            return self._optimizer_param("momentum")
        return self._optimizer_param("betas")

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last optimizer step (before clipping)."""
        return None if self.optimizer is None else self.optimizer.last_grad_norm

    def empty_partition_cache(self) -> None:
        """Release every gathered, non-resident parameter and the prefetch cache, then the
        allocator's cache (DeepSpeed's call to free memory between phases)."""
        self._settle()
        self.fetcher.release_all()
        gc.collect()
        get_accelerator().empty_cache()

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def global_rank(self) -> int:
        return self.comm.rank

    @property
    def local_rank(self) -> int:
        return get_accelerator().local_rank()

    @property
    def dp_world_size(self) -> int:
        return self.comm.world_size

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def loss_scaler_state(self) -> dict | None:
        return self.loss_scaler.state_dict() if self.loss_scaler is not None else None

    def load_loss_scaler_state(self, state: dict) -> None:
        if self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(state)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Refused, as in DeepSpeed at stage 3: gradients are partitioned as they are made."""
        raise EngineError("no_sync() is incompatible with ZeRO stage 3, whose gradients are reduce-scattered "
                          "into shards during backward (DeepSpeed refuses it too); use "
                          "engine.coalesce_grad_reduction() to reduce once for several backwards")
        yield  # pragma: no cover - a generator for the context manager protocol

    # ------------------------------------------------------- loss scale, queries
    def comm_stats(self) -> dict[str, tuple[int, int]]:
        """op name -> (calls, bytes), cumulative since initialize."""
        return self.comm.counters.snapshot()

    @property
    def late_gathers(self) -> int:
        """Gathers the backward safety net had to make (zero on ordinary models)."""
        return self.fetcher.late_gathers

    def set_gpu_budget(self, budget: int) -> None:
        """zero3's: place the state anew under `budget` bytes of device memory, between
        steps: what fits moves to the device, the rest to the host (engine_parts/placement.py).
        Raises PlacementError, moving nothing, when the budget cannot hold what must be there."""
        self._check_alive()
        self._settle()
        self.placement_watch.place_under(int(budget), "set_gpu_budget")

    def prepare_async_checkpoint(self) -> int:
        """zero3's: allocate now the host buffer of asynchronous saves (initialize does with
        checkpoint.async_save), so the first one blocks no longer than later ones; its bytes
        (see AsyncCheckpointer.prepare)."""
        self._check_alive()
        return self.checkpointer.prepare(self._training_state())

    def offload_states(self, include: Any = None, device: Any = "cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """DeepSpeed's: the state kinds in `include` (OffloadStateTypeEnum values; all when
        None) moved to the host between steps; forward, backward and step are refused until
        `reload_states()` (engine_parts/state_offload.py)."""
        self._check_alive()
        self.state_offload.offload(include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """DeepSpeed's: every offloaded state back where it was."""
        self._check_alive()
        self.state_offload.reload(non_blocking)

    def sharded_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer state."""
        return held_bytes(self.sharded_model, self.optimizer_access, self.reducer.sink)
