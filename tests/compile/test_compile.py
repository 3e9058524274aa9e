"""torch.compile under zero3: each fetch unit's forward compiled, hooks and discovery eager.

One launch of 2 gloo ranks runs every check (`_checks`), since compiling is slow on CPU;
the tests compare its results with the same training in eager mode:
- the three ways to ask (blocks compiled in place before initialize, a torch.compile
  wrapper passed to initialize, engine.compile after) train to the same losses and
  parameters as eager (fp32, 1e-5);
- dynamo makes no graph break and compiles nothing new after the first steps, across
  train / eval switches and in a fresh engine resumed from a checkpoint (bit-exact);
- a parameter read outside its module is discovered by the unit's first (eager) call and
  gathered for its compiled calls; one read only later makes that unit eager, still exact;
- engine.compile is DeepSpeed's: `is_compiled`, once, refusing what zero3 cannot honour.
"""

from __future__ import annotations

import pytest
import torch

from compile_cases import BACKEND, batch, build, graph_breaks, graphs, make_model, parameters, train
from harness import run_ranks

STEPS = 4
TOL = 1e-5


def _fresh_dynamo() -> None:
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()


def _parity(rank: int) -> dict:
    out = {}
    for mode in ("eager", "block", "wrapped", "engine"):
        _fresh_dynamo()
        engine = build(mode, rank)
        losses, counts = train(engine, rank, range(STEPS))
        out[mode] = {"losses": losses, "params": parameters(engine), "graphs": counts,
                     "breaks": graph_breaks(), "is_compiled": engine.is_compiled,
                     "names": sorted(n for n, _ in engine.module.named_parameters())}
        engine.destroy()
    return out


def _train_eval(rank: int) -> dict:
    """train, eval, train, eval: each mode compiles on its first use only."""
    _fresh_dynamo()
    engine = build("engine", rank)
    counts = []
    train(engine, rank, range(2))
    counts.append(graphs())
    for round_ in range(2):
        engine.eval()
        with torch.no_grad():
            engine(batch(rank, 100 + round_))
        counts.append(graphs())
        engine.train()
        train(engine, rank, range(2 + round_, 3 + round_))
        counts.append(graphs())
    return {"graphs": counts, "breaks": graph_breaks()}


def _resume(rank: int, folder: str) -> dict:
    """2 steps, save, a fresh compiled engine loads and trains 2 more."""
    _fresh_dynamo()
    first = build("engine", rank)
    train(first, rank, range(2))
    first.save_checkpoint(folder, tag="mid")
    first.destroy()
    before = graphs()
    second = build("engine", rank)
    second.load_checkpoint(folder, tag="mid")
    losses, counts = train(second, rank, range(2, STEPS))
    return {"losses": losses, "params": parameters(second), "new_graphs": [c - before for c in counts],
            "breaks": graph_breaks()}


