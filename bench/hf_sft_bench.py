"""TRL SFTTrainer + PEFT LoRA through the Hugging Face Trainer: zero3 against DeepSpeed.

The same script, the same Trainer arguments, model, data and DeepSpeed JSON; the only
difference is how the trainer is made, as a user moving a script over would do it:
  zero3:      zero3.hf.trainer_class(SFTTrainer)(..., zero3_config=cfg)
  deepspeed:  SFTTrainer(..., args=SFTConfig(..., deepspeed=cfg))   (DeepSpeed 0.19.8)

Each engine runs in its own torchrun process tree (one after the other), trains
`--steps` optimizer steps and reports the median optimizer-step time after `--warmup`
steps, tokens/s and peak memory; the parent prints both and zero3's speed ratio.

    python bench/hf_sft_bench.py                   # ~1B Llama, bf16, one GPU per process
    python bench/hf_sft_bench.py --tiny --nproc 2  # a tiny Llama on 2 CPU ranks (gloo)

Model: a LlamaConfig with random weights (hidden 2048, 16 layers, intermediate 5632, 16
heads, vocab 32000), LoRA r=16 on q/k/v/o, gradient checkpointing, every sample `--seq`
tokens long (generated words, a word-level tokenizer built in code; nothing downloaded).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

MARK = "HF_SFT_RESULT "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["zero3", "deepspeed", "both"], default="both")
    parser.add_argument("--tiny", action="store_true", help="the tiny Llama of examples/trl_sft_lora.py, on CPU")
    parser.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per run")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps")
    parser.add_argument("--warmup", type=int, default=3, help="optimizer steps left out of the timing")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--trainer", choices=["sft", "dpo"], default="sft",
                        help="sft: SFTTrainer + LoRA; dpo: DPOTrainer, full fine-tune with a reference model")
    return parser.parse_args(argv)


# ------------------------------------------------------------------- one engine
def build_model(options: argparse.Namespace, vocab: int):
    import torch
    import trl_sft_lora as example
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    if options.tiny:
        return LlamaForCausalLM(example.llama_config(vocab, max_positions=max(64, options.seq)))
    config = example.llama_config(32000, hidden=2048, layers=16, heads=16, intermediate=5632,
                                  max_positions=options.seq)
    return LlamaForCausalLM(config).to(torch.bfloat16)


def ds_config(options: argparse.Namespace) -> dict:
    """The DeepSpeed JSON both engines get, Hugging Face "auto" values filled by each."""
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
            "zero_optimization": {"stage": 3}}


class StepClock:
    """Wall time of each optimizer step (device synchronized), from the Trainer's callbacks."""

    def __init__(self) -> None:
        import torch

        self.cuda = torch.cuda.is_available()
        self.marks: list[float] = []
        self.losses: list[float] = []

    def now(self) -> float:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def make_callback(clock: StepClock):
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if not clock.marks:
                clock.marks.append(clock.now())

        def on_step_end(self, args, state, control, **kwargs):
            clock.marks.append(clock.now())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                clock.losses.append(float(logs["loss"]))

    return Clock()


def sft_trainer(options: argparse.Namespace, world: int, out: Path, bf16: bool):
    """SFTTrainer + LoRA on samples of exactly `seq` tokens: (class, its arguments)."""
    import trl_sft_lora as example
    from peft import LoraConfig
    from trl import SFTTrainer

    tokenizer = example.build_tokenizer()
    words = options.seq - 2  # with <s> and </s>: every sample is exactly `seq` tokens
    dataset = example.make_dataset(rows=options.micro_batch * options.accumulation * world * (options.steps + 1),
                                   min_words=words, max_words=words)
    args = example.sft_config(out, options.steps, accumulation=options.accumulation, reentrant=False,
                              per_device_train_batch_size=options.micro_batch, max_length=options.seq,
                              learning_rate=1e-4, logging_steps=1, bf16=bf16,
                              deepspeed=ds_config(options) if options.engine == "deepspeed" else None)
    lora = LoraConfig(r=options.lora_r, lora_alpha=2 * options.lora_r, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM")
    return SFTTrainer, dict(model=build_model(options, len(tokenizer)), args=args, train_dataset=dataset,
                            processing_class=tokenizer, peft_config=lora)


def dpo_trainer(options: argparse.Namespace, world: int, out: Path, bf16: bool):
    """DPOTrainer, full fine-tune, the reference model loaded by TRL from the policy's folder:
    pairs of a `seq // 2`-word prompt and two `seq // 2 - 2`-word completions."""
    import torch
    import trl_sft_lora as example
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    tokenizer = example.build_tokenizer()
    generator = torch.Generator().manual_seed(0)

    def words(count: int) -> str:
        return " ".join(f"w{int(w)}" for w in torch.randint(0, example.WORDS, (count,), generator=generator))

    half = options.seq // 2
    rows = options.micro_batch * options.accumulation * world * (options.steps + 1)
    dataset = Dataset.from_list([{"prompt": words(half), "chosen": " " + words(half - 2),
                                  "rejected": " " + words(half - 2)} for _ in range(rows)])
    folder = out / f"policy_rank{os.environ.get('RANK', '0')}"  # each rank its own copy: no race, no barrier
    build_model(options, len(tokenizer)).save_pretrained(folder)  # TRL loads its reference from here
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16 if bf16 else torch.float32)
    args = DPOConfig(output_dir=str(out), per_device_train_batch_size=options.micro_batch,
                     gradient_accumulation_steps=options.accumulation, max_steps=options.steps,
                     learning_rate=1e-6, logging_steps=1, report_to=[], save_strategy="no", seed=0,
                     disable_tqdm=True, bf16=bf16, use_cpu=not torch.cuda.is_available(), max_length=options.seq,
                     gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
                     deepspeed=ds_config(options) if options.engine == "deepspeed" else None)
    return DPOTrainer, dict(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)


