"""DeepSpeed's `torch_autocast` section (engine_parts/autocast.py) and the precision keys' checks.

One launch per world size: zero3 with fp32 parameters and the forward under bf16 autocast
against plain PyTorch doing the same (an fp32 model whose forward runs under
torch.autocast("cpu", bfloat16), fused AdamW on fp32 state), 20 steps; the gradients of the
lower-precision-safe modules reduced in bf16 and the rest in fp32 (which parameters, and
the dtypes of the collectives); bit-exact resume; a custom module list; a class that cannot
be imported refused on every rank at initialize.

The bound (ULP_BOUND): the two runs compute the same forward and backward (the same autocast
casts); they differ in the gradient sum over ranks: zero3 reduce-scatters the Linear layers'
gradients in bf16 (DeepSpeed's rule for lower_precision_safe_modules), rounding each summed
element to bf16 (relative 2^-8), where plain PyTorch sums them in fp32. Adam normalizes the
update, so a 2^-8 relative change of a gradient moves an update by less than 1% of lr; the
fp32 weights then differ slightly, and the bf16 casts inside autocast round the two runs'
activations to neighbouring bf16 values. The losses come out of bf16 matmuls, so their own
resolution is a bf16 ulp of the loss: measured at most 1.3 such ulps apart at any of the 20
steps on 2 and 4 ranks; the bound is 2 ulps at every step.
"""

from __future__ import annotations

import math

import pytest
import torch
from common import make_batches, make_model, two_param_groups
from harness import run_ranks

MICRO = 2
STEPS = 20
HALF = 10
LR = 1e-2
CLIP = 1.0
ULP_BOUND = 2
AUTOCAST = {"enabled": True, "dtype": "bfloat16"}


def plain_autocast(world: int) -> list[float]:
    """An fp32 model, its forward under bf16 autocast, fused AdamW: losses [step][rank]."""
    model = make_model()
    optimizer = torch.optim.AdamW(two_param_groups(model, LR), fused=True)
    params = [p for p in model.parameters() if p.requires_grad]
    batches = make_batches(STEPS * world, MICRO)
    losses = []
    for step in range(STEPS):
        for rank in range(world):
            x, y = batches[step * world + rank]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x, y)
            (loss / world).backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        optimizer.step()
        optimizer.zero_grad()
    return losses


def build(autocast: dict, seed: int = 0):
    import zero3

    model = make_model(seed=seed)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": CLIP, "torch_autocast": autocast,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 30}}
    engine, *_ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model, LR)),
                                  config=config)
    return engine


def train(engine, rank: int, world: int, first: int, last: int) -> list[float]:
    batches = make_batches(STEPS * world, MICRO)
    losses = []
    for step in range(first, last):
        x, y = batches[step * world + rank]
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def reduced_dtypes(engine) -> dict[str, str]:
    return {sp.name: str(engine.reducer.param_reduce_dtypes.get(id(sp), "own"))
            for sp in engine.table.values() if sp.requires_grad}


def collective_dtypes(engine) -> set[torch.dtype]:
    """The dtypes of the reduce-scatters one backward issues (the reducer's groups)."""
    seen: set[torch.dtype] = set()
    reduce_group = engine.reducer._reduce_group

    def spy(group, dtype):
        seen.add(dtype)
        return reduce_group(group, dtype)

    engine.reducer._reduce_group = spy
    try:
        x, y = make_batches(1, MICRO)[0]
        engine.backward(engine(x, y))
    finally:
        engine.reducer._reduce_group = reduce_group
    engine.zero_grad()
    return seen


def autocast_checks(rank: int, world: int, folder: str) -> dict:
    from zero3.engine_parts.autocast import AutocastConfigError

    engine = build(AUTOCAST)
    losses = train(engine, rank, world, 0, HALF)
    engine.save_checkpoint(folder, tag="half")
    losses += train(engine, rank, world, HALF, STEPS)
    opt = engine.optimizer
    info = {"losses": losses, "reduced": reduced_dtypes(engine),
            "masters_are_shards": all(m is sp.shard and m.dtype == torch.float32 for sp, m in zip(opt.params, opt.masters)),
            "collectives": collective_dtypes(engine)}
    engine.destroy()
    resumed = build(AUTOCAST, seed=3)
    resumed.load_checkpoint(folder, tag="half")
    info["resumed"] = train(resumed, rank, world, HALF, STEPS)
    resumed.destroy()
    custom = build({**AUTOCAST, "lower_precision_safe_modules": ["torch.nn.LayerNorm"]})
    info["custom"] = reduced_dtypes(custom)
    custom.destroy()
    try:
        build({**AUTOCAST, "lower_precision_safe_modules": ["torch.nn.NoSuchLayer"]})
        info["refused"] = None
    except AutocastConfigError as error:
        info["refused"] = str(error)
    return info


