"""Scenarios of sequence parallelism and the long_sequence section, run on every rank by
tests/sequence/test_sequence_parallel.py (module level, so that spawned ranks import them).

One small HF Llama (fp32, sdpa, GQA), built from a config with the same random weights on
every rank; a few fixed batches. A group of `sp` consecutive ranks splits each sequence; the
runs they are compared with see whole sequences (each rank the batch of its group)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB, HIDDEN, SEQ, STEPS = 61, 32, 24, 3


def build_model(heads: int = 4, kv_heads: int = 2, attn: str = "sdpa", lora: bool = False, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=72, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                         attn_implementation=attn, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                                 lora_dropout=0.0))
        torch.manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if "lora_B" in name:  # non-zero, so the adapters change the loss from the first step
                p.data.normal_(0, 0.05)
    return model


def batches(group: int, seq: int = SEQ) -> list[dict]:
    """The fixed batches of data-parallel group `group`: input_ids, position_ids, labels (a few ignored)."""
    out = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * group + step)
        ids = torch.randint(0, VOCAB, (1, seq), generator=g)
        labels = ids.clone()
        labels[0, : 2 + step] = -100
        out.append({"input_ids": ids, "position_ids": torch.arange(seq).unsqueeze(0), "labels": labels})
    return out


def config(sp: int = 1, long_sequence: dict | None = None, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 2e-2, "weight_decay": 0.0}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, **extra}
    if sp > 1:
        cfg["sequence_parallel_size"] = sp
    if long_sequence:
        cfg["long_sequence"] = long_sequence
    return cfg


def shifted(labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()


def sp_slice(batch: dict, sp: int, sp_rank: int) -> dict:
    """This rank's slice of a whole-sequence batch, with shift_labels made before the cut."""
    shift = shifted(batch["labels"])
    chunk = batch["input_ids"].shape[1] // sp
    part = slice(sp_rank * chunk, (sp_rank + 1) * chunk)
    return {"input_ids": batch["input_ids"][:, part], "position_ids": batch["position_ids"][:, part],
            "shift_labels": shift[:, part]}


def sp_step_loss(engine, piece: dict):
    from zero3.sequence.loss import sequence_parallel_loss

    out = engine(input_ids=piece["input_ids"], position_ids=piece["position_ids"], labels=piece["shift_labels"],
                 shift_labels=piece["shift_labels"])
    return sequence_parallel_loss(out.loss, piece["shift_labels"])


def full_params(engine) -> dict[str, torch.Tensor]:
    from zero3.utils import safe_get_full_fp32_param

    return {name: safe_get_full_fp32_param(p).clone() for name, p in engine.module.named_parameters()
            if p.requires_grad}


def full_grads(engine) -> dict[str, torch.Tensor]:
    from zero3.utils import safe_get_full_grad

    return {name: safe_get_full_grad(p).clone() for name, p in engine.module.named_parameters() if p.requires_grad}


def train(engine, data: list[dict], sp: int, sp_rank: int, start: int = 0, stop: int = STEPS,
          grads_at: int | None = None) -> dict[str, Any]:
    """Steps start..stop-1; at step `grads_at`, the full gradients before the optimizer step."""
    losses, grads = [], None
    for step in range(start, stop):
        batch = data[step]
        if sp > 1:
            loss = sp_step_loss(engine, sp_slice(batch, sp, sp_rank))
        else:
            loss = engine(**batch).loss
        engine.backward(loss)
        if step == grads_at:
            grads = full_grads(engine)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads}


def initialize(model, cfg):
    import zero3

    engine, *_ = zero3.initialize(model=model, config=cfg)
    return engine


