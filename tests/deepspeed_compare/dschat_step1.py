"""DeepSpeed-Chat's step 1 (supervised fine-tuning), its import lines switched to zero3, on CPU.

The script is DeepSpeedExamples' `applications/DeepSpeed-Chat/training/step1_supervised_finetuning/
main.py` with its `dschat` package, unchanged but for the import lines in SWITCHES. Run in a
venv where DeepSpeed 0.19.8, transformers, accelerate, datasets and sentencepiece are
installed, so that
transformers' `HfDeepSpeedConfig` (which the script's `create_hf_model` keeps alive) builds the
model under DeepSpeed's own zero.Init, as it does on a real cluster; zero3.initialize then
takes the model over (engine_parts/deepspeed_adopt.py) and trains it.

Shrunk to CPU without downloads: the model is a small random Llama built from a config and
saved as a local folder (with a SentencePiece tokenizer trained here), the data synthetic prompts
and answers in the `local/jsonfile` dataset the script reads from `DeepSpeed-Chat/data/`.

    # once: a copy of DeepSpeed-Chat per engine (zero3: imports switched; deepspeed: as it is),
    # the model folder and the data
    DSVENV/bin/python tests/deepspeed_compare/dschat_step1.py prepare --examples EXAMPLES --work WORK
    # each engine on 2 gloo CPU ranks
    DS_ACCELERATOR=cpu ZERO3_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=. DSVENV/bin/python \\
        -m torch.distributed.run --standalone --nproc_per_node=2 \\
        tests/deepspeed_compare/dschat_step1.py run --work WORK --engine zero3   # or deepspeed

EXAMPLES is a checkout of DeepSpeedExamples. More arguments for main.py follow `--` (for
example `-- --gradient_checkpointing --lora_dim 8 --lora_module_name layers. --only_optimize_lora`). `run` prints the script's own output (its losses
with --print_loss, its perplexity before and after the epoch) and saves the model as the
script does (`save_hf_format`, `save_zero_three_model`) under WORK/<engine>/output.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import runpy
import shutil
import sys
from pathlib import Path

CHAT = Path("applications/DeepSpeed-Chat")
MAIN = Path("training/step1_supervised_finetuning/main.py")
# (file under DeepSpeed-Chat, the import line as DeepSpeed-Chat has it, zero3's)
SWITCHES = [
    (MAIN, "import deepspeed", "import zero3 as deepspeed"),
    (MAIN, "from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam",
     "from zero3.ops.adam import DeepSpeedCPUAdam, FusedAdam"),
    (MAIN, "from deepspeed import get_accelerator", "from zero3 import get_accelerator"),
    (Path("dschat/utils/utils.py"), "import deepspeed", "import zero3 as deepspeed"),
    (Path("dschat/utils/utils.py"), "from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus",
     "from zero3.runtime.zero.partition_parameters import ZeroParamStatus"),
    (Path("dschat/utils/utils.py"), "from deepspeed.accelerator import get_accelerator",
     "from zero3.accelerator import get_accelerator"),
    (Path("dschat/utils/ds_utils.py"), "import deepspeed.comm as dist", "import zero3.comm as dist"),
    (Path("dschat/utils/ds_utils.py"), "from deepspeed.accelerator import get_accelerator",
     "from zero3.accelerator import get_accelerator"),
    (Path("dschat/utils/module/lora.py"), "from deepspeed.compression.helper import recursive_getattr, "
     "recursive_setattr", "from zero3.compression.helper import recursive_getattr, recursive_setattr"),
    (Path("dschat/utils/module/lora.py"), "import deepspeed", "import zero3 as deepspeed"),
    (Path("dschat/utils/data/data_utils.py"), "from deepspeed.accelerator import get_accelerator",
     "from zero3.accelerator import get_accelerator"),
]
WORDS = [f"w{i}" for i in range(90)]
VOCAB = 120
TRAIN_ROWS, EVAL_ROWS = 32, 8


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    prepare = sub.add_parser("prepare")
    prepare.add_argument("--examples", type=Path, required=True, help="a checkout of DeepSpeedExamples")
    prepare.add_argument("--work", type=Path, required=True)
    run = sub.add_parser("run")
    run.add_argument("--work", type=Path, required=True)
    run.add_argument("--engine", choices=("zero3", "deepspeed"), required=True)
    run.add_argument("extra", nargs="*", help="more arguments for main.py (after --)")
    args = parser.parse_args()
    if args.command == "prepare":
        for engine in ("zero3", "deepspeed"):
            copy_chat(args.examples, args.work / engine, switch=engine == "zero3")
            write_data(args.work / engine / "DeepSpeed-Chat" / "data")
        write_model(args.work / "tiny-llama")
    else:
        run_main(args.work, args.engine, args.extra)


def copy_chat(examples: Path, into: Path, switch: bool) -> None:
    """DeepSpeed-Chat's script and package under `into`, imports switched to zero3 if `switch`."""
    target = into / "DeepSpeed-Chat"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(examples / CHAT, target, ignore=shutil.ignore_patterns("assets", "*.log"))
    if not switch:
        return
    for path, old, new in SWITCHES:
        lines = (target / path).read_text().split("\n")
        hits = [i for i, line in enumerate(lines) if line == old]
        if len(hits) != 1:
            raise SystemExit(f"{path}: expected the line {old!r} once, found it {len(hits)} times; "
                             "this DeepSpeedExamples is not the one SWITCHES was written for")
        lines[hits[0]] = new
        (target / path).write_text("\n".join(lines))
        print(f"switched {path}: {old!r} -> {new!r}")
    left = [f"{p.relative_to(target)}: {line.strip()}" for p in [target / MAIN, *sorted((target / "dschat").rglob("*.py"))]
            for line in p.read_text().split("\n")
            if line.lstrip().startswith(("import deepspeed", "from deepspeed"))
            and "rlhf" not in str(p)]  # dschat.rlhf (step 3) is not imported by step 1
    if left:
        raise SystemExit(f"imports of deepspeed left in what step 1 imports: {left}")


