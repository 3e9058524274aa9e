"""`zero3 checkpoint export-deepspeed`: a zero3 checkpoint written in DeepSpeed 0.19's ZeRO-3 layout.

The source is the committed zero3 checkpoint of tests/fixtures/deepspeed/export_case.py
(Llama + LoRA, bf16, two param groups, frozen base, WarmupDecayLR, client_state; saved on
2 ranks). It is exported offline, then:

- loaded back by zero3's own DeepSpeed reader on 1, 2 and 3 ranks: every fp32 master and
  Adam moment equals the source's bit for bit, counters, scheduler and client_state come
  back, and the next steps' losses equal those of the same engine loading the source;
- compared with what real DeepSpeed 0.19.8 saw loading the same export on 2 ranks
  (export_llama_lora_bf16_w2/deepspeed_result.json, written by
  `scripts/make_deepspeed_fixtures.sh --check-export`; nothing here imports DeepSpeed):
  DeepSpeed's masters and moments have the digests of zero3's, and zero3's continuation
  gives DeepSpeed's losses.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from harness import run_ranks

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed"
sys.path.insert(0, str(FIXTURES))
pytest.importorskip("peft", reason="the Llama + LoRA case needs the hf extra")
import export_case as E  # noqa: E402

ENV = {"HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(FIXTURES), os.environ.get("PYTHONPATH", "")])}
EXPORTS = {"w2_sg40": (E.EXPORT_WORLD, E.EXPORT_SUB_GROUP_SIZE), "w3_sg7": (3, 7)}


def _export(dst: Path, world: int, sub_group_size: int) -> None:
    from zero3.cli import main

    assert main(["checkpoint", "export-deepspeed", str(E.SOURCE), str(dst), "--world-size", str(world),
                 "--sub-group-size", str(sub_group_size)]) == 0
    assert not torch.distributed.is_initialized()


def _progress(engine, client_state: dict) -> dict:
    return {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps, "micro_steps": engine.micro_steps,
            "lr": engine.get_lr(), "scheduler": engine.lr_scheduler.state_dict(),
            "client_state": {k: client_state.get(k) for k in E.FIXTURE.client_state}}


def load_worker(rank: int, world: int, folders: dict[str, str]) -> dict:
    """Per folder (the source and each export): digests, progress and the next losses."""
    import export_case as E

    out = {}
    for label, folder in folders.items():
        engine = E.zero3_engine(world, sub_group_size=11)
        path, client_state = engine.load_checkpoint(folder)
        out[label] = {"loaded": path is not None, "digests": E.zero3_state_digests(engine),
                      "progress": _progress(engine, client_state),
                      "losses": E.M.train(E.FIXTURE, engine, rank, E.FIXTURE.steps, E.NEXT_STEPS)}
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, str]:
    if not (E.SOURCE / "latest").exists():
        pytest.fail(f"{E.SOURCE} is missing: run python tests/fixtures/deepspeed/export_case.py")
    root = tmp_path_factory.mktemp("exported")
    folders = {"source": str(E.SOURCE)}
    for label, (world, sub_group_size) in EXPORTS.items():
        _export(root / label, world, sub_group_size)
        folders[label] = str(root / label)
    return folders


@pytest.mark.parametrize("world", [1, 2, 3])
def test_an_export_loads_back_bit_for_bit_and_trains_on(exported, world):
    results = run_ranks(load_worker, world, exported, timeout=600, env=ENV)
    for rank, per_folder in enumerate(results):
        source = per_folder["source"]
        for label in EXPORTS:
            got = per_folder[label]
            assert got["loaded"], label
            assert got["digests"] == source["digests"], (label, rank)  # masters and moments, bit for bit
            assert got["progress"] == source["progress"], (label, rank)
            assert got["losses"] == source["losses"], (label, rank)


def test_real_deepspeed_loaded_the_export_with_zero3s_values_and_losses(exported):
    """DeepSpeed 0.19.8's view of the export (recorded in its venv) against zero3's."""
    result = json.loads(E.RESULT.read_text())
    assert (result["world_size"], result["sub_group_size"]) == EXPORTS["w2_sg40"]
    assert result["mismatches"] == [] and result["tensors_compared"] == len(result["digests"]) > 0
    ours = run_ranks(load_worker, E.EXPORT_WORLD, {"w2_sg40": exported["w2_sg40"]}, timeout=600, env=ENV)
    assert ours[0]["w2_sg40"]["digests"] == result["digests"]
    loaded = result["loaded"]
    progress = ours[0]["w2_sg40"]["progress"]
    assert loaded["steps"] == [float(E.FIXTURE.steps)]
    assert (loaded["global_steps"], loaded["global_samples"], loaded["skipped_steps"]) == (
        progress["global_steps"], progress["global_samples"], progress["skipped_steps"])
    assert loaded["lr_scheduler"] == progress["scheduler"] and loaded["lr"] == progress["lr"]
    assert loaded["client_state"] == dict(E.FIXTURE.client_state)
    per_step = E.FIXTURE.grad_accum
    for rank, r in enumerate(ours):
        mine, deepspeeds = r["w2_sg40"]["losses"], result["losses"][rank]
        assert mine[:per_step] == deepspeeds[:per_step], rank  # the step right after the load: equal
        for a, b in zip(mine[per_step:], deepspeeds[per_step:]):  # then bf16 updates reduced in another order
            assert abs(a - b) <= 1e-4 * abs(b), (rank, a, b)