def parity_and_resume(rank: int, world: int, sp: int, folder: str, long_sequence: dict | None = None,
                      lora: bool = False) -> dict:
    """Whole sequences, then sequence parallelism (saved mid-way), its exact resume, and a resume
    without sequence parallelism."""
    from zero3.sequence.ulysses import unregister_from_transformers

    group, sp_rank = rank // sp, rank % sp
    data = batches(group)
    out: dict[str, Any] = {}
    engine = initialize(build_model(lora=lora), config(long_sequence=long_sequence))
    out["whole"] = train(engine, data, 1, 0, grads_at=0)
    out["whole_params"] = full_params(engine)
    engine.destroy()

    ckpt = Path(folder) / "ckpt"
    engine = initialize(build_model(lora=lora), config(sp, long_sequence))
    out["sp"] = train(engine, data, sp, sp_rank, 0, 1, grads_at=0)
    engine.save_checkpoint(ckpt)
    later = train(engine, data, sp, sp_rank, 1, STEPS)
    out["sp"]["losses"] += later["losses"]
    out["sp_params"] = full_params(engine)
    out["spilled_bytes"] = _spilled_bytes(engine)
    engine.destroy()

    engine = initialize(build_model(lora=lora, seed=7), config(sp, long_sequence))
    engine.load_checkpoint(ckpt)
    out["sp_resumed"] = train(engine, data, sp, sp_rank, 1, STEPS)
    out["sp_resumed_params"] = full_params(engine)
    engine.destroy()

    unregister_from_transformers()
    engine = initialize(build_model(lora=lora, seed=7), config(long_sequence=long_sequence))
    engine.load_checkpoint(ckpt)
    out["whole_resumed"] = train(engine, data, 1, 0, 1, STEPS)
    out["whole_resumed_params"] = full_params(engine)
    engine.destroy()
    return out


def _spilled_bytes(engine) -> int:
    from zero3.sequence import long_context

    state = next((long_context._STATES[m] for m in engine.module.modules() if m in long_context._STATES), None)
    return state.store.bytes_spilled if state is not None and state.store is not None else 0


def tiled_parity(rank: int, world: int, lora: bool, hf_checkpointing: bool) -> dict:
    """The same steps without and with the long_sequence pieces (tiny tiles: 5 MLP tiles, loss
    tiles of 2 KiB of logits, i.e. 8 tokens)."""
    pieces = {"tiled_mlp": True, "mlp_tiles": 5, "tiled_loss": True, "loss_tile_bytes": 2048,
              "offload_hidden_states": not hf_checkpointing}
    data = batches(rank)
    out = {}
    for name, section in (("plain", None), ("tiled", pieces)):
        model = build_model(lora=lora)
        if hf_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if lora:
                model.enable_input_require_grads()
        engine = initialize(model, config(long_sequence=section))
        out[name] = train(engine, data, 1, 0, grads_at=0)
        out[name + "_params"] = full_params(engine)
        out[name + "_late"] = engine.late_gathers
        if section is not None:
            out["classes_while"] = sorted({type(m).__name__ for m in engine.module.modules() if type(m).__name__.startswith(("Tiled", "HostCheckpointed"))})
        engine.destroy()
        out[name + "_classes_after"] = sorted({type(m).__name__ for m in model.modules()})
    return out


