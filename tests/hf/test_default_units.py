"""The fetch units zero3 chooses for Hugging Face models with no leaf declared (no
set_z3_leaf_modules, no leaf_module config, no granularity threshold): each decoder layer is
one unit gathered whole (its attention, MLP or experts, norms), and what lies outside the
layers (embedding, final norm, head) is gathered by the modules that hold it. Checked for
Llama, Qwen2 and Mixtral, on 2 gloo ranks. Mixtral's sparse MoE block is one of DeepSpeed's
default leaf classes: it stays inside its layer's unit (before, the default leaf made every
attention projection a unit of its own), also when a script declares it with
set_z3_leaf_modules, as DeepSpeed's Mixtral recipes do; a declared leaf of another kind keeps
the declared units."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the hf extra is not installed: pip install zero3[hf]")

# isort: split
from harness import run_ranks  # noqa: E402

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32)


def _model(kind: str):
    import torch
    import transformers

    torch.manual_seed(0)
    if kind == "mixtral":
        config = transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2)
        return transformers.MixtralForCausalLM(config)
    config_class, model_class = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                                 "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[kind]
    return model_class(config_class(**SMALL))


def units_of(rank: int, world: int) -> dict:
    import transformers

    import zero3
    from zero3.utils import set_z3_leaf_modules

    def declared_leaf_units(kind: str, leaf_class: type) -> list[str]:
        model = _model(kind)
        set_z3_leaf_modules(model, [leaf_class])
        engine, *_ = zero3.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                           "zero_optimization": {"stage": 3}})
        names = [u.name for u in engine.units if u.leaf]
        engine.destroy()
        return names

    seen = {"mixtral_declared": declared_leaf_units(
                "mixtral", transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock),
            "llama_mlp_declared": declared_leaf_units("llama", transformers.models.llama.modeling_llama.LlamaMLP)}
    for kind in ("llama", "qwen2", "mixtral"):
        model = _model(kind)
        engine, *_ = zero3.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                           "zero_optimization": {"stage": 3}})
        layers = {id(layer) for layer in model.model.layers}
        leaf_units = [u for u in engine.units if u.leaf]
        owner = {sp.name: u.name for u in engine.units for sp in u.params}
        seen[kind] = {
            "leaf_modules_are_layers": [id(u.module) in layers for u in leaf_units],
            "leaf_names": [u.name for u in leaf_units],
            "layer_params_in_their_layer": all(owner[name].startswith(name.rsplit(".", 2)[0].split(".mlp")[0]
                                                                      .split(".self_attn")[0].split(".input")[0]
                                                                      .split(".post")[0])
                                               for name in owner if ".layers." in name),
            "expert_owner": owner.get("model.layers.0.mlp.experts.gate_up_proj",
                                      next((v for k, v in owner.items() if ".experts." in k), None)),
            "outside": sorted({v for k, v in owner.items() if ".layers." not in k}),
        }
        engine.destroy()
    return seen


@pytest.fixture(scope="module")
def units():
    return run_ranks(units_of, 2)[0]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mixtral"])
def test_each_decoder_layer_is_one_unit(units, kind):
    seen = units[kind]
    assert seen["leaf_modules_are_layers"] == [True] * 3, seen
    assert seen["leaf_names"] == [f"model.layers.{i}" for i in range(3)], seen
    assert seen["layer_params_in_their_layer"], seen
    assert not any(name.startswith("model.layers") for name in seen["outside"]), seen


def test_mixtral_experts_stay_in_their_layers_unit(units):
    assert units["mixtral"]["expert_owner"] == "model.layers.0"


def test_a_declared_moe_leaf_is_subsumed_and_another_leaf_kept(units):
    assert units["mixtral_declared"] == [f"model.layers.{i}" for i in range(3)]
    assert units["llama_mlp_declared"] == [f"model.layers.{i}.mlp" for i in range(3)]
