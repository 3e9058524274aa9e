"""Issue 3: every way a model touches its parameters works under zero3, or fails clearly.

Each pattern is a *case*: a small model, the micro-step it runs (which may also evaluate,
generate, or call backward twice) and a config. `run_cases` trains it on 2 or 4 gloo
ranks for STEPS optimizer steps, saves, loads into a fresh engine built from different
initial weights, trains STEPS more, and the test compares every recorded value (losses,
eval losses, generated tokens) and the final weights with plain single-process PyTorch
on the same global batches (fp32, 1e-5 relative), and asserts the engine's
`late_gathers` counter (0 wherever the pattern is ordinary).

Plain PyTorch follows DeepSpeed's step semantics, which zero3 keeps: the gradient of a
micro-step is the mean over ranks, a trainable parameter unused in a step gets a zero
gradient (so AdamW still decays it), and clipping is by the global norm (coefficient
clip / (norm + 1e-6)).

The same cases run against DeepSpeed 0.19.8 in tests/deepspeed_compare/run_patterns.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from harness import run_ranks

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
    CASES[name] = Case(**kwargs)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)


def build_seeded(c: Case, seed: int, framework: str = "zero3") -> nn.Module:
    torch.manual_seed(seed)
    model = c.build()
    if c.prepare is not None:
        c.prepare(model, framework)
    return model


# ------------------------------------------------ 1. reads outside the module, before it runs
class Probes(nn.Module):
    """dtype / shape / device probes of a child's parameters before the child is called.

    `child.weight` (64 elements) is partitioned at threshold 20, `small.*` stay resident;
    `late.weight` is probed only from the first step after the resume.
    """

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.child = nn.Linear(8, 8)
        self.small = nn.Linear(8, 2)
        self.late = nn.Linear(2, 3)
        self.probe_late = False

    def forward(self, x, y):
        h = self.inp(x)
        h = h.to(self.child.weight.dtype)
        assert self.child.weight.shape == (8, 8) and self.child.weight.numel() == 64
        h = h.to(self.small.weight.device).to(self.small.bias.dtype)
        if self.probe_late:
            assert self.late.weight.shape == (3, 2)
            h = h.to(self.late.weight.dtype)
        h = self.small(torch.tanh(self.child(h)))
        return F.mse_loss(self.late(h), y)


def probe_after_resume(driver: Driver, step: int) -> None:
    driver.module.probe_late = step >= STEPS


case("probes_partitioned", build=Probes, threshold=0, before=probe_after_resume)
case("probes_resident_and_partitioned", build=Probes, threshold=20, before=probe_after_resume)


# ------------------------------------------------ 2. another module's weight, tied weights
class UsesOther(nn.Module):
    """A unit (it has a parameter of its own) that computes with another module's weight."""

    def __init__(self, other: nn.Linear) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))
        self._other = [other]  # a reference outside the module tree

    def forward(self, h):
        return h * self.scale + F.linear(h, self._other[0].weight)


class TiedLM(nn.Module):
    """Embedding tied to the lm head; `other` is never called, only its weight is used."""

    def __init__(self, vocab: int = 11, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.proj = nn.Linear(width, width)
        self.other = nn.Linear(width, width)
        self.mix = UsesOther(self.other)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, tokens, targets):
        h = torch.tanh(self.proj(self.embed(tokens)))
        h = h + F.linear(h, self.other.weight, self.other.bias)
        h = self.mix(h)
        logits = self.lm_head(h)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def token_step(driver: Driver, step: int, rank: int, world: int) -> list[float]:
    tokens, targets = token_batch(step, rank)
    loss = driver(tokens, targets)
    driver.backward(loss)
    return [loss.item()]


case("other_weight_and_tied", build=TiedLM, step=token_step, threshold=0)
# Clipping well below the gradient norm, so the tied gradient's share of it decides the step.
case("tied_with_clipping", build=TiedLM, step=token_step, threshold=10, clip=0.05)


