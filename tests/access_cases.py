"""Access patterns: the shared machinery of tests/params/test_access_*.py.

Each pattern is a *case*: a small model, the micro-step it runs (which may also evaluate,
generate, or call backward twice) and a config, registered with `case(...)` by the test
module of its family (reads, adapters, control_flow, modes, gathered). `check_cases` trains
it on 2 or 4 gloo ranks for STEPS optimizer steps, saves, loads into a fresh engine built
from different initial weights, trains STEPS more, and compares every recorded value
(losses, eval losses, generated tokens) and the final weights with plain single-process
PyTorch on the same global batches (fp32, 1e-5 relative), and asserts the engine's
`late_gathers` counter (0 wherever the pattern is ordinary).

Plain PyTorch's step semantics are the reference: the gradient of a micro-step is the
mean over ranks, a parameter that got no gradient in a step is not stepped, and clipping
is by the global norm (coefficient clip / (norm + 1e-6)).

The same cases run against DeepSpeed 0.19.8 in tests/deepspeed_compare/run_patterns.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from harness import run_ranks
from torch import nn

STEPS = 3  # optimizer steps before the save, and again after the load
MICRO = 4  # samples per rank and micro-step
LR = 1e-2


# ============================================================================ drivers
class Driver:
    """One rank's view of a training micro-step, for an engine or for plain PyTorch.

    `forward`/`backward` are the engine's (zero3 or DeepSpeed) or, for the reference, the
    plain module's with the loss divided by the world size (the engine averages over
    ranks). `gathered(params, modifier_rank)` is GatheredParameters or a no-op.
    """

    def __init__(self, module: nn.Module, forward: Callable, backward: Callable, rank: int, world: int,
                 gathered: Callable, plain: bool) -> None:
        self.module, self.forward, self._backward = module, forward, backward
        self.rank, self.world, self.gathered, self.plain = rank, world, gathered, plain

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        self._backward(loss, retain_graph)

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)


def engine_driver(engine, rank: int, world: int, gathered_cls) -> Driver:
    return Driver(engine.module, engine, lambda loss, rg: engine.backward(loss, retain_graph=rg), rank, world,
                  gathered_cls, plain=False)


def plain_driver(model: nn.Module, rank: int, world: int) -> Driver:
    return Driver(model, model, lambda loss, rg: (loss / world).backward(retain_graph=rg), rank, world,
                  lambda params, modifier_rank=None: contextlib.nullcontext(), plain=True)


# ============================================================================ data
def regression_batch(step: int, rank: int, inputs: int = 6, outputs: int = 3):
    g = torch.Generator().manual_seed(10_000 + 100 * step + rank)
    return torch.randn(MICRO, inputs, generator=g), torch.randn(MICRO, outputs, generator=g)


def token_batch(step: int, rank: int, vocab: int = 11, length: int = 5):
    g = torch.Generator().manual_seed(20_000 + 100 * step + rank)
    tokens = torch.randint(0, vocab, (MICRO, length + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def simple_step(driver: Driver, step: int, rank: int, world: int) -> list[float]:
    """The ordinary micro-step: forward on this rank's batch, backward."""
    x, y = regression_batch(step, rank)
    loss = driver(x, y)
    driver.backward(loss)
    return [loss.item()]


# ============================================================================ cases
@dataclasses.dataclass(frozen=True)
class Case:
    """A model, its micro-step and config; see the module docstring."""

    build: Callable[[], nn.Module]
    step: Callable[[Driver, int, int, int], list[float]] = simple_step
    threshold: int = 0  # stage3_param_persistence_threshold
    zero: dict = dataclasses.field(default_factory=dict)  # more zero_optimization keys
    clip: float = 0.0
    late: int = 0  # expected late_gathers of the whole run (both engines)
    prepare: Callable[[nn.Module, str], None] | None = None  # (model, framework), before initialize
    before: Callable[[Driver, int], None] | None = None  # once per optimizer step, before it
    bf16: bool = False
    home: str = ""  # the test module that registered the case (imported by the ranks)

    def config(self) -> dict:
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": self.clip,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": self.threshold, **self.zero},
        }
        if self.bf16:
            config["bf16"] = {"enabled": True}
        return config


CASES: dict[str, Case] = {}


def case(name: str, **kwargs) -> None:
    """Register a case; called at import time by the test module of its family."""
    CASES[name] = Case(home=inspect.currentframe().f_back.f_globals["__name__"], **kwargs)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)


def build_seeded(c: Case, seed: int, framework: str = "zero3") -> nn.Module:
    torch.manual_seed(seed)
    model = c.build()
    if c.prepare is not None:
        c.prepare(model, framework)
    return model


# ============================================================================ shared models
class TinyLM(nn.Module):
    """Next-token model; in eval mode the logits are tempered (train and eval differ)."""

    def __init__(self, vocab: int = 11, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.block = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens, targets=None):
        h = self.embed(tokens)
        h = self.norm(h + torch.tanh(self.block(h)))
        logits = self.head(h) / (1.0 if self.training else 2.0)
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x, y):
        return F.mse_loss(self.head(torch.tanh(self.mid(torch.tanh(self.inp(x))))), y)