def _foreign_reads(rank: int) -> dict:
    """Blocks read `emb.weight` (another unit's) from their first call, or only from step 2."""
    out = {}
    for when in ("always", "late"):
        for mode in ("eager", "engine"):
            _fresh_dynamo()
            model = make_model()
            if when == "always":
                for block in model.blocks:
                    block.read_foreign = True

            def late(engine, step):
                if step == 2:
                    for block in engine.module.blocks:
                        block.read_foreign = True

            # nothing kept gathered past its unit: emb.weight is released while the blocks run
            engine = build(mode, rank, model=model, zero_optimization={
                "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0})
            losses, _ = train(engine, rank, range(STEPS), on_step=late if when == "late" else None)
            out[(when, mode)] = {"losses": losses, "params": parameters(engine),
                                 "fallbacks": engine.compiled_units.fallbacks(), "breaks": graph_breaks()}
            engine.destroy()
    return out


def _refusals(rank: int) -> dict:
    from zero3.params.compiled import CompileError

    engine = build("engine", rank)
    messages = {}
    for name, call in {"twice": lambda: engine.compile(backend=BACKEND),
                       "schedule": lambda: build("eager", rank).compile(schedule=[]),
                       "cudagraphs": lambda: build("eager", rank).compile(compile_kwargs={"mode": "reduce-overhead"}),
                       }.items():
        try:
            call()
            messages[name] = None
        except CompileError as exc:
            messages[name] = str(exc)
    return messages


FEATURES = {
    "accumulation": ({}, {"ga": 2}),
    "checkpoint_reentrant": ({"checkpointing": "reentrant"}, {}),
    "checkpoint_non_reentrant": ({"checkpointing": "non_reentrant"}, {}),
    "bf16": ({}, {"bf16": {"enabled": True}}),
    "offload": ({}, {"zero_optimization": {"offload_param": {"device": "cpu"},
                                           "offload_optimizer": {"device": "cpu"}}}),
}


def _features(rank: int) -> dict:
    """Each feature once, compiled (engine.compile) against the same run eager."""
    out = {}
    for name, (model_kwargs, config_extra) in FEATURES.items():
        for mode in ("eager", "engine"):
            _fresh_dynamo()
            engine = build(mode, rank, model=make_model(**model_kwargs), **config_extra)
            losses, counts = train(engine, rank, range(3))
            out[(name, mode)] = {"losses": losses, "params": parameters(engine), "graphs": counts,
                                 "breaks": graph_breaks(), "late_gathers": engine.late_gathers}
            engine.destroy()
    return out


def _inductor(rank: int) -> dict:
    """The default backend once: inductor's kernels against eager. With SGD: Adam's first steps
    move each element by about lr whatever its gradient's size, so fused kernels' rounding of
    a near-zero gradient would show as an lr-sized difference."""
    out = {}
    for mode in ("eager", "engine"):
        _fresh_dynamo()
        engine = build(mode, rank, backend="inductor", optimizer={"type": "SGD", "params": {"lr": 0.1}})
        losses, counts = train(engine, rank, range(3))
        out[mode] = {"losses": losses, "params": parameters(engine), "graphs": counts, "breaks": graph_breaks()}
        engine.destroy()
    return out


def _checks(rank: int, world_size: int, folder: str) -> dict:
    return {"parity": _parity(rank), "train_eval": _train_eval(rank), "resume": _resume(rank, folder),
            "foreign": _foreign_reads(rank), "refusals": _refusals(rank), "features": _features(rank),
            "inductor": _inductor(rank)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("compile_ckpt"))
    return run_ranks(_checks, 2, folder, timeout=600)


def _close(a: dict, b: dict, tol: float = TOL) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("mode", ["block", "wrapped", "engine"])
def test_compiled_trains_as_eager(results, mode):
    for rank_results in results:
        eager, compiled = rank_results["parity"]["eager"], rank_results["parity"][mode]
        assert compiled["is_compiled"] and not eager["is_compiled"]
        assert compiled["names"] == eager["names"]  # no `_orig_mod.` in the names: checkpoints match
        assert max(abs(a - b) for a, b in zip(compiled["losses"], eager["losses"])) <= TOL
        assert _close(compiled["params"], eager["params"]) <= TOL
        assert compiled["graphs"][0] == 0 < compiled["graphs"][-1]  # first calls eager, then compiled


@pytest.mark.parametrize("mode", ["block", "wrapped", "engine"])
def test_no_graph_break_and_no_recompile_after_first_steps(results, mode):
    for rank_results in results:
        compiled = rank_results["parity"][mode]
        assert compiled["breaks"] == {}
        # units run eagerly on their first call, compiled from the second: all compiled by step 2
        assert compiled["graphs"][1] == compiled["graphs"][-1], compiled["graphs"]
        # one graph per kind of unit: embedding, the blocks (one class, one graph), norm, head
        assert compiled["graphs"][-1] <= 4


def test_train_eval_switches_compile_each_mode_once(results):
    for rank_results in results:
        counts = rank_results["train_eval"]["graphs"]  # train, eval, train, eval, train
        assert rank_results["train_eval"]["breaks"] == {}
        assert counts[1] > counts[0]  # eval (no grad) is a graph of its own ...
        assert counts[2] == counts[3] == counts[4] == counts[1], counts  # ... compiled once


def test_resume_into_fresh_compiled_engine_is_exact_and_compiles_nothing_new(results):
    for rank_results in results:
        uninterrupted, resumed = rank_results["parity"]["engine"], rank_results["resume"]
        assert resumed["losses"] == uninterrupted["losses"][2:]
        assert _close(resumed["params"], uninterrupted["params"]) == 0.0
        assert resumed["breaks"] == {}
        assert resumed["new_graphs"][0] == resumed["new_graphs"][-1], resumed["new_graphs"]


@pytest.mark.parametrize("when", ["always", "late"])
def test_parameter_read_outside_its_module(results, when):
    for rank_results in results:
        eager, compiled = rank_results["foreign"][(when, "eager")], rank_results["foreign"][(when, "engine")]
        assert max(abs(a - b) for a, b in zip(compiled["losses"], eager["losses"])) <= TOL
        assert _close(compiled["params"], eager["params"]) <= TOL
        if when == "always":  # discovered by each block's first (eager) call, then compiled
            assert compiled["fallbacks"] == [] and compiled["breaks"] == {}
        else:  # first read in a compiled call: that block runs eagerly from then on
            assert compiled["fallbacks"] == ["blocks.0", "blocks.1"]


def test_engine_compile_refusals(results):
    messages = results[0]["refusals"]
    assert "compiled already" in messages["twice"]
    assert "DeepCompile" in messages["schedule"]
    assert "max-autotune-no-cudagraphs" in messages["cudagraphs"]


@pytest.mark.parametrize("feature", list(FEATURES))
def test_features_compiled_train_as_eager(results, feature):
    for rank_results in results:
        eager = rank_results["features"][(feature, "eager")]
        compiled = rank_results["features"][(feature, "engine")]
        tol = 1e-2 if feature == "bf16" else TOL  # bf16: fused kernels round differently
        assert max(abs(a - b) for a, b in zip(compiled["losses"], eager["losses"])) <= tol
        assert _close(compiled["params"], eager["params"]) <= tol
        assert compiled["breaks"] == {}
        assert 0 < compiled["graphs"][1] == compiled["graphs"][-1], compiled["graphs"]
        assert compiled["late_gathers"] == eager["late_gathers"]


def test_inductor_backend_trains_as_eager(results):
    for rank_results in results:
        eager, compiled = rank_results["inductor"]["eager"], rank_results["inductor"]["engine"]
        assert max(abs(a - b) for a, b in zip(compiled["losses"], eager["losses"])) <= TOL
        assert _close(compiled["params"], eager["params"]) <= TOL
        assert compiled["breaks"] == {} and compiled["graphs"][-1] > 0
