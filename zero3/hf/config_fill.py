"""Hugging Face's "auto" values in a DeepSpeed config, filled from `TrainingArguments`.

Transformers fills a DeepSpeed config for its Trainer in two stages, and zero3 keeps both
(so one JSON serves DeepSpeed and zero3 alike):

1. From the arguments alone (`fill_from_arguments`): micro batch, accumulation steps,
   `train_batch_size` (= world size x micro batch x accumulation), `gradient_clipping`
   (`max_grad_norm`), the optimizer's lr / betas / eps / weight decay, the scheduler's
   warmup lr bounds, `bf16.enabled` / `fp16.enabled`.
2. Once the model and the number of steps are known (`fill_from_model`): the bucket sizes
   and persistence threshold from the model's hidden size (hidden², 0.9 hidden²,
   10 hidden), the scheduler's `total_num_steps` and `warmup_num_steps`.

A value that is not "auto" must equal the argument it stands for; every mismatch is
reported at once, naming both sides. The input is never modified: each stage returns a
new dict.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

from zero3.hf.sequence_parallel import sp_size_of

AUTO = "auto"
HIDDEN_SIZE_KEYS = ("zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                    "zero_optimization.stage3_param_persistence_threshold")


class ConfigFillError(ValueError):
    """The zero3_config disagrees with the TrainingArguments, or an "auto" cannot be filled."""


def load_config(config: dict | str | os.PathLike) -> dict:
    """A deep copy of the config dict, or the JSON file it names."""
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if not path.is_file():
            raise ConfigFillError(f"zero3_config={str(config)!r} is not a file; pass a DeepSpeed JSON path or a dict")
        return json.loads(path.read_text())
    raise ConfigFillError(f"zero3_config must be a dict or a path to a DeepSpeed JSON, got {type(config).__name__}")


class _Filler:
    """Walks dotted keys of one config dict, replacing "auto" and collecting mismatches."""

    def __init__(self, config: dict) -> None:
        self.config = config
        self.mismatches: list[str] = []

    def _node(self, dotted: str) -> tuple[dict | None, str]:
        *parents, leaf = dotted.split(".")
        node: Any = self.config
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                return None, leaf
        return (node if isinstance(node, dict) else None), leaf

    def is_auto(self, dotted: str) -> bool:
        node, leaf = self._node(dotted)
        return node is not None and node.get(leaf) == AUTO

    def fill(self, dotted: str, value: Any, argument: str | None = None) -> None:
        """Replace "auto" by `value`; with `argument`, a set value must equal it."""
        node, leaf = self._node(dotted)
        if node is None or leaf not in node:
            return
        if node[leaf] == AUTO:
            node[leaf] = value
        elif argument is not None and node[leaf] != value:
            self.mismatches.append(f"{dotted}={node[leaf]!r} but {argument}={value!r}")

    def raise_mismatches(self) -> None:
        if self.mismatches:
            raise ConfigFillError("zero3_config disagrees with the TrainingArguments: " + "; ".join(self.mismatches)
                                  + '. Set these keys to "auto" (filled from the arguments) or make them equal')


def fill_from_arguments(config: dict, args: Any) -> dict:
    """Stage 1: the "auto" values that the TrainingArguments alone determine."""
    filled = _Filler(copy.deepcopy(config))
    micro, steps = args.per_device_train_batch_size, args.gradient_accumulation_steps
    filled.fill("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size")
    filled.fill("gradient_accumulation_steps", steps, "gradient_accumulation_steps")
    sp = sp_size_of(args)
    filled.fill("train_batch_size", args.world_size // sp * micro * steps,
                "world_size / sp_size x per_device_train_batch_size x gradient_accumulation_steps")
    if sp > 1:
        filled.config.setdefault("sequence_parallel_size", sp)
        filled.fill("sequence_parallel_size", sp, "parallelism_config.sp_size")
    filled.fill("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    filled.fill("optimizer.params.lr", args.learning_rate, "learning_rate")
    filled.fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "[adam_beta1, adam_beta2]")
    filled.fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    filled.fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    filled.fill("scheduler.params.warmup_min_lr", 0)
    filled.fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    filled.fill("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16 or fp16_full_eval")
    filled.fill("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16 or bf16_full_eval")
    filled.raise_mismatches()
    return filled.config


def fill_from_model(config: dict, args: Any, model: Any, num_training_steps: int) -> dict:
    """Stage 2: hidden-size based sizes and the scheduler's step counts."""
    filled = _Filler(copy.deepcopy(config))
    auto_keys = [key for key in HIDDEN_SIZE_KEYS if filled.is_auto(key)]
    if auto_keys:
        hidden = model_hidden_size(model)
        if hidden is None:
            raise ConfigFillError(f"{', '.join(auto_keys)} are \"auto\", but the model's config has no hidden_size "
                                  "or hidden_sizes to fill them from; write numbers for them")
        filled.fill("zero_optimization.reduce_bucket_size", hidden * hidden)
        filled.fill("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden * hidden))
        filled.fill("zero_optimization.stage3_param_persistence_threshold", 10 * hidden)
    filled.fill("scheduler.params.total_num_steps", num_training_steps, "the number of training steps")
    filled.fill("scheduler.params.warmup_num_steps", max(1, args.get_warmup_steps(num_training_steps)),
                "warmup_steps")
    filled.raise_mismatches()
    return filled.config


TRAINING_ONLY_SECTIONS = ("optimizer", "scheduler")


def fill_for_inference(config: dict, args: Any, model: Any) -> dict:
    """The config of an engine that only runs forwards (evaluation before training, a
    reference model): stage 2 filled from `model`, no optimizer or scheduler section, and
    no checkpoint.async_save (it never saves: no host buffer is allocated for its saves)."""
    filled = fill_from_model(config, args, model, 0)
    inference = {key: value for key, value in filled.items() if key not in TRAINING_ONLY_SECTIONS}
    if isinstance(inference.get("checkpoint"), dict) and "async_save" in inference["checkpoint"]:
        inference["checkpoint"] = {k: v for k, v in inference["checkpoint"].items() if k != "async_save"}
    return inference


def model_hidden_size(model: Any) -> int | None:
    """The model's hidden size as Transformers reads it (largest of hidden_sizes; the
    text config of a multimodal model)."""
    config = getattr(model, "config", None)
    for candidate in (config, getattr(config, "text_config", None)):
        if candidate is None:
            continue
        if getattr(candidate, "hidden_size", None):
            return int(candidate.hidden_size)
        if getattr(candidate, "hidden_sizes", None):
            return int(max(candidate.hidden_sizes))
    return None
