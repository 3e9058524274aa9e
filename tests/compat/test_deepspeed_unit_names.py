"""Three of DeepSpeed 0.19.8's own tests (tests/unit/...) under their upstream class and test
names, their scenarios rebuilt on zero3 (real gloo processes, one launch per class):

- runtime/test_ds_initialize.py::TestClientLrScheduler: a client scheduler (config section,
  instance, factory) with a client optimizer (config section, instance, factory). A scheduler
  instance comes back as the same object and drives the engine's optimizer, even when it was
  built on another optimizer; a factory is called with the engine's optimizer; the config's
  section gives DeepSpeed's WarmupLR. An old-style `_LRScheduler` without an optimizer instance
  is refused with DeepSpeed's AssertionError.
- runtime/zero/test_zero_leaf_module.py::TestSetZ3LeafModule::test_no_grad_input_error: a leaf
  module fed inputs that do not require grad. DeepSpeed raises RuntimeError there, because its
  gradient reduction hangs on the inputs' gradients; zero3 reduces on the parameters' own
  gradient hooks, so it trains, and the test shows the parameters equal a plain run's.
- v1/zero/test_zero_user_backward.py::TestZeroUserBackwardGradAccumulation::
  test_grad_accumulation[3]: `loss.backward()` over 4 micro-steps in bf16 against DDP's sums.
  With `data_types.grad_accum_dtype: "bf16"` (DeepSpeed's default: the model's dtype) zero3's
  gradients are DDP's bit for bit; without the key zero3 keeps its fp32 accumulation, whose
  gradients are the exact fp32 sums of the same averaged bf16 micro-gradients.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks

SCHEDULERS = ("config", "instance", "factory")
OPTIMIZERS = ("config", "instance", "factory")


def _lambda(epoch: int) -> float:
    return epoch // 10


def client_scheduler_outcomes(rank: int, world: int) -> dict:
    import zero3
    from torch.optim import Optimizer
    from torch.optim.lr_scheduler import LambdaLR, _LRScheduler

    from zero3.runtime.lr_schedules import WarmupLR

    outcomes = {}
    for sched in SCHEDULERS:
        for opt in OPTIMIZERS:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 10))
            cfg: dict = {"train_batch_size": 1}
            client_opt = None
            if opt == "config":
                cfg["optimizer"] = {"type": "Adam"}
            elif opt == "instance":
                client_opt = torch.optim.Adam(model.parameters())
            else:
                client_opt = lambda params: torch.optim.AdamW(params=params)  # noqa: E731
            client_sched = None
            if sched == "config":
                cfg["scheduler"] = {"type": "WarmupLR", "params": {}}
            elif sched == "instance":  # on the client's optimizer, or on one the engine never sees
                on = client_opt if isinstance(client_opt, Optimizer) else torch.optim.Adam(model.parameters())
                client_sched = LambdaLR(on, _lambda)
            else:
                client_sched = lambda optimizer: LambdaLR(optimizer, _lambda)  # noqa: E731
            engine, optimizer, _, returned = zero3.initialize(model=model, model_parameters=list(model.parameters()),
                                                             optimizer=client_opt, lr_scheduler=client_sched, config=cfg)
            driven = getattr(returned, "optimizer", None)
            outcomes[(sched, opt)] = {
                "warmup": isinstance(returned, WarmupLR), "same": returned is client_sched,
                "lambda": isinstance(returned, LambdaLR),
                "drives_engine": driven is optimizer or driven is getattr(optimizer, "optimizer", None)}
            engine.destroy()

    class OldStyle(_LRScheduler):
        def get_lr(self):
            return [group["lr"] for group in self.optimizer.param_groups]

    model = torch.nn.Linear(10, 10)
    try:
        zero3.initialize(model=model, config={"train_batch_size": 1, "optimizer": {"type": "Adam"}},
                         lr_scheduler=OldStyle(torch.optim.Adam(model.parameters())))
        outcomes["old_style"] = "accepted"
    except AssertionError as exc:  # zero3's EngineUsageError is one, as DeepSpeed's assert is
        outcomes["old_style"] = type(exc).__name__
    return outcomes


@pytest.fixture(scope="module")
def scheduler_outcomes():
    return run_ranks(client_scheduler_outcomes, 1)[0]


@pytest.mark.parametrize("scheduler_type", SCHEDULERS)
@pytest.mark.parametrize("optimizer_type", OPTIMIZERS)
class TestClientLrScheduler:
    def test(self, scheduler_outcomes, scheduler_type, optimizer_type):
        seen = scheduler_outcomes[(scheduler_type, optimizer_type)]
        if scheduler_type == "config":
            assert seen["warmup"], seen
        elif scheduler_type == "instance":
            assert seen["same"] and seen["drives_engine"], seen
        else:
            assert seen["lambda"] and seen["drives_engine"], seen


def test_old_style_scheduler_without_an_optimizer_instance_is_deepspeeds_assertion(scheduler_outcomes):
    assert scheduler_outcomes["old_style"] == "EngineUsageError"  # caught above as AssertionError


class ChooseByCounter(torch.nn.Module):
    """DeepSpeed's ChooseModuleByCounter: each forward uses the next of two layers, so the
    module must be a leaf (its parameters are gathered together)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linears = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden, bias=False) for _ in range(2))
        self.loss = torch.nn.CrossEntropyLoss()
        self.counter = 0

    def forward(self, x, y):
        x = torch.relu(self.linears[self.counter % 2](x))
        self.counter += 1
        return x, self.loss(x, y)


