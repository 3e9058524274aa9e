"""zero3 with Hugging Face transformers + PEFT LoRA: train, save, resume, export.

A small Llama (`LlamaConfig`, random weights, no hub downloads), built inside
`zero3.Init()` so each weight is sharded as soon as it exists, gets PEFT LoRA adapters on
q_proj / v_proj (`get_peft_model`), HF gradient checkpointing (reentrant or not), and is
trained with zero3 on 2 ranks with gradient accumulation 2 and parameters offloaded to CPU.

Phase `first`: train STEPS optimizer steps, save a zero3 checkpoint.
Phase `resume`: new processes load it and train STEPS more; a few tokens are generated
with the weights gathered once; the same 2*STEPS steps are then run uninterrupted and
the losses after the resume compared bit for bit. Then the
model is exported: the LoRA adapter in PEFT's own format (`DIR/adapter`, loadable by
`PeftModel.from_pretrained`) and the merged full model as safetensors (`DIR/full`,
loadable by `LlamaForCausalLM.from_pretrained`); both are loaded back and checked to give
the trained model's logits.

    pip install -e .[hf]      # transformers==5.19.0, peft==0.21.2
    torchrun --standalone --nproc_per_node=2 examples/peft_lora.py --phase first --dir DIR
    torchrun --standalone --nproc_per_node=2 examples/peft_lora.py --phase resume --dir DIR
    (add --reentrant for reentrant activation checkpointing, --steps N for N steps a phase)

The functions here are also what tests/hf/test_hf_peft.py runs.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch

VOCAB, HIDDEN, LAYERS, HEADS, SEQ, MICRO, GA, STEPS, RANK = 128, 32, 2, 4, 16, 2, 2, 3, 4
LR = 1e-2
PAD, EOS, BOS = 0, 1, 2


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=64,
        tie_word_embeddings=False, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS,
        attn_implementation="eager", use_cache=False,
    )


def build_base(seed: int = 0, partitioned: bool = False):
    """The base Llama with random weights, the same on every rank and in every process.

    `partitioned`: built inside `zero3.Init()`, so each weight is sharded across the ranks
    as soon as it exists (a collective: every rank builds it)."""
    from transformers import AutoModelForCausalLM

    import zero3

    torch.manual_seed(seed)
    with zero3.Init(enabled=partitioned):
        return AutoModelForCausalLM.from_config(llama_config())


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                      task_type="CAUSAL_LM")


def build_peft_model(reentrant: bool, checkpointing: bool = True, seed: int = 0, partitioned: bool = False):
    """The trainable PEFT model: frozen base, LoRA A/B on q_proj and v_proj."""
    from peft import get_peft_model

    model = get_peft_model(build_base(seed, partitioned), lora_config())
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        if reentrant:
            # The base (and so the embedding output) is frozen: reentrant checkpointing needs an
            # input that requires grad, or no gradient reaches the LoRA weights inside it.
            model.enable_input_require_grads()
    model.train()
    return model


def zero3_config(threshold: int, offload: bool = True) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": threshold}
    if offload:
        zero["offload_param"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GA,
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
    }


def make_optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)


def build_engine(reentrant: bool, threshold: int, offload: bool = True):
    import zero3

    model = build_peft_model(reentrant, partitioned=True)
    engine, _, _, _ = zero3.initialize(model=model, optimizer=make_optimizer(model),
                                       config=zero3_config(threshold, offload))
    return engine


def batch(step: int, micro: int, rank: int, world: int) -> dict:
    """Arithmetic sequences (start + i * stride) mod VOCAB: learnable from context."""
    g = torch.Generator().manual_seed(((step * GA + micro) * world + rank) * 7919 + 13)
    start = torch.randint(3, VOCAB, (MICRO, 1), generator=g)
    stride = torch.randint(1, 4, (MICRO, 1), generator=g)
    ids = 3 + (start + stride * torch.arange(SEQ)) % (VOCAB - 3)
    return {"input_ids": ids, "labels": ids.clone()}


def eval_batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(4242)
    return torch.randint(3, VOCAB, (2, SEQ), generator=g)


def train(engine, first: int, count: int, progress: bool = False) -> dict:
    """Train steps [first, first+count): {(step, micro, rank): loss} of this rank."""
    rank, world = engine.global_rank, engine.world_size
    losses = {}
    steps = range(first, first + count)
    if progress and rank == 0:
        from tqdm import tqdm

        steps = tqdm(steps, desc=f"train {first}..{first + count}", ncols=80)
    for step in steps:
        for micro in range(GA):
            loss = engine(**batch(step, micro, rank, world)).loss
            engine.backward(loss)
            engine.step()
            losses[(step, micro, rank)] = loss.item()
        if progress and rank == 0:
            steps.set_postfix(loss=f"{losses[(step, GA - 1, rank)]:.4f}")
    return losses


def gather_losses(engine, losses: dict) -> dict:
    """Every rank's losses on every rank (a collective)."""
    import torch.distributed as dist

    out = [None] * engine.world_size
    dist.all_gather_object(out, losses)
    merged = {}
    for part in out:
        merged.update(part)
    return merged


def engine_logits(engine) -> torch.Tensor:
    """The trained model's logits on the eval batch (a collective: every rank runs it)."""
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=eval_batch()).logits.detach().clone()
    engine.train()
    return logits


def reference_losses(reentrant: bool, steps: int, world: int) -> dict:
    """The same run without zero3, in one process, on the same global batches."""
    model = build_peft_model(reentrant)
    optimizer = make_optimizer(model)
    losses = {}
    for step in range(steps):
        for micro in range(GA):
            for rank in range(world):
                loss = model(**batch(step, micro, rank, world)).loss
                (loss / (GA * world)).backward()
                losses[(step, micro, rank)] = loss.item()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return losses


