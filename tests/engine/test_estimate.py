"""`zero3 estimate` / `zero3.estimate.estimate_memory` against what the engine holds.

An engine is built on 2 (and 4) real ranks for each config, trained one step (so the
optimizer state exists) and run forward and backward once more (so the gradient shards
exist); then `engine.sharded_bytes()` (the bytes of the tensors it really holds) is
compared with the estimate, category by category, within 5%.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from common import make_model
from harness import run_ranks

BASE = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}


def merged(extra: dict) -> dict:
    config = json.loads(json.dumps(BASE))
    for key, value in extra.items():
        if key == "zero_optimization":
            config[key].update(value)
        else:
            config[key] = value
    return config


CONFIGS = {
    "fp32": {},
    "bf16": {"bf16": {"enabled": True}},
    "bf16-offload-param": {"bf16": {"enabled": True}, "zero_optimization": {"offload_param": {"device": "cpu"}}},
    "fp32-offload-optimizer": {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
    "resident-small": {"zero_optimization": {"stage3_param_persistence_threshold": 30}},
    "sgd-momentum": {"optimizer": {"type": "SGD", "params": {"lr": 0.01, "momentum": 0.9}}},
    "bf16-masters-states": {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                                     "bf16_optimizer_states": True}},
    "bf16-masters-offloaded": {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
                               "zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
}


def held_and_estimated(rank: int, world: int, extra: dict):
    import zero3
    from zero3.estimate import estimate_memory

    config = merged(extra)
    model = make_model(width=40, depth=3)  # a frozen block, uneven sizes
    estimate = estimate_memory(model, world, config, device_type="cpu")
    optimizer = None if "optimizer" in config else torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-3)
    engine, *_ = zero3.initialize(model=model, optimizer=optimizer, config=config)
    g = torch.Generator().manual_seed(rank)
    dtype = torch.bfloat16 if "bf16" in config else torch.float32
    for _ in range(2):
        loss = engine(torch.randn(2, 13, generator=g).to(dtype), torch.randn(2, 5, generator=g).to(dtype))
        engine.backward(loss)
        if engine.global_steps == 0:
            engine.step()
    held = engine.sharded_bytes()
    engine.destroy()
    return {"held": held, "estimate": estimate.by_category(), "device": estimate.device, "host": estimate.host}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_estimate_matches_what_the_engine_holds(name):
    for r in run_ranks(held_and_estimated, 2, CONFIGS[name]):
        for category, held in r["held"].items():
            assert r["estimate"][category] == pytest.approx(held, rel=0.05, abs=64), (category, r)
        assert sum(r["estimate"].values()) == pytest.approx(sum(r["held"].values()), rel=0.05)
        if "offload_param" in json.dumps(CONFIGS[name]):
            assert r["host"]["param_shards"] > 0 and "param_shards" not in r["device"]


def test_estimate_matches_at_four_ranks():
    for r in run_ranks(held_and_estimated, 4, CONFIGS["bf16"]):
        for category, held in r["held"].items():
            assert r["estimate"][category] == pytest.approx(held, rel=0.05, abs=64), (category, r)


@pytest.mark.parametrize("name", ["bf16", "resident-small", "bf16-offload-param"])
def test_estimate_matches_at_one_rank(name):
    """World size 1: parameters are their own shards (no resident copy) unless offloaded."""
    for r in run_ranks(held_and_estimated, 1, CONFIGS[name]):
        for category, held in r["held"].items():
            assert r["estimate"][category] == pytest.approx(held, rel=0.05, abs=64), (category, r)
        if "offload_param" not in json.dumps(CONFIGS[name]):
            assert r["held"]["resident_params"] == 0 and r["held"]["param_shards"] > 0


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zero3.cli", "estimate", *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_estimate_from_a_parameter_count():
    out = run_cli("--params", "1000000000", "--world-size", "8", "--dtype", "bf16", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    shard = 125_000_000
    assert result["device"] == {"param_shards": 2 * shard, "resident_params": 0, "grad_shards": 4 * shard,
                                "masters": 4 * shard, "optimizer_state": 8 * shard + 4}
    table = run_cli("--params", "1000000000", "--world-size", "8", "--offload-optimizer")
    assert table.returncode == 0 and "optimizer_state" in table.stdout and "host" in table.stdout


def test_cli_estimate_refuses_bad_input_with_the_reason():
    out = run_cli("--params", "1000", "--world-size", "2", "--config", "/nonexistent/ds.json")
    assert out.returncode == 2 and "/nonexistent/ds.json" in out.stderr
    out = run_cli("--params", "1000", "--trainable", "2000", "--world-size", "2")
    assert out.returncode == 2 and "trainable=2000" in out.stderr


def test_cli_estimate_from_a_hugging_face_config(tmp_path):
    pytest.importorskip("transformers", reason="the hf extra is not installed: pip install zero3[hf]")
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256,
              "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = run_cli("--model-config", str(tmp_path), "--world-size", "2", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    from transformers import AutoModelForCausalLM, LlamaConfig

    model = AutoModelForCausalLM.from_config(LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"}))
    assert result["parameters"] == sum(p.numel() for p in model.parameters())
    assert result["resident"] == sum(p.numel() for p in model.parameters() if p.numel() <= 100_000)
    assert result["gathered_unit"] == 4 * sum(p.numel() for p in model.model.layers[0].parameters())


def test_bytes_a_parameter_of_each_precision_setting():
    """The placement's rule (placement/sizes.py) and the estimate, Adam, gradients held: 18 bytes
    a trainable parameter with bf16 compute and fp32 masters (zero3 accumulates fp32 gradient
    shards), 8 with both bf16 keys (the master is the shard), 14 in the offloaded mixed mode (a
    separate bf16 master, fp32 moments)."""
    from zero3.estimate import estimate_memory
    from zero3.placement.sizes import state_bytes_per_element

    assert 2 + state_bytes_per_element(2, 2) == 18
    assert 2 + state_bytes_per_element(2, 2, master_width=2, state_width=2) == 8
    assert 2 + state_bytes_per_element(2, 2, master_width=2, state_width=4) == 14
    n = 1 << 20
    for extra, per_param in ((CONFIGS["bf16"], 18), (CONFIGS["bf16-masters-states"], 8),
                             (CONFIGS["bf16-masters-offloaded"], 14)):
        estimate = estimate_memory(n, 1, merged(extra), device_type="cuda").by_category()
        per_element = sum(v for k, v in estimate.items() if k != "resident_params") - 4  # Adam's step counter
        assert per_element == per_param * n, (extra, estimate)


def test_activations_by_sequence_length():
    """placement/activations.py's count: the loss grows as seq x vocab until tiled, the kept
    layer inputs as layers x seq x hidden and move to the host with offload_hidden_states, the
    MLP's share shrinks to a tile, and sequence parallelism divides the tokens."""
    from zero3.placement.activations import ModelShape, estimate_activations

    shape = ModelShape(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256)
    plain = estimate_activations(shape, 32768)
    assert plain.loss == 32768 * 128256 * 10  # fp32 logits and their gradient, bf16 logits
    assert plain.kept_inputs == 32 * 32768 * 4096 * 2 and plain.host == 0
    assert plain.device == plain.kept_inputs + max(plain.layer_working, plain.loss)
    tiled = estimate_activations(shape, 32768, tiled_mlp=True, tiled_loss=True, offload_hidden_states=True)
    assert tiled.host == plain.kept_inputs and tiled.loss < (3 << 30)
    mlp = 6 * 32768 * 14336 * 2
    assert plain.layer_working - tiled.layer_working == mlp - mlp // 8  # 8 tiles of hidden_size tokens
    assert tiled.device == max(tiled.layer_working, tiled.loss)
    split = estimate_activations(shape, 32768, sequence_parallel=4)
    assert split.tokens == 8192 and split.kept_inputs == plain.kept_inputs // 4
    eager = estimate_activations(shape, 4096, checkpointing=False)
    assert eager.device == 32 * eager.layer_working + eager.loss


def test_cli_estimate_prints_activations_at_a_sequence_length(tmp_path):
    pytest.importorskip("transformers", reason="the hf extra is not installed: pip install zero3[hf]")
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                              "long_sequence": {"offload_hidden_states": True, "tiled_loss": True}}))
    out = run_cli("--model-config", str(tmp_path), "--world-size", "1", "--config", str(ds), "--seq", "65536")
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if "activations at seq 65,536" in x)
    assert "on the host" in line and "host 16.0 MiB" in line  # 2 layers x 65536 x 64 x 2 bytes
    out = run_cli("--params", "1000", "--world-size", "1", "--seq", "128")
    assert out.returncode != 0 and "--model-config" in out.stderr