HIDDEN, LEAF_STEPS = 16, 4


def _leaf_batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(1, HIDDEN, generator=g), torch.randint(0, HIDDEN, (1,), generator=g))
            for _ in range(LEAF_STEPS * world)]


def leaf_without_input_grad(rank: int, world: int) -> dict:
    import zero3
    from zero3.utils import safe_get_full_fp32_param, set_z3_leaf_modules, z3_leaf_module

    out = {}
    torch.manual_seed(0)
    model = ChooseByCounter(HIDDEN)
    set_z3_leaf_modules(model, [ChooseByCounter])
    out["leaf"] = z3_leaf_module(model)
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.5}}, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}}
    engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    batches = _leaf_batches(world)
    for step in range(LEAF_STEPS):
        x, y = batches[step * world + rank]
        x.requires_grad = False
        loss = engine(x, y)[1]
        engine.backward(loss)
        engine.step()
    out["params"] = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    # the upstream test's own settings (bf16, Adam at 1e-6): trains too
    torch.manual_seed(0)
    model = ChooseByCounter(HIDDEN)
    set_z3_leaf_modules(model, [ChooseByCounter])
    cfg = {**cfg, "optimizer": {"type": "Adam", "params": {"lr": 1e-6}}, "bf16": {"enabled": True}}
    engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses = []
    for step in range(LEAF_STEPS):
        x, y = batches[step * world + rank]
        loss = engine(x.bfloat16(), y)[1]
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    out["bf16_losses_finite"] = all(torch.isfinite(torch.tensor(losses)))
    engine.destroy()
    return out


def _plain_leaf_params(world: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = ChooseByCounter(HIDDEN)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    batches = _leaf_batches(world)
    for step in range(LEAF_STEPS):
        optimizer.zero_grad()
        counter = model.counter
        total = 0
        for rank in range(world):  # every rank's forward uses the same layer, as in the engine
            model.counter = counter
            x, y = batches[step * world + rank]
            total = total + model(x, y)[1] / world
        total.backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class TestSetZ3LeafModule:
    def test_no_grad_input_error(self):
        """zero3's answer to the upstream case: no error, and the run equals plain PyTorch."""
        results = run_ranks(leaf_without_input_grad, 2)
        expected = _plain_leaf_params(2)
        for seen in results:
            assert seen["leaf"] and seen["bf16_losses_finite"]
            for name, value in expected.items():
                torch.testing.assert_close(seen["params"][name], value, rtol=1e-6, atol=1e-7)


H, GAS, MICRO = 4, 4, 2


def _simple_model() -> torch.nn.Module:
    torch.manual_seed(42)
    return torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.Linear(H, H))


def _accumulation_batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(MICRO, H, generator=g), torch.randint(0, H, (MICRO,), generator=g))
            for _ in range(GAS * world)]


def user_backward_gradients(rank: int, world: int, accum_dtype: str | None) -> dict[str, torch.Tensor]:
    import zero3
    from zero3.utils import safe_get_full_grad

    model = _simple_model()
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "bf16": {"enabled": True}}
    if accum_dtype is not None:
        cfg["data_types"] = {"grad_accum_dtype": accum_dtype}
    engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    batches = _accumulation_batches(world)
    grads = {}
    for micro in range(GAS):
        x, y = batches[micro * world + rank]
        loss = torch.nn.functional.cross_entropy(engine(x.bfloat16()), y)
        loss.backward()
        if engine.is_gradient_accumulation_boundary():
            grads = {n: safe_get_full_grad(p).float().clone() for n, p in engine.module.named_parameters()}
        engine.step()
    engine.destroy()
    return grads


def _ddp_sums(world: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """What DDP over a bf16 model accumulates, (loss / GAS).backward() a micro-step: each
    micro-step's gradients averaged over the ranks in bf16, then summed in bf16 (DDP's .grad)
    and, beside it, the same averaged bf16 gradients summed in fp32."""
    model = _simple_model().bfloat16()
    batches = _accumulation_batches(world)
    in_bf16 = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    in_fp32 = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in model.named_parameters()}
    for micro in range(GAS):
        per_rank = []
        for rank in range(world):
            x, y = batches[micro * world + rank]
            model.zero_grad()
            (torch.nn.functional.cross_entropy(model(x.bfloat16()), y) / GAS).backward()
            per_rank.append({n: p.grad.clone() for n, p in model.named_parameters()})
        for name in in_bf16:
            averaged = sum(g[name] for g in per_rank) / world
            in_bf16[name] += averaged
            in_fp32[name] += averaged.float()
    return in_bf16, in_fp32


@pytest.mark.parametrize("zero_stage", [3])
class TestZeroUserBackwardGradAccumulation:
    def test_grad_accumulation(self, zero_stage):
        ddp_bf16, fp32_sums = _ddp_sums(2)
        as_deepspeed = run_ranks(user_backward_gradients, 2, "bf16")
        default = run_ranks(user_backward_gradients, 2, None)
        for rank in range(2):
            for name, expected in ddp_bf16.items():  # the upstream comparison: fp32 tolerances
                torch.testing.assert_close(as_deepspeed[rank][name], expected.float())
                torch.testing.assert_close(default[rank][name], fp32_sums[name], rtol=0, atol=0)
        assert any(not torch.equal(default[0][n], ddp_bf16[n].float()) for n in ddp_bf16), \
            "the two accumulations should differ somewhere on this data, or the test shows nothing"
