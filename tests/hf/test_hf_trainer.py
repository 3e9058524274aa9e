"""The Hugging Face Trainer, TRL's SFTTrainer and Accelerate training with zero3 (zero3.hf),
on 2 gloo ranks (ZERO3_TEST_WORLD_SIZE=1: one rank, for a GPU on NCCL, where Accelerate's gathers
refuse gloo's CUDA tensors). Hugging Face processes start slowly, so one launch runs several checks:

- launch `first`: SFTTrainer + LoRA through SFTTrainer's own peft_config (LoRA A resident by
  the persistence threshold, reentrant gradient checkpointing, accumulation 4, parameters
  offloaded to the CPU), checkpoints every 3 steps with save_total_limit=1; then a plain
  Trainer full fine-tune of a model loaded by from_pretrained inside zero3.zero.Init
  (compared with a plain load first), evaluate(), predict(), generation in an evaluation
  callback with ranks stopping at different lengths, save_model();
- launch `resume`: new processes resume the SFT run from its checkpoint-3;
- `accelerate launch` of examples/trl_sft_lora.py (plain multi-CPU config, no DeepSpeed);
- in this process: "auto" filling and the refusal of options zero3 cannot honour.

The model is a tiny Llama with random weights saved for from_pretrained, the tokenizer is
built in code and the dataset generated (examples/trl_sft_lora.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from trl_setup import ENV, ROOT  # first: skips without the hf extra, puts examples/ on sys.path

# isort: split
import torch  # noqa: E402
import trl_sft_lora as E  # noqa: E402  (on sys.path through trl_setup)
from harness import DEVICE, WORLD_SIZE_OVERRIDE, free_port, run_ranks  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

STEPS, SAVE_AT = 6, 3
WORLD = WORLD_SIZE_OVERRIDE or 2
MAX_NEW = 6


# ---------------------------------------------------------------- rank functions
class KeepFirstCheckpoint(TrainerCallback):
    """Copies checkpoint-SAVE_AT aside when it is written (rank 0, once every rank has written its files), before
    save_total_limit=1 rotates it away."""

    def __init__(self, source: Path, target: Path) -> None:
        self.source, self.target = source, target

    def on_save(self, args, state, control, **kwargs):
        if state.global_step != SAVE_AT:
            return
        import torch.distributed as dist

        dist.barrier()  # each rank writes its own rng_state_<rank>.pth, with no barrier after it
        if state.is_world_process_zero:
            shutil.copytree(self.source / f"checkpoint-{SAVE_AT}", self.target)


def sft_run(folder: Path, out: str, resume: str | None) -> dict:
    import trl_sft_lora as E

    args = E.sft_config(folder / out, STEPS, SAVE_AT, save_total_limit=1)
    trainer = E.build_sft_trainer(folder / "base", args)
    log = E.LossLog()
    trainer.add_callback(log)
    if resume is None:
        trainer.add_callback(KeepFirstCheckpoint(folder / out, folder / "kept"))
    trainer.train(resume_from_checkpoint=resume)
    engine = trainer.zero3_engine
    resident_a = {sp.name: sp.persistent for sp in engine.table.values() if ".lora_A." in sp.name}
    return {"losses": log.losses, "logs": log.logs, "resident_a": resident_a, "late": engine.late_gathers,
            "checkpoints": sorted(p.name for p in (folder / out).glob("checkpoint-*"))}


class GenerateOnEvaluate(TrainerCallback):
    """On evaluate, each rank generates greedily from its own prompt with its own stop token
    (rank 0 stops after 1 token, rank 1 runs MAX_NEW): no rank may wait on the other."""

    def __init__(self, results: dict) -> None:
        self.results = results

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        import torch.distributed as dist

        rank = dist.get_rank()
        model.generation_config.eos_token_id = None
        prompt = torch.tensor([[5 + rank, 9, 11, 7 + 3 * rank][: 3 + rank]], device=args.device)  # the Trainer's
        common = dict(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                      max_new_tokens=MAX_NEW, pad_token_id=0)
        with torch.no_grad():
            free = model.generate(**common)
            eos = int(free[0, prompt.shape[1]]) if rank == 0 else None
            tokens = model.generate(**common, eos_token_id=eos)
        self.results.setdefault("generated", []).append(tokens[0, prompt.shape[1]:].tolist())


def full_finetune(folder: Path) -> dict:
    """from_pretrained inside zero3.zero.Init equals a plain load; a plain Trainer fine-tunes
    it, evaluates, predicts, generates in a callback and saves the model."""
    import trl_sft_lora as E
    from transformers import AutoModelForCausalLM, DataCollatorForLanguageModeling, TrainingArguments

    import zero3
    import zero3.hf

    plain = AutoModelForCausalLM.from_pretrained(folder / "base")
    config = E.zero3_config(persistence_threshold=0, offload_param=False)
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    with zero3.zero.Init(config_dict_or_path=config):
        model = AutoModelForCausalLM.from_pretrained(folder / "base")
    empty = [name for name, p in model.named_parameters() if p.untyped_storage().nbytes() == 0]
    tokenizer = E.build_tokenizer()
    data = E.make_dataset(32, seed=1).map(lambda row: tokenizer(row["text"]), remove_columns=["text"])
    args = TrainingArguments(output_dir=str(folder / "full"), per_device_train_batch_size=4 // WORLD,  # 4 a step
                             gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-2, max_grad_norm=0.5,
                             logging_steps=1, report_to=[], save_strategy="no", seed=0, disable_tqdm=True,
                             gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
                             per_device_eval_batch_size=2, use_cpu=E.on_cpu())
    results: dict = {}
    trainer = zero3.hf.Trainer(model=model, args=args, train_dataset=data, eval_dataset=data.select(range(8)),
                               data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
                               processing_class=tokenizer, zero3_config=config,
                               callbacks=[E.LossLog(), GenerateOnEvaluate(results)])
    loaded = trainer.evaluate()  # builds the engine: compare its whole values with the plain load
    engine = trainer.zero3_engine
    state = engine.state_dict()
    loaded_equal = {k: float((state["module." + k] - v).abs().max()) for k, v in plain.state_dict().items()
                    if not torch.equal(state["module." + k], v)}
    trainer.train()
    log = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, E.LossLog))
    predictions = trainer.predict(data.select(range(4)))
    trainer.save_model(str(folder / "saved"))
    trained = {k[len("module."):]: v for k, v in trainer.zero3_engine.state_dict().items()}
    return {"empty_after_init": empty, "n_params": len(list(model.parameters())), "loaded_unequal": loaded_equal,
            "eval_loss_before": loaded["eval_loss"], "eval_loss_after": trainer.evaluate()["eval_loss"],
            "logs": log.logs, "predict_shape": tuple(predictions.predictions.shape), "trained": trained,
            "generated": results["generated"]}


def lora_on_init_model(folder: Path) -> dict:
    """A model loaded inside zero3.zero.Init gets LoRA by SFTTrainer's peft_config= and by
    PEFT's get_peft_model; both train (2 steps each)."""
    import trl_sft_lora as E
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM
    from trl import SFTTrainer

    import zero3
    import zero3.hf

    losses = {}
    for path in ("peft_config", "get_peft_model"):
        with zero3.zero.Init(config_dict_or_path=E.zero3_config()):
            model = AutoModelForCausalLM.from_pretrained(folder / "base")
        extra = {"peft_config": E.lora_config()}
        if path == "get_peft_model":
            model, extra = get_peft_model(model, E.lora_config()), {}
        trainer = zero3.hf.trainer_class(SFTTrainer)(
            model=model, args=E.sft_config(folder / f"init_{path}", 2), train_dataset=E.make_dataset(),
            processing_class=E.build_tokenizer(), zero3_config=E.zero3_config(), **extra)
        log = E.LossLog()
        trainer.add_callback(log)
        trainer.train()
        trainer.zero3_engine.destroy()
        losses[path] = log.losses
    return losses