# ============================================================================ running
def run_case(name: str, rank: int, world: int, folder: str, framework: str = "zero3") -> dict[str, Any]:
    """Train STEPS, save, load into a fresh engine (other initial weights), train STEPS."""
    c = CASES[name]
    values: list[list[float]] = []
    late = 0
    engine = initialize(build_seeded(c, 0, framework), c, framework)
    for step in range(STEPS):
        values.append(engine_step(engine, c, step, rank, world, framework))
    engine.save_checkpoint(folder, tag=name)
    late += getattr(engine, "late_gathers", 0)
    engine.destroy()
    engine = initialize(build_seeded(c, 1, framework), c, framework)
    engine.load_checkpoint(folder, tag=name)
    for step in range(STEPS, 2 * STEPS):
        values.append(engine_step(engine, c, step, rank, world, framework))
    late += getattr(engine, "late_gathers", 0)
    state = full_state(engine, framework)
    engine.destroy()
    return {"values": values, "late": late, "state": state if rank == 0 else None}


def initialize(model: nn.Module, c: Case, framework: str):
    if framework == "zero3":
        import zero3 as ds
    else:
        import deepspeed as ds
    config = c.config()
    if framework != "zero3":
        config["zero_allow_untested_optimizer"] = True
    engine, _, _, _ = ds.initialize(model=model, optimizer=make_optimizer(model), config=config)
    return engine


def gathered_class(framework: str):
    if framework == "zero3":
        import zero3

        return zero3.GatheredParameters
    import deepspeed

    return deepspeed.zero.GatheredParameters


def engine_step(engine, c: Case, step: int, rank: int, world: int, framework: str) -> list[float]:
    driver = engine_driver(engine, rank, world, gathered_class(framework))
    if c.before is not None:
        c.before(driver, step)
    values = c.step(driver, step, rank, world)
    engine.step()
    return values


def full_state(engine, framework: str) -> dict[str, torch.Tensor]:
    if framework == "zero3":
        from zero3.checkpoint.export import consolidated_state_dict

        return consolidated_state_dict(engine)
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def reference(name: str, world: int) -> dict[str, Any]:
    """The same global batches in one process, plain PyTorch's step semantics: a parameter
    that got no gradient in a step (`.grad` None) is not stepped (DeepSpeed 0.19.8 steps it
    with a zero gradient: momentum and weight decay still move it)."""
    c = CASES[name]
    torch.manual_seed(0)
    model = c.build()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(model)
    values: list[list[float]] = []
    for step in range(2 * STEPS):
        if c.before is not None:
            c.before(plain_driver(model, 0, world), step)
        recorded: list[float] = []
        for rank in range(world):
            recorded.extend(c.step(plain_driver(model, rank, world), step, rank, world))
        values.append(recorded)
        if c.clip > 0:
            torch.nn.utils.clip_grad_norm_(trainable, c.clip)
        optimizer.step()
        optimizer.zero_grad()
    return {"values": values, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def cases_worker(rank: int, world: int, names: list[str], folder: str, framework: str = "zero3",
                 homes: tuple[str, ...] = ()):
    for home in homes:  # a fresh rank registers the cases by importing their test modules
        importlib.import_module(home)
    torch.use_deterministic_algorithms(True)
    return {name: run_case(name, rank, world, f"{folder}/{name}", framework) for name in names}


def assert_values_match(label: str, per_rank: list[list[list[float]]], expected: list[list[float]],
                        engine: str = "zero3") -> None:
    """per_rank[r][step]: rank r's values; expected[step]: plain PyTorch's, ranks in order."""
    assert all(len(values) == len(expected) for values in per_rank), f"{label}: step counts differ"
    for step, ref in enumerate(expected):
        got = [v for values in per_rank for v in values[step]]
        assert len(got) == len(ref), f"{label} step {step}: {len(got)} values, plain PyTorch {len(ref)}"
        for i, (a, b) in enumerate(zip(got, ref)):
            assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7), (
                f"{label}, step {step} ({'after' if step >= STEPS else 'before'} the resume), "
                f"value {i}: {engine} {a!r}, plain PyTorch {b!r}")


def assert_matches_reference(name: str, world: int, results: list[dict]) -> None:
    expected = reference(name, world)
    per_rank = [r[name] for r in results]
    assert_values_match(f"{name}, {world} ranks", [r["values"] for r in per_rank], expected["values"])
    state = per_rank[0]["state"]
    assert set(state) == set(expected["state"]), f"{name}: state names differ"
    for key, ref in expected["state"].items():
        torch.testing.assert_close(state[key], ref, rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")
    lates = [r["late"] for r in per_rank]
    assert lates == [CASES[name].late] * world, f"{name}: late_gathers per rank {lates}, expected {CASES[name].late}"


def check_cases(names: list[str], world: int, folder) -> None:
    homes = tuple(sorted({CASES[name].home for name in names}))
    results = run_ranks(cases_worker, world, names, str(folder), "zero3", homes)
    for name in names:
        assert_matches_reference(name, world, results)


WORLDS = [2, 4]
