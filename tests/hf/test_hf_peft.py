"""Hugging Face transformers + PEFT LoRA under zero3 (the `hf` extra: transformers 5.19.0,
peft 0.21.2): train with GA, CPU param offload and HF gradient checkpointing on 2 ranks,
save, resume exactly, export the adapter in PEFT's format and the merged model as
safetensors; and `generate()` on 2 ranks whose prompts stop at different steps.

The flow is the one of examples/peft_lora.py, imported from there.
"""

from __future__ import annotations

import copy
import math
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the hf extra is not installed: pip install zero3[hf]")
pytest.importorskip("peft", reason="the hf extra is not installed: pip install zero3[hf]")

os.environ["HF_HUB_OFFLINE"] = "1"  # models are built from a config: never reach the hub
EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)

import peft_lora as P  # noqa: E402
import torch  # noqa: E402
from harness import run_ranks  # noqa: E402

ENV = {"HF_HUB_OFFLINE": "1", "PYTHONPATH": EXAMPLES + os.pathsep + os.environ.get("PYTHONPATH", "")}
LORA_A_NUMEL = P.RANK * P.HIDDEN  # q_proj / v_proj lora_A: (r, hidden)


def lora_flow(rank: int, world: int, reentrant: bool, threshold: int, folder: str):
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import peft_lora as P

    folder = Path(folder)
    engine = P.build_engine(reentrant, threshold)
    persistent_a = {sp.name: sp.persistent for sp in engine.table.values() if ".lora_A." in sp.name}
    first = P.train(engine, 0, P.STEPS)
    engine.save_checkpoint(folder / "ckpt")
    engine.destroy()

    engine = P.build_engine(reentrant, threshold)  # a fresh engine and model, loaded from disk
    engine.load_checkpoint(folder / "ckpt")
    resumed = P.train(engine, P.STEPS, P.STEPS)
    logits = P.engine_logits(engine)
    paths = P.export(engine, folder)
    late = engine.late_gathers
    engine.destroy()

    engine = P.build_engine(reentrant, threshold)
    straight = P.train(engine, 0, 2 * P.STEPS)
    engine.destroy()
    return {"persistent_a": persistent_a, "first": first, "resumed": resumed, "straight": straight,
            "logits": logits, "paths": paths, "late": late}


@pytest.mark.parametrize("reentrant,threshold,a_persistent", [
    (False, LORA_A_NUMEL, True),   # LoRA A under the threshold: resident
    (True, LORA_A_NUMEL - 1, False),  # LoRA A over it: sharded, gathered on use
    (True, LORA_A_NUMEL, True),
], ids=["nonreentrant-A-resident", "reentrant-A-sharded", "reentrant-A-resident"])
def test_lora_train_resume_export(tmp_path, reentrant, threshold, a_persistent):
    results = run_ranks(lora_flow, 2, reentrant, threshold, str(tmp_path), timeout=400, env=ENV)
    for r in results:
        assert r["persistent_a"] and all(v == a_persistent for v in r["persistent_a"].values()), r["persistent_a"]
        # resume is exact: the resumed run is bit-identical to the uninterrupted one
        assert {**r["first"], **r["resumed"]} == r["straight"]
        assert r["late"] == 0
    # both ranks computed the same logits for the trained model
    torch.testing.assert_close(results[0]["logits"], results[1]["logits"], rtol=0, atol=0)

    # losses match the same run without zero3, in one process, on the same global batches
    reference = P.reference_losses(reentrant, 2 * P.STEPS, 2)
    losses = {**results[0]["straight"], **results[1]["straight"]}
    assert set(losses) == set(reference)
    for key, value in reference.items():
        assert math.isclose(losses[key], value, rel_tol=1e-4), (key, losses[key], value)
    assert losses[(2 * P.STEPS - 1, P.GA - 1, 0)] < losses[(0, P.GA - 1, 0)]  # it learned

    # the exported adapter, loaded by PEFT into a fresh base, gives the trained model's outputs
    paths = results[0]["paths"]
    assert (Path(paths["adapter"]) / "adapter_config.json").exists()
    assert (Path(paths["adapter"]) / "adapter_model.safetensors").exists()
    trained = results[0]["logits"]
    torch.testing.assert_close(P.load_adapter_logits(paths["adapter"]), trained, rtol=0, atol=1e-5)
    # and the merged full model as safetensors, loaded by LlamaForCausalLM
    assert list(Path(paths["full"]).glob("*.safetensors"))
    torch.testing.assert_close(P.load_full_logits(paths["full"]), trained, rtol=0, atol=1e-5)


