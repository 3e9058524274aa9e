"""save_checkpoint / load_checkpoint entered by only some ranks: a named error, not a hang.

One 2-rank launch with `checkpoint.arrival_timeout` of 2 s and a 60 s collective timeout
(a hang would show as a run far past 2 s). Cases: rank 0 saves alone; rank 1 loads alone;
rank 0 saves while rank 1 loads (both wait, both raise). Afterwards both ranks save and
load together: the check-in keys were cleaned, the earlier checkpoint loads exactly and
the refused saves wrote nothing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from common import config, make_batches, make_model
from harness import run_ranks

os.environ.setdefault("ZERO3_ACCELERATOR", "cpu")

TIMEOUT = 2.0


def _timed(call) -> tuple[str, float]:
    from zero3.checkpoint.errors import CheckpointError

    started = time.monotonic()
    try:
        call()
    except CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - started
    return "ok", time.monotonic() - started


def arrival_worker(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    import zero3
    from zero3.checkpoint.arrival import default_store
    from zero3.checkpoint.export import consolidated_state_dict

    root = Path(root)
    model = make_model()
    cfg = {**config(2, 1), "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "checkpoint": {"arrival_timeout": TIMEOUT}}
    engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x, y = make_batches(2, 2)[rank]
    engine.backward(engine(x, y))
    engine.step()
    engine.save_checkpoint(str(root), tag="good")
    good = consolidated_state_dict(engine)
    out = {}
    save_alone = (lambda: engine.save_checkpoint(str(root), tag="alone"))
    out["save_alone"] = _timed(save_alone) if rank == 0 else ("skipped", 0.0)
    dist.barrier()
    out["load_alone"] = _timed(lambda: engine.load_checkpoint(str(root))) if rank == 1 else ("skipped", 0.0)
    dist.barrier()
    mixed = save_alone if rank == 0 else (lambda: engine.load_checkpoint(str(root)))
    out["mixed"] = _timed(mixed)
    dist.barrier()
    engine.backward(engine(x, y))
    engine.step()  # move away from `good`
    out["together_save"] = _timed(lambda: engine.save_checkpoint(str(root), tag="together"))
    out["together_load"] = _timed(lambda: engine.load_checkpoint(str(root), tag="good"))
    state = consolidated_state_dict(engine)
    out["exact"] = all(torch.equal(state[k], good[k]) for k in good)
    dist.barrier()
    store = default_store()
    arrival_keys = [f"zero3/arrival/{call}/{n}/{suffix}" for call in ("save_checkpoint", "load_checkpoint")
                    for n in range(4) for suffix in ("0", "1", "done")]
    out["keys_left"] = [key for key in arrival_keys if store.check([key])]
    out["alone_written"] = (root / "alone").exists()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("arrival")
    return run_ranks(arrival_worker, 2, str(root), timeout=120, collective_timeout=60)


def _assert_arrival_error(result: tuple[str, float], call: str, missing: int) -> None:
    message, seconds = result
    assert message.startswith("CheckpointArrivalError"), message
    assert call in message and f"rank(s) [{missing}]" in message, message
    assert TIMEOUT - 0.5 <= seconds < TIMEOUT + 10, seconds


def test_a_call_on_one_rank_fails_by_name_within_the_timeout(results):
    _assert_arrival_error(results[0]["save_alone"], "save_checkpoint", missing=1)
    _assert_arrival_error(results[1]["load_alone"], "load_checkpoint", missing=0)


def test_ranks_in_different_checkpoint_calls_both_fail(results):
    _assert_arrival_error(results[0]["mixed"], "save_checkpoint", missing=1)
    _assert_arrival_error(results[1]["mixed"], "load_checkpoint", missing=0)


def test_nothing_lost_and_keys_cleaned_afterwards(results):
    for out in results:
        assert out["together_save"][0] == "ok" and out["together_load"][0] == "ok"
        assert out["exact"] is True
        assert out["alone_written"] is False
        assert out["keys_left"] == [], out["keys_left"]
