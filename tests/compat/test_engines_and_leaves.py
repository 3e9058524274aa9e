"""DeepSpeed's tests of several engines in one process, leaf modules declared in the config
and gradients changed through the local fragment API, checked on zero3 (2 ranks, one launch)."""

from __future__ import annotations

import torch
from common import config, make_batches, make_model
from harness import run_ranks

MICRO = 2


class Alternating(torch.nn.Module):
    """Uses one of its two layers per call, alternating: trains only as one leaf unit."""

    def __init__(self) -> None:
        super().__init__()
        self.linears = torch.nn.ModuleList(torch.nn.Linear(8, 8, bias=False) for _ in range(2))
        self.calls = 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.linears[self.calls % 2](x)
        self.calls += 1
        return torch.nn.functional.mse_loss(out, y)


def _engines(shared: bool, rank: int, world: int) -> list[dict]:
    import zero3
    from zero3.utils import safe_get_full_fp32_param

    engines = []
    for seed in range(2):
        model = make_model(seed=seed)
        engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(), config={
            **config(MICRO, 1), "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}})
        engines.append(engine)
    x, y = make_batches(world, MICRO)[rank]
    losses = [engine.module(x, y) / (i + 1) for i, engine in enumerate(engines)]
    if shared:
        sum(losses).backward()  # one backward through both engines' models
    else:
        for engine, loss in zip(engines, losses):
            engine.backward(loss)
    for engine in engines:
        engine.step()
        engine.optimizer.zero_grad()
    result = [{n: safe_get_full_fp32_param(p) for n, p in e.module.named_parameters() if p.requires_grad}
              for e in engines]
    for engine in engines:
        engine.destroy()
    return result


def _checks(rank: int, world: int) -> dict:
    import zero3
    from zero3.utils import safe_get_local_grad, safe_set_local_grad, z3_leaf_module

    out = {"shared": _engines(True, rank, world), "separate": _engines(False, rank, world)}
    # a leaf declared in the config by its fully qualified class name, names as a plain string;
    # inputs that do not require grad
    cfg = config(MICRO, 1, threshold=0)
    cfg["zero_optimization"]["leaf_module"] = {"classes": f"{Alternating.__module__}.Alternating", "names": "linears"}
    torch.manual_seed(0)
    model = Alternating()
    engine, *_ = zero3.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), config=cfg)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(4):
        x, y = torch.randn(MICRO, 8, generator=g), torch.randn(MICRO, 8, generator=g)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    out["leaf"] = (z3_leaf_module(model), z3_leaf_module(model.linears), losses)
    # clip each local gradient fragment, then step: the engine's norm is the clipped gradients'
    x, y = torch.randn(MICRO, 8, generator=g), torch.randn(MICRO, 8, generator=g)
    engine.backward(engine(x, y) * 100.0)
    squares = torch.zeros(())
    for p in model.parameters():
        clipped = safe_get_local_grad(p).clamp(-0.01, 0.01)
        safe_set_local_grad(p, clipped)
        squares += clipped.double().square().sum()
    torch.distributed.all_reduce(squares)
    engine.step()
    out["clipped_norm"] = (engine.get_global_grad_norm(), squares.sqrt().item())
    return out


def test_several_engines_leaf_modules_and_local_gradients():
    for out in run_ranks(_checks, 2):
        for shared, separate in zip(out["shared"], out["separate"]):
            for name in separate:  # one backward through both equals a backward each
                assert torch.allclose(shared[name], separate[name], rtol=0, atol=1e-7), name
        is_leaf, inner_leaf, losses = out["leaf"]
        assert is_leaf and inner_leaf and len(set(losses)) == 4
        norm, expected = out["clipped_norm"]
        assert abs(norm - expected) < 1e-5 * expected, (norm, expected)