def first_launch(rank: int, world: int, folder: str) -> dict:
    folder = Path(folder)
    return {"sft": sft_run(folder, "sft", None), "full": full_finetune(folder),
            "init_lora": lora_on_init_model(folder)}


def resume_launch(rank: int, world: int, folder: str) -> dict:
    folder = Path(folder)
    return sft_run(folder, "sft_resumed", str(folder / "kept"))


# ----------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_trainer")
    E.save_tiny_llama(folder / "base")
    first = run_ranks(first_launch, WORLD, str(folder), timeout=400, env=ENV)
    resumed = run_ranks(resume_launch, WORLD, str(folder), timeout=300, env=ENV)
    return {"folder": folder, "first": first, "resumed": resumed}


def test_sft_lora_resume_is_exact(runs):
    first, resumed = [r["sft"] for r in runs["first"]], runs["resumed"]
    straight = first[0]["losses"]
    assert sorted(straight) == list(range(1, STEPS + 1))
    for r in first + resumed:
        assert r["resident_a"] and all(r["resident_a"].values()), r["resident_a"]  # LoRA A resident
        assert r["late"] == 0
    for r in resumed:
        assert r["losses"] == {s: straight[s] for s in range(SAVE_AT + 1, STEPS + 1)}  # bit for bit
    assert all(r["losses"] == straight for r in first)
    # save_total_limit=1 rotated checkpoint-3 away; the kept copy holds the Trainer's files and zero3's
    assert first[0]["checkpoints"] == [f"checkpoint-{STEPS}"]
    kept = {p.name for p in (runs["folder"] / "kept").iterdir()}
    rng_files = {f"rng_state_{rank}.pth" for rank in range(WORLD)} if WORLD > 1 else {"rng_state.pth"}
    assert rng_files | {"trainer_state.json", "scheduler.pt", "latest",
            f"global_step{SAVE_AT}", "adapter_model.safetensors", "adapter_config.json"} <= kept
    logged = [log for log in first[0]["logs"] if "loss" in log]
    assert all(log["grad_norm"] > 0 and "learning_rate" in log for log in logged)


