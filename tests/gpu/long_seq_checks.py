"""The long_sequence section on CUDA (one card, world size 1): tiled MLP, tiled loss and the
hidden states in pinned host memory give the plain model's loss and gradients (bf16: within
its rounding), the host copies happen, and the GPU's peak is lower; with no host share and an
NVMe folder the hidden states go through swap files and give the host run's loss and
gradients.

    torchrun --standalone --nproc_per_node=1 tests/gpu/long_seq_checks.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.environ.get("ZERO3_TREE") or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def build():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1792, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1 << 16,
                      tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
    with torch.device("cuda"):
        return LlamaForCausalLM(cfg)


def run(section):
    import zero3
    from zero3.utils import safe_get_full_grad

    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "steps_per_print": None,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 3}}
    if section:
        config["long_sequence"] = section
    engine, *_ = zero3.initialize(model=build(), config=config)
    ids = torch.randint(0, 32000, (1, 8192), generator=torch.Generator().manual_seed(3)).cuda()
    torch.cuda.reset_peak_memory_stats()
    loss = engine(input_ids=ids, labels=ids, position_ids=torch.arange(8192, device="cuda")[None]).loss
    engine.backward(loss)
    grads = {n: safe_get_full_grad(p).float().clone() for n, p in engine.module.named_parameters()}
    peak = torch.cuda.max_memory_allocated() / (1 << 30)
    store = engine.long_sequence.store if engine.long_sequence is not None else None
    offloaded = (store.bytes_offloaded + store.bytes_spilled) if store is not None else 0
    pinned = all(t.is_pinned() for free in store.pool.values() for t in free) if store is not None else None
    engine.step()
    engine.destroy()
    return loss.item(), grads, peak, offloaded, pinned


def main() -> None:
    import zero3

    zero3.init_distributed()
    plain_loss, plain_grads, plain_peak, _, _ = run(None)
    section = {"tiled_mlp": True, "tiled_loss": True, "offload_hidden_states": True, "loss_tile_bytes": 64 << 20}
    loss, grads, peak, offloaded, pinned = run(section)
    folder = os.environ.get("ZERO3_HIDDEN_NVME", "/tmp/zero3_hidden_nvme")
    os.makedirs(folder, exist_ok=True)
    spill_loss, spill_grads, _, spilled, _ = run({**section, "host_bytes": 0, "nvme_path": folder})
    spill_worst = max(((spill_grads[n] - g).norm() / g.norm().clamp_min(1e-12)).item() for n, g in grads.items())
    worst = max(((grads[n] - g).norm() / g.norm().clamp_min(1e-12)).item() for n, g in plain_grads.items())
    checks = {
        "loss": abs(loss - plain_loss) < 2e-2 * abs(plain_loss),
        "grads": worst < 3e-2,
        "offloaded": offloaded == 4 * 8192 * 512 * 2,
        "pinned": pinned is True,
        "peak_lower": peak < plain_peak,
        "nvme_loss": spill_loss == loss,
        "nvme_grads": spill_worst < 1e-2,
        "nvme_spilled": spilled == 4 * 8192 * 512 * 2,
        "nvme_removed": not any(name.endswith("-hidden") for name in os.listdir(os.path.join(folder, "zero3_swap"))),
    }
    print(f"loss plain {plain_loss:.5f} tiled {loss:.5f}; worst relative gradient difference {worst:.2e}; "
          f"peak plain {plain_peak:.2f} GiB tiled {peak:.2f} GiB; host bytes {offloaded}; through NVMe: loss "
          f"{spill_loss:.5f}, worst relative gradient difference to the host run {spill_worst:.2e}, {spilled} bytes")
    for name, ok in checks.items():
        print(("PASS " if ok else "FAIL ") + name)
    print("CHECKS", "PASS" if all(checks.values()) else "FAIL")


if __name__ == "__main__":
    main()
