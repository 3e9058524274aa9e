"""The events of one optimizer step, with DeepSpeed 0.19.8's names, at the global sample count:

- `Train/Samples/lr`: the first group's learning rate, every optimizer step;
- `Train/Samples/loss_scale`: with fp16, the loss scale;
- with `wall_clock_breakdown`, the step's wall times in milliseconds, summed over its
  micro-steps: `Train/Samples/elapsed_time_ms_forward`, `..._backward`, `..._backward_inner`
  (zero3's backward is one autograd pass with the reduce-scatters inside it: the same time as
  backward), `..._backward_allreduce` (the wait for the reductions still in flight at the
  step, inside the step's time) and `..._step`.
"""

from __future__ import annotations

from typing import Any

from zero3.monitor.base import Event

TIMED = (("forward", "forward"), ("backward", "backward"), ("backward_inner", "backward"),
         ("backward_allreduce", "backward_allreduce"), ("step", "step"))


def step_events(lr: float, samples: int, loss_scale: float | None = None, timers: Any = None) -> list[Event]:
    """The events of the optimizer step that brought the count to `samples`; `timers`:
    engine_parts/timers.py's StepTimers, whose window is read (the caller resets it)."""
    events: list[Event] = [("Train/Samples/lr", lr, samples)]
    if loss_scale is not None:
        events.append(("Train/Samples/loss_scale", loss_scale, samples))
    if timers is not None and timers.enabled:
        events += [(f"Train/Samples/elapsed_time_ms_{name}", timers.window_ms(phase), samples) for name, phase in TIMED]
    return events
