"""A trainer's frozen reference model (TRL's DPO, KTO, GRPO with a KL term) sharded by zero3, as DeepSpeed does.

TRL keeps the reference model in `trainer.ref_model` and runs it under `torch.no_grad()`
beside the policy. Under DeepSpeed ZeRO-3 TRL wraps it in an inference engine; under
zero3 the trainer's constructor does the same once TRL's own constructor is done:

- `shard_reference_model` replaces an `nn.Module` reference with a zero3 engine without
  optimizer, built from the trainer's zero3_config (its "auto" values filled from the
  reference model). Each rank then holds 1/world of it, and it computes in the same
  dtype as the policy, so the two agree exactly before the first update, as under
  DeepSpeed. A reference built inside `zero3.zero.Init` is adopted without ever being
  whole; one TRL loads itself is whole until this runs (as under DeepSpeed).
- `SyncReferenceWeights` replaces TRL's `SyncRefModelCallback` (`sync_ref_model=True`):
  every `ref_model_sync_steps` it sets reference = (1 - alpha) * reference + alpha *
  policy, one parameter pair gathered at a time (the policy's compute-dtype weights, as
  DeepSpeed mixes them), rank 0 computing and the result written back to every rank's
  shard. Memory: one gathered parameter of each model at a time.

A reference that is a PEFT adapter switched off (no `ref_model`) needs none of this: it
runs through the policy's own engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import TrainerCallback

from zero3.api import initialize
from zero3.engine import Engine
from zero3.engine_parts.gathered import GatheredParameters
from zero3.hf import config_fill


def shard_reference_model(trainer: Any) -> None:
    """`trainer.ref_model`, if it is a whole module, becomes a zero3 inference engine over it
    (a collective: every rank's trainer is built together). TRL's sync callback, if any, is
    replaced by `SyncReferenceWeights` over that engine."""
    reference = getattr(trainer, "ref_model", None)
    if not isinstance(reference, nn.Module) or isinstance(reference, Engine):
        return
    for param in reference.parameters():
        param.requires_grad_(False)
    config = config_fill.fill_for_inference(trainer.zero3_config, trainer.args, reference)
    engine, _, _, _ = initialize(model=reference, config=config)
    engine.eval()
    trainer.ref_model = engine
    _replace_sync_callback(trainer, engine)


def _replace_sync_callback(trainer: Any, reference: Engine) -> None:
    handler = trainer.callback_handler
    for index, callback in enumerate(handler.callbacks):
        if type(callback).__name__ == "SyncRefModelCallback":
            handler.callbacks[index] = SyncReferenceWeights(reference, lambda: trainer.model)


class SyncReferenceWeights(TrainerCallback):
    """TRL's `sync_ref_model` for a zero3 reference engine (see the module docstring).

    `policy_of` returns the policy model (sharded by the trainer's engine) when called."""

    def __init__(self, reference: Engine, policy_of: Callable[[], nn.Module]) -> None:
        self.reference = reference
        self.policy_of = policy_of

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % args.ref_model_sync_steps == 0:
            mix_into_reference(self.policy_of(), self.reference.module, args.ref_model_mixup_alpha)


@torch.no_grad()
def mix_into_reference(policy: nn.Module, reference: nn.Module, alpha: float) -> None:
    """reference = (1 - alpha) * reference + alpha * policy, parameter by parameter, on
    every rank together (each pair is gathered; rank 0's result is written back)."""
    policy_params, reference_params = list(policy.parameters()), list(reference.parameters())
    if len(policy_params) != len(reference_params):
        raise ValueError(f"sync_ref_model: the policy has {len(policy_params)} parameters and the reference "
                         f"{len(reference_params)}; the reference must be a copy of the policy's architecture")
    rank = dist.get_rank() if dist.is_initialized() else 0
    for source, target in zip(policy_params, reference_params):
        if source.shape != target.shape:
            raise ValueError(f"sync_ref_model: a policy parameter of shape {tuple(source.shape)} pairs with a "
                             f"reference parameter of shape {tuple(target.shape)}; the two models differ")
        with GatheredParameters([source]), GatheredParameters([target], modifier_rank=0):
            if rank == 0:
                target.mul_(1.0 - alpha).add_(source.to(target.dtype), alpha=alpha)
