"""wall_clock_breakdown: forward / backward / step wall times, reported every steps_per_print."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

from zero3.platform.device import synchronize_cuda


class StepTimers:
    """Accumulates wall time per phase; does nothing when disabled. `totals` / `counts` run
    until the next `summary_and_reset` (steps_per_print), `window` until `reset_window`
    (each optimizer step, for the monitors)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.totals: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.window: dict[str, float] = defaultdict(float)

    def window_ms(self, phase: str) -> float:
        return 1000 * self.window[phase]

    def reset_window(self) -> None:
        self.window.clear()

    @contextlib.contextmanager
    def time(self, phase: str):
        if not self.enabled:
            yield
            return
        synchronize_cuda()
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize_cuda()
            elapsed = time.perf_counter() - start
            self.totals[phase] += elapsed
            self.window[phase] += elapsed
            self.counts[phase] += 1

    def summary_and_reset(self) -> str:
        parts = [f"{phase}={1000 * self.totals[phase] / self.counts[phase]:.1f}ms"
                 for phase in ("forward", "backward", "step") if self.counts[phase]]
        self.totals.clear()
        self.counts.clear()
        return " ".join(parts)


class ThroughputTimer:
    """DeepSpeed's `engine.tput_timer` (config `timers.throughput`): wall time from each
    forward (`start`) to the step() that ends its micro-step (`stop`), counted from the
    `start_step`-th optimizer step on (the first ones warm up), and the running samples per
    second, logged every `steps_per_output` optimizer steps. Does nothing when disabled;
    with `synchronized` the device is synchronized before each reading. `epoch_count` is
    the script's, advanced by `update_epoch_count()` and shown in the report line."""

    def __init__(self, enabled: bool, synchronized: bool, batch_size: int, steps_per_output: int | None,
                 report: "callable", start_step: int = 2) -> None:
        self.enabled = enabled
        self.synchronized = synchronized
        self.batch_size = batch_size
        self.steps_per_output = steps_per_output
        self.report = report
        self.start_step = start_step
        self.initialized = False
        self.started = False
        self.start_time = 0.0
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0

    def update_epoch_count(self) -> None:
        """A new epoch begins (as DeepSpeed's ThroughputTimer, the count is only reported)."""
        self.epoch_count += 1

    def _now(self) -> float:
        if self.synchronized:
            synchronize_cuda()
        return time.time()

    def start(self) -> None:
        if not self.enabled:
            return
        self.initialized = True
        self.started = True
        if self.global_step_count >= self.start_step:
            self.start_time = self._now()

    def stop(self, global_step: bool) -> None:
        if not self.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time <= 0:
            return
        duration = self._now() - self.start_time
        self.total_elapsed_time += duration
        self.step_elapsed_time += duration
        if not global_step:
            return
        if self.steps_per_output and self.global_step_count % self.steps_per_output == 0:
            self.report(f"zero3: epoch={self.epoch_count} global_step={self.global_step_count} "
                        f"micro_step={self.micro_step_count} "
                        f"RunningAvgSamplesPerSec={self.avg_samples_per_sec():.3f} "
                        f"CurrSamplesPerSec={self.batch_size / max(self.step_elapsed_time, 1e-9):.3f}")
        self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the timed optimizer steps (-inf before any)."""
        timed = self.global_step_count - self.start_step
        if timed <= 0 or self.total_elapsed_time <= 0:
            return float("-inf")
        return self.batch_size / (self.total_elapsed_time / timed)