# ------------------------------------------------ 3. one module called several times
class Repeated(nn.Module):
    """A shared layer in a loop, applied to two inputs at once, and repeated inside checkpoints."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.layer = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def twice(self, h):
        return self.layer(torch.tanh(self.layer(h)))

    def forward(self, x, y):
        h = self.inp(x)
        for _ in range(3):
            h = h + torch.tanh(self.layer(h))
        h = torch.tanh(self.layer(h)) * torch.tanh(self.layer(2 * h))  # two uses, one backward each
        h = checkpoint(self.twice, h, use_reentrant=True)
        h = checkpoint(self.twice, h, use_reentrant=False)
        return F.mse_loss(self.head(h), y)


case("shared_layer", build=Repeated, threshold=0)
case("shared_layer_resident_bias", build=Repeated, threshold=8)


# ------------------------------------------------ 4. checkpointing, frozen base + adapters
class AdapterBlock(nn.Module):
    """A frozen 8x8 base with a trainable 8-2-8 adapter (16 + 2 + 16 elements)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(8, 8, bias=False)
        self.base.weight.requires_grad_(False)
        self.adapter_A = nn.Linear(8, 2)
        self.adapter_B = nn.Linear(2, 8, bias=False)

    def forward(self, value):
        base = self.base(value)
        value = value.to(self.adapter_A.weight.dtype)
        return base + self.adapter_B(self.adapter_A(value))


class Adapters(nn.Module):
    """Adapter blocks under reentrant and non-reentrant checkpointing, and unchecked.

    The root owns a parameter used before the checkpointed blocks: its backward comes
    after the reentrant checkpoint's inner backward has ended.
    """

    def __init__(self) -> None:
        super().__init__()
        self.root_scale = nn.Parameter(torch.ones(8))
        self.inp = nn.Linear(6, 8)
        self.reentrant = AdapterBlock()
        self.non_reentrant = AdapterBlock()
        self.plain = AdapterBlock()
        self.head = nn.Linear(8, 3)

    def forward(self, x, y):
        h = self.inp(x) * self.root_scale
        h = checkpoint(self.reentrant, h, use_reentrant=True)
        h = checkpoint(self.non_reentrant, torch.tanh(h), use_reentrant=False)
        h = self.plain(torch.tanh(h))
        return F.mse_loss(self.head(h), y)


case("adapters_threshold_0", build=Adapters, threshold=0)
case("adapters_threshold_between", build=Adapters, threshold=8)  # biases resident, adapters not
case("adapters_threshold_above", build=Adapters, threshold=20)  # adapters resident, bases not


class SeedAdapterModel(nn.Module):
    """The seed: a checkpointed adapter block as the whole model; ones as input."""

    def __init__(self) -> None:
        super().__init__()
        self.adapter = AdapterBlock()

    def forward(self, value):
        return checkpoint(self.adapter, value, use_reentrant=True).square().mean()


def seed_step(driver: Driver, step: int, rank: int, world: int) -> list[float]:
    value = torch.ones(2, 8, requires_grad=True) * (1 + 0.1 * rank)
    loss = driver(value)
    driver.backward(loss)
    return [loss.item()]


case("seed_adapter_threshold_16", build=SeedAdapterModel, step=seed_step, threshold=16)


