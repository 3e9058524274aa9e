"""Tests for zero3.lr_schedules: closed-form curves, construction behaviour, state round
trips, and (when /work/main/.venv-bench has DeepSpeed) a curve-by-curve comparison with
DeepSpeed 0.19.8's own classes."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from zero3.optim import lr_schedules
from zero3.optim.lr_schedules import (
    SCHEDULERS,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
)

STEPS = 100
REPO = Path(__file__).resolve().parents[2]
BENCH_PYTHON = REPO / ".venv-bench" / "bin" / "python"


# ---------------------------------------------------------------------------------------
# recording a curve: shared verbatim with the DeepSpeed subprocess (exec'd there)

RECORDER = r'''
import torch

def make_optimizer(kind, lrs):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    if kind == "adam":
        return torch.optim.Adam(groups, lr=lrs[0], betas=(0.85, 0.95))
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=lrs[0])
    return torch.optim.SGD(groups, lr=lrs[0], momentum=0.9)

def record(module, case, steps):
    """lrs/betas of every group after construction (index 0) and after each step."""
    opt = make_optimizer(case["opt"], case["lrs"])
    sched = getattr(module, case["cls"])(opt, **case["kwargs"])
    def snap():
        return {"lr": [float(g["lr"]) for g in opt.param_groups],
                "betas": [list(g["betas"]) if "betas" in g else None for g in opt.param_groups]}
    out = [snap()]
    for _ in range(steps):
        sched.step()
        out.append(snap())
    return {"curve": out, "last_lr": [float(x) for x in sched.get_last_lr()],
            "state": sched.state_dict()}
'''

_ns: dict[str, Any] = {}
exec(RECORDER, _ns)
make_optimizer: Callable = _ns["make_optimizer"]
record: Callable = _ns["record"]


def lr_curve(case: dict) -> list[list[float]]:
    return [s["lr"] for s in record(lr_schedules, case, STEPS)["curve"]]


def assert_close(got: float, want: float, what: str) -> None:
    assert math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-15), f"{what}: got {got!r}, want {want!r}"


def check_curve(case: dict, formula: Callable[[int, int], float]) -> None:
    """formula(it, group) is the lr at batch index ``it`` (-1: after construction)."""
    curve = lr_curve(case)
    assert len(curve) == STEPS + 1
    for k, lrs in enumerate(curve):
        it = k - 1
        for g, lr in enumerate(lrs):
            assert_close(lr, formula(it, g), f"{case['cls']} it={it} group={g}")


# ---------------------------------------------------------------------------------------
# closed forms, written independently of the module


def warm(kind: str, it: int, w: int) -> float:
    """Warmup progress: log -> ln(it+1)/ln(w), linear -> it/w."""
    return math.log1p(it) / math.log(w) if kind == "log" else it / w


TWO_LRS = [0.01, 0.002]


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("w", [1, 10, 37])
def test_warmup_lr_scalar(kind: str, w: int) -> None:
    lo, hi = 1e-4, 3e-3
    ww = max(2, w)
    case = dict(cls="WarmupLR", opt="adam", lrs=[0.5],
                kwargs=dict(warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=w, warmup_type=kind))

    def f(it: int, g: int) -> float:
        if it < 0:
            return lo
        return lo + (hi - lo) * (warm(kind, it, ww) if it < ww else 1.0)

    check_curve(case, f)


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_two_groups(kind: str) -> None:
    # max lr defaults to each group's own lr; min lr given per group
    mins = [1e-3, 0.0]
    case = dict(cls="WarmupLR", opt="sgd", lrs=TWO_LRS,
                kwargs=dict(warmup_min_lr=mins, warmup_num_steps=25, warmup_type=kind))

    def f(it: int, g: int) -> float:
        lo, hi = mins[g], TWO_LRS[g]
        if it < 0:
            return lo
        return lo + (hi - lo) * (warm(kind, it, 25) if it < 25 else 1.0)

    check_curve(case, f)


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("total,w", [(80, 20), (60, 60), (10, 30)])
def test_warmup_decay_lr(kind: str, total: int, w: int) -> None:
    los, his = [1e-5, 2e-5], [1e-3, 4e-3]
    case = dict(cls="WarmupDecayLR", opt="adamw", lrs=TWO_LRS,
                kwargs=dict(total_num_steps=total, warmup_min_lr=los, warmup_max_lr=his,
                            warmup_num_steps=w, warmup_type=kind))

    def f(it: int, g: int) -> float:
        lo, hi = los[g], his[g]
        if it < 0:
            return lo
        if it < w:
            frac = warm(kind, it, w)
        else:
            frac = max(0.0, (total - it) / max(1, total - w))
        return lo + (hi - lo) * frac

    check_curve(case, f)


def test_warmup_decay_default_max_lr() -> None:
    opt = make_optimizer("adam", [0.5])
    s = WarmupDecayLR(opt, total_num_steps=50, warmup_num_steps=10, warmup_type="linear")
    for _ in range(11):
        s.step()
    assert_close(opt.param_groups[0]["lr"], 0.001, "WarmupDecayLR max lr default")


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("total,w,a,b", [(80, 20, 0.1, 0.05), (100, 10, 0.0, 0.0001), (15, 30, 0.2, 0.3)])
def test_warmup_cosine_lr(kind: str, total: int, w: int, a: float, b: float) -> None:
    case = dict(cls="WarmupCosineLR", opt="adamw", lrs=TWO_LRS,
                kwargs=dict(total_num_steps=total, warmup_min_ratio=a, warmup_num_steps=w,
                            cos_min_ratio=b, warmup_type=kind))

    def f(it: int, g: int) -> float:
        if it < 0:
            return 0.0
        if it < w:
            ratio = a + (1 - a) * warm(kind, it, w)
        else:
            t = min(1.0, (it - w + 1) / max(1, total - w))
            ratio = b + (1 - b) * 0.5 * (1 + math.cos(math.pi * t))
        return TWO_LRS[g] * ratio

    check_curve(case, f)


def one_cycle_height(n: int, first: int, second: int, k1: int = 0, k2: int = 0) -> float:
    """Triangle height at batch count n: up over `first` batches, down over `second`."""
    total = first + second
    c = n % total
    if c <= first:
        return math.floor(c * k1 / first) / k1 if k1 else c / first
    return math.floor((total - c) * k2 / second) / k2 if k2 else (total - c) / second


ONE_CYCLE_SETS = [
    # (first, second, stairs1, stairs2, decay_step, lr_rate, mom_rate)
    (20, 30, 0, None, 10, 0.5, 0.1),
    (25, None, 0, None, 0, 0.5, 0.1),   # no decay: stays at min lr / max mom
    (10, 15, 5, None, 7, 1.0, 0.0),     # staircase, both halves 5 stairs
    (12, 18, 4, 6, 5, 0.3, 0.05),       # different stair counts
    (40, 0, 0, None, 20, 2.0, 0.02),    # rising half only
]


@pytest.mark.parametrize("first,second,k1,k2,dss,lr_rate,mom_rate", ONE_CYCLE_SETS)
def test_one_cycle(first: int, second: int | None, k1: int, k2: int | None, dss: int,
                   lr_rate: float, mom_rate: float) -> None:
    los, his = [1e-4, 5e-4], [1e-2, 2e-2]
    mlo, mhi = [0.8, 0.85], 0.95
    case = dict(cls="OneCycle", opt="adam", lrs=TWO_LRS,
                kwargs=dict(cycle_min_lr=los, cycle_max_lr=his, decay_lr_rate=lr_rate,
                            cycle_first_step_size=first, cycle_second_step_size=second,
                            cycle_first_stair_count=k1, cycle_second_stair_count=k2,
                            decay_step_size=dss, cycle_momentum=True, cycle_min_mom=mlo,
                            cycle_max_mom=mhi, decay_mom_rate=mom_rate))
    g2 = first if second is None else second
    s2 = k1 if k2 is None else k2
    total = first + g2

    def height(it: int) -> float:
        return one_cycle_height(it + 1, first, g2, k1, s2)

    def lr(it: int, g: int) -> float:
        if it < 0:
            return los[g]
        if it < total:
            return los[g] + (his[g] - los[g]) * height(it)
        d = it - total + 1
        return los[g] / (1 + lr_rate * d / dss) if dss else los[g]

    def mom(it: int, g: int) -> float:
        if it < 0:
            return mlo[g]
        if it < total:
            return mhi - (mhi - mlo[g]) * height(it)
        d = it - total + 1
        return mhi * (1 + mom_rate * d / dss) if dss and mom_rate else mhi

    rec = record(lr_schedules, case, STEPS)
    for k, snap in enumerate(rec["curve"]):
        it = k - 1
        for g in range(2):
            assert_close(snap["lr"][g], lr(it, g), f"OneCycle lr it={it} g={g}")
            b1, b2 = snap["betas"][g]
            assert_close(b1, mom(it, g), f"OneCycle beta1 it={it} g={g}")
            assert b2 == 0.99   # DeepSpeed replaces beta2 with 0.99


def test_one_cycle_peak_and_ends() -> None:
    opt = make_optimizer("adam", [0.1])
    s = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4)
    lrs = []
    for _ in range(9):
        s.step()
        lrs.append(opt.param_groups[0]["lr"])
    # batch counts 1..9: up 4, down 4, then post-cycle at min lr
    want = [0.0325, 0.055, 0.0775, 0.1, 0.0775, 0.055, 0.0325, 0.01, 0.01]
    for got, w in zip(lrs, want):
        assert_close(got, w, "OneCycle triangle")


def test_one_cycle_sgd_does_not_cycle_momentum(caplog: pytest.LogCaptureFixture) -> None:
    opt = make_optimizer("sgd", TWO_LRS)
    with caplog.at_level("WARNING"):
        s = OneCycle(opt, cycle_min_lr=1e-3, cycle_max_lr=1e-2, cycle_first_step_size=10)
    assert "cycle_momentum disabled" in caplog.text
    assert not s.cycle_momentum and s.get_mom() is None
    for _ in range(30):
        s.step()
    assert all(g["momentum"] == 0.9 and "betas" not in g for g in opt.param_groups)


def test_one_cycle_momentum_off() -> None:
    opt = make_optimizer("adam", [0.1])
    s = OneCycle(opt, 1e-3, 1e-2, cycle_first_step_size=5, cycle_momentum=False)
    for _ in range(12):
        s.step()
    assert opt.param_groups[0]["betas"] == (0.85, 0.95)


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test(staircase: bool) -> None:
    mins = [1e-4, 3e-4]
    case = dict(cls="LRRangeTest", opt="sgd", lrs=TWO_LRS,
                kwargs=dict(lr_range_test_min_lr=mins, lr_range_test_step_size=7,
                            lr_range_test_step_rate=2.5, lr_range_test_staircase=staircase))

    def f(it: int, g: int) -> float:
        q = (it + 1) / 7
        return mins[g] * (1 + 2.5 * (math.floor(q) if staircase else q))

    check_curve(case, f)


# ---------------------------------------------------------------------------------------
# construction behaviour, API details


def test_construction_writes_start_lr() -> None:
    opt = make_optimizer("adam", TWO_LRS)
    WarmupLR(opt, warmup_min_lr=1e-5, warmup_max_lr=1e-3)
    assert [g["lr"] for g in opt.param_groups] == [1e-5, 1e-5]

    opt = make_optimizer("adam", TWO_LRS)
    s = WarmupCosineLR(opt, total_num_steps=100, warmup_num_steps=10)
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]
    assert s.get_last_lr() == [0.0, 0.0]
    assert s.org_lrs == TWO_LRS

    opt = make_optimizer("adam", TWO_LRS)
    s = OneCycle(opt, cycle_min_lr=[1e-4, 2e-4], cycle_max_lr=1e-2, cycle_min_mom=0.7)
    assert [g["lr"] for g in opt.param_groups] == [1e-4, 2e-4]
    assert [g["betas"] for g in opt.param_groups] == [(0.7, 0.99), (0.7, 0.99)]
    with pytest.raises(AssertionError):   # as DeepSpeed: nothing recorded before step()
        s.get_last_lr()

    opt = make_optimizer("sgd", TWO_LRS)
    LRRangeTest(opt, lr_range_test_min_lr=5e-4)
    assert [g["lr"] for g in opt.param_groups] == [5e-4, 5e-4]


@pytest.mark.parametrize("cls,kwargs", [
    (WarmupLR, dict(warmup_min_lr=1e-5, warmup_max_lr=1e-3)),
    (WarmupDecayLR, dict(total_num_steps=50)),
    (WarmupCosineLR, dict(total_num_steps=50)),
    (OneCycle, dict(cycle_min_lr=1e-4, cycle_max_lr=1e-2)),
    (LRRangeTest, dict()),
])
def test_resume_constructor_leaves_optimizer(cls: type, kwargs: dict) -> None:
    opt = make_optimizer("adam", TWO_LRS)
    s = cls(opt, last_batch_iteration=5, **kwargs)
    assert [g["lr"] for g in opt.param_groups] == TWO_LRS
    assert opt.param_groups[0]["betas"] == (0.85, 0.95)
    with pytest.raises(AssertionError):
        s.get_last_lr()
    s.step()
    assert s.last_batch_iteration == 6


def test_step_explicit_index_and_get_lr() -> None:
    opt = make_optimizer("adam", [0.1])
    s = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear")
    s.step(last_batch_iteration=4)
    assert s.last_batch_iteration == 4 and opt.param_groups[0]["lr"] == pytest.approx(0.4)
    assert s.get_last_lr() == [opt.param_groups[0]["lr"]]
    s.last_batch_iteration = 7
    assert s.get_lr() == [pytest.approx(0.7)]          # computed, not written
    assert opt.param_groups[0]["lr"] == pytest.approx(0.4)
    s.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.8)

    opt = make_optimizer("adam", [0.1])
    o = OneCycle(opt, 0.0, 1.0, cycle_first_step_size=10)
    o.step(batch_iteration=4)                           # DeepSpeed's keyword for OneCycle
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)
    r = LRRangeTest(opt, lr_range_test_step_size=10)
    r.step(batch_iteration=9)
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-3)


def test_tensor_lr_updated_in_place() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([p], lr=torch.tensor(0.01))
    lr_tensor = opt.param_groups[0]["lr"]
    s = WarmupCosineLR(opt, total_num_steps=20, warmup_num_steps=5, warmup_type="linear")
    for _ in range(7):
        s.step()
    assert opt.param_groups[0]["lr"] is lr_tensor
    assert float(lr_tensor) == pytest.approx(0.01 * (1e-4 + (1 - 1e-4) * 0.5 * (1 + math.cos(math.pi * 2 / 15))))


def test_validation() -> None:
    opt = make_optimizer("adam", TWO_LRS)
    with pytest.raises(ValueError):
        WarmupLR(opt, warmup_num_steps=0)
    with pytest.raises(ValueError):
        WarmupLR(opt, warmup_num_steps=10.0)
    with pytest.raises(ValueError):
        WarmupLR(opt, warmup_min_lr=[0.0, 0.0, 0.0])
    with pytest.raises(ValueError):
        WarmupCosineLR(opt, total_num_steps=10, warmup_num_steps=-1)
    with pytest.raises(ValueError):
        OneCycle(opt, 1e-4, 1e-2, cycle_first_step_size=0)
    with pytest.raises(ValueError):
        OneCycle(opt, 1e-4, 1e-2, cycle_second_step_size=-1)
    with pytest.raises(ValueError):
        OneCycle(opt, [1e-4], 1e-2)
    with pytest.raises(ValueError):
        LRRangeTest(opt, lr_range_test_step_size=0)
    with pytest.raises(TypeError):
        WarmupLR(opt, warmup_max=1.0)
    with pytest.raises(TypeError):
        WarmupLR(object())
    assert [g["lr"] for g in opt.param_groups] == TWO_LRS   # failures touched nothing


def test_unknown_warmup_type_falls_back_to_log(caplog: pytest.LogCaptureFixture) -> None:
    opt = make_optimizer("adam", [0.1])
    with caplog.at_level("WARNING"):
        s = WarmupLR(opt, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="cosine")
    assert s.warmup_type == "log" and "warmup_type" in caplog.text


def test_wrapped_optimizer_is_unwrapped() -> None:
    class Wrapper:
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer

    opt = make_optimizer("adam", [0.1])
    s = WarmupLR(Wrapper(opt), warmup_min_lr=0.01, warmup_max_lr=0.1)
    assert s.optimizer is opt and opt.param_groups[0]["lr"] == 0.01


def test_schedulers_registry() -> None:
    assert SCHEDULERS == {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR,
                          "WarmupCosineLR": WarmupCosineLR, "OneCycle": OneCycle,
                          "LRRangeTest": LRRangeTest}


# ---------------------------------------------------------------------------------------
# state_dict round trip


ROUND_TRIP_CASES = [
    dict(cls="WarmupLR", opt="adam", lrs=TWO_LRS,
         kwargs=dict(warmup_min_lr=[1e-4, 0.0], warmup_num_steps=30, warmup_type="log")),
    dict(cls="WarmupDecayLR", opt="adam", lrs=TWO_LRS,
         kwargs=dict(total_num_steps=90, warmup_min_lr=1e-5, warmup_max_lr=[1e-3, 2e-3],
                     warmup_num_steps=30, warmup_type="linear")),
    dict(cls="WarmupCosineLR", opt="adamw", lrs=TWO_LRS,
         kwargs=dict(total_num_steps=90, warmup_min_ratio=0.1, warmup_num_steps=30, cos_min_ratio=0.01)),
    dict(cls="OneCycle", opt="adam", lrs=TWO_LRS,
         kwargs=dict(cycle_min_lr=[1e-4, 2e-4], cycle_max_lr=[1e-2, 2e-2], decay_lr_rate=0.2,
                     cycle_first_step_size=20, cycle_second_step_size=25, decay_step_size=5,
                     decay_mom_rate=0.01)),
    dict(cls="LRRangeTest", opt="sgd", lrs=TWO_LRS,
         kwargs=dict(lr_range_test_min_lr=[1e-4, 2e-4], lr_range_test_step_size=9,
                     lr_range_test_staircase=True)),
]


def _state(opt: torch.optim.Optimizer) -> list:
    return [(g["lr"], g.get("betas")) for g in opt.param_groups]


@pytest.mark.parametrize("case", ROUND_TRIP_CASES, ids=[c["cls"] for c in ROUND_TRIP_CASES])
def test_state_dict_round_trip(case: dict) -> None:
    cls = SCHEDULERS[case["cls"]]
    opt_a = make_optimizer(case["opt"], case["lrs"])
    a = cls(opt_a, **case["kwargs"])
    for _ in range(40):
        a.step()

    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert state == {"last_batch_iteration": 39}
    assert type(state["last_batch_iteration"]) is int

    opt_b = make_optimizer(case["opt"], case["lrs"])
    b = cls(opt_b, **case["kwargs"])
    b.load_state_dict(state)
    assert b.last_batch_iteration == 39

    # the same state through the resume constructor argument
    opt_c = make_optimizer(case["opt"], case["lrs"])
    c = cls(opt_c, last_batch_iteration=39, **case["kwargs"])

    for _ in range(STEPS - 40):
        a.step()
        b.step()
        c.step()
        assert _state(opt_b) == _state(opt_a)
        assert _state(opt_c) == _state(opt_a)
        assert b.get_last_lr() == a.get_last_lr()
    assert b.state_dict() == a.state_dict() == {"last_batch_iteration": STEPS - 1}


# ---------------------------------------------------------------------------------------
# against DeepSpeed itself


DS_CASES: list[dict] = [
    *[dict(cls="WarmupLR", opt=o, lrs=TWO_LRS,
           kwargs=dict(warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=w, warmup_type=t))
      for t in ("log", "linear")
      for (o, lo, hi, w) in [("adam", 1e-4, 3e-3, 37), ("sgd", [1e-3, 0.0], None, 25), ("adam", 0.0, 1e-3, 1)]],
    *[dict(cls="WarmupDecayLR", opt="adamw", lrs=TWO_LRS,
           kwargs=dict(total_num_steps=n, warmup_min_lr=[1e-5, 2e-5], warmup_max_lr=[1e-3, 4e-3],
                       warmup_num_steps=w, warmup_type=t))
      for t in ("log", "linear") for (n, w) in [(80, 20), (60, 60), (10, 30)]],
    dict(cls="WarmupDecayLR", opt="adam", lrs=[0.5], kwargs=dict(total_num_steps=50, warmup_num_steps=10)),
    *[dict(cls="WarmupCosineLR", opt="adamw", lrs=TWO_LRS,
           kwargs=dict(total_num_steps=n, warmup_min_ratio=a, warmup_num_steps=w, cos_min_ratio=b,
                       warmup_type=t))
      for t in ("log", "linear") for (n, w, a, b) in [(80, 20, 0.1, 0.05), (100, 10, 0.0, 1e-4), (15, 30, 0.2, 0.3)]],
    *[dict(cls="OneCycle", opt="adam", lrs=TWO_LRS,
           kwargs=dict(cycle_min_lr=[1e-4, 5e-4], cycle_max_lr=[1e-2, 2e-2], decay_lr_rate=r,
                       cycle_first_step_size=f, cycle_second_step_size=s, cycle_first_stair_count=k1,
                       cycle_second_stair_count=k2, decay_step_size=d, cycle_momentum=True,
                       cycle_min_mom=[0.8, 0.85], cycle_max_mom=0.95, decay_mom_rate=m))
      for (f, s, k1, k2, d, r, m) in ONE_CYCLE_SETS + [(7, 13, 3, 2, 4, 0.7, 0.03), (33, 1, 0, None, 3, 0.1, 0.0)]],
    dict(cls="OneCycle", opt="sgd", lrs=TWO_LRS,
         kwargs=dict(cycle_min_lr=1e-3, cycle_max_lr=1e-2, cycle_first_step_size=15, decay_step_size=5,
                     decay_lr_rate=0.5)),
    dict(cls="OneCycle", opt="adam", lrs=TWO_LRS,
         kwargs=dict(cycle_min_lr=1e-3, cycle_max_lr=1e-2, cycle_first_step_size=15, cycle_momentum=False)),
    *[dict(cls="LRRangeTest", opt="sgd", lrs=TWO_LRS,
           kwargs=dict(lr_range_test_min_lr=[1e-4, 3e-4], lr_range_test_step_size=7,
                       lr_range_test_step_rate=2.5, lr_range_test_staircase=st))
      for st in (False, True)],
]

DS_SCRIPT = RECORDER + r'''
import json, sys
import deepspeed.runtime.lr_schedules as ds
cases = json.load(open(sys.argv[1]))
json.dump([record(ds, c, int(sys.argv[3])) for c in cases], open(sys.argv[2], "w"))
'''


def test_matches_deepspeed() -> None:
    if not BENCH_PYTHON.exists():
        pytest.skip(f"{BENCH_PYTHON} not found: no DeepSpeed venv to compare against")
    with tempfile.TemporaryDirectory() as tmp:
        cases_path, out_path, script = (os.path.join(tmp, n) for n in ("cases.json", "out.json", "ds.py"))
        with open(cases_path, "w") as fh:
            json.dump(DS_CASES, fh)
        with open(script, "w") as fh:
            fh.write(DS_SCRIPT)
        env = dict(os.environ, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
        proc = subprocess.run([str(BENCH_PYTHON), script, cases_path, out_path, str(STEPS)],
                              capture_output=True, text=True, timeout=600, env=env, cwd=tmp)
        if proc.returncode != 0 and "No module named 'deepspeed'" in proc.stderr:
            pytest.skip(f"{BENCH_PYTHON} cannot import deepspeed")
        assert proc.returncode == 0, proc.stderr[-4000:]
        with open(out_path) as fh:
            theirs = json.load(fh)

    assert len(theirs) == len(DS_CASES)
    for case, ref in zip(DS_CASES, theirs):
        ours = record(lr_schedules, case, STEPS)
        label = f"{case['cls']} {case['opt']} {case['kwargs']}"
        assert ours["state"] == ref["state"], label
        for k, (a, b) in enumerate(zip(ours["curve"], ref["curve"])):
            for g in range(len(case["lrs"])):
                assert abs(a["lr"][g] - b["lr"][g]) <= 1e-12, f"{label} it={k - 1} g={g}: {a} vs {b}"
                if b["betas"][g] is None:
                    assert a["betas"][g] is None, label
                else:
                    for x, y in zip(a["betas"][g], b["betas"][g]):
                        assert abs(x - y) <= 1e-12, f"{label} betas it={k - 1} g={g}: {a} vs {b}"
        for x, y in zip(ours["last_lr"], ref["last_lr"]):
            assert abs(x - y) <= 1e-12, label
