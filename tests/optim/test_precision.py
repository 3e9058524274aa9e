"""Mixed precision, loss scaling, clipping, offload and the config's optimizer/scheduler."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from common import batch_index, config, make_batches, make_model, reference_training, two_param_groups
from harness import run_ranks
from torch import nn

MICRO = 2


class TiedNet(nn.Module):
    """Tied embedding / output head, a small resident bias read outside its module."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(23, 16)
        self.mix = nn.Linear(16, 16)
        self.adapter = nn.Linear(16, 2, bias=False)   # 32 elements: resident at threshold 40
        self.up = nn.Linear(2, 16, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens[:, :-1])
        h = h.to(self.adapter.weight.dtype)            # read outside the adapter's module
        h = torch.tanh(self.mix(h)) + self.up(self.adapter(h))
        logits = F.linear(h, self.embed.weight)       # tied head
        return F.cross_entropy(logits.reshape(-1, 23).float(), tokens[:, 1:].reshape(-1))


def tied_batches(count: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 23, (MICRO, 9), generator=g) for _ in range(count)]


def tied_reference(steps: int, world: int, clip: float):
    torch.manual_seed(0)
    model = TiedNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    batches = tied_batches(steps * world)
    norms, losses = [], []
    for step in range(steps):
        for rank in range(world):
            loss = model(batches[step * world + rank])
            (loss / world).backward()
            losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        optimizer.step()
        optimizer.zero_grad()
    return norms, losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def tied_zero3(rank: int, world: int, steps: int, clip: float):
    import zero3
    from zero3.checkpoint.export import consolidated_state_dict

    torch.manual_seed(0)
    model = TiedNet()
    cfg = config(MICRO, 1, threshold=40)
    cfg["gradient_clipping"] = clip
    engine, _, _, _ = zero3.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), config=cfg)
    resident = sorted(sp.name for sp in engine.table.values() if sp.persistent)
    batches = tied_batches(steps * world)
    norms, losses = [], []
    for step in range(steps):
        loss = engine(batches[step * world + rank])
        engine.backward(loss)
        engine.step()
        norms.append(engine.get_global_grad_norm())
        losses.append(loss.item())
    return norms, losses, consolidated_state_dict(engine), resident, engine.late_gathers


@pytest.mark.parametrize("world", [2, 4])
def test_clipping_uses_the_global_norm_with_tied_and_resident_params(world):
    steps, clip = 4, 0.3
    ref_norms, ref_losses, ref_state = tied_reference(steps, world, clip)
    assert max(ref_norms) > clip  # clipping really happens
    results = run_ranks(tied_zero3, world, steps, clip)
    for rank, (norms, losses, _, resident, late) in enumerate(results):
        assert "adapter.weight" in resident and "mix.bias" in resident
        for a, b in zip(norms, ref_norms):
            assert math.isclose(a, b, rel_tol=1e-6), (norms, ref_norms)
        for step, value in enumerate(losses):
            assert math.isclose(value, ref_losses[step * world + rank], rel_tol=1e-5)
        assert late == 0
    for name, value in ref_state.items():
        torch.testing.assert_close(results[0][2][name], value, rtol=1e-5, atol=1e-6)


def precision_run(rank: int, world: int, precision: dict, steps: int, overflow_at: int | None):
    import zero3

    model = make_model()
    cfg = config(MICRO, 1, threshold=30)
    cfg.update(precision)
    engine, _, _, _ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model, 1e-3)),
                                       config=cfg)
    batches = make_batches(steps * world, MICRO)
    losses, scales, skipped = [], [], []
    for step in range(steps):
        x, y = batches[batch_index(step, 0, rank, 1, world)]
        loss = engine(x.to(engine.compute_dtype), y.to(engine.compute_dtype))  # inputs cast by the user, as with DeepSpeed
        if step == overflow_at and rank == world - 1:
            loss = loss * float("inf")   # only one rank overflows: all must skip
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
        scales.append(engine.loss_scale)
        skipped.append(engine.skipped_steps)
    return losses, scales, skipped, str(engine.module.embed.weight.dtype)


@pytest.mark.parametrize("name,precision,tolerance", [
    ("bf16", {"bf16": {"enabled": True}}, 2e-2),
    ("fp16", {"fp16": {"enabled": True, "initial_scale_power": 8}}, 5e-3),
])
def test_half_precision_tracks_fp32(name, precision, tolerance):
    steps, world = 20, 2
    ref, _ = reference_training(steps, 1, world, MICRO, lr=1e-3)
    results = run_ranks(precision_run, world, precision, steps, None)
    for rank, (losses, _, skipped, dtype) in enumerate(results):
        assert dtype == ("torch.bfloat16" if name == "bf16" else "torch.float16")
        assert skipped[-1] == 0
        for step, value in enumerate(losses):
            expected = ref[(step, 0, rank)]
            assert abs(value - expected) <= tolerance * max(1.0, abs(expected)), (step, value, expected)


def test_fp16_overflow_skips_exactly_that_step_on_all_ranks():
    precision = {"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1, "loss_scale_window": 1000}}
    results = run_ranks(precision_run, 2, precision, 6, 3)
    for losses, scales, skipped, _ in results:
        assert skipped == [0, 0, 0, 1, 1, 1]
        assert scales[:3] == [256.0] * 3 and scales[3:] == [128.0] * 3
    assert results[0][2] == results[1][2]


def skip_then_resume(rank: int, world: int, folder: str):
    """Overflow, save, load, overflow again: the resident adapter keeps working."""
    import zero3

    def build():
        torch.manual_seed(0)
        model = TiedNet()
        cfg = config(MICRO, 1, threshold=40)
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 6, "hysteresis": 1}
        engine, _, _, _ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                           config=cfg)
        return engine

    batches = tied_batches(8 * world)

    def step(engine, index: int, overflow: bool):
        loss = engine(batches[index * world + rank])
        engine.backward(loss * float("inf") if overflow else loss)
        engine.step()
        return loss.float().item()

    engine = build()
    losses = [step(engine, 0, False), step(engine, 1, True), step(engine, 2, False)]
    engine.save_checkpoint(folder)
    scale_saved = engine.loss_scale
    engine.destroy()
    engine = build()
    engine.load_checkpoint(folder)
    assert engine.loss_scale == scale_saved and engine.skipped_steps == 1
    losses += [step(engine, 3, True), step(engine, 4, False), step(engine, 5, False)]
    assert engine.skipped_steps == 2
    return losses, engine.late_gathers


