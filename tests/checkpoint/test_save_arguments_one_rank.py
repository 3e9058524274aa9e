"""A save whose arguments are bad on one rank only is refused on every rank, before writing.

A save's argument checks (the tag's name, `client_state`) and the tag agreement share one
exchange, so every rank learns of one rank's bad argument in the same call. One 2-rank
launch, synchronous and asynchronous saves: rank 1 alone passes a tag that is no folder
name, then a `client_state` that needs code to load; both ranks get a CheckpointError
naming rank 1 and the problem, nothing is written, and the next save, with good
arguments, commits and loads back exactly.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from common import config, make_batches, make_model
from harness import run_ranks

os.environ.setdefault("ZERO3_ACCELERATOR", "cpu")


class NeedsCode:
    """A value only pickle with code could restore: refused in client_state."""


def _refusal(engine, root: str, rank: int, tag: str, client_state: dict, async_save: bool) -> str:
    from zero3.checkpoint.errors import CheckpointError

    try:
        engine.save_checkpoint(root, tag=tag if rank == 1 else "fine", client_state=client_state,
                               async_save=async_save)
        engine.wait_for_checkpoint()
    except CheckpointError as exc:
        return str(exc)
    return "saved"


def worker(rank: int, world: int, root: str) -> dict:
    import zero3
    from zero3.checkpoint.export import consolidated_state_dict

    model = make_model()
    engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(),
                                  config={**config(2, 1), "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    for x, y in make_batches(4, 2)[rank::2]:
        engine.backward(engine(x, y))
        engine.step()
    out = {}
    for async_save in (False, True):
        mode = "async" if async_save else "sync"
        out[f"{mode}_tag"] = _refusal(engine, root, rank, ".hidden", {}, async_save)
        bad_state = {"note": NeedsCode()} if rank == 1 else {}
        out[f"{mode}_client_state"] = _refusal(engine, root, rank, "fine", bad_state, async_save)
    out["entries_after_refusals"] = sorted(p.name for p in Path(root).iterdir()) if Path(root).exists() else []
    engine.save_checkpoint(root, tag="good", async_save=True)
    engine.wait_for_checkpoint()
    saved = consolidated_state_dict(engine)
    for x, y in make_batches(4, 2)[rank::2]:  # move on, so that a load that did nothing shows
        engine.backward(engine(x, y))
        engine.step()
    engine.load_checkpoint(root)
    loaded = consolidated_state_dict(engine)
    out["exact"] = all(torch.equal(saved[k], loaded[k]) for k in saved)
    out["latest"] = (Path(root) / "latest").read_text()
    engine.destroy()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("one_rank_args") / "ckpt"
    return run_ranks(worker, 2, str(root), timeout=150)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_bad_tag_on_one_rank_is_refused_on_every_rank(results, mode):
    for out in results:
        message = out[f"{mode}_tag"]
        assert "rank 1" in message and "'.hidden'" in message and "not a valid folder name" in message, message


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_client_state_needing_code_on_one_rank_is_refused_on_every_rank(results, mode):
    for out in results:
        message = out[f"{mode}_client_state"]
        assert "rank 1" in message and "client_state" in message and "NeedsCode" in message, message


def test_nothing_is_written_and_the_next_save_commits_and_loads_exactly(results):
    for out in results:
        assert out["entries_after_refusals"] == [], out["entries_after_refusals"]
        assert out["exact"] and out["latest"] == "good"