def write_data(folder: Path) -> None:
    """Synthetic prompts and answers in the `local/jsonfile` format (prompt, chosen, rejected)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)

    def sentence(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    for name, rows in (("train.json", TRAIN_ROWS), ("eval.json", EVAL_ROWS)):
        with open(folder / name, "w") as f:
            for _ in range(rows):
                row = {"prompt": f"Human: {sentence(rng.randint(3, 8))} Assistant:",
                       "chosen": sentence(rng.randint(4, 12)), "rejected": sentence(rng.randint(4, 12))}
                f.write(json.dumps(row) + "\n")


def write_model(folder: Path) -> None:
    """A small random Llama (built from a config) and a SentencePiece tokenizer trained here on
    the synthetic words, saved as a model folder (named for Llama, as the script's
    load_hf_tokenizer takes a LlamaTokenizer for such a folder)."""
    import sentencepiece
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    rng = random.Random(1)
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(f"Human: {' '.join(rng.choices(WORDS, k=8))} Assistant: "
                                 f"{' '.join(rng.choices(WORDS, k=8))}" for _ in range(400)))
    sentencepiece.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(folder / "tokenizer"),
                                             vocab_size=VOCAB, model_type="bpe", unk_id=0, bos_id=1, eos_id=2,
                                             pad_id=-1, minloglevel=2)
    corpus.unlink()
    (folder / "tokenizer.vocab").unlink()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    saved["_name_or_path"] = str(folder)  # where the script's load_hf_tokenizer looks for the tokenizer
    (folder / "config.json").write_text(json.dumps(saved, indent=2))


def run_main(work: Path, engine: str, extra: list[str]) -> None:
    """DeepSpeed-Chat's main.py as its launcher would start it on this rank."""
    chat = (work / engine / "DeepSpeed-Chat").resolve()
    sys.path.insert(0, str(chat))
    sys.argv = [str(chat / MAIN),
                "--data_path", "local/jsonfile", "--data_split", "10,0,0",
                "--data_output_path", str(work.resolve() / engine / "data_files"),
                "--model_name_or_path", str((work / "tiny-llama").resolve()),
                "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2",
                "--max_seq_len", "32", "--learning_rate", "1e-3", "--weight_decay", "0.1",
                "--num_train_epochs", "1", "--gradient_accumulation_steps", "1",
                "--lr_scheduler_type", "cosine", "--num_warmup_steps", "0", "--seed", "1234",
                "--zero_stage", "3", "--dtype", "bf16", "--print_loss",
                "--output_dir", str(work.resolve() / engine / "output"),
                "--local_rank", os.environ.get("LOCAL_RANK", "0"), *extra]
    transformers_4_names()
    if engine == "zero3":  # zero3's notes (the adoption of DeepSpeed's partitions among them) on the console
        logging.getLogger("zero3").setLevel(logging.INFO)
        logging.getLogger("zero3").addHandler(logging.StreamHandler())
    runpy.run_path(sys.argv[0], run_name="__main__")


def transformers_4_names() -> None:
    """DeepSpeed-Chat was written for transformers 4: names that transformers 5 moved are put
    back where the script imports them from (for both engines alike)."""
    import transformers.modeling_utils

    if not hasattr(transformers.modeling_utils, "no_init_weights"):
        from transformers.initialization import no_init_weights

        transformers.modeling_utils.no_init_weights = no_init_weights


if __name__ == "__main__":
    main()