def test_lora_on_a_model_loaded_inside_init(runs):
    for r in runs["first"]:
        straight = r["sft"]["losses"]
        # SFTTrainer's peft_config= on the sharded load: the same run as on a plain load
        assert r["init_lora"]["peft_config"] == {1: straight[1], 2: straight[2]}
        got = r["init_lora"]["get_peft_model"]
        assert sorted(got) == [1, 2] and all(0 < v < 10 for v in got.values()), got


def test_full_finetune_save_model_evaluate_generate(runs):
    from transformers import AutoModelForCausalLM

    full = [r["full"] for r in runs["first"]]
    for r in full:
        assert r["loaded_unequal"] == {}  # from_pretrained inside zero3.zero.Init == a plain from_pretrained
        assert len(r["empty_after_init"]) == r["n_params"]  # every weight partitioned at load
        assert r["eval_loss_after"] < r["eval_loss_before"]
        assert r["predict_shape"][0] == 4
    # grad_norm is the engine's pre-clipping norm; learning_rate the one the update used (linear decay)
    logged = [log for log in full[0]["logs"] if "loss" in log]
    assert len(logged) == 3 and all(log["grad_norm"] > 0 for log in logged)
    assert [round(log["learning_rate"], 6) for log in logged] == [0.01, round(0.01 * 2 / 3, 6), round(0.01 / 3, 6)]
    # generation in the evaluation callback ended on every rank, each at its own length
    assert [len(g) for g in full[0]["generated"]] == [1, 1]
    assert all([len(g) for g in r["generated"]] == [MAX_NEW, MAX_NEW] for r in full[1:])
    # save_model(): from_pretrained-loadable safetensors with the trained values
    saved = AutoModelForCausalLM.from_pretrained(runs["folder"] / "saved")
    for name, value in saved.state_dict().items():
        assert torch.equal(value, full[0]["trained"][name]), name


