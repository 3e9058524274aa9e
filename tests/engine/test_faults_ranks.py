"""Ranks that disagree on the config or the model: RankMismatchError at initialize, on every rank.

Without the check these trained silently divergent (clipping, learning rate), aborted in
gloo (persistence threshold), hung until the process-group timeout (accumulation steps)
or were reported as control-flow divergence (prefetch). One 2-rank launch runs every case
with a short collective timeout, so a hang would fail the test quickly.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from common import config, make_batches, make_model, two_param_groups
from harness import run_ranks

os.environ.setdefault("ZERO3_ACCELERATOR", "cpu")


def _case_config(case: str, rank: int) -> dict:
    cfg = {**config(2, 1, threshold=30), "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    zero = cfg["zero_optimization"]
    if case == "gradient_clipping":
        cfg["gradient_clipping"] = 1.0 if rank == 0 else 0.5
    elif case == "config_lr":
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2 * (rank + 1)}}
    elif case == "persistence_threshold":
        zero["stage3_param_persistence_threshold"] = 30 if rank == 0 else 200
    elif case == "gradient_accumulation_steps":
        cfg["gradient_accumulation_steps"] = 1 + rank
    elif case == "prefetch":
        zero["stage3_prefetch_bucket_size"] = 1000 * (rank + 1)
    elif case == "per_rank_logging":
        cfg["steps_per_print"] = 10 + rank  # may differ: logging only
    elif case == "unreadable_on_one_rank" and rank == 1:
        return "/nonexistent/ds_config.json"  # a path missing on one machine
    return cfg


def _initialize(case: str, rank: int):
    import zero3

    model = make_model(outputs=5 + rank if case == "shape" else 5,
                       freeze_block=(1 if rank == 0 else 2) if case == "requires_grad" else 1)
    cfg = _case_config(case, rank)
    if case == "client_lr":
        cfg.pop("optimizer")
        return zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model, lr=0.01 + rank)),
                                config=cfg)[0]
    return zero3.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]


CASES = ["gradient_clipping", "config_lr", "client_lr", "persistence_threshold", "gradient_accumulation_steps",
         "prefetch", "shape", "requires_grad", "per_rank_logging", "unreadable_on_one_rank"]


def ranks_worker(rank: int, world: int) -> dict:
    from zero3.config import ConfigError
    from zero3.engine_parts.rank_agreement import RankMismatchError

    out = {}
    for case in CASES:
        started = time.monotonic()
        try:
            engine = _initialize(case, rank)
        except (RankMismatchError, ConfigError, FileNotFoundError) as exc:
            out[case] = (f"{type(exc).__name__}: {exc}", time.monotonic() - started)
            continue
        x, y = make_batches(2, 2)[rank]
        engine.backward(engine(x, y))
        engine.step()  # the engine that was accepted trains
        engine.destroy()
        out[case] = ("ok", time.monotonic() - started)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(ranks_worker, 2, timeout=150, collective_timeout=30)


EXPECTED = {
    "gradient_clipping": ["config.gradient_clipping", "rank 0: 1.0", "rank 1: 0.5"],
    "config_lr": ["config.optimizer", "0.01", "0.02"],
    "client_lr": ["optimizer.param_groups[0].lr", "rank 0: 0.01", "rank 1: 1.01"],
    "persistence_threshold": ["config.zero.param_persistence_threshold", "rank 0: 30", "rank 1: 200"],
    "gradient_accumulation_steps": ["config.gradient_accumulation_steps", "rank 0: 1", "rank 1: 2"],
    "prefetch": ["config.zero.prefetch_bucket_size", "rank 0: 1000", "rank 1: 2000"],
    "shape": ["param head.weight", "shape=(5, 24)", "shape=(6, 24)", "param head.bias"],
    "requires_grad": ["param blocks.1.linear.weight", "requires_grad=False", "requires_grad=True",
                      "param blocks.2.linear.weight"],
}


def test_a_config_unreadable_on_one_rank_fails_on_every_rank(results):
    """Rank 1's config path does not exist: rank 1 raises its own error, rank 0 a
    ConfigError naming rank 1, both at once (no wait for the collective timeout)."""
    messages = [out["unreadable_on_one_rank"] for out in results]
    for rank, (message, seconds) in enumerate(messages):
        assert "/nonexistent/ds_config.json" in message, (rank, message)
        assert seconds < 20, (rank, seconds)
    assert messages[0][0].startswith("ConfigError") and "rank 1" in messages[0][0], messages[0]


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_disagreeing_ranks_get_a_named_error_on_every_rank(results, case):
    for rank, out in enumerate(results):
        message, seconds = out[case]
        assert message != "ok", f"rank {rank}: {case} was accepted"
        for fragment in EXPECTED[case]:
            assert fragment in message, (rank, case, fragment, message)
        assert seconds < 20, (rank, case, seconds)


def test_logging_only_fields_may_differ(results):
    for out in results:
        assert out["per_rank_logging"][0] == "ok"