MAX_NEW = 8


def prompts(seed: int) -> list[torch.Tensor]:
    """Rank 0 gets a short prompt, rank 1 a longer one."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, P.VOCAB, (1, n), generator=g) for n in (4, 9)]


def greedy(model, prompt: torch.Tensor, eos, **kwargs) -> torch.Tensor:
    return model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=MAX_NEW,
                          do_sample=False, pad_token_id=P.PAD, eos_token_id=eos, use_cache=True, **kwargs)


def pick_eos(model):
    """Prompts and an end-of-sequence token such that rank 0's greedy continuation stops
    after 2 new tokens and rank 1's runs on (at least 5 tokens): the ranks finish at
    different steps."""
    model.generation_config.eos_token_id = None
    for seed in range(50):
        ps = prompts(seed)
        with torch.no_grad():
            conts = [greedy(model, p, None)[0, p.shape[1]:].tolist() for p in ps]
        eos = conts[0][1]
        if eos not in conts[0][:1] and eos not in conts[1][:5]:
            return ps, eos
    raise AssertionError("no prompt found whose continuations stop at different steps")


def generate_on_ranks(rank: int, world: int):
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import peft_lora as P

    import zero3

    model = P.build_base().eval()
    unsharded = copy.deepcopy(model)
    ps, eos = pick_eos(unsharded)
    prompt = ps[rank]
    with torch.no_grad():
        expected = greedy(unsharded, prompt, eos)
    config = {"train_micro_batch_size_per_gpu": 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "offload_param": {"device": "cpu"}}}
    engine, _, _, _ = zero3.initialize(model=model, config=config)
    engine.eval()
    with torch.no_grad():
        got = greedy(engine.module, prompt, eos, synced_gpus=True)
    engine.destroy()
    return {"expected": expected, "got": got, "eos": eos, "prompt_len": prompt.shape[1]}


def test_generate_ranks_stop_at_different_steps():
    results = run_ranks(generate_on_ranks, 2, timeout=300, env=ENV, collective_timeout=60)
    new = [r["got"].shape[1] - r["prompt_len"] for r in results]
    assert new[0] == 2 and new[1] > 2, new  # rank 0 hit eos at step 2, rank 1 ran on
    assert results[0]["got"][0, -1].item() == results[0]["eos"]
    for r in results:
        assert torch.equal(r["got"], r["expected"]), (r["got"], r["expected"])


# --------------------------------------------------------------- zero3.Init
def init_build_and_train(rank: int, world: int):
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import peft_lora as P
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    import zero3
    from zero3.checkpoint.export import consolidated_state_dict

    torch.manual_seed(rank)  # rank 0's values must win
    with zero3.Init():
        base = AutoModelForCausalLM.from_config(P.llama_config())
    storage = sum(p.untyped_storage().nbytes() for p in base.parameters())
    model = get_peft_model(base, P.lora_config())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    engine, _, _, _ = zero3.initialize(model=model, optimizer=P.make_optimizer(model),
                                       config=P.zero3_config(P.RANK * P.HIDDEN))
    initial = consolidated_state_dict(engine)
    losses = P.train(engine, 0, 2)
    engine.destroy()
    torch.manual_seed(rank)
    P.build_base(0)  # consumes the RNG as the base build above did: LoRA A gets the same draws
    engine = P.build_engine(reentrant=False, threshold=P.RANK * P.HIDDEN)
    plain_losses = P.train(engine, 0, 2)
    engine.destroy()
    return {"storage": storage, "initial": initial, "losses": losses, "plain_losses": plain_losses}


def test_init_builds_a_partitioned_llama_that_trains_like_a_normal_build():
    results = run_ranks(init_build_and_train, 2, timeout=300, env=ENV)
    expected = P.build_base(0).state_dict()  # rank 0's seed, built the ordinary way
    initial = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
               for k, v in results[0]["initial"].items() if "lora_" not in k}
    assert set(initial) == set(expected)
    for name, value in expected.items():
        assert torch.equal(initial[name], value), name
    for r in results:
        assert r["storage"] == 0
        assert r["losses"] == r["plain_losses"], (r["losses"], r["plain_losses"])


def build_llama_measured(rank: int, world: int, with_init: bool, pretrained: str | None = None):
    import ctypes

    from test_init import M_MMAP_THRESHOLD, peak_anon_while, peak_rss_while
    from transformers import AutoModelForCausalLM, LlamaConfig

    import zero3

    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    config = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                 num_hidden_layers=1, num_attention_heads=2))  # warm imports

    def load():
        if pretrained is None:
            return AutoModelForCausalLM.from_config(config)
        return AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32)

    def build():
        if not with_init:
            return load()
        with zero3.Init():
            return load()

    model, peak = (peak_rss_while if pretrained is None else peak_anon_while)(build)
    numels = [p.numel() for p in model.parameters()]
    return {"peak": peak, "model_bytes": 4 * sum(numels), "largest": 4 * max(numels),
            "storage": sum(p.untyped_storage().nbytes() for p in model.parameters())}


def test_init_peak_memory_of_a_llama_from_config():
    whole = run_ranks(build_llama_measured, 2, False, timeout=300, env=ENV)
    partitioned = run_ranks(build_llama_measured, 2, True, timeout=300, env=ENV)
    for r in whole:
        assert r["storage"] == r["model_bytes"] and r["peak"] >= 0.95 * r["model_bytes"], r
    for r in partitioned:
        assert r["storage"] == 0
        assert r["peak"] <= r["model_bytes"] / 2 + r["largest"] + 16 * 2**20, r
        assert r["peak"] < 0.8 * r["model_bytes"], r


def test_init_peak_memory_of_a_llama_from_pretrained(tmp_path):
    """from_pretrained inside zero3.Init: the process's anonymous memory rises by about its
    shards plus the largest weight, not by the whole model (the safetensors file pages the
    loader maps are page cache, counted apart)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "llama")
    whole = run_ranks(build_llama_measured, 2, False, str(tmp_path / "llama"), timeout=300, env=ENV)
    partitioned = run_ranks(build_llama_measured, 2, True, str(tmp_path / "llama"), timeout=300, env=ENV)
    for r in whole:  # the plain load keeps its weights in the file mapping: little RSS until read
        assert r["storage"] == r["model_bytes"], r
    for r in partitioned:
        assert r["storage"] == 0
        assert r["peak"] <= r["model_bytes"] / 2 + r["largest"] + 16 * 2**20, (r, [w["peak"] for w in whole])


