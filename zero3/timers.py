"""wall_clock_breakdown: forward / backward / step wall times, reported every steps_per_print."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch


class StepTimers:
    """Accumulates wall time per phase; does nothing when disabled."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.totals: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    @contextlib.contextmanager
    def time(self, phase: str):
        if not self.enabled:
            yield
            return
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            self.totals[phase] += time.perf_counter() - start
            self.counts[phase] += 1

    def summary_and_reset(self) -> str:
        parts = [f"{phase}={1000 * self.totals[phase] / self.counts[phase]:.1f}ms"
                 for phase in ("forward", "backward", "step") if self.counts[phase]]
        self.totals.clear()
        self.counts.clear()
        return " ".join(parts)
