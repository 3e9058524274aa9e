"""A full disk while saving: the error names the file, no temporary file is left, nothing
valid is lost.

The checkpoints live on a real 1 MiB tmpfs (mounting needs root; the test is skipped
otherwise), which gives the genuine ENOSPC of a full disk. One 2-rank launch:
  1. saves `good_a` and `good_b` (`latest` -> good_b);
  2. fills the disk so that exactly the files of one more tag fit, and saves `good_c`:
     every file fits but the new `latest` does not: the error names `latest.tmp` on both
     ranks, `latest.tmp` is gone and `latest` still names good_b, which loads;
  3. overwrites `good_b` with a client_state larger than the disk: the save writes into
     `good_b`'s staging folder, so the error names `.good_b.incoming/common.pt.tmp`; no
     `.tmp` and no staging folder is left, and `good_b` itself, untouched, still loads
     exactly.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from common import config, make_batches, make_model
from harness import run_ranks

os.environ.setdefault("ZERO3_ACCELERATOR", "cpu")

PAGE = 4096


def _save_error(engine, root: Path, tag: str, client_state=None) -> str:
    from zero3.checkpoint.errors import CheckpointError

    try:
        engine.save_checkpoint(str(root), tag=tag, client_state=client_state)
    except CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def _fill_leaving(root: Path, folder: Path) -> None:
    """Fill the disk so that exactly as many pages as `folder`'s files take stay free."""
    need = sum(math.ceil(p.stat().st_size / PAGE) * PAGE for p in folder.iterdir())
    stats = os.statvfs(root)
    free = stats.f_bavail * stats.f_frsize
    with open(root / "filler", "wb") as f:
        f.write(b"\0" * (free - need))


def _temporaries(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.tmp"))


def disk_worker(rank: int, world: int, root: str) -> dict:
    import shutil

    import torch.distributed as dist

    import zero3
    from zero3.checkpoint.export import consolidated_state_dict

    root = Path(root)
    model = make_model()
    engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(),
                                  config={**config(2, 1), "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    x, y = make_batches(2, 2)[rank]

    def step():
        engine.backward(engine(x, y))
        engine.step()
    step()
    engine.save_checkpoint(str(root), tag="good_a")
    step()
    engine.save_checkpoint(str(root), tag="good_b")
    state_b = consolidated_state_dict(engine)
    if rank == 0:
        _fill_leaving(root, root / "good_b")
    dist.barrier()
    out = {"latest_full": _save_error(engine, root, "good_c")}
    out["after_latest_full"] = (_temporaries(root), (root / "latest").read_text())
    step()
    out["load_b"] = engine.load_checkpoint(str(root))[0]
    if rank == 0:
        (root / "filler").unlink()
        shutil.rmtree(root / "good_c")
    dist.barrier()
    blob = torch.zeros(512 * 1024)  # 2 MiB of client_state on a 1 MiB disk
    out["overwrite_full"] = _save_error(engine, root, "good_b", client_state={"blob": blob})
    out["after_overwrite_full"] = (_temporaries(root), sorted(p.name for p in root.iterdir()))
    step()
    out["load_after_overwrite"] = engine.load_checkpoint(str(root))[0]
    state = consolidated_state_dict(engine)
    out["exact_b"] = all(torch.equal(state[k], state_b[k]) for k in state_b)
    return out


@pytest.fixture(scope="module")
def results(tmpfs):
    return run_ranks(disk_worker, 2, str(tmpfs), timeout=120)


def test_full_disk_at_latest_names_it_and_leaves_no_tmp(results, tmpfs):
    for out in results:
        message = out["latest_full"]
        assert message.startswith("CheckpointError"), message
        assert str(tmpfs / "latest.tmp") in message and "No space left" in message, message
        assert out["after_latest_full"] == ([], "good_b")
        assert out["load_b"] == str(tmpfs / "good_b")


def test_full_disk_while_overwriting_a_tag_keeps_the_tag_as_it_was(results, tmpfs):
    for out in results:
        message = out["overwrite_full"]
        assert message.startswith("CheckpointError"), message
        assert str(tmpfs / ".good_b.incoming" / "common.pt.tmp") in message and "No space left" in message, message
        assert out["after_overwrite_full"] == ([], ["good_a", "good_b", "latest"])
        assert out["load_after_overwrite"] == str(tmpfs / "good_b")
        assert out["exact_b"] is True
