"""What an engine reports after each optimizer step: the monitors' events
(zero3/monitor/events.py) and DeepSpeed's steps_per_print line (rank 0: step, skipped steps,
lr, gradient norm, loss scale and, with wall_clock_breakdown, the mean forward / backward /
step times since the last line)."""

from __future__ import annotations

import logging
from typing import Any

from zero3.monitor.events import step_events

logger = logging.getLogger("zero3")


def report_step(engine: Any) -> None:
    """Called by the engine once the step's counters have advanced."""
    scaler = engine.loss_scaler
    if engine.monitor.enabled:
        engine.monitor.write_events(step_events(engine.get_lr()[0], engine.global_samples,
                                                scaler.scale if scaler is not None else None, engine.timers))
    engine.timers.reset_window()
    every = engine.config.steps_per_print
    if not every or engine.global_steps % every or engine.comm.rank != 0:
        return
    message = (f"zero3: step={engine.global_steps} skipped={engine.skipped_steps} "
               f"lr={engine.get_lr()} grad_norm={engine.get_global_grad_norm()}")
    if scaler is not None:
        message += f" loss_scale={scaler.scale:g}"
    if engine.timers.enabled:
        message += " " + engine.timers.summary_and_reset()
    logger.info(message)
    print(message, flush=True)
