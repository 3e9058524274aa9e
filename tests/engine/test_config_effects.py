"""The config switches that act on reporting and the process: timers.throughput,
dump_state, log_level, memory_breakdown, disable_python_gc, vocabulary_size,
log_trace_cache_warnings and enable_sanity_checks, each observed on 2 real ranks."""

from __future__ import annotations

import torch
from common import config, make_batches, make_model, two_param_groups
from harness import run_ranks
from torch import nn

MICRO = 2


class Switching(nn.Module):
    """Takes a different path through its layers on odd steps (the same on every rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(13, 13) for _ in range(3))
        self.head = nn.Linear(13, 5)

    def forward(self, x, y, odd: bool):
        order = [2, 1, 0] if odd else [0, 1, 2]
        for i in order:
            x = torch.tanh(self.layers[i](x))
        return nn.functional.mse_loss(self.head(x), y)


def effects(rank: int, world: int):
    import gc
    import io
    import logging
    from contextlib import redirect_stdout

    import pytest

    import zero3

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("zero3").addHandler(Keep())
    cfg = {**config(MICRO, 2), "steps_per_print": 2, "dump_state": True, "log_level": "info",
           "memory_breakdown": True, "disable_python_gc": True, "vocabulary_size": 50257,
           "timers": {"throughput": {"enabled": True, "synchronized": False}}}
    model = make_model()
    printed = io.StringIO()
    with redirect_stdout(printed):
        engine, _, _, _ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model)),
                                           config=cfg)
    assert logging.getLogger("zero3").level == logging.INFO and not gc.isenabled()
    assert ("zero3 engine configuration" in printed.getvalue()) == (rank == 0)
    assert any("vocabulary_size 50257 is not a multiple of 8" in r for r in records) == (rank == 0)
    records.clear()
    batches = make_batches(8 * world, MICRO)
    for i in range(8):
        x, y = batches[i * world + rank]
        engine.backward(engine(x, y))
        engine.step()
    timer = engine.tput_timer
    assert (timer.micro_step_count, timer.global_step_count) == (8, 4)
    assert timer.total_elapsed_time > 0 and timer.avg_samples_per_sec() > 0
    speed = [r for r in records if "RunningAvgSamplesPerSec" in r]
    memory = [r for r in records if r.startswith("zero3: memory")]
    assert (len(speed), len(memory) > 0) == ((1, True) if rank == 0 else (0, False)), (speed, len(memory))  # timed from step 3
    if rank == 0:
        assert {m.split(":")[1].strip() for m in memory} >= {"memory before forward", "memory after step"}
    engine.destroy()
    assert gc.isenabled()  # given back at destroy

    # log_trace_cache_warnings and enable_sanity_checks
    torch.manual_seed(0)
    switching = Switching()
    cfg = {**config(MICRO, 1, threshold=0), "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0, "log_trace_cache_warnings": True,
        "enable_sanity_checks": True}}
    engine, _, _, _ = zero3.initialize(model=switching, optimizer=torch.optim.SGD(switching.parameters(), lr=0.1),
                                       config=cfg)
    records.clear()
    x, y = make_batches(1, MICRO)[0]
    for step in range(4):
        engine.backward(engine(x, y, odd=step >= 2))
        engine.step()
    departures = [r for r in records if "left last step's fetch order" in r]
    assert len(departures) == 1, departures  # step 2 changed the order; step 3 repeats it
    held = switching.layers[0].weight
    with pytest.raises(zero3.EngineError, match=r"enable_sanity_checks: after backward layers\.0\.weight is FULL"):
        with zero3.GatheredParameters([held]):
            engine.backward(engine(x, y, odd=False))
    engine.destroy()
    return True


def test_config_switches_have_their_effect():
    assert run_ranks(effects, 2) == [True, True]
