"""The sharded CUDA path on one GPU: 2 and 4 ranks over gloo with CUDA tensors, or world
size 1 on NCCL with ZERO3_COLLECTIVES_AT_WORLD_SIZE_1=1 (not part of CI: no GPU there).

    torchrun --standalone --nproc_per_node=W tests/gpu/sharded_checks.py --backend gloo --phase train
    torchrun --standalone --nproc_per_node=W tests/gpu/sharded_checks.py --backend gloo --phase save --dir D
    torchrun --standalone --nproc_per_node=W tests/gpu/sharded_checks.py --backend gloo --phase load --dir D --from 2,4

No process calls torch.cuda.set_device: the device rule of zero3/platform/device.py puts
every rank on the one visible GPU. The model is a small Llama from transformers' config
(random weights): its norm weights are resident (under the persistence threshold), every
other parameter is sharded. Each check prints one PASS / FAIL line on rank 0, agreed
across ranks; the run ends with CHECKS_PASSED or CHECKS_FAILED.

Phase `train`:
1. the device rule: every rank computes on cuda:0, whatever its LOCAL_RANK;
2. fp32 parity with plain single-process PyTorch on the same global batch (1e-5), with
   activation checkpointing reentrant and not, gradient accumulation 2, clipping;
3. bf16 tracks fp32 over 20 steps (2%);
4. both offloads to pinned host memory, and the overlapped host step, against no offload;
5. prefetch on the side stream against prefetch off (bit for bit), and the collectives of
   a steady step against the arithmetic of the units and shards: all-gather calls and
   bytes (forward and backward), reduce-scatter bytes, small all-reduces;
6. parameters one rank did not use in a window get the averaged gradient (zeros from the
   others), as plain PyTorch on the global batch;
7. fp16 overflow on one rank skips the step on all;
8. rank-divergent control flow ends in DivergenceError on every rank within bounded time;
9. a sealed CUDA parameter touched between steps raises ReleasedParameterError on every
   rank, and training goes on unchanged.
Phases `save` / `load`: bit-exact resume in new processes at the same world size, and
resharding (the fp32 masters bit for bit, the next losses at 1e-5 on the same global batch).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import zero3  # noqa: E402
from zero3.checkpoint.export import consolidated_state_dict  # noqa: E402
from zero3.params.divergence import HEADER_BYTES  # noqa: E402

VOCAB, HIDDEN, LAYERS, SEQ = 256, 64, 4, 16
GLOBAL_BATCH, GA = 8, 2  # samples per optimizer step, whatever the world size
failures: list[str] = []
# cuda:0 on the GPU machine; the CPU when run with ZERO3_ACCELERATOR=cpu (to debug the script)
DEV = torch.device("cpu") if os.environ.get("ZERO3_ACCELERATOR") == "cpu" else torch.device("cuda", 0)


# ------------------------------------------------------------------ plumbing
def rank() -> int:
    return dist.get_rank()


def world() -> int:
    return dist.get_world_size()


def collective_device() -> torch.device:
    """Where this script's own small collectives live: NCCL takes only CUDA tensors."""
    return DEV if dist.get_backend() == "nccl" else torch.device("cpu")


def report(name: str, ok: bool, detail: str) -> None:
    """One line on rank 0; the check passes only if it passed on every rank."""
    flag = torch.tensor([0.0 if ok else 1.0], device=collective_device())
    dist.all_reduce(flag)
    passed = flag.item() == 0
    if rank() == 0:
        print(f"{'PASS' if passed else 'FAIL'} {name}: {detail}", flush=True)
    if not passed:
        failures.append(name)


def llama(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False, use_cache=False,
                         attn_implementation="eager")
    return LlamaForCausalLM(config).to(dtype)


def batches(steps: int, seed: int = 1) -> torch.Tensor:
    """[steps, GLOBAL_BATCH, SEQ] token ids, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (steps, GLOBAL_BATCH, SEQ), generator=g)


def micro_batch(data: torch.Tensor, step: int, micro: int, r: int, w: int) -> torch.Tensor:
    """Rank r's micro-batch `micro` of `step`: the global batch split into w * GA parts."""
    size = GLOBAL_BATCH // (w * GA)
    start = (micro * w + r) * size
    return data[step, start:start + size]


