"""Generation with a compiled engine, on 2 gloo ranks: `engine.generate` (every weight gathered
once) of a Llama whose fetch units are compiled gives the tokens of the same engine eager, and
training goes on after it with the eager run's losses."""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks

pytest.importorskip("transformers", reason="the Llama needs the hf extra")


def _run(compiled: bool) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    import zero3

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                         use_cache=True, attn_implementation="eager")
    model = LlamaForCausalLM(config)
    engine, *_ = zero3.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    if compiled:
        engine.compile(backend="aot_eager")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    losses = []
    for step in range(4):
        if step == 2:  # generation between training steps, prompts of another length than training's
            tokens = engine.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=6, do_sample=False)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    out = {"tokens": tokens.tolist(), "losses": losses, "compiled": engine.is_compiled}
    engine.destroy()
    return out


def _both(rank: int, world: int) -> dict:
    return {"eager": _run(False), "compiled": _run(True)}


def test_generation_with_a_compiled_engine_equals_eager():
    for result in run_ranks(_both, 2, timeout=300):
        eager, compiled = result["eager"], result["compiled"]
        assert compiled["compiled"] and not eager["compiled"]
        assert compiled["tokens"] == eager["tokens"] and len(compiled["tokens"][0]) == 10, (compiled, eager)
        assert max(abs(a - b) for a, b in zip(compiled["losses"], eager["losses"])) < 1e-5, (compiled, eager)
