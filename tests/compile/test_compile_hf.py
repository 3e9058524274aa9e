"""The Hugging Face Trainer with torch_compile=True under zero3.hf, on 2 gloo ranks: TRL's
SFTTrainer, LoRA on a frozen tiny Llama (reentrant gradient checkpointing, accumulation 2,
parameters offloaded to the CPU), compiled by the engine per fetch unit (each decoder layer),
against the same run eager in the same launch."""

from __future__ import annotations

from pathlib import Path

import torch
from trl_setup import ENV  # first: skips without the hf extra, puts examples/ on the path

import trl_sft_lora as E  # noqa: E402,I001
from harness import run_ranks  # noqa: E402

STEPS = 4


def _sft(folder: Path, compiled: bool) -> dict:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    extra = {"torch_compile": True, "torch_compile_backend": "aot_eager"} if compiled else {}
    args = E.sft_config(folder / ("compiled" if compiled else "eager"), STEPS, accumulation=2, **extra)
    trainer = E.build_sft_trainer(folder / "base", args)
    log = E.LossLog()
    trainer.add_callback(log)
    trainer.train()
    engine = trainer.zero3_engine
    result = {"losses": log.losses, "is_compiled": engine.is_compiled, "breaks": dict(counters["graph_break"]),
              "graphs": counters["stats"]["unique_graphs"], "fallbacks": engine.compiled_units.fallbacks(),
              "lora": {n: p.clone() for n, p in engine.state_dict().items() if "lora_" in n}}
    engine.destroy()
    return result


def _both(rank: int, world_size: int, folder: str) -> dict:
    return {"eager": _sft(Path(folder), False), "compiled": _sft(Path(folder), True)}


def test_trainer_torch_compile_trains_lora_as_eager(tmp_path):
    E.save_tiny_llama(tmp_path / "base")
    for rank_results in run_ranks(_both, 2, str(tmp_path), timeout=600, env=ENV):
        eager, compiled = rank_results["eager"], rank_results["compiled"]
        assert compiled["is_compiled"] and not eager["is_compiled"]
        assert compiled["losses"].keys() == eager["losses"].keys() and len(eager["losses"]) == STEPS
        assert max(abs(compiled["losses"][k] - eager["losses"][k]) for k in eager["losses"]) <= 1e-5
        assert max((compiled["lora"][k] - eager["lora"][k]).abs().max().item() for k in eager["lora"]) <= 1e-5
        assert compiled["graphs"] > 0 and compiled["fallbacks"] == []
        assert compiled["breaks"] == {}, compiled["breaks"]
