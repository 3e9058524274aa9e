"""TRL's DPOTrainer, GRPOTrainer and KTOTrainer under zero3 (zero3.hf.trainer_class(...)) on 2 gloo ranks,
against TRL's own trainers (plain data parallel) in the same launch.

DPO:

- full fine-tune, the reference loaded by TRL, `sync_ref_model` every step: zero3 shards the
  reference in an engine of its own and mixes it through zero3; the losses equal TRL's;
- the same with the policy and a reference passed as `ref_model=` both built inside
  zero3.zero.Init: the same losses, the reference never whole;
- bf16: the reference computes in the policy's dtype, so the first loss is exactly log 2;
- LoRA (the reference is the policy with its adapter off): the losses equal TRL's;
- `precompute_ref_log_probs` with a model built inside zero3.zero.Init is refused by name on
  both ranks (TRL reads the model's values while the trainer is built).

GRPO (sampling its own completions, a KL term against a reference model): rank 0 may only
emit special tokens, so its completions end early and its generate() runs fewer steps than
rank 1's. The engine's generate() gathers the weights once, so neither rank waits on the
other; losses and rewards equal TRL's, and the reference is sharded.

KTO (full fine-tune, TRL's own reference copy): sharded, the losses equal TRL's.

The model is the tiny random Llama of examples/trl_sft_lora.py; the preference pairs are
generated and saved to disk (TRL's dataset caches must be shared between ranks).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from trl_setup import ENV  # first: skips without the hf extra, puts examples/ on sys.path

# isort: split
import trl_sft_lora as E  # noqa: E402  (on sys.path through trl_setup)
from harness import run_ranks  # noqa: E402

STEPS = 4
GRPO_NEW = 8


def save_preference_pairs(folder: Path, rows: int = 32) -> None:
    """Prompts with a longer chosen and a shorter rejected completion, random words."""
    import torch
    from datasets import Dataset

    generator = torch.Generator().manual_seed(0)

    def words(count: int) -> str:
        return " ".join(f"w{int(w)}" for w in torch.randint(0, E.WORDS, (count,), generator=generator))

    # completions start with a space: TRL joins prompt and completion as they are
    Dataset.from_list([{"prompt": words(4), "chosen": " " + words(3), "rejected": " " + words(2)}
                       for _ in range(rows)]).save_to_disk(str(folder))


# ---------------------------------------------------------------- rank functions
def dpo_run(folder: Path, name: str, zero3_trainer: bool, bf16: bool = False, init: bool = False,
            lora: bool = False, sync: bool = False, pass_reference: bool = False) -> dict:
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    import zero3
    import zero3.hf

    config = E.zero3_config(offload_param=False)

    def load():
        if not init:
            return AutoModelForCausalLM.from_pretrained(folder / "base")
        with zero3.zero.Init(config_dict_or_path=config):
            return AutoModelForCausalLM.from_pretrained(folder / "base")

    model = load()
    extra = {"peft_config": E.lora_config()} if lora else {}
    if pass_reference:
        extra["ref_model"] = load()
    args = DPOConfig(output_dir=str(folder / name), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                     max_steps=STEPS, learning_rate=5e-2, logging_steps=1, report_to=[], save_strategy="no",
                     use_cpu=True, seed=0, disable_tqdm=True, max_length=32, bf16=bf16,
                     sync_ref_model=sync, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5)
    cls, kwargs = DPOTrainer, {}
    if zero3_trainer:
        cls, kwargs = zero3.hf.trainer_class(DPOTrainer), {"zero3_config": config}
    reference_whole = None
    if pass_reference:
        reference_whole = [n for n, p in extra["ref_model"].named_parameters() if p.untyped_storage().nbytes()]
    trainer = cls(model=model, args=args, train_dataset=load_from_disk(str(folder / "pairs")),
                  processing_class=E.build_tokenizer(), **extra, **kwargs)
    log = E.LossLog()
    trainer.add_callback(log)
    trainer.train()
    out = {"losses": [log.losses[step] for step in sorted(log.losses)], "reference": type(trainer.ref_model).__name__,
           "reference_whole_at_start": reference_whole}
    if zero3_trainer and trainer.ref_model is not None:
        out["reference_engine"] = _reference_layout(trainer.ref_model)
        trainer.ref_model.destroy()
    if zero3_trainer:
        trainer.zero3_engine.destroy()
    return out


def _reference_layout(engine) -> dict:
    """How the reference engine holds the model on this rank."""
    sharded = [sp for sp in engine.table.values() if not sp.persistent]
    return {"no_optimizer": engine.optimizer is None,
            "sharded_numel": sum(sp.numel for sp in sharded),
            "local_numel": sum(sp.shard.numel() for sp in sharded),
            "released": all(sp.param.untyped_storage().nbytes() == 0 for sp in sharded),
            "resident_numel": sum(sp.numel for sp in engine.table.values() if sp.persistent),
            "requires_grad": any(sp.param.requires_grad for sp in engine.table.values())}


def refused_precompute(folder: Path) -> str:
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    import zero3
    import zero3.hf

    config = E.zero3_config(offload_param=False)
    with zero3.zero.Init(config_dict_or_path=config):
        model = AutoModelForCausalLM.from_pretrained(folder / "base")
    args = DPOConfig(output_dir=str(folder / "precompute"), per_device_train_batch_size=2, max_steps=1,
                     report_to=[], use_cpu=True, bf16=False, precompute_ref_log_probs=True, max_length=32)
    try:
        zero3.hf.trainer_class(DPOTrainer)(model=model, args=args, train_dataset=load_from_disk(str(folder / "pairs")),
                                           processing_class=E.build_tokenizer(), zero3_config=config)
    except Exception as exc:  # noqa: BLE001 - the class and text are what the test checks
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def grpo_run(folder: Path, rank: int, zero3_trainer: bool) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    import zero3.hf

    generator = torch.Generator().manual_seed(0)
    prompts = Dataset.from_list([{"prompt": " ".join(f"w{int(w)}" for w in torch.randint(0, E.WORDS, (4,),
                                                                                       generator=generator))}
                                 for _ in range(32)])
    lengths: list[int] = []

    def reward_length(completions, completion_ids, **kwargs):
        lengths.extend(len(ids) for ids in completion_ids)
        return [float(len(ids)) for ids in completion_ids]

    only_special = {"bad_words_ids": [[token] for token in range(4, len(E.build_tokenizer()))]}
    args = GRPOConfig(output_dir=str(folder / f"grpo_{zero3_trainer}"), per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=GRPO_NEW, max_steps=3, learning_rate=1e-2,
                      logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
                      bf16=False, beta=0.04, generation_kwargs=only_special if rank == 0 else None)
    cls, kwargs = GRPOTrainer, {}
    if zero3_trainer:
        cls, kwargs = zero3.hf.trainer_class(GRPOTrainer), {"zero3_config": E.zero3_config(offload_param=False)}
    trainer = cls(model=AutoModelForCausalLM.from_pretrained(folder / "base"), reward_funcs=reward_length,
                  args=args, train_dataset=prompts, processing_class=E.build_tokenizer(), **kwargs)
    log = E.LossLog()
    trainer.add_callback(log)
    trainer.train()
    out = {"losses": [line["loss"] for line in log.logs if "loss" in line],
           "rewards": [line["reward"] for line in log.logs if "reward" in line],
           "longest": max(lengths), "reference": type(trainer.ref_model).__name__}
    if zero3_trainer:
        out["reference_engine"] = _reference_layout(trainer.ref_model)
        trainer.ref_model.destroy()
        trainer.zero3_engine.destroy()
    return out


def kto_run(folder: Path, zero3_trainer: bool) -> dict:
    """KTOTrainer, full fine-tune: its reference is TRL's own copy (sharded under zero3)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import KTOConfig, KTOTrainer

    import zero3.hf

    pairs = load_pairs(folder)
    rows = Dataset.from_list([{"prompt": row["prompt"], "completion": row["chosen" if i % 2 else "rejected"],
                               "label": bool(i % 2)} for i, row in enumerate(pairs)])
    args = KTOConfig(output_dir=str(folder / f"kto_{zero3_trainer}"), per_device_train_batch_size=4,
                     gradient_accumulation_steps=2, max_steps=3, learning_rate=5e-2, logging_steps=1, report_to=[],
                     save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, bf16=False, max_length=32)
    cls, kwargs = KTOTrainer, {}
    if zero3_trainer:
        cls, kwargs = zero3.hf.trainer_class(KTOTrainer), {"zero3_config": E.zero3_config(offload_param=False)}
    trainer = cls(model=AutoModelForCausalLM.from_pretrained(folder / "base"), args=args, train_dataset=rows,
                  processing_class=E.build_tokenizer(), **kwargs)
    log = E.LossLog()
    trainer.add_callback(log)
    trainer.train()
    out = {"losses": [log.losses[step] for step in sorted(log.losses)], "reference": type(trainer.ref_model).__name__}
    if zero3_trainer:
        trainer.ref_model.destroy()
        trainer.zero3_engine.destroy()
    return out


