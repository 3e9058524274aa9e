"""What the Trainer holds as `optimizer` and `lr_scheduler` once zero3's engine owns both.

The engine steps its optimizer and scheduler itself, inside `Engine.step()` at the
accumulation boundary (see trainer.py: after each micro-batch's backward). The Trainer's
own calls (`optimizer.step()`, `optimizer.zero_grad()`, `lr_scheduler.step()`) come after
that and are therefore no-ops here, so each update happens exactly once. Queries read the
engine: `param_groups` and `state_dict()` are the client optimizer's (over this rank's
shards), `get_last_lr()` gives the rates the last update used (what the Trainer logs as
`learning_rate`). Neither facade owns any tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zero3.engine import Engine


class EngineOptimizer:
    """`trainer.optimizer`: a view of the engine's client optimizer."""

    def __init__(self, engine: "Engine") -> None:
        self.engine = engine

    @property
    def optimizer(self) -> Any:
        return self.engine.optimizer.optimizer if self.engine.optimizer is not None else None

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups if self.optimizer is not None else []

    @property
    def state(self) -> Any:
        return self.optimizer.state if self.optimizer is not None else {}

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last boundary's update was skipped (overflow)."""
        return not self.engine.was_step_applied()

    def step(self, closure: Any = None) -> None:
        """No-op: the engine stepped at the boundary (Engine.step)."""
        if closure is not None:
            raise ValueError("zero3's engine steps the optimizer itself; a closure cannot be passed")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No-op: the engine drops its gradient shards after each update."""

    def state_dict(self) -> dict:
        """This rank's shard of the optimizer state (the whole state is in the engine's checkpoint)."""
        return self.optimizer.state_dict() if self.optimizer is not None else {}

    def load_state_dict(self, state_dict: dict) -> None:
        raise RuntimeError("zero3's optimizer state is restored from the engine's checkpoint "
                           "(trainer.train(resume_from_checkpoint=...)), not from a state dict")


class EngineScheduler:
    """`trainer.lr_scheduler`: a view of the engine's scheduler and of the learning rates
    of the last update (`record_rates` is called just before each boundary step)."""

    def __init__(self, engine: "Engine") -> None:
        self.engine = engine
        self._last_rates: list[float] = list(engine.get_lr())

    @property
    def scheduler(self) -> Any:
        return self.engine.lr_scheduler

    def record_rates(self) -> None:
        """The learning rates the coming update will use."""
        self._last_rates = [float(lr) for lr in self.engine.get_lr()]

    def get_last_lr(self) -> list[float]:
        return list(self._last_rates)

    def step(self, *args: Any, **kwargs: Any) -> None:
        """No-op: the engine steps its scheduler after each applied update."""

    def state_dict(self) -> dict:
        return self.scheduler.state_dict() if self.scheduler is not None else {}

    def load_state_dict(self, state_dict: dict) -> None:
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state_dict)
