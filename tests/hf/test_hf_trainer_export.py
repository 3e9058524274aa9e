"""A Trainer `checkpoint-N` written by zero3.hf, exported with `zero3 checkpoint
export-deepspeed`, resumes under the Hugging Face Trainer with `deepspeed=`.

The source is the committed checkpoint-2 of tests/fixtures/deepspeed/hf_trainer_export.py
(tiny Llama + PEFT LoRA, fp32, 2 ranks, saved by zero3.hf). Real DeepSpeed 0.19.8 resumed
its export through the Trainer on 2 gloo ranks and logged steps 3 and 4
(hf_trainer_export_lora_w2/deepspeed_result.json, written by
`scripts/make_deepspeed_fixtures.sh --check-trainer-export`; nothing here imports DeepSpeed).
Here zero3.hf resumes the same checkpoint-2, and also the export itself, in new processes:
both continuations log DeepSpeed's losses, learning rates and gradient norms.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft", reason="the hf extra is not installed: pip install zero3[hf]")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed"
if str(FIXTURES) not in sys.path:
    sys.path.insert(0, str(FIXTURES))

import hf_trainer as H  # noqa: E402
import hf_trainer_export as X  # noqa: E402
from harness import run_ranks  # noqa: E402

ENV = {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(FIXTURES) + os.pathsep + os.environ.get("PYTHONPATH", "")}
REL_TOL = 1e-6  # measured (torch 2.13 CPU): losses and learning rates bit-equal, gradient norms within 4.4e-8


def _deepspeed_result() -> dict:
    if not (X.SOURCE / "latest").exists() or not X.RESULT.exists():
        pytest.fail(f"the fixture {X.FOLDER} is missing: run python {FIXTURES / 'hf_trainer_export.py'}, then "
                    "scripts/make_deepspeed_fixtures.sh --check-trainer-export")
    return json.loads(X.RESULT.read_text())


def _export(dst: Path, world: int) -> None:
    from zero3.cli import main

    assert main(["checkpoint", "export-deepspeed", str(X.SOURCE), str(dst), "--world-size", str(world)]) == 0


def _assert_continues_like_deepspeed(results: list[dict], deepspeed: dict) -> None:
    resumed = list(range(H.SAVE_AT + 1, H.STEPS + 1))
    for rank, r in enumerate(results):
        assert r["global_step"] == H.STEPS
        theirs = {int(step): logged for step, logged in deepspeed["logged"][rank].items()}
        assert sorted(r["logged"]) == sorted(theirs) == resumed  # both went on from checkpoint-2
        for step in resumed:
            for key in X.LOGGED:
                mine, ds = r["logged"][step][key], theirs[step][key]
                assert math.isclose(mine, ds, rel_tol=REL_TOL), (rank, step, key, mine, ds)


def test_deepspeed_resumed_the_export_through_the_trainer_where_zero3_goes_on(tmp_path):
    deepspeed = _deepspeed_result()
    assert (deepspeed["deepspeed_version"], deepspeed["world_size"]) == ("0.19.8", H.WORLD)
    assert deepspeed["global_step"] == [H.STEPS] * H.WORLD
    results = run_ranks(X.zero3_worker, H.WORLD, str(tmp_path / "out"), str(X.SOURCE), timeout=300, env=ENV)
    _assert_continues_like_deepspeed(results, deepspeed)


def test_the_export_is_a_trainer_checkpoint_in_deepspeeds_layout(tmp_path):
    """The export holds the Trainer's files unchanged beside DeepSpeed's `latest` and rank
    files, and resumes under zero3.hf too (zero3 reads DeepSpeed's layout) with the same steps."""
    exported = tmp_path / "exported" / X.SOURCE.name
    _export(exported, H.WORLD)
    for name in ("trainer_state.json", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth",
                 "adapter_model.safetensors", "adapter_config.json", "training_args.bin"):
        assert (exported / name).read_bytes() == (X.SOURCE / name).read_bytes(), name
    tag = (exported / "latest").read_text()
    assert sorted(p.name for p in (exported / tag).iterdir()) == sorted(
        f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in range(H.WORLD) for kind in ("model", "optim"))
    results = run_ranks(X.zero3_worker, H.WORLD, str(tmp_path / "out"), str(exported), timeout=300, env=ENV)
    _assert_continues_like_deepspeed(results, _deepspeed_result())


def test_an_export_never_overwrites_trainer_files(tmp_path, capsys):
    from zero3.cli import main

    dst = tmp_path / X.SOURCE.name
    dst.mkdir()
    (dst / "trainer_state.json").write_text("{}")
    assert main(["checkpoint", "export-deepspeed", str(X.SOURCE), str(dst), "--world-size", "2"]) == 1
    assert "already holds the Trainer files ['trainer_state.json']" in capsys.readouterr().err
    assert sorted(p.name for p in dst.iterdir()) == ["trainer_state.json"]  # nothing was written
    assert (dst / "trainer_state.json").read_text() == "{}"


def test_an_export_for_more_processes_says_which_lack_their_rng_state(tmp_path, capsys):
    _export(tmp_path / "w3" / X.SOURCE.name, 3)
    assert "note: no rng_state_2.pth" in capsys.readouterr().out
