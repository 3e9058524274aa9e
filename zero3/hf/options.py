"""Trainer options zero3 cannot honour: refused by name before training starts.

ZeRO-3 sharding is zero3's own, so every other sharding or parallel scheme (FSDP,
DeepSpeed, tensor / context / sequence parallelism) is refused, as are the `torch_compile_mode`s
that capture CUDA graphs (`torch_compile` itself is honoured: the engine compiles each fetch
unit's forward, zero3/params/compiled.py) and fp16 (the Trainer backpropagates
the unscaled loss itself; bf16 needs no loss scale). `check_arguments` runs on the
TrainingArguments, `check_model` on the model the Trainer was given,
`check_reference_precompute` on both before a TRL trainer reads the model's values, and
`check_accelerator` on the Accelerator the Trainer built (an `accelerate launch` DeepSpeed
or FSDP config).
"""

from __future__ import annotations

from typing import Any

from zero3.params.compiled import CUDAGRAPH_MODES
from zero3.params.released import is_released

# TrainingArguments.optim values whose optimizer zero3 runs on flat shards (torch's own,
# elementwise). Others may use a tensor's shape (Adafactor) or carry quantized state.
ELEMENTWISE_OPTIM_NAMES = frozenset({
    "adamw_torch", "adamw_torch_fused", "adamw_hf", "sgd", "adagrad", "rmsprop",
})


class UnsupportedOptionError(ValueError):
    """A Trainer option zero3 cannot honour."""


def _refuse(option: str, value: Any, why: str) -> None:
    raise UnsupportedOptionError(f"TrainingArguments.{option}={value!r}: {why}")


def check_arguments(args: Any, config: dict) -> None:
    """Every TrainingArguments option that zero3 cannot honour, refused by name."""
    if getattr(args, "deepspeed", None):
        _refuse("deepspeed", args.deepspeed, "zero3 replaces DeepSpeed here; leave `deepspeed` unset and pass the "
                "same DeepSpeed JSON (path or dict) as zero3_config= to the trainer")
    if getattr(args, "fsdp", None):
        _refuse("fsdp", args.fsdp, "zero3 shards the model itself (ZeRO stage 3); remove the fsdp option")
    if getattr(args, "torch_compile_mode", None) in CUDAGRAPH_MODES:
        _refuse("torch_compile_mode", args.torch_compile_mode, "its CUDA graphs replay fixed parameter addresses, but "
                "zero3 gathers each parameter into new storage on every use; use \"max-autotune-no-cudagraphs\" or "
                "\"default\"")
    if getattr(args, "fp16", False) or getattr(args, "fp16_full_eval", False):
        _refuse("fp16", True, "the Trainer backpropagates the unscaled loss, which fp16 needs scaled; "
                "use bf16=True (and \"bf16\": {\"enabled\": \"auto\"} in zero3_config)")
    _check_parallelism(getattr(args, "parallelism_config", None))
    if "optimizer" not in config and args.optim not in ELEMENTWISE_OPTIM_NAMES:
        _refuse("optim", str(args.optim), "zero3 steps each rank's flat shard, so it needs an elementwise torch "
                f"optimizer: one of {sorted(ELEMENTWISE_OPTIM_NAMES)}, or an \"optimizer\" section in zero3_config")


def _check_parallelism(config: Any) -> None:
    if config is None:
        return
    for size in ("tp_size", "cp_size", "sp_size", "dp_shard_size"):
        value = getattr(config, size, 1) or 1
        if size == "sp_size" and getattr(config, "sp_backend", None) == "deepspeed":
            continue  # Ulysses sequence parallelism: zero3's own (hf/sequence_parallel.py)
        if value > 1:
            _refuse(f"parallelism_config.{size}", value, "zero3 has ZeRO-3 sharding and Ulysses sequence "
                    "parallelism (sp_backend=\"deepspeed\", sp_size) only; remove the other sizes")


def check_model(model: Any) -> None:
    """A model sharded or parallelized at load time (tensor parallel) is refused."""
    tp_size = getattr(model, "tp_size", None) or 1
    if tp_size > 1:
        _refuse("model.tp_size", tp_size, "the model was loaded with tensor parallelism (tp_plan); load it "
                "without tp_plan / device_mesh for zero3")


def check_reference_precompute(args: Any, model: Any) -> None:
    """TRL's precompute_ref_log_probs reads the model's values while the trainer is being
    built, before zero3's engine exists: a model partitioned by zero3.zero.Init has none
    to give there (DPO's own checks would fail on its empty parameters)."""
    if not getattr(args, "precompute_ref_log_probs", False) or not hasattr(model, "parameters"):
        return
    partitioned = [name for name, param in model.named_parameters() if is_released(param)]
    if partitioned:
        _refuse("precompute_ref_log_probs", True,
                f"the model was built inside zero3.zero.Init ({len(partitioned)} partitioned parameters, e.g. "
                f"{partitioned[0]!r}), and the reference log-probs are computed while the trainer is built, before "
                "zero3 runs it; set precompute_ref_log_probs=False (the reference is then sharded by zero3 and run "
                "beside the policy), or build the model outside zero3.zero.Init")


def check_accelerator(accelerator: Any) -> None:
    """An `accelerate launch` config that brings DeepSpeed or FSDP is refused."""
    state = accelerator.state
    if getattr(state, "deepspeed_plugin", None) is not None:
        _refuse("deepspeed (from the accelerate config)", "DeepSpeedPlugin",
                "launch with a plain multi-process accelerate config (no deepspeed_config section)")
    if getattr(state, "fsdp_plugin", None) is not None:
        _refuse("fsdp (from the accelerate config)", "FullyShardedDataParallelPlugin",
                "launch with a plain multi-process accelerate config (no fsdp_config section)")