def generate_sample(engine, new_tokens: int = 8) -> dict:
    """Greedy generation from an arithmetic-sequence prompt, the weights gathered once (a
    collective to enter and leave; generate itself issues none). Each rank has its own prompt."""
    rank = engine.global_rank
    prompt = 3 + (torch.arange(5 + rank) * 2 + 10) % (VOCAB - 3)
    with engine.gathered_for_generation() as model, torch.no_grad():
        out = model.generate(input_ids=prompt[None], attention_mask=torch.ones(1, prompt.numel(), dtype=torch.long),
                             max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD, eos_token_id=None,
                             use_cache=True)
    return {"prompt": prompt.tolist(), "new": out[0, prompt.numel():].tolist()}


def export(engine, folder: Path) -> dict | None:
    """Export the adapter (PEFT format) and the merged model (safetensors). A collective;
    rank 0 writes `folder/adapter` and `folder/full` and returns their paths."""
    from zero3.checkpoint.export import consolidated_state_dict

    state = consolidated_state_dict(engine)  # full PEFT-model state dict on rank 0
    if engine.global_rank != 0:
        return None
    copy = build_peft_model(reentrant=False, checkpointing=False)
    copy.load_state_dict(state, strict=True)
    adapter_dir, full_dir = Path(folder) / "adapter", Path(folder) / "full"
    copy.save_pretrained(adapter_dir)  # adapter_config.json + adapter_model.safetensors
    merged = copy.merge_and_unload()
    merged.save_pretrained(full_dir, safe_serialization=True)
    return {"adapter": str(adapter_dir), "full": str(full_dir)}


def load_adapter_logits(adapter_dir) -> torch.Tensor:
    """A fresh base + the exported adapter through PEFT's own loader."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(build_base(), adapter_dir).eval()
    with torch.no_grad():
        return model(input_ids=eval_batch()).logits


def load_full_logits(full_dir) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(full_dir).eval()
    with torch.no_grad():
        return model(input_ids=eval_batch()).logits


def say(text: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(text, flush=True)


def fmt(losses: dict) -> str:
    return ", ".join(f"{losses[k]:.6f}" for k in sorted(losses) if k[1] == GA - 1 and k[2] == 0)


def main() -> None:
    import zero3
    from zero3.accelerator import get_accelerator

    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=["first", "resume"], required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--reentrant", action="store_true", help="reentrant activation checkpointing")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps before the save, and after the resume")
    parser.add_argument("--threshold", type=int, default=RANK * HIDDEN,
                        help="stage3_param_persistence_threshold (default: LoRA A/B stay resident)")
    args = parser.parse_args()
    get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))
    zero3.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    torch.set_num_threads(1)
    folder = Path(args.dir)
    engine = build_engine(args.reentrant, args.threshold)
    if args.phase == "first":
        total = sum(p.numel() for p in engine.module.parameters())
        trainable = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
        say(f"zero3 + PEFT LoRA: Llama {LAYERS} layers, hidden {HIDDEN}: {total:,} parameters "
            f"({trainable:,} LoRA, trainable) on {engine.world_size} ranks, "
            f"{'reentrant' if args.reentrant else 'non-reentrant'} checkpointing, GA {GA}, CPU param offload")
        held = engine.sharded_bytes()
        say(f"built inside zero3.Init: rank 0 holds {held['param_shards'] + held['resident_params']:,} bytes of "
            f"parameters (the whole model is {4 * total:,})")
        losses = gather_losses(engine, train(engine, 0, args.steps, progress=True))
        engine.save_checkpoint(folder / "ckpt", client_state={"losses": {str(k): v for k, v in losses.items()}})
        say(f"saved after {engine.global_steps} steps; losses (rank 0, last micro): {fmt(losses)}")
        engine.destroy()
        return
    _, client = engine.load_checkpoint(folder / "ckpt")
    before = {tuple(int(x) for x in k.strip("()").split(", ")): v for k, v in client["losses"].items()}
    say(f"new processes loaded the checkpoint at global step {engine.global_steps}")
    resumed = gather_losses(engine, train(engine, args.steps, args.steps, progress=True))
    logits = engine_logits(engine)
    sample = generate_sample(engine)
    paths = export(engine, folder)
    engine.destroy()
    say(f"generated with the weights gathered once (rank 0's prompt {sample['prompt']}): {sample['new']}")
    reference = build_engine(args.reentrant, args.threshold)
    straight = gather_losses(reference, train(reference, 0, 2 * args.steps, progress=True))
    reference.destroy()
    exact = {**before, **resumed} == straight
    say("losses before save : " + fmt(before))
    say("losses after resume: " + fmt(resumed))
    say("uninterrupted run  : " + fmt(straight))
    ok = exact
    if paths is not None:
        adapter_err = (load_adapter_logits(paths["adapter"]) - logits).abs().max().item()
        full_err = (load_full_logits(paths["full"]) - logits).abs().max().item()
        say(f"exported adapter -> {paths['adapter']} (PeftModel.from_pretrained): max |logit diff| {adapter_err:.2e}")
        say(f"exported merged model -> {paths['full']} (LlamaForCausalLM.from_pretrained): "
            f"max |logit diff| {full_err:.2e}")
        ok = ok and adapter_err <= 1e-5 and full_err <= 1e-4
    say("RESUME_EXACT: the resumed run is bit-identical to the uninterrupted one" if exact
        else "RESUME_MISMATCH: the resumed run differs from the uninterrupted one")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
