"""Evaluation callbacks that may generate: run with the model's weights gathered.

`model.generate()` on a sharded model issues collectives on every forward, so ranks that
generate different numbers of tokens (each stops at its own end-of-sequence) would wait on
each other forever. The Trainer's `on_evaluate` and `on_predict` events therefore run
inside `gathered_for_generation` (every parameter gathered once, no collective while it
holds): a callback may call `model.generate()` freely. Entering and leaving are
collectives, which is safe because every rank raises these events together. Memory: the
whole model in the compute dtype, for the duration of those callbacks only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from transformers.trainer_callback import CallbackHandler

from zero3.engine_parts.generation import gathered_for_generation


class GatheredEvaluationCallbacks(CallbackHandler):
    """The Trainer's CallbackHandler, with on_evaluate / on_predict under gathered weights."""

    def __init__(self, handler: CallbackHandler, engine_of: Callable[[], Any]) -> None:
        super().__init__(handler.callbacks, handler.model, handler.processing_class, handler.optimizer,
                         handler.lr_scheduler)
        self.train_dataloader = handler.train_dataloader
        self.eval_dataloader = handler.eval_dataloader
        self._engine_of = engine_of

    def _gathered(self) -> contextlib.AbstractContextManager:
        engine = self._engine_of()
        if engine is None:
            return contextlib.nullcontext()
        return gathered_for_generation(engine, eval_mode=False)

    def on_evaluate(self, args, state, control, metrics):
        with self._gathered():
            return super().on_evaluate(args, state, control, metrics)

    def on_predict(self, args, state, control, metrics):
        with self._gathered():
            return super().on_predict(args, state, control, metrics)
