"""DeepSpeed ALST's tiled compute under zero3's contract, in one process (no engine):
`TiledMLP`, `sequence_tiled_compute` and `TiledFusedLogitsLoss` give the untiled outputs and
gradients (fp32, within 1e-6), and each parameter's gradient reaches autograd once, whole,
after the last tile (its post-accumulate-grad hook, zero3's reduce-scatter, fires once);
gradient accumulation's scale on the loss reaches the parameters' gradients too."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zero3.runtime.sequence_parallel.ulysses_sp import (
    SequenceTiledCompute,  # noqa: F401  (the path DeepSpeed scripts import)
    TiledFusedLogitsLoss,
    TiledMLP,
    sequence_tiled_compute,
)

HIDDEN, INNER, VOCAB = 16, 40, 97


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INNER, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INNER, bias=False)
        self.down_proj = nn.Linear(INNER, HIDDEN, bias=True)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def _hook_counts(module: nn.Module) -> dict[str, int]:
    counts = {name: 0 for name, _ in module.named_parameters()}
    for name, p in module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: counts.__setitem__(name, counts[name] + 1))
    return counts


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in module.named_parameters()}


@pytest.mark.parametrize("shards,shape", [(1, (2, 12)), (4, (2, 12)), (5, (1, 13)), (3, (13,))])
def test_tiled_mlp_equals_untiled_and_hands_each_gradient_over_once(shards, shape):
    torch.manual_seed(0)
    mlp = MLP()
    x = torch.randn(*shape, HIDDEN, requires_grad=True)
    weights = torch.randn(*shape, HIDDEN)
    (mlp(x) * weights).sum().backward()
    expected, expected_x = _grads(mlp), x.grad.clone()
    mlp.zero_grad(set_to_none=True)
    x.grad = None
    counts = _hook_counts(mlp)
    out = TiledMLP.apply(lambda self, t: self(t), mlp, x, shards, list(mlp.parameters()))
    torch.testing.assert_close(out, mlp(x), rtol=1e-6, atol=1e-6)
    (out * weights).sum().backward()
    for name, grad in _grads(mlp).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, expected_x, rtol=1e-6, atol=1e-6)
    assert set(counts.values()) == {1}, counts


def _ce(head: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(head(x).float(), y, ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("shards,reduction,scale", [(1, "sum", 1.0), (3, "sum", 0.25), (4, "mean", 1.0)])
def test_tiled_fused_logits_loss_equals_untiled(shards, reduction, scale):
    torch.manual_seed(1)
    head = nn.Linear(HIDDEN, VOCAB, bias=False)
    x = torch.randn(2, 10, HIDDEN, requires_grad=True)
    y = torch.randint(0, VOCAB, (2, 10))
    y[0, :3] = -100
    flat_x, flat_y = x.reshape(-1, HIDDEN), y.reshape(-1)
    if reduction == "sum":
        reference = _ce(head, flat_x, flat_y)
    else:  # the mean over tiles of each tile's sum
        reference = torch.stack([_ce(head, a, b) for a, b in zip(flat_x.chunk(shards), flat_y.chunk(shards))]).mean()
    (reference * scale).backward()
    expected, expected_x = _grads(head), x.grad.clone()
    head.zero_grad(set_to_none=True)
    x.grad = None
    counts = _hook_counts(head)
    loss = TiledFusedLogitsLoss.apply(_ce, head, x, y, None, shards, [head.weight], reduction)
    assert counts == {"weight": 0}, "no gradient may reach the parameters before backward"
    torch.testing.assert_close(loss, reference.detach(), rtol=0, atol=1e-5)
    (loss * scale).backward()  # an accumulation divisor on the loss reaches the parameters too
    torch.testing.assert_close(head.weight.grad, expected["weight"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, expected_x, rtol=1e-6, atol=1e-6)
    assert counts == {"weight": 1}


def test_tiled_fused_logits_loss_with_a_mask_and_frozen_head():
    torch.manual_seed(2)
    head = nn.Linear(HIDDEN, VOCAB, bias=False).requires_grad_(False)
    x = torch.randn(1, 9, HIDDEN, requires_grad=True)
    y = torch.randint(0, VOCAB, (1, 9))
    mask = torch.rand(1, 9) > 0.3

    def masked(head, a, b, m):
        return (nn.functional.cross_entropy(head(a).float(), b, reduction="none") * m).sum()

    masked(head, x.reshape(-1, HIDDEN), y.reshape(-1), mask.reshape(-1)).backward()
    expected_x = x.grad.clone()
    x.grad = None
    TiledFusedLogitsLoss.apply(masked, head, x, y, mask, 4, [], "sum").backward()
    torch.testing.assert_close(x.grad, expected_x, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("reduction,unshard", [(None, 1), ("mean", 1), ("sum", 0), ("mean", 0)])
def test_sequence_tiled_compute_equals_untiled(reduction, unshard):
    torch.manual_seed(3)
    mlp = MLP()
    x = torch.randn(2, 12, HIDDEN, requires_grad=True)
    bias = torch.randn(HIDDEN)
    shards = 3

    def fn(hidden_states, bias):
        out = mlp(hidden_states) + bias
        return out.pow(2).mean() if unshard == 0 else out

    if unshard == 0:
        tiles = [fn(t, bias) for t in x.chunk(shards, dim=1)]
        reference = torch.stack(tiles).mean() if reduction == "mean" else torch.stack(tiles).sum()
    else:
        full = fn(x, bias)
        reference = full if reduction is None else full.mean()
    weights = torch.randn_like(reference)
    (reference * weights).sum().backward()
    expected, expected_x = _grads(mlp), x.grad.clone()
    mlp.zero_grad(set_to_none=True)
    x.grad = None
    counts = _hook_counts(mlp)
    out = sequence_tiled_compute(fn, 12, shards, {"hidden_states": x}, {"bias": bias}, "hidden_states",
                                 compute_params=None, output_unshard_dimension=unshard, output_reduction=reduction)
    torch.testing.assert_close(out, reference.detach(), rtol=1e-6, atol=1e-6)
    (out * weights).sum().backward()
    for name, grad in _grads(mlp).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, expected_x, rtol=1e-6, atol=1e-6)
    assert set(counts.values()) == {1}, counts


def test_bad_arguments_are_clear_errors():
    head = nn.Linear(HIDDEN, VOCAB)
    x, y = torch.randn(1, 4, HIDDEN), torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="output_reduction"):
        TiledFusedLogitsLoss.apply(_ce, head, x, y, None, 2, [], "max")
    with pytest.raises(ValueError, match=r"agree on \[batch, seq\]"):
        TiledFusedLogitsLoss.apply(_ce, head, x, y[:, :3], None, 2, [], "sum")
    with pytest.raises(ValueError, match="shards"):
        TiledMLP.apply(lambda self, t: self(t), MLP(), torch.randn(4, HIDDEN), 0, [])
    with pytest.raises(ValueError, match="grad_requiring_tensor_key"):
        sequence_tiled_compute(lambda a: a, 4, 2, {"a": x}, {}, "b")
