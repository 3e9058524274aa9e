"""The placement on a GPU (zero3/placement/, engine_parts/placement.py): run under torchrun.

    torchrun --standalone --nproc_per_node=2 tests/gpu/placement_checks.py --backend gloo
    torchrun --standalone --nproc_per_node=1 tests/gpu/placement_checks.py --backend nccl

A small Llama-like stack in bf16 with the config's AdamW and clipping, trained for STEPS
optimizer steps (accumulation 2) under each placement, against the run with nothing
offloaded:
- `budget_part`: both offloads, a budget that holds half of what the state needs: device-tier
  units step on the GPU in step(), host-tier ones on the CPU behind the next forward (their
  masters written into device shards through pinned staging on a side stream);
- `auto`: both offloads, the budget measured over the first window, then what fits moved;
- `moved`: all on the host, then `set_gpu_budget` to the part budget after two steps;
- `ratio`: DeepSpeed's offload_optimizer.ratio 0.5, no budget;
- `resumed`: `budget_part` saved after two steps, loaded under the all-host budget;
- `accumulators`: every optimizer side on the host (ratio 1), gradients summed on the device
  over the window (a budget given) against summed on the host (none): bit for bit;
- `early_updates_clip_*`: host updates started in the window's last backward against none,
  with and without clipping: bit for bit.
Each prints its largest parameter difference from the all-device run (the CPU's and the
GPU's fused AdamW round differently; a bf16 parameter differs by at most a few of its ulps)
and the device's peak allocated bytes against the plan. PASS / FAIL lines, CHECKS at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

STEPS, GA, MICRO, WIDTH, LAYERS = 6, 2, 4, 256, 6
failures: list[str] = []


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(32, WIDTH)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, 8)
        self.layers[1].requires_grad_(False)  # a frozen unit

    def forward(self, x, y):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return torch.nn.functional.mse_loss(self.head(h).float(), y)


def check(name: str, ok: bool, detail: str) -> None:
    if dist.get_rank() == 0:
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        failures.append(name)


def build(placement: dict | None, offload: bool = True, ratio: float | None = None, clip: float = 0.3,
          param_nvme: str | None = None):
    import zero3

    torch.manual_seed(0)
    model = Stack()
    zero = {"stage": 3, "stage3_param_persistence_threshold": 300, "reduce_bucket_size": 200_000}
    if offload:
        zero["offload_param"] = {"device": "cpu"}
        zero["offload_optimizer"] = {"device": "cpu", **({} if ratio is None else {"ratio": ratio})}
    if param_nvme is not None:  # every shard the budget leaves off the card in swap files (max_in_cpu 0)
        zero["offload_param"] = {"device": "nvme", "nvme_path": param_nvme, "buffer_count": 4,
                                 "buffer_size": 1_000_000, "max_in_cpu": 0}
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GA, "gradient_clipping": clip,
              "bf16": {"enabled": True}, "zero_optimization": zero, "steps_per_print": None,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}}
    if placement is not None:
        config["placement"] = placement
    zero3.set_z3_leaf_modules(model, [Layer])
    engine, *_ = zero3.initialize(model=model, config=config)
    return engine


def batches(step: int, micro: int):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
    return torch.randn(MICRO, 32, generator=g).cuda().bfloat16(), torch.randn(MICRO, 8, generator=g).cuda()


def train(engine, first: int, last: int) -> list[float]:
    losses = []
    for step in range(first, last):
        for micro in range(GA):
            loss = engine(*batches(step, micro))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def full_params(engine) -> dict[str, torch.Tensor]:
    import zero3
    params = dict(engine.module.named_parameters())
    with zero3.GatheredParameters(list(params.values())):
        return {n: p.detach().float().clone() for n, p in params.items()}


def largest_difference(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def tiers(engine) -> str:
    c = engine.placement.plan.counts()
    return f"{c['params_on_device']}/{c['units']} shards, {c['state_on_device']}/{c['trainable']} optimizer sides on the GPU"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="nccl")
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    world = dist.get_world_size()
    reference = build(None, offload=False)
    ref_losses = train(reference, 0, STEPS)
    expected = full_params(reference)
    reference.destroy()
    everything = build({"gpu_budget": "1TiB"})
    fixed, whole = everything.placement.plan.fixed_bytes, everything.placement.plan.device_bytes
    everything.destroy()
    part = fixed + (whole - fixed) // 2
    tolerance = 4e-2  # a few bf16 ulps of parameters of magnitude up to ~4

    folder = tempfile.mkdtemp() if dist.get_rank() == 0 else None
    folder = [folder]
    dist.broadcast_object_list(folder)
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()  # what the engines above left (a destroyed engine's memory lingers)
    partial = build({"gpu_budget": part})
    before = torch.cuda.memory_allocated() - start
    losses = train(partial, 0, 2)
    partial.save_checkpoint(folder[0], tag="half")
    losses += train(partial, 2, STEPS)
    got = full_params(partial)
    plan = partial.placement.plan
    check("budget_part", largest_difference(expected, got) < tolerance and plan.counts()["state_on_device"] > 0,
          f"world {world}, {tiers(partial)}, largest difference {largest_difference(expected, got):.2e}, "
          f"losses {losses[-1]:.5f} vs {ref_losses[-1]:.5f}")
    check("budget_part_memory", before <= plan.device_bytes + (1 << 20),
          f"allocated by initialize {before / 2**20:.1f} MiB, planned device {plan.device_bytes / 2**20:.1f} MiB "
          f"of budget {part / 2**20:.1f} MiB, peak over training {(torch.cuda.max_memory_allocated() - start) / 2**20:.1f} MiB")
    partial.destroy()

    auto = build(None)
    train(auto, 0, STEPS)
    got = full_params(auto)
    # at world size 1 the measured plan aliases what it keeps wholly on the card (no copy a use)
    on_card = [sp for sp in auto.table.values() if auto.placement.params_tier(sp).value == "device"
               and auto.placement.state_tier(sp).value == "device"]
    aliased = [sp for sp in auto.table.values() if sp.aliased]
    aliases_right = world > 1 or (bool(on_card) and {id(sp) for sp in aliased} == {id(sp) for sp in on_card})
    check("auto", largest_difference(expected, got) < tolerance and auto.placement.plan.budget is not None
          and aliases_right,
          f"{auto.placement.plan.describe()}; largest difference {largest_difference(expected, got):.2e}; "
          f"{len(aliased)} aliased of {len(on_card)} parameters wholly on the card")
    auto.destroy()

    moved = build({"gpu_budget": fixed})
    host_only = tiers(moved)
    train(moved, 0, 2)
    moved.set_gpu_budget(part)
    train(moved, 2, STEPS)
    got = full_params(moved)
    check("moved", largest_difference(expected, got) < tolerance,
          f"{host_only} -> {tiers(moved)}; largest difference {largest_difference(expected, got):.2e}")
    moved.destroy()

    ratio = build(None, ratio=0.5)
    train(ratio, 0, STEPS)
    got = full_params(ratio)
    check("ratio", largest_difference(expected, got) < tolerance, f"{tiers(ratio)}; largest difference "
          f"{largest_difference(expected, got):.2e}")
    ratio.destroy()

    # Gradient accumulators on the device for host-side optimizers against host accumulation:
    # the same sums (fp32 adds of the same 16-bit slices), so the same bits (no clipping: its
    # norm is taken on the GPU in one run and on the CPU in the other).
    summed_on_host = build(None, ratio=1.0, clip=0.0)
    train(summed_on_host, 0, STEPS)
    on_host = full_params(summed_on_host)
    summed_on_host.destroy()
    summed_on_device = build({"gpu_budget": "1TiB"}, ratio=1.0, clip=0.0)
    counts = summed_on_device.placement.plan.counts()
    train(summed_on_device, 0, STEPS)
    got = full_params(summed_on_device)
    check("accumulators", counts["accumulators_on_device"] > 0 and counts["state_on_device"] == 0
          and largest_difference(on_host, got) == 0.0,
          f"{summed_on_device.placement.plan.describe()}; largest difference from host accumulation "
          f"{largest_difference(on_host, got):.2e}")
    summed_on_device.destroy()

    # Host updates started in the window's last backward (optim/early_update.py) against none:
    # bit for bit, with clipping (whose coefficient may undo them) and without.
    for clip in (0.0, 0.3):
        runs = {}
        for name, placement in (("early", {"gpu_budget": part}), ("none", {"gpu_budget": part, "early_update_bytes": 0})):
            engine = build(placement, clip=clip)
            train(engine, 0, STEPS)
            runs[name] = (full_params(engine), engine.optimizer.early.committed, engine.optimizer.early.put_back)
            engine.destroy()
        check(f"early_updates_clip_{clip}", largest_difference(runs["early"][0], runs["none"][0]) == 0.0,
              f"early updates that stood {runs['early'][1]}, put back {runs['early'][2]}; largest difference from "
              f"none {largest_difference(runs['early'][0], runs['none'][0]):.2e}")

    # Parameter shards in swap files (offload_param "nvme", params/nvme_shards.py) against the
    # host tier under the same budget: the same kernels over the same values, bit for bit.
    nvme_dir = "/tmp/zero3_param_nvme_check"
    os.makedirs(nvme_dir, exist_ok=True)
    runs = {}
    for name, nvme in (("host", None), ("nvme", nvme_dir)):
        engine = build({"gpu_budget": fixed}, param_nvme=nvme)
        losses = train(engine, 0, STEPS)
        runs[name] = (full_params(engine), losses, engine.placement.plan.describe())
        engine.destroy()
    check("param_nvme", runs["nvme"][1] == runs["host"][1] and largest_difference(runs["host"][0], runs["nvme"][0]) == 0.0
          and "on NVMe" in runs["nvme"][2],
          f"{runs['nvme'][2]}; losses equal {runs['nvme'][1] == runs['host'][1]}, largest difference from the host "
          f"tier {largest_difference(runs['host'][0], runs['nvme'][0]):.2e}")

    resumed = build({"gpu_budget": fixed})
    resumed.load_checkpoint(folder[0], tag="half")
    train(resumed, 2, STEPS)
    got = full_params(resumed)
    check("resumed", largest_difference(expected, got) < tolerance,
          f"saved under {part} B, loaded under {fixed} B ({tiers(resumed)}); largest difference "
          f"{largest_difference(expected, got):.2e}")
    resumed.destroy()
    if dist.get_rank() == 0:
        print(f"CHECKS {'FAIL ' + ','.join(failures) if failures else 'PASS'}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