def ds_config(dtype: str = "fp32", **zero) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // (world() * GA),
        "gradient_accumulation_steps": GA,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": HIDDEN, **zero},
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    if dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return config


def optimizer_for(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)


def train(engine, data: torch.Tensor, steps: range, on_micro=None) -> list[float]:
    """Per-rank micro-batch losses, in order."""
    losses = []
    device = engine.device
    for step in steps:
        for micro in range(GA):
            ids = micro_batch(data, step, micro, rank(), world()).to(device)
            if on_micro is not None:
                on_micro(engine, step, micro)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def global_means(losses: list[float]) -> list[float]:
    """The mean loss of each optimizer step over every rank's micro-batches."""
    mine = torch.tensor(losses, dtype=torch.float64, device=collective_device()).view(-1, GA).sum(1)
    dist.all_reduce(mine)
    return (mine / (GA * world())).tolist()


def engine_for(model: nn.Module, config: dict, optimizer: bool = True):
    engine, *_ = zero3.initialize(model=model, optimizer=optimizer_for(model) if optimizer else None,
                                  config=config)
    return engine


def max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def max_param_diff(state: dict, reference: dict) -> float:
    worst = 0.0
    for name, value in reference.items():
        worst = max(worst, (state[name].float().cpu() - value.float().cpu()).abs().max().item())
    return worst


# ------------------------------------------------------------------ phase: train
def check_device_rule() -> None:
    engine = engine_for(llama(), ds_config())
    where = str(engine.device)
    on_gpu = DEV.type == "cuda"
    report("device rule: one visible GPU is every rank's",
           where == str(DEV) and (not on_gpu or torch.cuda.current_device() == 0),
           f"rank {rank()} LOCAL_RANK={os.environ.get('LOCAL_RANK')} computes on {where}; "
           f"backend {dist.get_backend()}, world {world()}")
    engine.destroy()


def reference_run(steps: int, reentrant: bool | None, device: torch.device) -> tuple[list[float], dict]:
    """Plain single-process PyTorch on the same global batches: every rank's micro-batch
    losses in (step, micro, rank) order, and the final state dict."""
    model = llama().to(device)
    if reentrant is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    optimizer = optimizer_for(model)
    data = batches(steps)
    losses = {}
    for step in range(steps):
        for micro in range(GA):
            for r in range(world()):
                ids = micro_batch(data, step, micro, r, world()).to(device)
                loss = model(input_ids=ids, labels=ids).loss
                (loss / (GA * world())).backward()
                losses[(step, micro, r)] = loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    mine = [losses[(s, m, rank())] for s in range(steps) for m in range(GA)]
    return mine, {k: v.detach().clone() for k, v in model.state_dict().items()}


def check_parity() -> None:
    steps = 4
    for reentrant in (None, True, False):
        ref_losses, ref_state = reference_run(steps, reentrant, DEV)
        model = llama()
        if reentrant is not None:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        engine = engine_for(model, ds_config())
        losses = train(engine, batches(steps), range(steps))
        state = consolidated_state_dict(engine)
        resident = sum(sp.persistent for sp in engine.table.values())
        sharded = sum(not sp.persistent for sp in engine.table.values())
        worst_param = max_param_diff(state, ref_state) if rank() == 0 else 0.0
        label = {None: "no checkpointing", True: "reentrant checkpointing", False: "non-reentrant checkpointing"}
        report(f"fp32 parity with plain PyTorch ({label[reentrant]})",
               max_rel(losses, ref_losses) < 1e-5 and worst_param < 1e-5 and engine.late_gathers == 0,
               f"max relative loss difference {max_rel(losses, ref_losses):.2e}, max parameter difference "
               f"{worst_param:.2e}, {resident} resident and {sharded} sharded parameters, late gathers "
               f"{engine.late_gathers}")
        engine.destroy()


def check_bf16_tracks_fp32() -> None:
    steps = 20
    data = batches(steps)
    means = {}
    for dtype in ("fp32", "bf16"):
        engine = engine_for(llama(), ds_config(dtype))
        means[dtype] = global_means(train(engine, data, range(steps)))
        engine.destroy()
    worst = max_rel(means["bf16"], means["fp32"])
    report("bf16 tracks fp32 over 20 steps", worst < 2e-2,
           f"max relative deviation of the step loss {worst:.2e} (fp32 {means['fp32'][0]:.4f} -> "
           f"{means['fp32'][-1]:.4f}, bf16 {means['bf16'][0]:.4f} -> {means['bf16'][-1]:.4f})")