def load_pairs(folder: Path):
    from datasets import load_from_disk

    return load_from_disk(str(folder / "pairs"))


def trl_launch(rank: int, world: int, folder: str) -> dict:
    folder = Path(folder)
    return {
        "plain_sync": dpo_run(folder, "plain_sync", zero3_trainer=False, sync=True),
        "zero3_sync": dpo_run(folder, "zero3_sync", zero3_trainer=True, sync=True),
        "zero3_init_sync": dpo_run(folder, "zero3_init_sync", zero3_trainer=True, sync=True, init=True,
                                   pass_reference=True),
        "zero3_bf16": dpo_run(folder, "zero3_bf16", zero3_trainer=True, bf16=True),
        "plain_lora": dpo_run(folder, "plain_lora", zero3_trainer=False, lora=True),
        "zero3_lora": dpo_run(folder, "zero3_lora", zero3_trainer=True, lora=True),
        "precompute": refused_precompute(folder),
        "plain_grpo": grpo_run(folder, rank, zero3_trainer=False),
        "zero3_grpo": grpo_run(folder, rank, zero3_trainer=True),
        "plain_kto": kto_run(folder, zero3_trainer=False),
        "zero3_kto": kto_run(folder, zero3_trainer=True),
    }


# ----------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_trl")
    E.save_tiny_llama(folder / "base")
    save_preference_pairs(folder / "pairs")
    return run_ranks(trl_launch, 2, str(folder), timeout=400, env=ENV)