def far(losses: list[float], plain: list[float]) -> float:
    """The largest distance over the steps, in bf16 ulps of the plain run's loss."""
    return max(abs(x - y) / 2.0 ** (math.floor(math.log2(abs(y))) - 7) for x, y in zip(losses, plain))


@pytest.mark.parametrize("world", [2, 4])
def test_torch_autocast_matches_plain_autocast(tmp_path, world):
    results = run_ranks(autocast_checks, world, str(tmp_path), timeout=300)
    plain = plain_autocast(world)
    for rank, r in enumerate(results):
        assert far(r["losses"], plain[rank::world]) <= ULP_BOUND, (r["losses"], plain[rank::world])
        assert r["resumed"] == r["losses"][HALF:]
        assert r["masters_are_shards"]  # fp32 parameters are their own masters: 16 bytes, no copy
        linear = {n for n in r["reduced"] if n.startswith(("embed.", "head.")) or ".linear." in n}
        assert linear and all(r["reduced"][n] == "torch.bfloat16" for n in linear)
        assert all(v == "own" for n, v in r["reduced"].items() if n not in linear)  # LayerNorm: fp32
        assert r["collectives"] == {torch.bfloat16, torch.float32}
        assert set(n for n, v in r["custom"].items() if v != "own") == {n for n in r["reduced"] if ".norm." in n}
        assert r["refused"] is not None and "torch.nn.NoSuchLayer" in r["refused"] and "full path" in r["refused"]


# ------------------------------------------------------------------ config checks (no launch)
def parse(**sections):
    from zero3.config import from_deepspeed

    return from_deepspeed({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, **sections}, 1)


@pytest.mark.parametrize("sections, words", [
    ({"bf16": {"enabled": True, "bf16_optimizer_states": True}},
     ["bf16.bf16_optimizer_states", "requires bf16_master_weights_and_grads"]),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
     ["offload_optimizer.device is 'none'", '"bf16_optimizer_states": true']),
    ({"bf16": {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}},
     ["needs bf16.enabled true", "float32"]),
    ({"bfloat16": {"enabled": False, "bf16_master_weights_and_grads": True}}, ["bfloat16.bf16_master_weights"]),
    ({"torch_autocast": {"enabled": True}}, ["no autocast dtype given", '"dtype": "bfloat16"']),
    ({"torch_autocast": {"enabled": True, "dtype": "fp16"}}, ["needs gradient scaling", "float16"]),
    ({"bf16": {"enabled": True}, "torch_autocast": {"enabled": True, "dtype": "torch.float16"}},
     ["differs from the enabled precision (bfloat16)", "float16"]),
    ({"torch_autocast": {"enabled": True, "dtype": "bf16"}, "communication_data_type": "fp32"},
     ["communication_data_type", "not used under torch_autocast"]),
    ({"torch_autocast": {"enabled": True, "lower_precision_safe_modules": "torch.nn.Linear"}},
     ["lower_precision_safe_modules", "list of fully qualified class names"]),
])
def test_precision_keys_refused_with_the_value_and_the_fix(sections, words):
    from zero3.config import ConfigError

    with pytest.raises(ConfigError) as error:
        parse(**sections)
    for word in words:
        assert word in str(error.value), str(error.value)


def test_precision_keys_accepted_as_deepspeed_accepts_them():
    full = parse(bf16={"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
                 torch_autocast={"enabled": True, "dtype": "torch.bfloat16"}).precision  # the example's bf16_full
    assert (full.master_dtype, full.optimizer_state_dtype, full.autocast_dtype) == (torch.bfloat16,) * 3
    mixed = parse(bf16={"enabled": True, "bf16_master_weights_and_grads": True},
                  zero_optimization={"stage": 3, "offload_optimizer": {"device": "cpu"}}).precision
    assert (mixed.master_dtype, mixed.optimizer_state_dtype) == (torch.bfloat16, torch.float32)
    off = parse(torch_autocast={"enabled": False, "dtype": "bfloat16"}).precision
    assert off.autocast_dtype is None and off.master_dtype == torch.float32
    implied = parse(bf16={"enabled": True}, torch_autocast={"enabled": True}).precision
    assert implied.autocast_dtype == torch.bfloat16
