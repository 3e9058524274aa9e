"""A model whose parameters DeepSpeed's own zero.Init partitioned, given to zero3.initialize
where DeepSpeed cannot take part (engine_parts/deepspeed_adopt.py), on 2 gloo ranks in one
launch.

The parameters are put in the state DeepSpeed 0.19.8's zero.Init leaves them in (shape
(0,), `ds_shape`, `ds_numel`, `ds_tensor` holding the rank's padded slice, `ds_status`,
`ds_id`, `ds_zero_partition_world_size` as instance attributes). The adoption itself,
through DeepSpeed's gather, runs against real DeepSpeed in
tests/deepspeed_compare/adopt_zero_init.py (results in its RESULTS.md).
"""

from __future__ import annotations

import math
import sys

import torch
from common import config, make_batches, make_model
from harness import run_ranks

MICRO = 2


def _partition_as_deepspeed(model: torch.nn.Module, rank: int, partition_world: int) -> None:
    """Put every parameter of `model` in the state DeepSpeed's zero.Init leaves it in."""
    for index, (_, p) in enumerate(model.named_parameters()):
        flat = p.detach().reshape(-1)
        size = math.ceil(flat.numel() / partition_world) if flat.numel() else 0
        part = torch.zeros(size, dtype=p.dtype)
        mine = flat[rank * size:(rank + 1) * size]
        part[:mine.numel()] = mine
        p.ds_shape, p.ds_numel, p.ds_tensor = p.shape, p.numel(), part
        p.ds_status, p.ds_id, p.ds_persist = "NOT_AVAILABLE", index, False
        p.ds_zero_partition_world_size = partition_world
        p.data = torch.empty(0, dtype=p.dtype)


def _initialize(model: torch.nn.Module) -> str:
    """zero3.initialize on `model`: the error's class and message, or 'ok'."""
    import zero3

    try:
        zero3.initialize(model=model, config={**config(MICRO, 1), "optimizer": {"type": "AdamW",
                                                                               "params": {"lr": 1e-2}}})
    except Exception as exc:  # noqa: BLE001 - the error is what the test looks at
        return f"{type(exc).__name__}: {exc}"
    return "ok"


class _ZeroSize(torch.nn.Module):
    """A zero-size parameter (DeepSpeed's partition of it has shape (0,) too) and a layer."""

    def __init__(self) -> None:
        super().__init__()
        self.empty = torch.nn.Parameter(torch.empty(0))
        self.linear = torch.nn.Linear(13, 5)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.linear(x), y)


def _adoption_cases(rank: int, world: int) -> dict:
    import zero3
    from zero3.engine_parts.build import EngineError
    from zero3.engine_parts.deepspeed_adopt import DeepSpeedAdoptionError, find_deepspeed_partitioned

    out: dict = {}
    sys.modules["deepspeed"] = None  # DeepSpeed not importable in this process, installed or not
    model = make_model()
    names = [n for n, _ in model.named_parameters()]
    with zero3.zero.Init():
        own = make_model()
    out["zero3_init_not_taken_for_deepspeed"] = find_deepspeed_partitioned(own) == []
    _partition_as_deepspeed(model, rank, world)
    out["detected"] = [n for n, _ in find_deepspeed_partitioned(model)] == names
    out["not_importable"] = _initialize(model)
    try:
        zero3.initialize(model=model, config=config(MICRO, 1))
    except DeepSpeedAdoptionError as exc:
        out["error_classes"] = isinstance(exc, EngineError) and isinstance(exc, RuntimeError)
    out["left_as_it_was"] = all(tuple(p.shape) == (0,) and "ds_tensor" in vars(p) for p in model.parameters())
    other_world = make_model()
    _partition_as_deepspeed(other_world, rank, 4)
    out["world_mismatch"] = _initialize(other_world)
    managed = make_model()
    _partition_as_deepspeed(managed, rank, world)
    managed.blocks[0].ds_id = 3  # what a DeepSpeed engine puts on each module it hooks
    out["managed_by_deepspeed"] = _initialize(managed)
    one_rank = _ZeroSize()
    if rank == 1:
        _partition_as_deepspeed(one_rank, rank, world)
    out["on_one_rank_only"] = _initialize(one_rank)
    engine, *_ = zero3.initialize(model=make_model(), config={**config(MICRO, 1), "optimizer": {
        "type": "AdamW", "params": {"lr": 1e-2}}})
    x, y = make_batches(world, MICRO)[rank]
    engine.backward(engine(x, y))
    engine.step()
    out["trains_after"] = engine.global_steps
    engine.destroy()
    return out


def test_deepspeed_partitions_are_refused_on_every_rank_where_they_cannot_be_adopted():
    for rank, out in enumerate(run_ranks(_adoption_cases, 2)):
        assert out["detected"] and out["zero3_init_not_taken_for_deepspeed"], rank
        text = out["not_importable"]
        assert text.startswith("DeepSpeedAdoptionError: zero3.initialize cannot take over the model (on every "
                               "rank): "), text
        for part in ("16 parameters of the model", "'embed.weight', has shape (0,) and ds_shape (24, 13)",
                     "partitioned by DeepSpeed's zero.Init", "HfDeepSpeedConfig", "DeepSpeed cannot be imported",
                     "ModuleNotFoundError", "make DeepSpeed importable on every rank",
                     "with zero3.zero.Init(config_dict_or_path=ds_config):"):
            assert part in text, (part, text)
        assert out["error_classes"] and out["left_as_it_was"]
        assert "over a process group of 4 ranks, but this engine shards over 2 ranks" in out["world_mismatch"]
        assert "DeepSpeedAdoptionError" in out["world_mismatch"]
        assert "a DeepSpeed engine already manages it (module 'blocks.0'" in out["managed_by_deepspeed"]
        text = out["on_one_rank_only"]
        assert text.startswith("RankMismatchError") and "param empty" in text, text
        assert "rank 1: shape=(0,) dtype=float32 requires_grad=True partitioned by DeepSpeed's zero.Init" in text
        assert out["trains_after"] == 1


def test_compression_helpers_reach_and_replace_a_submodule_by_its_path():
    """`deepspeed.compression.helper`, as DeepSpeed-Chat's LoRA conversion uses it."""
    from zero3.compression.helper import recursive_getattr, recursive_setattr

    model = make_model()
    assert recursive_getattr(model, "blocks.1.linear") is model.blocks[1].linear
    replacement = torch.nn.Linear(24, 24)
    recursive_setattr(model, "blocks.1.linear", replacement)
    recursive_setattr(model, "head", torch.nn.Identity())
    assert model.blocks[1].linear is replacement and isinstance(model.head, torch.nn.Identity)
    try:
        recursive_getattr(model, "blocks.1.missing")
    except AttributeError as exc:
        assert "missing" in str(exc)
    else:
        raise AssertionError("a path to nothing must raise AttributeError")
