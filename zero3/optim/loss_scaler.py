"""fp16 loss scaling with DeepSpeed's semantics (static or dynamic with hysteresis).

Dynamic scaling: the loss is multiplied by `scale` before backward. A step whose global
gradient norm is inf or nan is skipped and, once `hysteresis` overflows have been
absorbed, the scale is divided by 2 (never below `min_scale`). The scale is doubled on a
good step that follows `window` (or a multiple of it) good steps since the last
overflow (or the start), as DeepSpeed 0.19.8's DynamicLossScaler counts. `consecutive_hysteresis`
refills the hysteresis budget on every good step instead of only when the scale grows.
A static scale (`loss_scale` > 0 in the config) never changes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class LossScaler:
    scale: float
    dynamic: bool
    window: int = 1000
    min_scale: float = 1.0
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    factor: float = 2.0
    iteration: int = 0
    last_overflow_iteration: int = -1
    hysteresis_left: int = 2

    @classmethod
    def from_precision(cls, precision) -> "LossScaler":
        if precision.loss_scale and precision.loss_scale > 0:
            return cls(scale=float(precision.loss_scale), dynamic=False)
        return cls(
            scale=float(2 ** precision.initial_scale_power),
            dynamic=True,
            window=int(precision.loss_scale_window),
            min_scale=float(precision.min_loss_scale),
            hysteresis=int(precision.hysteresis),
            consecutive_hysteresis=bool(precision.consecutive_hysteresis),
            hysteresis_left=int(precision.hysteresis),
        )

    def update(self, overflow: bool) -> None:
        """Called once per optimizer step (taken or skipped)."""
        if self.dynamic:
            if overflow:
                if self.hysteresis == 1 or self.hysteresis_left == 1:
                    self.scale = max(self.scale / self.factor, self.min_scale)
                else:
                    self.hysteresis_left -= 1
                self.last_overflow_iteration = self.iteration
            else:
                if self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                stable = self.iteration - self.last_overflow_iteration - 1  # good updates before this one
                if stable > 0 and stable % self.window == 0:
                    if not self.consecutive_hysteresis:
                        self.hysteresis_left = self.hysteresis
                    self.scale *= self.factor
        self.iteration += 1

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)