# ------------------------------------------------ 5. control flow changing between steps
class Branchy(nn.Module):
    """`sometimes` runs on two steps of three; `route` picks `a` or `b` from the data."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.sometimes = nn.Linear(8, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)

    def forward(self, x, y, flags):
        h = torch.tanh(self.inp(x))
        if flags[0] > 0:
            h = h + torch.tanh(self.sometimes(h))
        h = self.a(h) if flags[1] > 0 else self.b(h)
        return F.mse_loss(self.head(h), y)


def branchy_step(driver: Driver, step: int, rank: int, world: int) -> list[float]:
    x, y = regression_batch(step, rank)
    g = torch.Generator().manual_seed(step)  # the same on every rank
    flags = torch.tensor([step % 3 != 0, torch.rand((), generator=g) > 0.5])
    loss = driver(x, y, flags)
    driver.backward(loss)
    return [loss.item()]


case("changing_control_flow", build=Branchy, step=branchy_step, threshold=0)
case("changing_control_flow_resident", build=Branchy, step=branchy_step, threshold=8)


# ------------------------------------------------ 6. control flow that differs between ranks
class MoE(nn.Module):
    """An MoE-style block: each token goes to the expert its route names (ranks differ)."""

    def __init__(self, width: int = 8, experts: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(width, experts)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))

    def forward(self, h, route):
        weights = torch.softmax(self.gate(h), dim=-1)
        out = torch.zeros_like(h)
        for index, expert in enumerate(self.experts):
            mask = route == index
            if mask.any():
                out = out.index_add(0, mask.nonzero().flatten(),
                                    expert(h[mask]) * weights[mask, index:index + 1])
        return out


class MoEModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.moe = MoE()
        self.proj = nn.Linear(8, 32)
        self.head = nn.Linear(32, 3)

    def forward(self, x, y, route):
        h = torch.tanh(self.inp(x))
        h = h + self.moe(h, route)
        return F.mse_loss(self.head(torch.tanh(self.proj(h))), y)


def expert_route(step: int, rank: int, world: int) -> torch.Tensor:
    """Rank r sends its tokens to experts {r, r + 1} (mod 4) or, at 4 ranks, to expert r alone."""
    if world >= 4:
        return torch.full((MICRO,), rank % 4)
    return torch.tensor([(2 * rank + i % 2) % 4 for i in range(MICRO)])


def moe_step(driver: Driver, step: int, rank: int, world: int) -> list[float]:
    x, y = regression_batch(step, rank)
    loss = driver(x, y, expert_route(step, rank, world))
    driver.backward(loss)
    return [loss.item()]


def declare_moe_leaf(model: nn.Module, framework: str) -> None:
    if framework == "zero3":
        from zero3 import set_z3_leaf_modules
    else:
        from deepspeed.utils import set_z3_leaf_modules
    set_z3_leaf_modules(model, [MoE])


case("moe_set_z3_leaf_modules", build=MoEModel, step=moe_step, threshold=0, prepare=declare_moe_leaf)
# Granularity (elements // layers, DeepSpeed's): the MoE block 324 // 6 = 54, the whole model
# 767 // 10 = 76, childless modules never; so the threshold 60 makes the MoE block a leaf
# and nothing else (test_06_leaf_selection checks this).
MOE_GRANULARITY_THRESHOLD = 60
case("moe_granularity_threshold", build=MoEModel, step=moe_step, threshold=0,
     zero={"stage3_module_granularity_threshold": MOE_GRANULARITY_THRESHOLD})
case("moe_config_leaf_module", build=MoEModel, step=moe_step, threshold=0,
     zero={"leaf_module": {"classes": ["MoE"]}})


# ------------------------------------------------ 7. train / eval, generation under no_grad
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


def eval_and_generate_step(driver: Driver, step: int, rank: int, world: int) -> list[float]:
    tokens, targets = token_batch(step, rank)
    loss = driver(tokens, targets)
    driver.backward(loss)
    values = [loss.item()]
    driver.train(False)
    with torch.no_grad():
        eval_tokens, eval_targets = token_batch(step + 1000, rank)
        values.append(driver(eval_tokens, eval_targets).item())
        generated = eval_tokens[:1, :2]
        for _ in range(1 + step % 3):  # variable length, the same on every rank
            logits = driver(generated)
            generated = torch.cat([generated, logits[:, -1:].argmax(-1)], dim=1)
        values.extend(float(t) for t in generated.flatten())
        values.append(float(generated.shape[1]))
    driver.train(True)
    return values


case("eval_and_generation", build=TinyLM, step=eval_and_generate_step, threshold=0)
case("eval_and_generation_resident", build=TinyLM, step=eval_and_generate_step, threshold=16)


# ------------------------------------------------ 8. parameters in outputs; output types
@dataclasses.dataclass
class ValueAndBias:
    value: torch.Tensor
    bias: torch.Tensor


class SkipBiasAdd(nn.Module):
    """Returns (x @ W^T, its own bias), as Megatron's skip_bias_add layers do."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) / 3)
        self.bias = nn.Parameter(torch.randn(8) / 3)

    def forward(self, x):
        return F.linear(x, self.weight), self.bias


class DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return {"h": self.lin(x), "scale": self.scale}


class DataclassOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8, bias=False)
        self.bias = nn.Parameter(torch.randn(8) / 3)

    def forward(self, x):
        return ValueAndBias(value=self.lin(x), bias=self.bias)


class OutputsModel(nn.Module):
    """Uses returned parameters in ops that save them (mul), and returns one to the caller."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.skip = SkipBiasAdd()
        self.dict_out = DictOut()
        self.data_out = DataclassOut()
        self.head = nn.Linear(8, 3)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        value, bias = self.skip(h)
        h = torch.tanh(value + bias) * bias
        out = self.dict_out(h)
        h = out["h"] * out["scale"]
        both = self.data_out(h)
        h = torch.tanh(both.value) * both.bias
        return {"loss": F.mse_loss(self.head(h), y), "penalty_param": self.data_out.bias}


def outputs_step(driver: Driver, step: int, rank: int, world: int) -> list[float]:
    x, y = regression_batch(step, rank)
    out = driver(x, y)
    loss = out["loss"] + 0.01 * out["penalty_param"].square().sum()  # computed outside the model
    driver.backward(loss)
    return [loss.item()]


case("params_in_outputs", build=OutputsModel, step=outputs_step, threshold=0)


# ------------------------------------------------ 9. retain_graph, forward without backward
class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x, y):
        return F.mse_loss(self.head(torch.tanh(self.mid(torch.tanh(self.inp(x))))), y)


def retain_and_skip_step(driver: Driver, step: int, rank: int, world: int) -> list[float]:
    values = []
    if step % 2 == 1:
        x, y = regression_batch(step + 500, rank)
        values.append(driver(x, y).item())  # a micro-step skipped: never backpropagated
    x, y = regression_batch(step, rank)
    loss = driver(x, y)
    driver.backward(loss, retain_graph=True)
    driver.backward(loss)  # the same graph again: gradients add up
    values.append(loss.item())
    return values


case("retain_graph_and_skipped_forward", build=Small, step=retain_and_skip_step, threshold=0)


# ------------------------------------------------ 10. zero-size parameter
class WithEmpty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.empty = nn.Linear(8, 0)
        self.head = nn.Linear(8, 3)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        h = torch.cat([h, self.empty(h)], dim=-1)
        return F.mse_loss(self.head(h), y)


case("zero_size_parameter", build=WithEmpty, threshold=0)


# ------------------------------------------------ 11. GatheredParameters
def gathered_edits(driver: Driver, step: int) -> None:
    """At step 1: read everything, then rank 0 rewrites two parameters (one resident)."""
    if step != 1:
        return
    model = driver.module
    edited = [model.mid.weight, model.head.bias]
    with driver.gathered(edited, modifier_rank=0):
        if driver.plain or driver.rank == 0:
            with torch.no_grad():
                model.mid.weight.mul_(0.5).add_(0.25)
                model.head.bias.fill_(0.125)


case("gathered_parameters_modify", build=Small, threshold=3, before=gathered_edits)


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
        from zero3.export import consolidated_state_dict

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


def cases_worker(rank: int, world: int, names: list[str], folder: str, framework: str = "zero3"):
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
    results = run_ranks(cases_worker, world, names, str(folder))
    for name in names:
        assert_matches_reference(name, world, results)


WORLDS = [2, 4]


@pytest.mark.parametrize("world", WORLDS)
def test_01_reads_before_the_module_runs(world, tmp_path):
    check_cases(["probes_partitioned", "probes_resident_and_partitioned"], world, tmp_path)


@pytest.mark.parametrize("world", WORLDS)
def test_02_other_modules_weight_and_tied_weights(world, tmp_path):
    check_cases(["other_weight_and_tied", "tied_with_clipping"], world, tmp_path)


@pytest.mark.parametrize("world", WORLDS)
def test_03_module_called_several_times(world, tmp_path):
    check_cases(["shared_layer", "shared_layer_resident_bias"], world, tmp_path)


@pytest.mark.parametrize("world", WORLDS)
def test_04_checkpointing_frozen_base_and_adapters(world, tmp_path):
    check_cases(["adapters_threshold_0", "adapters_threshold_between", "adapters_threshold_above",
                 "seed_adapter_threshold_16"], world, tmp_path)


@pytest.mark.parametrize("world", WORLDS)
def test_05_control_flow_changing_between_steps(world, tmp_path):
    check_cases(["changing_control_flow", "changing_control_flow_resident"], world, tmp_path)


@pytest.mark.parametrize("world", WORLDS)
def test_06_rank_dependent_control_flow_in_a_leaf(world, tmp_path):
    """Each rank routes to different experts; the MoE block is a leaf three ways."""
    check_cases(["moe_set_z3_leaf_modules", "moe_granularity_threshold", "moe_config_leaf_module"], world, tmp_path)


@pytest.mark.parametrize("world", WORLDS)
def test_07_eval_and_generation_between_steps(world, tmp_path):
    check_cases(["eval_and_generation", "eval_and_generation_resident"], world, tmp_path)


@pytest.mark.parametrize("world", WORLDS)
def test_08_parameters_in_outputs(world, tmp_path):
    check_cases(["params_in_outputs"], world, tmp_path)


@pytest.mark.parametrize("world", WORLDS)
def test_09_retain_graph_and_skipped_forward(world, tmp_path):
    check_cases(["retain_graph_and_skipped_forward"], world, tmp_path)


@pytest.mark.parametrize("world", WORLDS)
def test_10_zero_size_parameter(world, tmp_path):
    check_cases(["zero_size_parameter"], world, tmp_path)


@pytest.mark.parametrize("world", WORLDS)
def test_11_gathered_parameters_modify(world, tmp_path):
    check_cases(["gathered_parameters_modify"], world, tmp_path)


# ============================================================================ 6. errors
def test_06_leaf_selection():
    """Which modules become leaves: declared, by threshold (DeepSpeed's granularity), by config."""
    import zero3
    from zero3.config import LeafModuleConfig
    from zero3.partition import ShardedParam
    from zero3.units import LeafModuleError, build_units, granularity, threshold_leaves

    model = MoEModel()
    values = granularity(model)
    assert (values[model], values[model.moe]) == (767 // 10, 324 // 6)
    assert threshold_leaves(model, MOE_GRANULARITY_THRESHOLD) == [model.moe]
    assert threshold_leaves(model, 100) == [model]  # parents first: the root itself
    assert threshold_leaves(model, 0) == []
    table = {p: ShardedParam(p, n, 0, 1, False, torch.device("cpu")) for n, p in model.named_parameters()}

    def leaf_names(**kwargs):
        return [u.name for u in build_units(model, table, **kwargs) if u.leaf]

    assert leaf_names(granularity_threshold=MOE_GRANULARITY_THRESHOLD) == ["moe"]
    assert leaf_names(granularity_threshold=0, leaf_module=LeafModuleConfig(classes=("MoE",))) == ["moe"]
    assert leaf_names(granularity_threshold=0, leaf_module=LeafModuleConfig(names=("moe",))) == ["moe"]
    assert leaf_names(granularity_threshold=0, leaf_module=LeafModuleConfig(name_suffixes=("oe",))) == ["moe"]
    # Nothing declared (the defaults name transformers' MoE classes): each ModuleList element
    # is gathered whole, the default fetch unit.
    assert leaf_names(granularity_threshold=0, leaf_module=LeafModuleConfig()) == [f"moe.experts.{i}" for i in range(4)]
    units = build_units(model, table, 0, leaf_module=LeafModuleConfig(classes=("MoE",)))
    moe = next(u for u in units if u.name == "moe")
    assert len(moe.params) == 2 + 2 * 4  # the gate and every expert, gathered as one
    assert [u.name for u in units] == ["<root>", "inp", "moe", "proj", "head"]
    fresh = MoEModel()
    assert zero3.set_z3_leaf_modules(fresh, ["MoE"]) == [fresh.moe]  # by class name, as DeepSpeed
    assert [u.name for u in build_units(fresh, {p: ShardedParam(p, n, 0, 1, False, torch.device("cpu"))
                                                for n, p in fresh.named_parameters()}, 0) if u.leaf] == ["moe"]
    with pytest.raises(LeafModuleError, match="no module of the classes"):
        zero3.set_z3_leaf_modules(fresh, [TinyLM])


def diverging_worker(rank: int, world: int, kind: str, propagate: bool = False):
    """One training step of a model whose control flow differs between ranks; the error text.

    With `propagate`, the DivergenceError is not caught (for runs where some rank dies).
    """
    import time

    import zero3
    from zero3.divergence import DivergenceError

    if kind == "experts":
        c = Case(build=MoEModel, step=moe_step, threshold=0)
    elif kind == "resident_module_skipped":
        c = Case(build=RankSkip, step=rank_skip_step, threshold=40)  # `extra` resident, `head` not
    else:
        c = Case(build=RankSkip, step=rank_skip_step, threshold=0)
    engine = initialize(build_seeded(c, 0), c, "zero3")
    driver = engine_driver(engine, rank, world, zero3.GatheredParameters)
    start = time.monotonic()
    try:
        c.step(driver, 0, rank, world)
    except DivergenceError as exc:
        if propagate:
            raise
        return str(exc), time.monotonic() - start
    raise AssertionError(f"rank {rank}: no DivergenceError")


class RankSkip(nn.Module):
    """`extra` (8x4 + 4) runs only on even ranks: a rank-dependent skip, no leaf to hold it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.extra = nn.Linear(8, 4)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x, y, use_extra: bool):
        h = torch.tanh(self.inp(x))
        if use_extra:
            h = h + torch.tanh(self.extra(h)).repeat(1, 2)
        return F.mse_loss(self.head(torch.tanh(self.mid(h))), y)


def rank_skip_step(driver: Driver, step: int, rank: int, world: int) -> list[float]:
    x, y = regression_batch(step, rank)
    loss = driver(x, y, rank % 2 == 0)
    driver.backward(loss)
    return [loss.item()]


@pytest.mark.parametrize("world", WORLDS)
def test_06_rank_dependent_experts_without_leaf_raise_naming_the_block(world):
    for message, seconds in run_ranks(diverging_worker, world, "experts", timeout=120):
        assert "ranks diverged" in message and "moe.experts." in message, message
        assert "zero3.set_z3_leaf_modules(model, [MoE])" in message and "'moe'" in message, message
        assert seconds < 20, seconds


@pytest.mark.parametrize("world", WORLDS)
def test_06_rank_skipping_a_resident_module_raises_naming_it(world):
    """`extra` is resident (it gathers nothing): the trace in the next gather's header tells."""
    for message, seconds in run_ranks(diverging_worker, world, "resident_module_skipped", timeout=120):
        assert "ranks diverged" in message and "entered 'extra'" in message, message
        assert seconds < 20, seconds


@pytest.mark.parametrize("world", WORLDS)
def test_06_rank_skipping_a_sharded_module_fails_fast_naming_it(world):
    """Gathers of different sizes: the ranks that received less raise DivergenceError naming
    `extra`; gloo aborts a rank that received more than it expected. Either way, no hang."""
    with pytest.raises(AssertionError) as failure:
        run_ranks(diverging_worker, world, "sharded_module_skipped", True, timeout=120, collective_timeout=30)
    text = str(failure.value)
    assert "did not finish" not in text, text
    assert "DivergenceError" in text and "unit 'extra'" in text, text


# ============================================================================ 10. attach after init
def attach_after_initialize_worker(rank: int, world: int):
    import warnings

    from zero3.late_params import LateParameterWarning

    c = Case(build=Small, threshold=0)
    engine = initialize(build_seeded(c, 0), c, "zero3")
    x, y = regression_batch(0, rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.module.extra = nn.Linear(8, 4)  # never called by the forward
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        engine.module.act = nn.Tanh()  # no parameters: nothing to report
        engine.module.head.bias = nn.Parameter(torch.zeros(3))  # a parameter replaced after initialize
        second = engine(x, y)
    messages = [str(w.message) for w in caught if issubclass(w.category, LateParameterWarning)]
    return messages, loss.item(), second.item(), engine.late_gathers


@pytest.mark.parametrize("world", WORLDS)
def test_10_module_attached_after_initialize_is_used_whole_and_named(world):
    """Decision: a parameter added after initialize is used as in plain PyTorch with an
    optimizer built before it (whole on every rank, not stepped), and rank 0 names it once
    with how to have it trained (tests/test_late_modules.py checks parity and checkpoints).
    Modules without parameters are attached silently."""
    results = run_ranks(attach_after_initialize_worker, world)
    torch.manual_seed(0)
    plain = Small()
    for rank, (messages, loss, second, late) in enumerate(results):
        if rank == 0:
            assert len(messages) == 2, messages
            assert "extra.weight (4, 8), extra.bias (4,)" in messages[0], messages[0]
            assert "before zero3.initialize" in messages[0], messages[0]
            assert "head.bias (3,)" in messages[1] and "extra" not in messages[1], messages[1]
        else:
            assert messages == []
        assert math.isclose(loss, plain(*regression_batch(0, rank)).item(), rel_tol=1e-6)
        assert math.isfinite(second) and late == 0


# ============================================================================ 11. misuse
def gathered_misuse_worker(rank: int, world: int):
    import zero3
    from zero3.export import consolidated_state_dict
    from zero3.gathered import GatheredParametersError

    c = Case(build=Small, threshold=3)  # head.bias resident, the rest partitioned
    engine = initialize(build_seeded(c, 0), c, "zero3")
    model = engine.module
    params = [model.mid.weight, model.head.bias]
    with zero3.GatheredParameters(params):
        read = [p.detach().clone() for p in params]
    # A change without modifier_rank, on the last rank only, to an element another rank owns.
    with pytest.raises(GatheredParametersError) as error:
        with zero3.GatheredParameters(params):
            if rank == world - 1:
                with torch.no_grad():
                    model.mid.weight[0, 0] += 1.0
                    model.head.bias.fill_(7.0)
    with zero3.GatheredParameters(params):
        after = [p.detach().clone() for p in params]
    resident_after = model.head.bias.detach().clone()  # outside any context: resident values
    loss = engine(*regression_batch(0, rank))
    state = consolidated_state_dict(engine)
    engine.destroy()

    # bf16: the fp32 master must take rank 0's new values too.
    c16 = Case(build=Small, threshold=3, bf16=True)
    engine = initialize(build_seeded(c16, 0), c16, "zero3")
    model = engine.module
    with zero3.GatheredParameters([model.mid.weight, model.head.bias], modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                model.mid.weight.fill_(0.375)
                model.head.bias.fill_(-0.5)
    masters = consolidated_state_dict(engine, use_master=True)
    compute = consolidated_state_dict(engine)
    x, y = regression_batch(0, rank)
    loss16 = engine(x.bfloat16(), y.bfloat16())
    return (str(error.value), read, after, resident_after, loss.item(), state if rank == 0 else None,
            masters if rank == 0 else None, compute if rank == 0 else None, math.isfinite(loss16.item()))


@pytest.mark.parametrize("world", WORLDS)
def test_11_gathered_parameters_read_and_misuse(world):
    torch.manual_seed(0)
    plain = Small()
    initial = [plain.mid.weight.detach(), plain.head.bias.detach()]
    results = run_ranks(gathered_misuse_worker, world)
    for rank, (message, read, after, resident, loss, state, masters, compute, finite) in enumerate(results):
        assert "modified inside GatheredParameters(modifier_rank=None)" in message, message
        assert "modifier_rank" in message and "mid.weight" in message, message
        for got, ref in zip(read + after, initial + initial):
            assert torch.equal(got, ref)  # full values on every rank; the refused change undone
        assert torch.equal(resident, initial[1])
        assert math.isclose(loss, plain(*regression_batch(0, rank)).item(), rel_tol=1e-6)
        assert finite
    state, masters, compute = results[0][5], results[0][6], results[0][7]
    for key, value in plain.state_dict().items():
        assert torch.equal(state[key], value), key
    assert torch.equal(masters["mid.weight"], torch.full((8, 8), 0.375))
    assert torch.equal(masters["head.bias"], torch.full((3,), -0.5))
    assert torch.equal(compute["mid.weight"], torch.full((8, 8), 0.375, dtype=torch.bfloat16))


# ============================================================================ 12. resume flows
RESUME_CASE = "adapters_threshold_between"  # resident and partitioned, both checkpoint kinds


def train_steps(engine, c: Case, steps, rank: int, world: int, framework: str = "zero3") -> list[list[float]]:
    return [engine_step(engine, c, step, rank, world, framework) for step in steps]


def resume_flows_worker(rank: int, world: int, folder: str, framework: str = "zero3"):
    c = CASES[RESUME_CASE]
    out: dict[str, Any] = {}
    full = lambda engine: full_state(engine, framework)  # noqa: E731

    # (a) saved before the first optimizer step
    engine = initialize(build_seeded(c, 0, framework), c, framework)
    engine.save_checkpoint(folder, tag="before_first_step")
    engine.destroy()
    engine = initialize(build_seeded(c, 1, framework), c, framework)
    engine.load_checkpoint(folder, tag="before_first_step")
    out["before_first_step"] = train_steps(engine, c, range(2 * STEPS), rank, world, framework)
    engine.destroy()

    # (b) saved right after a load, nothing in between
    engine = initialize(build_seeded(c, 0, framework), c, framework)
    first = train_steps(engine, c, range(STEPS), rank, world, framework)
    engine.save_checkpoint(folder, tag="a")
    engine.destroy()
    engine = initialize(build_seeded(c, 1, framework), c, framework)
    engine.load_checkpoint(folder, tag="a")
    loaded_a = full(engine)
    engine.save_checkpoint(folder, tag="b")
    engine.destroy()
    engine = initialize(build_seeded(c, 2, framework), c, framework)
    engine.load_checkpoint(folder, tag="b")
    same = full(engine)
    out["saved_after_load"] = first + train_steps(engine, c, range(STEPS, 2 * STEPS), rank, world, framework)
    engine.destroy()

    # (c) loaded into engines that already trained in this process: itself, and another
    engine = initialize(build_seeded(c, 0, framework), c, framework)
    first = train_steps(engine, c, range(STEPS), rank, world, framework)
    engine.save_checkpoint(folder, tag="c")
    train_steps(engine, c, range(100, 102), rank, world, framework)  # moves on, then goes back
    engine.load_checkpoint(folder, tag="c")
    out["reloaded_itself"] = first + train_steps(engine, c, range(STEPS, 2 * STEPS), rank, world, framework)
    other = initialize(build_seeded(c, 3, framework), c, framework)
    train_steps(other, c, range(200, 202), rank, world, framework)
    other.load_checkpoint(folder, tag="c")
    out["loaded_into_trained_other"] = first + train_steps(other, c, range(STEPS, 2 * STEPS), rank, world, framework)
    out["late"] = sum(getattr(e, "late_gathers", 0) for e in (engine, other))
    out["same_after_resave"] = (rank != 0) or all(torch.equal(loaded_a[k], same[k]) for k in loaded_a)
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_12_resume_flows(world, tmp_path):
    expected = reference(RESUME_CASE, world)["values"]
    results = run_ranks(resume_flows_worker, world, str(tmp_path))
    for flow in ("before_first_step", "saved_after_load", "reloaded_itself", "loaded_into_trained_other"):
        assert_values_match(f"{flow}, {world} ranks", [r[flow] for r in results], expected)
    assert [r["late"] for r in results] == [0] * world
    assert results[0]["same_after_resave"]  # what a re-save right after a load holds is what was loaded