@pytest.mark.skipif(DEVICE != "cpu" or WORLD != 2, reason="compares with the launch on 2 CPU ranks")
def test_accelerate_launch(runs, tmp_path):
    """The example under `accelerate launch` with a plain multi-CPU config (no DeepSpeed
    plugin). On a CPU, Accelerate's launcher starts one process per call (it spreads CPU
    processes with mpirun only), so each rank is one `accelerate launch` with the rank in
    its environment, as an MPI launcher would give it. The two ranks join one gloo group
    and train the same run as the `first` launch: the same losses."""
    port = free_port()
    config = tmp_path / "accelerate.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 2\n"
                      "num_machines: 1\nmachine_rank: 0\nmain_process_ip: 127.0.0.1\n"
                      f"main_process_port: {port}\nmixed_precision: 'no'\nuse_cpu: true\n")
    shutil.copytree(runs["folder"] / "base", tmp_path / "base")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               str(ROOT / "examples" / "trl_sft_lora.py"), "--dir", str(tmp_path), "--steps", str(STEPS),
               "--save-steps", str(SAVE_AT)]
    ranks = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={
        **os.environ, **ENV, "OMP_NUM_THREADS": "1", "ZERO3_ACCELERATOR": "cpu", "RANK": str(rank),
        "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}) for rank in range(2)]
    outputs = [process.communicate(timeout=300) for process in ranks]
    for process, (out, err) in zip(ranks, outputs):
        assert process.returncode == 0, out[-3000:] + err[-3000:]
    stdout = outputs[0][0]
    assert "world 2 distributed DistributedType.MULTI_CPU" in stdout, stdout[-2000:]
    losses = {int(line.split()[1]): float(line.split()[3]) for line in stdout.splitlines()
              if line.startswith("step ")}
    assert losses == runs["first"][0]["sft"]["losses"]
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()


# ------------------------------------------------------------- in this process
def _arguments(tmp_path, **overrides):
    from transformers import TrainingArguments

    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=3, gradient_accumulation_steps=5,
                  learning_rate=3e-4, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-7, weight_decay=0.1,
                  max_grad_norm=0.7, warmup_steps=4, report_to=[], use_cpu=True)
    values.update(overrides)
    return TrainingArguments(**values)


def test_auto_values_filled_from_arguments(tmp_path):
    from types import SimpleNamespace

    from zero3.hf import ConfigFillError, fill_from_arguments, fill_from_model

    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                        "weight_decay": "auto"}},
              "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                               "warmup_num_steps": "auto",
                                                               "total_num_steps": "auto"}},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                    "stage3_prefetch_bucket_size": "auto",
                                    "stage3_param_persistence_threshold": "auto"}}
    args = _arguments(tmp_path)
    filled = fill_from_model(fill_from_arguments(config, args), args,
                             SimpleNamespace(config=SimpleNamespace(hidden_size=64)), 100)
    assert config["train_batch_size"] == "auto"  # the input is not modified
    assert (filled["train_micro_batch_size_per_gpu"], filled["gradient_accumulation_steps"],
            filled["train_batch_size"], filled["gradient_clipping"]) == (3, 5, 15, 0.7)
    assert filled["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-7, "weight_decay": 0.1}
    assert filled["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 4,
                                             "total_num_steps": 100}
    assert filled["bf16"] == {"enabled": False}
    assert filled["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 4096,
                                           "stage3_prefetch_bucket_size": 3686,
                                           "stage3_param_persistence_threshold": 640}
    with pytest.raises(ConfigFillError, match=r"gradient_accumulation_steps=4 but gradient_accumulation_steps=5"):
        fill_from_arguments({"gradient_accumulation_steps": 4}, args)


@pytest.mark.parametrize("option,value,message", [
    ("deepspeed", "ds_config.json", "pass the same DeepSpeed JSON"),
    ("torch_compile_mode", "reduce-overhead", "CUDA graphs"),
    ("fsdp", ["full_shard"], "fsdp"),
    ("fp16", True, "use bf16=True"),
    ("optim", "adafactor", "elementwise"),
])
def test_unsupported_options_refused_in_constructor(tmp_path, option, value, message):
    import zero3.hf

    args = _arguments(tmp_path)
    setattr(args, option, value)  # set after construction: TrainingArguments would act on some of these
    model = torch.nn.Linear(2, 2)
    with pytest.raises(zero3.hf.UnsupportedOptionError, match=rf"TrainingArguments\.{option}=.*{message}"):
        zero3.hf.Trainer(model=model, args=args, zero3_config={"zero_optimization": {"stage": 3}})


def test_trainer_class_needs_a_trainer_and_a_config(tmp_path):
    import transformers

    import zero3.hf

    assert zero3.hf.trainer_class(transformers.Trainer) is zero3.hf.Trainer
    assert issubclass(zero3.hf.Trainer, transformers.Trainer)
    with pytest.raises(TypeError, match="transformers.Trainer or a subclass"):
        zero3.hf.trainer_class(torch.nn.Module)
    with pytest.raises(TypeError, match="needs zero3_config="):
        zero3.hf.Trainer(model=torch.nn.Linear(2, 2), args=_arguments(tmp_path))
