"""A Trainer checkpoint written with real DeepSpeed 0.19.8 (the Hugging Face Trainer with
`deepspeed=`, PEFT LoRA, 2 ranks) resumed by zero3.hf in new processes: the run continues
from step 2 and its next losses are DeepSpeed's own (tests/fixtures/deepspeed/hf_trainer.py;
regenerate with scripts/make_deepspeed_fixtures.sh hf_trainer_lora_w2).

ZERO3_TEST_WORLD_SIZE=1 resumes it on one rank (a GPU on NCCL) with the micro-batch times the
fixture's world size: each step then sees the same samples in the same order, so DeepSpeed's
losses still hold."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft", reason="the hf extra is not installed: pip install zero3[hf]")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed"
if str(FIXTURES) not in sys.path:
    sys.path.insert(0, str(FIXTURES))

import hf_trainer as H  # noqa: E402
from harness import WORLD_SIZE_OVERRIDE, run_ranks  # noqa: E402

FOLDER = FIXTURES / H.NAME
WORLD = WORLD_SIZE_OVERRIDE or H.WORLD
ENV = {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(FIXTURES) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def resume_worker(rank: int, world: int, out: str, resume_from: str) -> dict:
    import hf_trainer as H
    from transformers import TrainerCallback

    import zero3.hf

    class Losses(TrainerCallback):
        def __init__(self) -> None:
            self.losses: dict[int, float] = {}

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses[state.global_step] = float(logs["loss"])

    log = Losses()
    args = H.arguments(Path(out), per_device_train_batch_size=H.WORLD // world)
    trainer = zero3.hf.Trainer(model=H.lora_model(FOLDER / "base"), args=args,
                               train_dataset=H.TokenRows(), callbacks=[log], zero3_config=H.ds_config())
    trainer.train(resume_from_checkpoint=resume_from)
    return {"losses": log.losses, "global_step": trainer.state.global_step}


def _expected_losses() -> dict[int, float]:
    if not (FOLDER / "out" / f"checkpoint-{H.SAVE_AT}" / "latest").exists():
        pytest.fail(f"the fixture {FOLDER} is missing: run scripts/make_deepspeed_fixtures.sh {H.NAME}")
    return {int(k): v for k, v in json.loads((FOLDER / "expected.json").read_text())["losses"].items()}


def test_resume_a_deepspeed_trainer_checkpoint(tmp_path):
    expected = _expected_losses()
    results = run_ranks(resume_worker, WORLD, str(tmp_path / "out"), str(FOLDER / "out" / f"checkpoint-{H.SAVE_AT}"),
                        timeout=300, env=ENV)
    _check_continuation(results, expected)


def _check_continuation(results: list[dict], expected: dict[int, float]) -> None:
    for r in results:
        assert r["global_step"] == H.STEPS
        assert sorted(r["losses"]) == list(range(H.SAVE_AT + 1, H.STEPS + 1))  # it went on from step 2
        for step, loss in r["losses"].items():
            assert math.isclose(loss, expected[step], rel_tol=1e-5), (step, loss, expected[step])


def _stale_deepspeed_checkpoint(out: Path) -> None:
    """`out/checkpoint-4` as the DeepSpeed run left it: the Trainer's files and DeepSpeed's
    `latest` + `global_step4/` of rank files (DeepSpeed's own files of the fixture, moved
    to the later step's names: a save only looks at what the folder holds)."""
    later = out / f"checkpoint-{H.STEPS}"
    shutil.copytree(out / f"checkpoint-{H.SAVE_AT}", later)
    (later / f"global_step{H.SAVE_AT}").rename(later / f"global_step{H.STEPS}")
    (later / "latest").write_text(f"global_step{H.STEPS}")


def test_a_rollback_resume_in_the_same_output_dir_overwrites_the_later_deepspeed_checkpoint(tmp_path):
    """DeepSpeed trained to step 4 (checkpoint-2 and checkpoint-4 in output_dir); zero3.hf
    resumes from checkpoint-2 in the same output_dir, trains steps 3-4 with DeepSpeed's
    losses and its save at step 4 replaces DeepSpeed's checkpoint-4/global_step4 whole."""
    from zero3.checkpoint.format import verify_checkpoint

    expected = _expected_losses()
    out = tmp_path / "out"
    shutil.copytree(FOLDER / "out", out)
    _stale_deepspeed_checkpoint(out)
    results = run_ranks(resume_worker, WORLD, str(out), str(out / f"checkpoint-{H.SAVE_AT}"), timeout=300, env=ENV)
    _check_continuation(results, expected)
    tag = out / f"checkpoint-{H.STEPS}" / f"global_step{H.STEPS}"
    assert verify_checkpoint(tag) == []  # a committed zero3 checkpoint, DeepSpeed's files gone
    assert not any(p.name.endswith("_states.pt") for p in tag.iterdir())
    state = json.loads((out / f"checkpoint-{H.STEPS}" / "trainer_state.json").read_text())
    assert state["global_step"] == H.STEPS
