"""DeepSpeed's bf16.bf16_master_weights_and_grads / bf16_optimizer_states (optim/precision.py).

Each world size runs every check in one launch (one spawn per rank): zero3 with bf16 masters
and bf16 Adam state against plain PyTorch doing the same arithmetic (a bf16 model, torch's
fused AdamW, clip_grad_norm_), 20 steps; bit-exact resume; the offloaded and the overlapped
host step, bit-identical to the resident run; DeepSpeed's offloaded mixed mode (bf16
masters, fp32 state) against plain PyTorch lifting the bf16 weights to fp32 for each step;
checkpoints converted between the settings; a GatheredParameters write reaching the master;
export-deepspeed / import-deepspeed keeping the bf16 dtypes.

The bound (ULP_BOUND): zero3 and the plain run differ only in how the gradient of the
global batch is summed: zero3 reduce-scatters the ranks' bf16 gradients (gloo sums them in
bf16, then divides by the world size), plain PyTorch accumulates (loss / world).backward()
into bf16 .grad one micro-batch after the other. Each sum rounds to bf16 (relative 2^-8) in
another order, so a gradient element may differ by an ulp or two; Adam divides by sqrt(v),
so the update moves by a few per cent of lr at most, and the weights, rounded to bf16 after
every step, differ by an ulp here and there. A loss is itself a bf16 value, so the unit of
difference is one ulp of the loss (2^(floor(log2 |loss|) - 7)); weights one ulp apart move
the loss by about one such unit. Over these 20 steps (lr 1e-2, losses 1 to 4) the runs
measured at most 3 ulps apart on 2 and 4 ranks (most steps 0 or 1); the bound is 6 ulps of
the plain run's loss at every step, room for a torch kernel that rounds differently.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from common import make_batches, make_model, two_param_groups
from harness import run_ranks

MICRO = 2
STEPS = 20
HALF = 10
LR = 1e-2
CLIP = 1.0
ULP_BOUND = 6  # bf16 ulps of the loss, at every step: see the module docstring

BF16_FULL = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
OFFLOAD = {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}


# ------------------------------------------------------------------ plain PyTorch
def plain_bf16(world: int, lifted: bool = False) -> list[float]:
    """Plain single-process PyTorch on the same global batches: a bf16 model with fused AdamW
    (bf16 state), or with `lifted` the weights widened to fp32 for each step against fp32
    state and rounded back (DeepSpeed's offloaded mixed mode).
    Losses in the order each rank sees its micro-batches: [step][rank]."""
    dtype = torch.bfloat16
    model = make_model().to(dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    work = [p.detach().float().clone().requires_grad_() for p in params] if lifted else params
    groups = two_param_groups(model, LR)
    if lifted:
        index = {id(p): i for i, p in enumerate(params)}
        groups = [{**g, "params": [work[index[id(p)]] for p in g["params"]]} for g in groups]
    optimizer = torch.optim.AdamW(groups, fused=True)
    batches = make_batches(STEPS * world, MICRO)
    losses = []
    for step in range(STEPS):
        for rank in range(world):
            x, y = batches[step * world + rank]
            loss = model(x.to(dtype), y.to(dtype))
            (loss / world).backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        if lifted:
            for p, w in zip(params, work):
                w.data.copy_(p.data.float())
                w.grad = p.grad.float()
        optimizer.step()
        if lifted:
            for p, w in zip(params, work):
                p.data.copy_(w.data)
        model.zero_grad()
        optimizer.zero_grad()
    return losses


# ------------------------------------------------------------------ zero3 side
def build(bf16: dict, zero_extra: dict | None = None, seed: int = 0):
    import zero3

    model = make_model(seed=seed)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": CLIP, "bf16": bf16,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 30, **(zero_extra or {})}}
    engine, *_ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model, LR)),
                                  config=config)
    return engine


def train(engine, rank: int, world: int, first: int, last: int) -> list[float]:
    batches = make_batches(STEPS * world, MICRO)
    losses = []
    for step in range(first, last):
        x, y = batches[step * world + rank]
        loss = engine(x.bfloat16(), y.bfloat16())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def snapshot(engine) -> dict[str, torch.Tensor]:
    """Every master and optimizer state tensor by parameter name (after the update in flight)."""
    opt = engine.optimizer
    opt.wait()
    out = {}
    for sp, master in zip(opt.params, opt.masters):
        out[sp.name] = master.detach().clone()
        for key, value in opt.optimizer.state[master].items():
            out[f"{sp.name}/{key}"] = value.detach().clone()
    return out


def dtypes_of(engine) -> dict[str, object]:
    opt = engine.optimizer
    opt.wait()
    first = opt.masters[0]
    return {"masters": {m.dtype for m in opt.masters}, "shared": all(m is sp.shard for sp, m in zip(opt.params, opt.masters)),
            "state": {k: v.dtype for k, v in opt.optimizer.state[first].items()},
            "fused": all(g.get("fused") for g in opt.optimizer.param_groups)}


class Notes(logging.Handler):
    """The zero3 logger's warnings, kept."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def resident_and_resume(rank: int, world: int, folder: str) -> dict:
    engine = build(BF16_FULL)
    losses = train(engine, rank, world, 0, HALF)
    engine.save_checkpoint(folder, tag="half")
    losses += train(engine, rank, world, HALF, STEPS)
    final, dtypes = snapshot(engine), dtypes_of(engine)
    grad_dtype = None
    x, y = make_batches(1, MICRO)[0]
    engine.backward(engine(x.bfloat16(), y.bfloat16()))  # a window left open: its gradient shards
    grad_dtype = {sp.grad_shard.dtype for sp in engine.optimizer.params if sp.grad_shard is not None}
    engine.destroy()
    resumed = build(BF16_FULL, seed=7)
    resumed.load_checkpoint(folder, tag="half")
    resumed_losses = train(resumed, rank, world, HALF, STEPS)
    same = all(torch.equal(v, final[k]) for k, v in snapshot(resumed).items())
    resumed.destroy()
    return {"losses": losses, "dtypes": dtypes, "grad_dtype": grad_dtype, "resumed_losses": resumed_losses,
            "resumed_equal": same}


def conversions(rank: int, world: int, folder: str) -> dict:
    """bf16 checkpoint -> fp32-master engine, and fp32 checkpoint -> bf16-master engine."""
    notes = Notes()
    logging.getLogger("zero3").addHandler(notes)
    try:
        saved_bf16 = build(BF16_FULL)
        saved_bf16.load_checkpoint(folder, tag="half")
        bf16_values = snapshot(saved_bf16)
        saved_bf16.destroy()
        wide = build({"enabled": True})
        wide.load_checkpoint(folder, tag="half")
        widened = snapshot(wide)
        train(wide, rank, world, HALF, HALF + 2)  # it trains on from there
        wide.save_checkpoint(folder, tag="fp32")
        fp32_values = snapshot(wide)
        wide.destroy()
        narrow = build(BF16_FULL)
        narrow.load_checkpoint(folder, tag="fp32")
        narrowed = snapshot(narrow)
        narrow.destroy()
    finally:
        logging.getLogger("zero3").removeHandler(notes)
    widened_ok = all(widened[k].dtype == torch.float32 and torch.equal(widened[k], v.float())
                     for k, v in bf16_values.items() if v.is_floating_point() and v.dim())
    narrowed_ok = all(narrowed[k].dtype == torch.bfloat16 and torch.equal(narrowed[k], v.bfloat16())
                      for k, v in fp32_values.items() if v.is_floating_point() and v.dim())
    return {"widened_ok": widened_ok, "narrowed_ok": narrowed_ok, "notes": notes.lines}


def offloaded(rank: int, world: int) -> dict:
    """Both offloads (the host copies are bf16 too), the overlapped host step, and the mixed mode."""
    engine = build(BF16_FULL, OFFLOAD)
    losses = train(engine, rank, world, 0, STEPS)
    host = dtypes_of(engine)
    engine.destroy()
    overlap = {**OFFLOAD, "offload_optimizer": {"device": "cpu", "overlap_step": True}, "sub_group_size": 200}
    engine = build(BF16_FULL, overlap)
    overlapped = engine.optimizer.unit_order is not None
    overlapped_losses = train(engine, rank, world, 0, STEPS)
    engine.destroy()
    engine = build({"enabled": True, "bf16_master_weights_and_grads": True}, OFFLOAD)
    mixed_losses = train(engine, rank, world, 0, STEPS)
    mixed = dtypes_of(engine)
    engine.destroy()
    return {"losses": losses, "dtypes": host, "overlapped": overlapped, "overlapped_losses": overlapped_losses,
            "mixed_losses": mixed_losses, "mixed": mixed}


def gathered_write(rank: int, world: int) -> dict:
    """A write into a gathered parameter (modifier rank 0) reaches the bf16 master everywhere."""
    import zero3

    engine = build(BF16_FULL)
    train(engine, rank, world, 0, 2)
    weight = engine.module.head.weight
    with zero3.GatheredParameters([weight], modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                weight.fill_(0.375)  # exact in bf16
    sp = engine.table[weight]
    master = engine.optimizer.master_of(sp)
    valid = master[: sp.local_valid_numel]
    written = bool(torch.all(valid == 0.375)) and master.dtype == torch.bfloat16
    train(engine, rank, world, 2, 3)  # the next step starts from the written values
    after = engine.optimizer.master_of(sp)[: sp.local_valid_numel].float()
    moved = bool(torch.any(after != 0.375)) and float((after - 0.375).abs().max()) < 0.05  # from the written values
    engine.destroy()
    return {"written": written, "moved": moved}


def all_checks(rank: int, world: int, folder: str) -> dict:
    return {"resident": resident_and_resume(rank, world, folder), "conversions": conversions(rank, world, folder),
            "offloaded": offloaded(rank, world), "gathered": gathered_write(rank, world)}


def far(losses: list[float], plain: list[float]) -> float:
    """The largest distance, over the steps, in bf16 ulps of the plain run's loss."""
    return max(abs(x - y) / 2.0 ** (math.floor(math.log2(abs(y))) - 7) for x, y in zip(losses, plain))


@pytest.mark.parametrize("world", [2, 4])
def test_bf16_masters_and_states(tmp_path, world):
    results = run_ranks(all_checks, world, str(tmp_path), timeout=420)
    plain = plain_bf16(world)
    lifted = plain_bf16(world, lifted=True)
    for rank, r in enumerate(results):
        resident, off = r["resident"], r["offloaded"]
        mine = plain[rank::world]
        # 8 bytes a parameter: bf16 masters that are the bf16 shards, bf16 moments, fused kernels kept.
        assert resident["dtypes"]["masters"] == {torch.bfloat16} and resident["dtypes"]["shared"]
        assert resident["dtypes"]["state"]["exp_avg"] == resident["dtypes"]["state"]["exp_avg_sq"] == torch.bfloat16
        assert resident["dtypes"]["fused"] and resident["grad_dtype"] == {torch.bfloat16}
        # Plain PyTorch doing the same arithmetic, within the stated bound.
        assert far(resident["losses"], mine) <= ULP_BOUND, (resident["losses"], mine)
        # Exact resume.
        assert resident["resumed_losses"] == resident["losses"][HALF:] and resident["resumed_equal"]
        # Offloaded (bf16 host copies) and the overlapped host step: the resident run's arithmetic.
        assert off["losses"] == resident["losses"] and off["dtypes"]["masters"] == {torch.bfloat16}
        assert off["dtypes"]["state"]["exp_avg"] == torch.bfloat16
        assert off["overlapped"] and off["overlapped_losses"] == resident["losses"]
        # DeepSpeed's mixed mode: bf16 masters apart from the shards, fp32 state, lifted for the step.
        assert off["mixed"]["masters"] == {torch.bfloat16} and not off["mixed"]["shared"]
        assert off["mixed"]["state"]["exp_avg"] == torch.float32
        assert far(off["mixed_losses"], lifted[rank::world]) <= ULP_BOUND, (off["mixed_losses"], lifted)
        # Conversions between the settings, each with its note on rank 0.
        conv = r["conversions"]
        assert conv["widened_ok"] and conv["narrowed_ok"]
        if rank == 0:
            assert any("bfloat16, this engine keeps them in float32" in n for n in conv["notes"]), conv["notes"]
            assert any("float32, this engine keeps them in bfloat16" in n for n in conv["notes"]), conv["notes"]
        assert r["gathered"] == {"written": True, "moved": True}
    deepspeed_round_trip(tmp_path, world)


def deepspeed_round_trip(folder, world: int) -> None:
    """export-deepspeed writes the bf16 masters and moments as bf16 flats with DeepSpeed's keys
    in ds_config; import-deepspeed brings them back as bf16, equal to what was saved."""
    from zero3.checkpoint.deepspeed.exporter import export_deepspeed
    from zero3.checkpoint.deepspeed.importer import import_deepspeed
    from zero3.checkpoint.deepspeed.unpickle import load_deepspeed_file
    from zero3.checkpoint.format import ShardReader, read_manifest

    export_deepspeed(folder, folder / "ds", world_size=world, tag="half")
    optim = load_deepspeed_file(folder / "ds" / "half" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    inner = optim["optimizer_state_dict"]
    assert {f.dtype for f in inner["fp32_flat_groups"]} == {torch.bfloat16}
    assert inner["optimizer_state_dict"]["state"][0]["exp_avg"].dtype == torch.bfloat16
    assert optim["ds_config"]["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True,
                                          "bf16_optimizer_states": True}
    import_deepspeed(folder / "ds", folder / "back", tag="half")
    original, back = read_manifest(folder / "half"), read_manifest(folder / "back" / "half")
    assert back["master_dtype"] == back["optimizer_state_dtype"] == "bfloat16"
    with ShardReader(folder / "half", original) as a, ShardReader(folder / "back" / "half", back) as b:
        for name, entry in original["params"].items():
            numel = entry["numel"]
            assert torch.equal(a.read_range(f"param/{name}", numel, 0, numel), b.read_range(f"param/{name}", numel, 0, numel))
            for key, kind in entry["optim"].items():
                if kind == "elementwise":
                    saved = a.read_range(f"optim/{name}/{key}", numel, 0, numel)
                    again = b.read_range(f"optim/{name}/{key}", numel, 0, numel)
                    assert saved.dtype == again.dtype == torch.bfloat16 and torch.equal(saved, again)
