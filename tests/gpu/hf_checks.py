"""CUDA checks of zero3.Init, zero3 estimate and gathered generation on a 1B Llama (one GPU).

    PYTHONPATH=$PWD torchrun --standalone --nproc_per_node=1 tests/gpu/hf_checks.py

1. `zero3.Init(config_dict_or_path=bf16 config)` builds LlamaForCausalLM (hidden 2048,
   16 layers, intermediate 5632, vocab 32000) from its config: peak GPU memory while
   building against the model's bf16 bytes (at world size 1 the shards are the model).
2. The engine adopts it and trains 3 steps (bf16, fused AdamW client optimizer, sequence
   2048, micro-batch 2); `estimate_memory` against `engine.sharded_bytes()` per category
   and against the GPU bytes allocated after the step (gradients are dropped by then).
3. The same with both offloads (pinned): the estimate's device and host totals against
   the GPU bytes allocated and the engine's host-held bytes.
4. Generation: 32 greedy tokens with the weights gathered once against sharded
   generation: the same tokens, and the time of each.
Prints one line per check and CHECKS_PASSED / CHECKS_FAILED.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zero3  # noqa: E402
from zero3.estimate import estimate_memory  # noqa: E402

DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
SEQ, MICRO = 2048, 2
failures: list[str] = []


def check(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        failures.append(name)


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=2048, num_hidden_layers=16, intermediate_size=5632, num_attention_heads=16,
                       num_key_value_heads=16, vocab_size=32000, max_position_embeddings=SEQ,
                       attn_implementation="sdpa", tie_word_embeddings=False, use_cache=True)


def ds_config(offload: bool) -> dict:
    zero = {"stage": 3}
    if offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {"train_micro_batch_size_per_gpu": MICRO, "bf16": {"enabled": True}, "zero_optimization": zero}


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def build(offload: bool):
    from transformers import AutoModelForCausalLM

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(DEVICE)
    before = torch.cuda.memory_allocated(DEVICE)
    start = time.perf_counter()
    torch.manual_seed(0)
    with zero3.Init(config_dict_or_path=ds_config(offload)):
        model = AutoModelForCausalLM.from_config(llama_config())
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(DEVICE) - before
    return model, peak, seconds, before


def train_steps(engine, steps: int) -> list[float]:
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 32000, (MICRO, SEQ), generator=g).to(DEVICE)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def check_build_train_estimate(offload: bool) -> "zero3.Engine":
    model, peak, seconds, baseline = build(offload)
    numels = [p.numel() for p in model.parameters()]
    model_bytes = 2 * sum(numels)
    largest = 2 * max(numels)
    on_gpu_after_build = torch.cuda.memory_allocated(DEVICE) - baseline
    label = "both offloads" if offload else "no offload"
    if offload:
        ok = peak <= 2 * largest + 64 * 2**20
        detail = f"peak GPU {gib(peak)} (the largest parameter twice: {gib(2 * largest)}), shards on the host"
    else:
        ok = peak <= model_bytes + 2 * largest + 64 * 2**20
        detail = f"peak GPU {gib(peak)} for a {gib(model_bytes)} bf16 model (+ largest parameter {gib(largest)})"
    check(f"zero3.Init builds the 1B Llama ({label})", ok,
          f"{detail}; built in {seconds:.1f} s; GPU after building {gib(on_gpu_after_build)}")

    estimate = estimate_memory(model, 1, ds_config(offload), device_type="cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=not offload)
    engine, *_ = zero3.initialize(model=model, optimizer=optimizer, config=ds_config(offload))
    losses = train_steps(engine, 3)
    torch.cuda.synchronize()
    held = engine.sharded_bytes()
    allocated = torch.cuda.memory_allocated(DEVICE) - baseline
    est = estimate.by_category()
    worst = max(abs(est[k] - held[k]) / max(held[k], 1) for k in held if k != "grad_shards")
    expected_gpu = estimate.device_total - estimate.device.get("grad_shards", 0)  # dropped after the step
    gpu_ratio = allocated / max(expected_gpu, 1)
    ok = worst <= 0.05 and (0.95 <= gpu_ratio <= 1.05 if expected_gpu > 2**30 else allocated < 2**30)
    check(f"estimate matches the engine ({label})", ok and all(l == l for l in losses),
          f"losses {[round(l, 4) for l in losses]}; estimate {dict((k, gib(v)) for k, v in est.items())} vs held "
          f"{dict((k, gib(v)) for k, v in held.items())} (worst {worst:.2%} without the dropped gradients); GPU "
          f"allocated after the step {gib(allocated)} vs estimate device total less gradients {gib(expected_gpu)}")
    return engine


def check_generation(engine) -> None:
    prompt = torch.randint(3, 32000, (1, 64), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    kwargs = dict(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32, do_sample=False,
                  eos_token_id=None, pad_token_id=0, use_cache=True)
    engine.eval()
    with torch.no_grad():
        engine.module.generate(**dict(kwargs, max_new_tokens=2))  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        sharded = engine.module.generate(**kwargs)
        torch.cuda.synchronize()
        sharded_s = time.perf_counter() - start
    engine.train()
    with engine.gathered_for_generation() as model, torch.no_grad():
        torch.cuda.synchronize()
        start = time.perf_counter()
        gathered = model.generate(**kwargs)
        torch.cuda.synchronize()
        gathered_s = time.perf_counter() - start
    losses = train_steps(engine, 1)
    check("generation with the weights gathered once", torch.equal(sharded, gathered) and losses[0] == losses[0],
          f"32 tokens: sharded {sharded_s * 1000:.0f} ms ({32 / sharded_s:.0f} tokens/s), gathered once "
          f"{gathered_s * 1000:.0f} ms ({32 / gathered_s:.0f} tokens/s), same tokens "
          f"{torch.equal(sharded, gathered)}; a training step after it: loss {losses[0]:.4f}")


def main() -> None:
    torch.cuda.set_device(DEVICE)
    zero3.init_distributed(dist_backend="nccl")
    for offload in (False, True):
        engine = None
        try:
            engine = check_build_train_estimate(offload)
            if not offload:
                check_generation(engine)
        except Exception as exc:  # noqa: BLE001 - report and go on
            import traceback

            traceback.print_exc()
            check(f"offload={offload}", False, f"raised {type(exc).__name__}: {exc}")
        finally:
            if engine is not None:
                engine.destroy()
            del engine
            torch.cuda.empty_cache()
    print("CHECKS_FAILED: " + ", ".join(failures) if failures else "CHECKS_PASSED", flush=True)


if __name__ == "__main__":
    main()