def bad_inputs(rank: int, world: int) -> dict:
    """Each refused input, caught on this rank: (exception type, message)."""
    from zero3.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from zero3.utils import groups

    seen = {}

    def catch(name, fn):
        try:
            fn()
            seen[name] = None
        except Exception as exc:  # noqa: BLE001 - recorded for the test's assertions
            seen[name] = (type(exc).__name__, str(exc))

    catch("heads", lambda: UlyssesSPAttentionHF.register_with_transformers(
        build_model(heads=1, kv_heads=1), "sdpa", 2, 1))
    catch("eager", lambda: UlyssesSPAttentionHF.register_with_transformers(build_model(attn="eager"), "eager", 2, 1))
    catch("config_degree", lambda: initialize(build_model(), config(sp=3)))
    mpu = UlyssesSPAttentionHF.register_with_transformers(build_model(), "sdpa", 2, 1)
    seen["mpu_size"] = mpu.get_sequence_parallel_world_size()
    seen["groups"] = (groups._get_sequence_parallel_world_size(), groups._get_sequence_parallel_rank())
    odd = [{"input_ids": torch.zeros(1, 7, dtype=torch.long), "position_ids": torch.arange(7)[None],
            "labels": torch.zeros(1, 7, dtype=torch.long)}]
    adapter = UlyssesSPDataLoaderAdapter(odd, sp_rank=groups._get_sequence_parallel_rank(),
                                         sp_group=groups._get_sequence_parallel_group(), sp_world_size=2, device="cpu")
    catch("odd_length", lambda: next(iter(adapter)))
    no_positions = [{"input_ids": torch.zeros(1, 8, dtype=torch.long)}]
    adapter = UlyssesSPDataLoaderAdapter(no_positions, sp_rank=groups._get_sequence_parallel_rank(),
                                         sp_group=groups._get_sequence_parallel_group(), sp_world_size=2, device="cpu")
    catch("no_positions", lambda: next(iter(adapter)))
    import zero3

    catch("mismatched_mpu", lambda: zero3.initialize(model=build_model(), config=config(sequence_parallel_size=1),
                                                     mpu=mpu))
    return seen


def loader_batches(rank: int, world: int) -> list[dict]:
    """What UlyssesSPDataLoaderAdapter hands this rank for two ranks' loaders of two batches each."""
    from zero3.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from zero3.utils import groups

    UlyssesSPAttentionHF.register_with_transformers(build_model(), "sdpa", world, 1)
    own = [{"input_ids": torch.arange(6)[None] + 100 * rank + 10 * i, "position_ids": torch.arange(6)[None],
            "labels": torch.arange(6)[None] + 100 * rank + 10 * i, "tag": f"r{rank}b{i}"} for i in range(2)]
    adapter = UlyssesSPDataLoaderAdapter(own, sp_rank=groups._get_sequence_parallel_rank(),
                                         sp_group=groups._get_sequence_parallel_group(),
                                         sp_world_size=groups._get_sequence_parallel_world_size(), device="cpu")
    return [len(adapter)] + list(adapter)


class _Rows(torch.utils.data.Dataset):
    """Random token rows with position ids (what Ulysses needs), labels = inputs."""

    def __init__(self, rows: int, seq: int = SEQ) -> None:
        g = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, VOCAB, (rows, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index],
                "position_ids": torch.arange(self.ids.shape[1])}


def trainer_run(rank: int, world: int, folder: str, sp: int, long_sequence: dict | None = None) -> dict:
    """zero3.hf.Trainer with TrainingArguments(parallelism_config=ParallelismConfig(sp_backend=
    "deepspeed", sp_size=sp)) (sp 1: none), 4 optimizer steps; the logged losses and the
    trained weights."""
    from transformers import TrainerCallback, TrainingArguments

    import zero3.hf

    losses: list[float] = []

    class Losses(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    extra = {}
    if sp > 1:
        from accelerate import ParallelismConfig

        extra["parallelism_config"] = ParallelismConfig(sp_backend="deepspeed", sp_size=sp)
    args = TrainingArguments(output_dir=str(Path(folder) / f"sp{sp}"), per_device_train_batch_size=1,
                             max_steps=4, learning_rate=1e-2, max_grad_norm=1.0, logging_steps=1, report_to=[],
                             save_strategy="no", seed=0, disable_tqdm=True, use_cpu=True, lr_scheduler_type="constant",
                             dataloader_drop_last=True, **extra)
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "gradient_clipping": "auto", "zero_optimization": {"stage": 3}}
    if long_sequence:
        cfg["long_sequence"] = long_sequence
    trainer = zero3.hf.Trainer(model=build_model(), args=args, train_dataset=_Rows(16),
                               zero3_config=cfg, callbacks=[Losses()])
    trainer.train()
    weights = {k: v.clone() for k, v in trainer.zero3_engine.state_dict().items()}
    trainer.zero3_engine.destroy()
    return {"losses": losses, "weights": weights}
