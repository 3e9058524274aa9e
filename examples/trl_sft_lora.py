"""TRL's SFTTrainer + PEFT LoRA, trained with zero3 through the Hugging Face Trainer.

Two lines differ from a DeepSpeed run of the same script: the trainer class comes from
`zero3.hf.trainer_class(SFTTrainer)`, and the DeepSpeed JSON is passed as `zero3_config=`
instead of `SFTConfig(deepspeed=...)`. Everything else is the Trainer's: its arguments,
logging, `checkpoint-N` folders and `resume_from_checkpoint`.

A tiny Llama with random weights (no downloads: built from a LlamaConfig, saved to
DIR/base and loaded with from_pretrained), a word-level tokenizer built in code and a
generated dataset; LoRA on q_proj / v_proj, LoRA A resident (persistence threshold),
reentrant gradient checkpointing, accumulation 4, parameters offloaded to the CPU:

    torchrun --standalone --nproc_per_node=2 examples/trl_sft_lora.py --dir DIR --steps 6 --save-steps 3
    torchrun --standalone --nproc_per_node=2 examples/trl_sft_lora.py --dir DIR --steps 6 --resume
    accelerate launch --num_processes 2 --cpu examples/trl_sft_lora.py --dir DIR --steps 6

Each rank prints `step N loss X` lines (rank 0) and the final adapter is saved to
DIR/adapter. The functions here are what tests/hf/test_hf_trainer.py and bench/hf_sft_bench.py use.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch
from transformers import TrainerCallback

WORDS, HIDDEN, LAYERS, HEADS, SEQ, LORA_R = 60, 32, 2, 4, 16, 4
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]


def on_cpu() -> bool:
    """Whether the Trainer runs on the CPU: where zero3's accelerator is the CPU (no GPU, or
    ZERO3_ACCELERATOR=cpu), so the Trainer's batches and zero3's engine share a device."""
    from zero3.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu"


def build_tokenizer():
    """A word-level tokenizer over `w0 .. w{WORDS-1}` and four special tokens, in code."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIALS + [f"w{i}" for i in range(WORDS)])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def llama_config(vocab_size: int, hidden: int = HIDDEN, layers: int = LAYERS, heads: int = HEADS,
                 intermediate: int | None = None, max_positions: int = 64):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                       max_position_embeddings=max_positions, tie_word_embeddings=False, pad_token_id=0,
                       bos_token_id=1, eos_token_id=2, use_cache=False)


def save_tiny_llama(folder: str | Path, seed: int = 0) -> Path:
    """A tiny Llama with random weights and the tokenizer, saved for from_pretrained."""
    from transformers import LlamaForCausalLM

    folder = Path(folder)
    staging = folder.with_name(folder.name + ".partial")
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    LlamaForCausalLM(llama_config(len(tokenizer))).save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    staging.rename(folder)  # whole or absent: other ranks wait for the folder
    return folder


def make_dataset(rows: int = 64, seed: int = 0, min_words: int = 6, max_words: int = SEQ - 2):
    """`rows` texts of random words, the same in every process."""
    from datasets import Dataset

    generator = torch.Generator().manual_seed(seed)
    texts = []
    for _ in range(rows):
        length = int(torch.randint(min_words, max_words + 1, (1,), generator=generator))
        words = torch.randint(0, WORDS, (length,), generator=generator).tolist()
        texts.append(" ".join(f"w{w}" for w in words))
    return Dataset.from_dict({"text": texts})


def zero3_config(persistence_threshold: int = LORA_R * HIDDEN, offload_param: bool = True) -> dict:
    """DeepSpeed's JSON with Hugging Face's "auto" values (the Trainer fills them)."""
    zero = {"stage": 3, "stage3_param_persistence_threshold": persistence_threshold}
    if offload_param:
        zero["offload_param"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
            "zero_optimization": zero}


def sft_config(output_dir: str | Path, max_steps: int, save_steps: int = 0, reentrant: bool = True,
               accumulation: int = 4, **overrides):
    from trl import SFTConfig

    values = dict(output_dir=str(output_dir), per_device_train_batch_size=1,
                  gradient_accumulation_steps=accumulation, max_steps=max_steps, learning_rate=2e-2,
                  lr_scheduler_type="linear", warmup_steps=1, logging_steps=1, report_to=[], seed=0,
                  save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
                  gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": reentrant},
                  max_length=SEQ, dataset_text_field="text", packing=False, dataloader_num_workers=0,
                  disable_tqdm=True, bf16=False, use_cpu=on_cpu())
    values.update(overrides)
    return SFTConfig(**values)


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=LORA_R, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                      task_type="CAUSAL_LM")


class LossLog(TrainerCallback):
    """Keeps `{step: loss}` and every log line from the Trainer's logs."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))
        if logs and "loss" in logs:
            self.losses[state.global_step] = float(logs["loss"])


def build_sft_trainer(model_dir: str | Path, args, config: dict | None = None, dataset=None):
    """zero3's SFTTrainer over the Llama in `model_dir`, with LoRA through SFTTrainer's peft_config."""
    from transformers import AutoModelForCausalLM
    from trl import SFTTrainer

    import zero3.hf

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    Trainer = zero3.hf.trainer_class(SFTTrainer)                       # changed line 1
    return Trainer(model=model, args=args, train_dataset=dataset if dataset is not None else make_dataset(),
                   processing_class=build_tokenizer(), peft_config=lora_config(),
                   zero3_config=config if config is not None else zero3_config())  # changed line 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="working folder: base model, checkpoints, adapter")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-steps", type=int, default=3)
    parser.add_argument("--resume", action="store_true", help="resume from the last checkpoint-N in DIR/out")
    parser.add_argument("--non-reentrant", action="store_true")
    options = parser.parse_args()
    folder = Path(options.dir)
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0 and not (folder / "base").exists():
        save_tiny_llama(folder / "base")
    args = sft_config(folder / "out", options.steps, options.save_steps, reentrant=not options.non_reentrant)
    _wait_for_file(folder / "base")
    trainer = build_sft_trainer(folder / "base", args)
    log = LossLog()
    trainer.add_callback(log)
    trainer.train(resume_from_checkpoint=True if options.resume else None)
    trainer.save_model(str(folder / "adapter"))
    if trainer.is_world_process_zero():
        print(f"world {trainer.args.world_size} distributed {trainer.accelerator.distributed_type}", flush=True)
        for step, loss in sorted(log.losses.items()):
            print(f"step {step} loss {loss!r}", flush=True)


def _wait_for_file(path: Path, seconds: float = 120.0) -> None:
    import time

    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {seconds:.0f}s (rank 0 writes it)")
        time.sleep(0.2)


if __name__ == "__main__":
    main()
