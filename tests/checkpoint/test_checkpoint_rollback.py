"""A save over a tag that holds another writer's checkpoint (checkpoint/tag_contents.py), on 2 ranks.

The rollback case: a save_dir where DeepSpeed 0.19.8 wrote `global_step3` (its real files,
from the committed fixture seed_fp32_w2) and `latest` names it; a zero3 run resumed from
an older state reaches step 3 again and saves. The DeepSpeed checkpoint is replaced whole
(one warning names it), the result is a committed zero3 checkpoint that loads; a tag
folder that also holds a file no checkpoint writes is refused on every rank, untouched.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from common import config, make_batches, make_model
from harness import run_ranks

DS_TAG = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed" / "seed_fp32_w2" / "ckpt" / "global_step2"
MICRO = 2


def _engine(seed: int = 0):
    import torch

    import zero3

    model = make_model(seed=seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    engine, _, _, _ = zero3.initialize(model=model, optimizer=optimizer, config=config(MICRO, 1))
    return engine


def _train(engine, rank: int, steps: int) -> None:
    for x, y in make_batches(steps, MICRO, seed=10 + rank):
        engine.backward(engine(x, y))
        engine.step()


def _plant_deepspeed_checkpoint(save_dir: Path, tag: str, extra: str | None = None) -> list[str]:
    """DeepSpeed's own rank files as `save_dir/tag`, `latest` naming it; their names."""
    shutil.copytree(DS_TAG, save_dir / tag)
    if extra:
        (save_dir / tag / extra).write_text("the user's")
    (save_dir / "latest").write_text(tag)
    return sorted(p.name for p in (save_dir / tag).iterdir())


def rollback_worker(rank: int, world: int, root: str) -> dict:
    import torch
    import torch.distributed as dist

    from zero3 import CheckpointError
    from zero3.checkpoint.export import consolidated_state_dict
    from zero3.checkpoint.format import verify_checkpoint

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("zero3").addHandler(handler)

    refused_dir, replaced_dir = Path(root) / "refused", Path(root) / "replaced"
    if rank == 0:
        _plant_deepspeed_checkpoint(refused_dir, "global_step3", extra="eval_results.json")
        planted = _plant_deepspeed_checkpoint(replaced_dir, "global_step3")
    dist.barrier()
    engine = _engine()
    _train(engine, rank, 3)

    try:
        engine.save_checkpoint(refused_dir)
        refusal = None
    except CheckpointError as exc:
        refusal = str(exc)
    refused_left = sorted(p.name for p in (refused_dir / "global_step3").iterdir())

    engine.save_checkpoint(replaced_dir)  # over DeepSpeed's global_step3, which `latest` names
    dist.barrier()
    fresh = _engine(seed=7)
    path, _ = fresh.load_checkpoint(replaced_dir)
    saved, loaded = consolidated_state_dict(engine), consolidated_state_dict(fresh)
    same = saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    result = {"refusal": refusal, "refused_left": refused_left, "loaded": path, "steps": fresh.global_steps,
              "same_as_saved": same, "warnings": [m for m in records if "DeepSpeed checkpoint" in m]}
    if rank == 0:
        result.update(planted=planted, problems=verify_checkpoint(replaced_dir / "global_step3"),
                      entries=sorted(p.name for p in replaced_dir.iterdir()),
                      tag_files=sorted(p.name for p in (replaced_dir / "global_step3").iterdir()))
    logging.getLogger("zero3").removeHandler(handler)
    return result


def test_a_save_replaces_a_stale_deepspeed_checkpoint_of_its_tag_and_refuses_other_data(tmp_path):
    results = run_ranks(rollback_worker, 2, str(tmp_path), timeout=300)
    for rank, r in enumerate(results):
        # a folder that also holds data no checkpoint writes: refused on every rank, untouched
        assert r["refusal"] is not None and "eval_results.json" in r["refusal"], r["refusal"]
        assert r["refused_left"] == sorted(results[0]["planted"] + ["eval_results.json"])
        assert r["loaded"] == str(tmp_path / "replaced" / "global_step3") and r["steps"] == 3
        assert r["same_as_saved"]
        assert len(r["warnings"]) == (1 if rank == 0 else 0), r["warnings"]  # one warning, from rank 0
    first = results[0]
    warning = first["warnings"][0]
    assert "global_step3" in warning and "zero_pp_rank_0_mp_rank_00_optim_states.pt" in warning
    assert first["problems"] == []
    assert not any(name.endswith("_states.pt") for name in first["tag_files"])  # DeepSpeed's files are gone
    assert "manifest.json" in first["tag_files"]
    assert first["entries"] == ["global_step3", "latest"]  # no staging or replaced folder left behind