def _close(ours: list[float], theirs: list[float], rtol: float = 1e-5) -> bool:
    return len(ours) == len(theirs) > 0 and all(abs(a - b) <= rtol * abs(b) + 1e-7 for a, b in zip(ours, theirs))


def test_full_finetune_with_a_synced_sharded_reference_matches_trl(runs):
    for out in runs:
        plain, ours = out["plain_sync"], out["zero3_sync"]
        assert plain["reference"] == "LlamaForCausalLM" and ours["reference"] == "Engine"
        assert len(ours["losses"]) == STEPS and _close(ours["losses"], plain["losses"]), (ours, plain)
        assert len(set(plain["losses"])) == STEPS  # the run moves: the comparison is not between constants
        layout = ours["reference_engine"]
        assert layout["no_optimizer"] and layout["released"] and not layout["requires_grad"], layout
        assert layout["local_numel"] == pytest.approx(layout["sharded_numel"] / 2, abs=64), layout
        assert layout["sharded_numel"] > 20 * layout["resident_numel"], layout


def test_init_policy_and_reference_never_whole(runs):
    for out in runs:
        ours = out["zero3_init_sync"]
        assert ours["reference_whole_at_start"] == [], ours["reference_whole_at_start"]
        assert _close(ours["losses"], out["plain_sync"]["losses"]), (ours["losses"], out["plain_sync"]["losses"])


def test_bf16_reference_computes_in_the_policy_dtype(runs):
    for out in runs:
        losses = out["zero3_bf16"]["losses"]
        assert losses[0] == pytest.approx(math.log(2), abs=1e-7), losses  # policy == reference before any update
        assert len(set(losses)) == STEPS, losses  # and the run moves on from there


def test_lora_reference_is_the_policy_without_its_adapter(runs):
    for out in runs:
        assert out["zero3_lora"]["reference"] == "NoneType"
        assert _close(out["zero3_lora"]["losses"], out["plain_lora"]["losses"]), (out["zero3_lora"], out["plain_lora"])


def test_precompute_on_an_init_model_is_refused_by_name(runs):
    for out in runs:
        error = out["precompute"]
        assert error.startswith("UnsupportedOptionError: TrainingArguments.precompute_ref_log_probs=True"), error
        assert "zero3.zero.Init" in error and "precompute_ref_log_probs=False" in error, error


def test_grpo_ranks_generating_different_lengths_match_trl(runs):
    assert runs[0]["zero3_grpo"]["longest"] < GRPO_NEW == runs[1]["zero3_grpo"]["longest"], runs
    for out in runs:
        plain, ours = out["plain_grpo"], out["zero3_grpo"]
        assert len(ours["losses"]) == 3 and _close(ours["losses"], plain["losses"]), (ours, plain)
        assert ours["rewards"] == pytest.approx(plain["rewards"], rel=1e-6), (ours, plain)
        assert plain["reference"] == "LlamaForCausalLM" and ours["reference"] == "Engine"
        assert ours["reference_engine"]["released"] and ours["reference_engine"]["no_optimizer"]


def test_kto_with_a_sharded_reference_matches_trl(runs):
    for out in runs:
        plain, ours = out["plain_kto"], out["zero3_kto"]
        assert plain["reference"] == "LlamaForCausalLM" and ours["reference"] == "Engine"
        assert len(ours["losses"]) == 3 and len(set(plain["losses"])) == 3, (ours, plain)
        assert _close(ours["losses"], plain["losses"]), (ours, plain)
