"""The Trainer's save_steps with checkpoint.async_save (2 gloo ranks, one launch).

A full fine-tune of a tiny Llama, 6 steps, a checkpoint every 2, save_total_limit=1. Rank
0's writer holds each commit back for 1 s (ZERO3_CHECKPOINT_PAUSE=shards-written@0 with
ZERO3_CHECKPOINT_PAUSE_SECONDS), so when the Trainer rotates its checkpoints the newest
one is still being written. A callback records, after each save, the folders present and
the save in flight. Checks: saves are in flight while training goes on; the rotation never
deleted the last committed checkpoint while the next was being written (the Trainer's own
rotation, keeping 1, would have); train() returns with the last save committed and the
limit honoured; that checkpoint resumes. An engine that only runs forwards (evaluation,
a reference model) gets no checkpoint.async_save, so it holds no snapshot buffer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from trl_setup import ENV  # isort: skip  (first: puts examples/ on sys.path)

import trl_sft_lora as E  # noqa: E402
from harness import run_ranks  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

STEPS, SAVE_EVERY = 6, 2


class RecordSaves(TrainerCallback):
    def __init__(self, trainer, run_dir: Path) -> None:
        self.trainer, self.run_dir, self.seen = trainer, run_dir, []

    def on_save(self, args, state, control, **kwargs):
        self.seen.append({"step": state.global_step, "in_flight": self.trainer.zero3_engine.checkpointer.in_flight,
                          "folders": sorted(p.name for p in self.run_dir.glob("checkpoint-*"))})


def _trainer(folder: Path, out: str, steps: int):
    from transformers import AutoModelForCausalLM, DataCollatorForLanguageModeling, TrainingArguments

    import zero3.hf

    tokenizer = E.build_tokenizer()
    data = E.make_dataset(32, seed=1).map(lambda row: tokenizer(row["text"]), remove_columns=["text"])
    config = E.zero3_config(persistence_threshold=0, offload_param=False)
    config["checkpoint"] = {"async_save": True}
    args = TrainingArguments(output_dir=str(folder / out), per_device_train_batch_size=2, max_steps=steps,
                             learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="steps",
                             save_steps=SAVE_EVERY, save_total_limit=1, seed=0, disable_tqdm=True, use_cpu=True)
    return zero3.hf.Trainer(model=AutoModelForCausalLM.from_pretrained(folder / "base"), args=args,
                            train_dataset=data, data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
                            processing_class=tokenizer, zero3_config=config)


def async_trainer(rank: int, world: int, folder: str) -> dict:
    import os

    folder = Path(folder)
    os.environ.update({"ZERO3_CHECKPOINT_PAUSE": "shards-written@0", "ZERO3_CHECKPOINT_PAUSE_SECONDS": "1"})
    trainer = _trainer(folder, "run", STEPS)
    record = RecordSaves(trainer, folder / "run")
    trainer.add_callback(record)
    trainer.train()
    out = {"seen": record.seen, "in_flight_after": trainer.zero3_engine.checkpointer.in_flight,
           "folders_after": sorted(p.name for p in (folder / "run").glob("checkpoint-*"))}
    from zero3.hf import config_fill

    out["inference_checkpoint"] = config_fill.fill_for_inference(trainer.zero3_config, trainer.args,
                                                                 trainer.model).get("checkpoint", {})
    os.environ.pop("ZERO3_CHECKPOINT_PAUSE")
    resumed = _trainer(folder, "resumed", STEPS + SAVE_EVERY)
    resumed.train(resume_from_checkpoint=str(folder / "run" / f"checkpoint-{STEPS}"))
    out["resumed_steps"] = resumed.zero3_engine.global_steps
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_async")
    E.save_tiny_llama(folder / "base")
    return folder, run_ranks(async_trainer, 2, str(folder), timeout=400, env=ENV)


def test_trainer_saves_are_asynchronous_and_rotation_keeps_the_last_committed(run):
    folder, results = run
    for out in results:
        steps = [seen["step"] for seen in out["seen"]]
        assert steps == [2, 4, 6], out["seen"]
        for seen in out["seen"]:
            assert seen["in_flight"] == str(folder / "run" / f"checkpoint-{seen['step']}" / f"global_step{seen['step']}")
            if seen["step"] > SAVE_EVERY:  # the previous, committed checkpoint stays while this one is written
                assert f"checkpoint-{seen['step'] - SAVE_EVERY}" in seen["folders"], seen


def test_training_ends_with_the_last_save_committed_and_the_limit_honoured(run):
    folder, results = run
    for out in results:
        assert out["in_flight_after"] is None
    assert results[0]["folders_after"] == [f"checkpoint-{STEPS}"]  # rank 0 (should_save) rotates
    last = folder / "run" / f"checkpoint-{STEPS}"
    assert (last / "latest").read_text() == f"global_step{STEPS}"
    assert (last / f"global_step{STEPS}" / "manifest.json").is_file()
    assert [out["resumed_steps"] for out in results] == [STEPS + SAVE_EVERY] * 2


def test_an_engine_that_only_runs_forwards_has_no_asynchronous_saves(run):
    _, results = run
    for out in results:
        assert "async_save" not in out["inference_checkpoint"], out["inference_checkpoint"]
