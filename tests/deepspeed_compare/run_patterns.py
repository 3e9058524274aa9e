#!/usr/bin/env python
"""The access patterns against DeepSpeed 0.19.8 (not collected by pytest).

Runs the cases of tests/params/test_access_*.py (tests/access_cases.py) with `deepspeed.initialize` instead of
`zero3.initialize`, on real gloo processes (tests/harness.py), and compares them with the
same plain-PyTorch reference; plus DeepSpeed versions of the error-path probes (rank-
dependent control flow without a leaf, a module attached after initialize, a change made
inside GatheredParameters without modifier_rank). Prints one line per probe.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv-bench/bin/python tests/deepspeed_compare/run_patterns.py [--world 2] [names...]

The bench venv has no pytest; the test module only needs `pytest.mark.parametrize` and
`pytest.raises` at import time and in its workers, so a small stand-in is installed
before importing it (also in the spawned ranks: they import this file first).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
import types
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _install_pytest_stand_in() -> None:
    try:
        import pytest  # noqa: F401
        return
    except ImportError:
        pass

    class _Raises:
        def __init__(self, expected, match=None):
            self.expected, self.value = expected, None

        def __enter__(self):
            return self

        def __exit__(self, kind, value, tb):
            if kind is None:
                raise AssertionError(f"DID NOT RAISE {self.expected.__name__}")
            if issubclass(kind, self.expected):
                self.value = value
                return True
            return False

    stand_in = types.ModuleType("pytest")
    stand_in.raises = _Raises
    class _Mark:  # every pytest.mark.<name>(...) is a decorator that changes nothing
        def __getattr__(self, name):
            return lambda *a, **k: (lambda f: f)

    stand_in.mark = _Mark()
    sys.modules["pytest"] = stand_in


_install_pytest_stand_in()

import importlib  # noqa: E402

import access_cases  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

FAMILIES = ["reads", "adapters", "control_flow", "modes", "gathered"]
# One namespace with the machinery and every family's models, steps and workers.
t = types.SimpleNamespace(**{name: value for module in [access_cases] + [
    importlib.import_module(f"test_access_{family}") for family in FAMILIES] for name, value in vars(module).items()})
from harness import run_ranks  # noqa: E402

FRAMEWORK = "deepspeed"


LOG = Path(os.environ.get("DS_COMPARE_LOG", Path(tempfile.gettempdir()) / "deepspeed_compare.log"))


def short(error: BaseException | str, limit: int = 300) -> str:
    """The last exception line of each failing rank (the whole text goes to LOG)."""
    text = str(error)
    with open(LOG, "a") as log:
        log.write(text + "\n" + "=" * 80 + "\n")
    lines = text.splitlines()
    causes = []
    for i, line in enumerate(lines):
        if line and not line.startswith(" ") and ("Error" in line or "Exception" in line or "exited" in line):
            bare = line.strip() in ("AssertionError", "RuntimeError")
            causes.append(f"{line.strip()} ({lines[i - 1].strip()})" if bare and i else line.strip())
    summary = " | ".join(dict.fromkeys(causes)) or " ".join(text.split())
    return summary if len(summary) <= limit else summary[:limit] + " ..."


# ------------------------------------------------------------------ parity probes
def parity(name: str, world: int) -> str:
    with tempfile.TemporaryDirectory() as folder:
        try:
            results = run_ranks(t.cases_worker, world, [name], folder, FRAMEWORK, (t.CASES[name].home,), timeout=300, collective_timeout=60)
        except AssertionError as exc:
            return "FAILS: " + short(exc)
    try:
        expected = t.reference(name, world)
        t.assert_values_match(f"{name}", [r[name]["values"] for r in results], expected["values"], "DeepSpeed")
        state = results[0][name]["state"]
        for key, ref in expected["state"].items():
            torch.testing.assert_close(state[key], ref, rtol=1e-5, atol=1e-6, msg=key)
    except AssertionError as exc:
        return "WRONG VALUES: " + short(exc)
    return "matches plain PyTorch"


def resume_flows(world: int) -> str:
    with tempfile.TemporaryDirectory() as folder:
        try:
            results = run_ranks(t.resume_flows_worker, world, folder, FRAMEWORK, timeout=300, collective_timeout=60)
        except AssertionError as exc:
            return "FAILS: " + short(exc)
    expected = t.reference(t.RESUME_CASE, world)["values"]
    outcomes = []
    for flow in ("before_first_step", "saved_after_load", "reloaded_itself", "loaded_into_trained_other"):
        try:
            t.assert_values_match(flow, [r[flow] for r in results], expected, "DeepSpeed")
            outcomes.append(f"{flow}: ok")
        except AssertionError as exc:
            outcomes.append(f"{flow}: WRONG VALUES ({short(exc, 120)})")
    return "; ".join(outcomes)


# ------------------------------------------------------------------ error-path probes
def ds_diverging_worker(rank: int, world: int, kind: str):
    import deepspeed  # noqa: F401

    c = (t.Case(build=t.MoEModel, step=t.moe_step) if kind == "experts"
         else t.Case(build=t.RankSkip, step=t.rank_skip_step))
    engine = t.initialize(t.build_seeded(c, 0, FRAMEWORK), c, FRAMEWORK)
    driver = t.engine_driver(engine, rank, world, t.gathered_class(FRAMEWORK))
    losses = []
    for step in range(2):
        losses.extend(c.step(driver, step, rank, world))
        engine.step()
    return losses


def diverging(kind: str, world: int) -> str:
    start = time.monotonic()
    try:
        run_ranks(ds_diverging_worker, world, kind, timeout=120, collective_timeout=45)
    except AssertionError as exc:
        text = str(exc)
        took = time.monotonic() - start
        if "did not finish" in text:
            return f"HANGS (ranks killed by the harness after {took:.0f}s): {short(text)}"
        return f"FAILS after {took:.0f}s: {short(text)}"
    return f"completes silently in {time.monotonic() - start:.0f}s (no error; ranks exchanged mismatched data)"


def ds_attach_worker(rank: int, world: int):
    c = t.Case(build=t.Small)
    engine = t.initialize(t.build_seeded(c, 0, FRAMEWORK), c, FRAMEWORK)
    engine.module.extra = nn.Linear(8, 8)
    x, y = t.regression_batch(0, rank)
    for step in range(2):
        loss = torch.nn.functional.mse_loss(engine.module.head(engine.module.extra(
            torch.tanh(engine.module.mid(torch.tanh(engine.module.inp(x)))))), y)
        engine.backward(loss)
        engine.step()
    weights = engine.module.extra.weight.detach().clone()
    return weights


def attach(world: int) -> str:
    try:
        weights = run_ranks(ds_attach_worker, world, timeout=180, collective_timeout=45)
    except AssertionError as exc:
        return "FAILS: " + short(exc)
    same = all(torch.equal(weights[0], w) for w in weights[1:])
    return ("trains on without an error; the attached module's weights "
            + ("stay equal across ranks" if same else "now DIFFER between ranks (not averaged)"))


def ds_gathered_worker(rank: int, world: int):
    import deepspeed

    c = t.Case(build=t.Small, threshold=3)
    engine = t.initialize(t.build_seeded(c, 0, FRAMEWORK), c, FRAMEWORK)
    model = engine.module
    raised = None
    try:
        with deepspeed.zero.GatheredParameters([model.mid.weight, model.head.bias]):
            if rank == world - 1:
                with torch.no_grad():
                    model.mid.weight[0, 0] += 1.0
                    model.head.bias.fill_(7.0)
    except Exception as exc:  # noqa: BLE001
        raised = f"{type(exc).__name__}: {exc}"
    with deepspeed.zero.GatheredParameters([model.mid.weight, model.head.bias]):
        after = (float(model.mid.weight[0, 0]), model.head.bias.detach().clone())
    return raised, after


def gathered_without_modifier(world: int) -> str:
    try:
        results = run_ranks(ds_gathered_worker, world, timeout=180, collective_timeout=45)
    except AssertionError as exc:
        return "FAILS: " + short(exc)
    raised = [r[0] for r in results]
    bias = [r[1][1] for r in results]
    kept_on = [rank for rank, b in enumerate(bias) if torch.equal(b, torch.full((3,), 7.0))]
    if any(raised):
        return f"raises: {raised}"
    return ("no error; the change is lost for partitioned parameters, and the resident one keeps "
            f"the changed value only on rank(s) {kept_on}" if kept_on else "no error; the change is lost")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("names", nargs="*")
    args = parser.parse_args()
    names = args.names or list(t.CASES) + ["resume_flows", "divergent_experts", "rank_skip",
                                           "attach_after_initialize", "gathered_without_modifier"]
    probes = {
        "resume_flows": lambda: resume_flows(args.world),
        "divergent_experts": lambda: diverging("experts", args.world),
        "rank_skip": lambda: diverging("skip", args.world),
        "attach_after_initialize": lambda: attach(args.world),
        "gathered_without_modifier": lambda: gathered_without_modifier(args.world),
    }
    import deepspeed

    print(f"DeepSpeed {deepspeed.__version__}, torch {torch.__version__}, {args.world} gloo ranks", flush=True)
    for name in names:
        start = time.monotonic()
        outcome = probes[name]() if name in probes else parity(name, args.world)
        print(f"{name:40s} {outcome}   [{time.monotonic() - start:.0f}s]", flush=True)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