# ------------------------------------------- generation with the weights gathered once
def generate_gathered_once(rank: int, world: int):
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import peft_lora as P

    import zero3

    engine = P.build_engine(reentrant=False, threshold=0)  # everything sharded, LoRA included
    first = P.train(engine, 0, 1)
    with zero3.GatheredParameters(list(engine.module.parameters())):
        trained = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    reference = P.build_peft_model(reentrant=False, checkpointing=False)
    reference.load_state_dict(trained, strict=False)
    reference.eval()
    ps, eos = pick_eos(reference)
    with torch.no_grad():
        expected = greedy(reference, ps[rank], eos)
    before = engine.comm_stats()
    with engine.gathered_for_generation() as model, torch.no_grad():
        entered = engine.comm_stats()
        got = greedy(model, ps[rank], eos)  # no synced_gpus: the ranks stop at different steps
        during = engine.comm_stats()
        mode_inside = model.training
    after = engine.comm_stats()
    training = engine.module.training
    engine.eval()
    with torch.no_grad():
        via_engine = greedy(engine, ps[rank], eos)  # engine.generate gathers once by itself
    engine.train(training)
    resumed = P.train(engine, 1, 1)  # training goes on, sharded
    engine.destroy()
    straight_engine = P.build_engine(reentrant=False, threshold=0)
    straight = P.train(straight_engine, 0, 2)
    straight_engine.destroy()
    return {"expected": expected, "got": got, "via_engine": via_engine, "prompt_len": ps[rank].shape[1], "eos": eos,
            "gathers_entering": entered.get("all_gather", (0, 0))[0] - before.get("all_gather", (0, 0))[0],
            "during_equal": during == entered, "after_equal": after == during, "mode_inside": mode_inside,
            "losses": {**first, **resumed}, "straight": straight}


def test_generate_with_weights_gathered_once_then_training_continues():
    results = run_ranks(generate_gathered_once, 2, timeout=300, env=ENV, collective_timeout=60)
    new = [r["got"].shape[1] - r["prompt_len"] for r in results]
    assert new[0] == 2 and new[1] > 2, new  # the ranks stopped at different steps
    for r in results:
        assert torch.equal(r["got"], r["expected"]), (r["got"], r["expected"])
        assert torch.equal(r["via_engine"], r["expected"]), (r["via_engine"], r["expected"])
        assert r["during_equal"] and r["after_equal"]  # no collective while generating or leaving
        assert r["gathers_entering"] > 0 and r["mode_inside"] is False
        assert r["losses"] == r["straight"]  # generation in between changed nothing in training