def run_one(options: argparse.Namespace) -> None:
    import torch

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    bf16 = not options.tiny and torch.cuda.is_available()
    out = Path(os.environ.get("HF_SFT_OUT", "/tmp/hf_sft_bench")) / options.trainer / options.engine
    make = sft_trainer if options.trainer == "sft" else dpo_trainer
    trainer_cls, common = make(options, world, out, bf16)
    if options.engine == "zero3":
        import zero3.hf

        trainer = zero3.hf.trainer_class(trainer_cls)(**common, zero3_config=ds_config(options))
    else:
        trainer = trainer_cls(**common)
    clock = StepClock()
    trainer.add_callback(make_callback(clock))
    trainer.train()
    steps = [b - a for a, b in zip(clock.marks, clock.marks[1:])][options.warmup:]
    pair = 2 if options.trainer == "dpo" else 1  # DPO runs the chosen and the rejected sequence
    tokens = options.micro_batch * options.accumulation * options.seq * world * pair
    median = statistics.median(steps)
    peak = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else float("nan")
    if rank == 0:
        print(MARK + json.dumps({"engine": options.engine, "step_ms": 1e3 * median, "min_ms": 1e3 * min(steps),
                                 "tokens_per_s": tokens / median, "peak_mib": peak, "steps_timed": len(steps),
                                 "losses": clock.losses[:4], "world": world}), flush=True)


# ---------------------------------------------------------------------- parent
def launch(engine: str, options: argparse.Namespace, argv: list[str]) -> dict | None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={options.nproc}",
               str(Path(__file__).resolve())]
    # The options travel in the environment: torchrun's own parser would take them for its flags.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               HF_SFT_ARGS=json.dumps(argv + ["--engine", engine]))
    if options.tiny:
        env.update(ZERO3_ACCELERATOR="cpu", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode != 0 or not lines:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-25:])
        print(f"# {engine}: failed (exit {done.returncode}) after {time.perf_counter() - started:.0f} s\n{tail}")
        return None
    result = json.loads(lines[-1][len(MARK):])
    print(f"# {engine}: done in {time.perf_counter() - started:.0f} s", flush=True)
    return result


def report(results: dict[str, dict], options: argparse.Namespace) -> None:
    what = f"SFTTrainer + LoRA r={options.lora_r}" if options.trainer == "sft" else "DPOTrainer, full fine-tune"
    print(f"\n{what}, seq {options.seq}, micro-batch {options.micro_batch}, "
          f"accumulation {options.accumulation}, {options.nproc} process(es), "
          f"{'tiny Llama on CPU' if options.tiny else '~1B Llama bf16'}; median of the steps after {options.warmup}\n")
    print("| engine    | step ms (median) | min ms | tokens/s | peak MiB/rank | first losses |")
    print("|-----------|------------------|--------|----------|---------------|--------------|")
    for name, r in results.items():
        losses = " ".join(f"{x:.4f}" for x in r["losses"])
        print(f"| {name:<9} | {r['step_ms']:16.1f} | {r['min_ms']:6.1f} | {r['tokens_per_s']:8,.0f} | "
              f"{r['peak_mib']:13.0f} | {losses} |")
    if "zero3" in results and "deepspeed" in results:
        print(f"\nzero3 tokens/s / DeepSpeed tokens/s = "
              f"{results['zero3']['tokens_per_s'] / results['deepspeed']['tokens_per_s']:.2f}")


def main() -> None:
    if "HF_SFT_ARGS" in os.environ:  # a rank of one engine's run
        run_one(parse_args(json.loads(os.environ["HF_SFT_ARGS"])))
        return
    argv = sys.argv[1:]
    options = parse_args(argv)
    engines = ["zero3", "deepspeed"] if options.engine == "both" else [options.engine]
    results = {name: r for name in engines if (r := launch(name, options, argv)) is not None}
    if results:
        report(results, options)


if __name__ == "__main__":
    main()