def check_offload() -> None:
    steps = 4
    data = batches(steps)
    offload = {"offload_param": {"device": "cpu", "pin_memory": True},
               "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    runs = {}
    for name, zero in (("none", {}), ("both", {**offload, "offload_optimizer": {**offload["offload_optimizer"],
                                                                              "overlap_step": True}}),
                       ("both, no overlap", {**offload, "offload_optimizer": {**offload["offload_optimizer"],
                                                                             "overlap_step": False}})):
        engine = engine_for(llama(), ds_config("bf16", **zero))
        losses = train(engine, data, range(steps))
        shards = [sp.shard for sp in engine.table.values() if not sp.persistent]
        masters = list(engine.optimizer.masters)
        runs[name] = {
            "losses": losses, "state": consolidated_state_dict(engine),
            "pinned": all(t.is_pinned() for t in shards + masters) if zero else None,
            "host": all(t.device.type == "cpu" for t in shards + masters) if zero else None,
            "overlapped": zero.get("offload_optimizer", {}).get("overlap_step"),
        }
        engine.destroy()
    base, both, sync = runs["none"], runs["both"], runs["both, no overlap"]
    exact = both["losses"] == sync["losses"] and (rank() != 0 or max_param_diff(both["state"], sync["state"]) == 0)
    diff = max_rel(both["losses"], base["losses"])
    report("both offloads pinned; the overlapped host step is exact",
           (both["pinned"] or DEV.type == "cpu") and both["host"] and exact
           and diff < 1e-2,
           f"shards and masters pinned {both['pinned']}, on the host {both['host']}, overlapped step "
           f"{both['overlapped']} (off: {sync['overlapped']}), overlapped vs synchronous host step bit-exact "
           f"{exact}; against no offload (bf16): max relative loss difference {diff:.2e}")


def unit_gather_bytes(engine) -> list[int]:
    """Bytes one all-gather of each unit sends from this rank: header + its shards."""
    out = []
    for unit in engine.units:
        out += [HEADER_BYTES + nbytes for nbytes in shard_bytes_by_dtype(unit.fetch_list()).values()]
    return out


def shard_bytes_by_dtype(params) -> dict[torch.dtype, int]:
    by_dtype: dict[torch.dtype, int] = {}
    for sp in params:
        by_dtype[sp.shard.dtype] = by_dtype.get(sp.shard.dtype, 0) + sp.shard_numel * sp.shard.element_size()
    return by_dtype


def check_prefetch_and_counters() -> None:
    """Every collective of a steady step accounted for: each unit's all-gather (header and
    shards) in forward and in backward of each micro-step, the header agreements of the
    gathers the guard did not predict and of the check-ins at the end of a forward (the
    guard's and the wire's counters), the resident parameters gathered
    again after the optimizer step (one all-gather per dtype), one reduce-scatter of every
    trainable parameter's padded gradient per micro-step, and the small all-reduces."""
    steps = 5
    data = batches(steps)
    results = {}
    for name, zero in (("on", {"stage3_max_reuse_distance": 0}),
                       ("off", {"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0})):
        engine = engine_for(llama(), ds_config(**zero))
        rows = []

        def before(e, step, micro, rows=rows):
            if micro == 0:
                rows.append((e.comm_stats(), e.fetcher.guard.mispredicted + e.fetcher.wire.check_ins))

        losses = train(engine, data, range(steps), on_micro=before)
        rows.append((engine.comm_stats(), engine.fetcher.guard.mispredicted + engine.fetcher.wire.check_ins))
        resident = [sp for sp in engine.table.values() if sp.persistent]
        results[name] = {"losses": losses, "rows": rows, "prefetched": engine.fetcher.prefetched_units,
                         "late": engine.late_gathers, "gathers": unit_gather_bytes(engine),
                         "resident": list(shard_bytes_by_dtype(resident).values()),
                         "grads": sum(sp.shard_numel * world() * 4 for sp in engine.table.values()
                                      if sp.param.requires_grad)}
        engine.destroy()
    on, off = results["on"], results["off"]
    steady = steps - 2
    (stats_a, miss_a), (stats_b, miss_b) = on["rows"][steady], on["rows"][steady + 1]

    def delta(op):
        a, b = stats_a.get(op, (0, 0)), stats_b.get(op, (0, 0))
        return b[0] - a[0], b[1] - a[1]

    agreed = miss_b - miss_a
    gathers = on["gathers"]
    expect_gather = (2 * GA * len(gathers) + agreed + len(on["resident"]),
                     2 * GA * sum(gathers) + agreed * HEADER_BYTES + sum(on["resident"]))
    got_gather, got_reduce, got_small = delta("all_gather"), delta("reduce_scatter"), delta("all_reduce")
    ok = (on["losses"] == off["losses"] and on["prefetched"] > 0 and off["prefetched"] == 0
          and got_gather == expect_gather and got_reduce[1] == GA * on["grads"]
          and on["late"] == off["late"] == 0 and got_small[0] <= 2)
    report("side-stream prefetch is exact; collectives equal the arithmetic", ok,
           f"losses bit-identical {on['losses'] == off['losses']}, units prefetched {on['prefetched']}; "
           f"steady step {steady}: all-gathers {got_gather} (expected {expect_gather}: {len(gathers)} unit "
           f"gathers x forward+backward x GA {GA}, {agreed} header agreements, {len(on['resident'])} resident "
           f"refresh), reduce-scatters {got_reduce} (expected bytes {GA * on['grads']}), small all-reduces "
           f"{got_small}, late gathers {on['late']}")
    if rank() == 0:
        print("COMM_VOLUME " + json.dumps({
            "world": world(), "ga": GA, "unit_gather_bytes_per_pass": sum(gathers),
            "all_gather": got_gather, "header_agreements": agreed, "reduce_scatter": got_reduce,
            "all_reduce": got_small}), flush=True)
    check_bytes_by_phase()


def check_bytes_by_phase() -> None:
    """The bytes this rank sends in one steady micro-step, forward and backward apart (prefetch
    off: with it on, most of the backward's gathers are issued during the forward's tail)."""
    engine = engine_for(llama(), ds_config(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0))
    data = batches(4)
    train(engine, data, range(3))
    ids = micro_batch(data, 3, 0, rank(), world()).to(engine.device)
    s0, m0 = engine.comm_stats(), engine.fetcher.guard.mispredicted + engine.fetcher.wire.check_ins
    loss = engine(input_ids=ids, labels=ids).loss
    s1, m1 = engine.comm_stats(), engine.fetcher.guard.mispredicted + engine.fetcher.wire.check_ins
    engine.backward(loss)
    s2, m2 = engine.comm_stats(), engine.fetcher.guard.mispredicted + engine.fetcher.wire.check_ins
    unit = sum(unit_gather_bytes(engine))
    grads = sum(sp.shard_numel * world() * 4 for sp in engine.table.values() if sp.param.requires_grad)
    engine.destroy()

    def sent(a, b, op):
        return b.get(op, (0, 0))[1] - a.get(op, (0, 0))[1]

    forward, backward = sent(s0, s1, "all_gather"), sent(s1, s2, "all_gather")
    reduced = sent(s1, s2, "reduce_scatter")
    expect_forward = unit + (m1 - m0) * HEADER_BYTES
    expect_backward = unit + (m2 - m1) * HEADER_BYTES
    report("bytes of a micro-step by phase equal the arithmetic",
           (forward, backward, reduced) == (expect_forward, expect_backward, grads),
           f"forward all-gather {forward} B (expected {expect_forward}), backward all-gather {backward} B "
           f"(expected {expect_backward}), reduce-scatter {reduced} B (expected {grads}) per rank")
    if rank() == 0:
        print("BYTES_BY_PHASE " + json.dumps({"world": world(), "forward_all_gather": forward,
                                              "backward_all_gather": backward, "reduce_scatter": reduced}),
              flush=True)


class Branchy(nn.Module):
    """Rank 0 alone uses `extra` on some steps (a module skipped elsewhere)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 64)
        self.extra = nn.Linear(64, 64)
        self.out = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        if use_extra:
            h = h + self.extra(h)
        return self.out(h).pow(2).mean()


def check_unused_on_one_rank() -> None:
    steps = 3
    g = torch.Generator().manual_seed(3)
    xs = torch.randn(steps, world(), 4, 16, generator=g)
    uses = [[s % 2 == 0 and r == 0 for r in range(world())] for s in range(steps)]
    ref = Branchy().to(DEV)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for s in range(steps):
        for r in range(world()):
            (ref(xs[s, r].to(DEV), uses[s][r]) / world()).backward()
        opt.step()
        opt.zero_grad()
    model = Branchy()
    zero3.set_z3_leaf_modules(model, [Branchy])  # control flow that differs between ranks stays in one unit
    engine, *_ = zero3.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  config={"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
                                          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    for s in range(steps):
        loss = engine(xs[s, rank()].to(DEV), uses[s][rank()])
        engine.backward(loss)
        engine.step()
    state = consolidated_state_dict(engine)
    diff = max_param_diff(state, ref.state_dict()) if rank() == 0 else 0.0
    report("a module used by one rank only gets the averaged gradient", diff < 1e-6,
           f"max parameter difference against plain PyTorch on the global batch {diff:.2e} "
           f"(rank 0 alone uses `extra` on steps 0 and 2)")
    engine.destroy()


def check_fp16_overflow_on_one_rank() -> None:
    engine = engine_for(llama(), ds_config("fp16"))
    data = batches(3)
    train(engine, data, range(1))
    before = {k: v.clone() for k, v in consolidated_state_dict(engine).items()}
    skipped_before = engine.skipped_steps

    ids = micro_batch(data, 1, 0, rank(), world()).to(DEV)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    ids = micro_batch(data, 1, 1, rank(), world()).to(DEV)
    loss = engine(input_ids=ids, labels=ids).loss
    if rank() == world() - 1:
        loss = loss * float("inf")  # an overflow on the last rank only
    engine.backward(loss)
    engine.step()
    after = consolidated_state_dict(engine)
    unchanged = rank() != 0 or all(torch.equal(after[k], before[k]) for k in before)
    skipped = engine.skipped_steps - skipped_before
    train(engine, data, range(2, 3))
    report("fp16 overflow on one rank skips the step on all", skipped == 1 and unchanged,
           f"rank {rank()}: skipped {skipped} step, parameters unchanged {unchanged}, loss scale now "
           f"{engine.loss_scaler.scale}; training went on")
    engine.destroy()


class TwoPaths(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, diverge: bool) -> torch.Tensor:
        h = self.a(x)
        h = self.c(h) if diverge else self.b(h)
        return h.pow(2).mean()


def check_divergence() -> None:
    model = TwoPaths()
    engine, *_ = zero3.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                  config={"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
                                          "zero_optimization": {"stage": 3,
                                                                "stage3_param_persistence_threshold": 0}})
    x = torch.randn(2, 32, device=DEV)
    for _ in range(2):
        loss = engine(x, False)
        engine.backward(loss)
        engine.step()
    start = time.monotonic()
    error = None
    try:
        loss = engine(x, rank() == 1)  # rank 1 takes another module
        engine.backward(loss)
        engine.step()
    except zero3.DivergenceError as exc:
        error = exc
    took = time.monotonic() - start
    report("rank-divergent control flow: DivergenceError on every rank", error is not None and took < 60,
           f"rank {rank()}: {type(error).__name__ if error else 'no error'} after {took:.1f} s: "
           f"{str(error).splitlines()[0][:120] if error else ''}")


def check_sealed() -> None:
    from zero3.params.released import ReleasedParameterError

    engine = engine_for(llama(), ds_config())
    data = batches(4)
    losses = train(engine, data, range(2))
    weight = engine.module.model.layers[0].mlp.up_proj.weight
    refused = []
    for name, touch in (("sum", lambda: weight.sum()), ("clone", lambda: weight.clone()),
                        ("add_", lambda: weight.data.add_(1.0)), ("norm", lambda: weight.detach().norm()),
                        *([("cpu", lambda: weight.cpu())] if DEV.type == "cuda" else [])):
        try:
            touch()
        except ReleasedParameterError:
            refused.append(name)
    losses += train(engine, data, range(2, 4))
    engine.destroy()
    fresh = engine_for(llama(), ds_config())
    clean = train(fresh, data, range(4))
    fresh.destroy()
    report("a sealed CUDA parameter raises the named error", len(refused) == (5 if DEV.type == "cuda" else 4)
           and losses == clean,
           f"rank {rank()}: refused {refused}; losses unchanged against an untouched run {losses == clean}")


# ------------------------------------------------------------------ phases: save, load
RESUME_STEPS = 3


def save_phase(folder: Path) -> None:
    data = batches(2 * RESUME_STEPS)
    engine = engine_for(llama(), ds_config())
    train(engine, data, range(RESUME_STEPS))
    engine.save_checkpoint(str(folder / f"w{world()}"), tag="mid")
    masters = consolidated_state_dict(engine)
    after = train(engine, data, range(RESUME_STEPS, 2 * RESUME_STEPS))
    means = global_means(after)
    every = [None] * world()
    dist.all_gather_object(every, after)
    if rank() == 0:
        torch.save(masters, folder / f"w{world()}" / "masters.pt")
        (folder / f"w{world()}" / "expected.json").write_text(json.dumps({"per_rank": every, "means": means}))
    report(f"saved at world size {world()}", True, f"continued losses {[round(m, 5) for m in means]}")
    engine.destroy()


def load_phase(folder: Path, sources: list[int]) -> None:
    data = batches(2 * RESUME_STEPS)
    for source in sources:
        engine = engine_for(llama(seed=7), ds_config())  # other initial weights: the load must replace them
        engine.load_checkpoint(str(folder / f"w{source}"), tag="mid")
        saved = torch.load(folder / f"w{source}" / "masters.pt", weights_only=True)
        loaded = consolidated_state_dict(engine)
        same_masters = rank() != 0 or all(torch.equal(loaded[k], saved[k]) for k in saved)
        after = train(engine, data, range(RESUME_STEPS, 2 * RESUME_STEPS))
        means = global_means(after)
        expected = json.loads((folder / f"w{source}" / "expected.json").read_text())
        if source == world():
            ok = after == expected["per_rank"][rank()] and same_masters
            what = f"bit-exact resume in new processes at world size {world()}"
            detail = f"losses {'identical' if after == expected['per_rank'][rank()] else 'DIFFER'}"
        else:
            diff = max_rel(means, expected["means"])
            ok = diff < 1e-5 and same_masters
            what = f"resharding {source} -> {world()}"
            detail = f"next step losses max relative difference {diff:.2e}"
        report(what, ok, f"{detail}; fp32 values after load bit-identical to the saved {same_masters}")
        engine.destroy()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--phase", default="train", choices=["train", "save", "load"])
    parser.add_argument("--dir", default="/tmp/zero3_sharded")
    parser.add_argument("--from", dest="sources", default="")
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    import datetime

    zero3.init_distributed(dist_backend=args.backend, timeout=datetime.timedelta(seconds=120))
    if rank() == 0:
        print(f"world {world()} backend {dist.get_backend()} torch {torch.__version__} "
              f"collectives at world size 1: {os.environ.get('ZERO3_COLLECTIVES_AT_WORLD_SIZE_1', '0')} "
              f"caching allocator off: {os.environ.get('PYTORCH_NO_CUDA_MEMORY_CACHING', '0')}", flush=True)
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    if args.phase == "save":
        save_phase(folder)
    elif args.phase == "load":
        load_phase(folder, [int(s) for s in args.sources.split(",") if s])
    else:
        checks = [check_device_rule, check_parity, check_bf16_tracks_fp32, check_offload,
                  check_prefetch_and_counters, check_unused_on_one_rank, check_fp16_overflow_on_one_rank,
                  check_sealed, check_divergence]
        if world() == 1:  # nothing can differ between ranks with one rank
            checks = [c for c in checks if c not in (check_unused_on_one_rank, check_divergence)]
        only = set(args.only.split(",")) - {""}
        for check in checks:
            if only and check.__name__.removeprefix("check_") not in only:
                continue
            try:
                check()
            except Exception as exc:  # noqa: BLE001 - a check that raised is a failed check
                print(f"FAIL {check.__name__} raised on rank {rank()}: {type(exc).__name__}: {exc}", flush=True)
                failures.append(check.__name__)
                if check is check_divergence or isinstance(exc, (RuntimeError,)) and "gloo" in str(exc):
                    break
    if rank() == 0:
        print("CHECKS_FAILED " + ", ".join(failures) if failures else "CHECKS_PASSED", flush=True)
    os._exit(1 if failures else 0)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
