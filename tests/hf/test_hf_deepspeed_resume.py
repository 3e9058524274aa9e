"""A Trainer checkpoint written with real DeepSpeed 0.19.8 (the Hugging Face Trainer with
`deepspeed=`, PEFT LoRA, 2 ranks) resumed by zero3.hf in new processes: the run continues
from step 2 and its next losses are DeepSpeed's own (tests/fixtures/deepspeed/hf_trainer.py;
regenerate with scripts/make_deepspeed_fixtures.sh hf_trainer_lora_w2)."""

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
from harness import run_ranks  # noqa: E402

FOLDER = FIXTURES / H.NAME
ENV = {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(FIXTURES) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def resume_worker(rank: int, world: int, out: str) -> dict:
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
    trainer = zero3.hf.Trainer(model=H.lora_model(FOLDER / "base"), args=H.arguments(Path(out)),
                               train_dataset=H.TokenRows(), callbacks=[log], zero3_config=H.ds_config())
    trainer.train(resume_from_checkpoint=str(FOLDER / "out" / f"checkpoint-{H.SAVE_AT}"))
    return {"losses": log.losses, "global_step": trainer.state.global_step}


def test_resume_a_deepspeed_trainer_checkpoint(tmp_path):
    if not (FOLDER / "out" / f"checkpoint-{H.SAVE_AT}" / "latest").exists():
        pytest.fail(f"the fixture {FOLDER} is missing: run scripts/make_deepspeed_fixtures.sh {H.NAME}")
    expected = {int(k): v for k, v in json.loads((FOLDER / "expected.json").read_text())["losses"].items()}
    results = run_ranks(resume_worker, H.WORLD, str(tmp_path / "out"), timeout=300, env=ENV)
    for r in results:
        assert r["global_step"] == H.STEPS
        assert sorted(r["losses"]) == list(range(H.SAVE_AT + 1, H.STEPS + 1))  # it went on from step 2
        for step, loss in r["losses"].items():
            assert math.isclose(loss, expected[step], rel_tol=1e-5), (step, loss, expected[step])