def test_resident_param_read_outside_module_survives_skips_and_resume(tmp_path):
    for losses, late in run_ranks(skip_then_resume, 2, str(tmp_path)):
        assert all(math.isfinite(x) for x in losses)
        assert late == 0


def offload_run(rank: int, world: int, offload: bool):
    import zero3
    from zero3.checkpoint.export import consolidated_state_dict

    model = make_model()
    cfg = config(MICRO, 2, threshold=30)
    if offload:
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    engine, _, _, _ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model)), config=cfg)
    batches = make_batches(8 * world, MICRO)
    losses = []
    for step in range(4):
        for micro in range(2):
            x, y = batches[batch_index(step, micro, rank, 2, world)]
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    devices = {str(sp.shard.device) for sp in engine.table.values()}
    devices |= {str(m.device) for m in engine.optimizer.masters}
    return losses, consolidated_state_dict(engine), devices


def test_offload_gives_the_same_results():
    plain = run_ranks(offload_run, 2, False)
    offloaded = run_ranks(offload_run, 2, True)
    for (l1, s1, _), (l2, s2, devices) in zip(plain, offloaded):
        assert l1 == l2
        assert devices == {"cpu"}
    for name in plain[0][1]:
        assert torch.equal(plain[0][1][name], offloaded[0][1][name]), name


def config_sections_run(rank: int, world: int):
    import zero3
    from zero3.optim.lr_schedules import WarmupDecayLR

    model = make_model()
    cfg = config(MICRO, 1, threshold=30)
    cfg["optimizer"] = {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.8, 0.99], "weight_decay": 0.01}}
    cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 3, "total_num_steps": 10,
                                                            "warmup_max_lr": 1e-3, "warmup_type": "linear"}}
    engine, optimizer, _, scheduler = zero3.initialize(model=model, config=cfg)
    assert type(optimizer).__name__ == "AdamW"  # DeepSpeed's "Adam" decouples weight decay
    assert isinstance(scheduler, WarmupDecayLR)
    shadow = WarmupDecayLR(torch.optim.SGD([torch.zeros(1)], lr=1e-3), warmup_num_steps=3, total_num_steps=10,
                           warmup_max_lr=1e-3, warmup_type="linear")
    batches = make_batches(6 * world, MICRO)
    lrs, expected = [], []
    for step in range(6):
        x, y = batches[step * world + rank]
        engine.backward(engine(x, y))
        engine.step()
        shadow.step()
        lrs.append(engine.get_lr()[0])
        expected.append(shadow.get_last_lr()[0])
    return lrs, expected


def test_config_optimizer_and_scheduler_sections():
    for lrs, expected in run_ranks(config_sections_run, 2):
        assert lrs == expected


class Elementless(torch.optim.Optimizer):
    """A made-up optimizer zero3 does not know."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-group["lr"])


def untested_optimizer_run(rank: int, world: int):
    import zero3

    cfg = config(MICRO, 1)
    model = make_model()
    try:
        zero3.initialize(model=model, optimizer=Elementless(model.parameters()), config=cfg)
        refused = None
    except zero3.EngineError as exc:
        refused = str(exc)
    cfg["zero_allow_untested_optimizer"] = True
    model = make_model()
    engine, _, _, _ = zero3.initialize(model=model, optimizer=Elementless(model.parameters()), config=cfg)
    x, y = make_batches(1, MICRO)[0]
    engine.backward(engine(x, y))
    engine.step()
    return refused, engine.global_steps


def test_untested_optimizer_needs_the_flag():
    for refused, steps in run_ranks(untested_optimizer_run, 2):
        assert refused is not None and "zero_allow_untested_optimizer" in refused
        assert steps == 1


def printing_run(rank: int, world: int):
    import zero3

    cfg = config(MICRO, 1)
    cfg.update({"steps_per_print": 2, "wall_clock_breakdown": True})
    model = make_model()
    engine, _, _, _ = zero3.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for x, y in make_batches(4, MICRO):
            engine.backward(engine(x, y))
            engine.step()
    return out.getvalue()


def test_steps_per_print_and_wall_clock_breakdown():
    rank0, rank1 = run_ranks(printing_run, 2)
    lines = rank0.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("zero3: step=2") and lines[1].startswith("zero3: step=4")
    assert "forward=" in lines[0] and "backward=" in lines[0] and "step=" in lines[0]
    assert rank1 == ""


def test_dynamic_scale_grows_when_deepspeeds_scaler_does():
    """DeepSpeed 0.19.8's DynamicLossScaler doubles on a good update that follows `window`
    good updates since the last overflow (or the start), not on the window-th one."""
    from zero3.optim.loss_scaler import LossScaler

    scaler = LossScaler(scale=2.0 ** 17, dynamic=True, window=2, hysteresis=1, hysteresis_left=1)
    scales = []
    for overflow in (False, False, False, True, False, False, False):
        scaler.update(overflow)
        scales.append(scaler.scale)
    assert scales == [2.0 ** p for p in (17, 17, 18, 17, 17, 17, 18)]
