"""Released storage: every path that could touch a freed parameter storage fails by name.

A sharded parameter keeps its shape with a zero-byte storage; torch kernels such as
`add_` or `sum` do not check that, so touching one would read or write freed memory
(a segmentation fault). One 2-rank launch runs every check; each records the error's
class name (or the observed values) and the test asserts them on both ranks.
"""

from __future__ import annotations

import copy
import io
import os

import pytest
import torch
from common import config, make_batches, make_model
from harness import run_ranks
from torch import nn

os.environ.setdefault("ZERO3_ACCELERATOR", "cpu")

INIT_CONFIG = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}


def _error_of(call) -> str:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the class name is what the test checks
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _two_linears():
    import zero3

    torch.manual_seed(0)
    with zero3.zero.Init(config_dict_or_path=INIT_CONFIG):
        l1, l2 = nn.Linear(10, 10), nn.Linear(10, 10)
    return l1, l2


def gathered_init_checks(rank: int) -> dict:
    """GatheredParameters over zero3.Init parameters before initialize (the reported crash)."""
    import zero3

    l1, l2 = _two_linears()
    out = {}
    with zero3.zero.GatheredParameters([l1.weight, l2.weight], modifier_rank=None):
        before = l1.weight.detach().clone()

    def write_same_values():
        with zero3.zero.GatheredParameters([l1.weight, l2.weight], modifier_rank=None):
            with torch.no_grad():
                l1.weight.add_(0.0)  # the reported SIGSEGV; an in-place write all the same, as DeepSpeed counts it
    out["unchanged"] = _error_of(write_same_values)

    def modify():
        with zero3.zero.GatheredParameters([l1.weight, l2.weight], modifier_rank=None):
            with torch.no_grad():
                l1.weight.add_(1.0)
    out["modified"] = _error_of(modify)
    with zero3.zero.GatheredParameters([l1.weight], modifier_rank=None):
        out["undone"] = torch.equal(l1.weight.detach(), before)
    with zero3.zero.GatheredParameters([l1.weight], modifier_rank=0):
        with torch.no_grad():
            l1.weight.fill_(float(rank + 7))  # only rank 0's value is kept
    with zero3.zero.GatheredParameters([l1.weight]):
        out["adopted"] = l1.weight.detach().unique().tolist()
    out["released_after"] = l1.weight.untyped_storage().nbytes()
    return out


def init_misuse_checks(rank: int) -> dict:
    """Forward and state_dict before initialize; `p.data = t` inside Init."""
    import zero3

    l1, _ = _two_linears()
    out = {"forward": _error_of(lambda: l1(torch.ones(1, 10)))}
    state = l1.state_dict()
    out["state_dict"] = (state["weight"].device.type, tuple(state["weight"].shape))
    out["state_dict_read"] = _error_of(lambda: state["weight"].cpu())
    replacement = torch.full((10, 10), 3.0)
    with zero3.zero.Init(config_dict_or_path=INIT_CONFIG):
        layer = nn.Linear(10, 10)
        layer.weight.data = replacement
        out["wrong_shape"] = _error_of(lambda: setattr(layer.bias, "data", torch.ones(3)))
    out["replacement_kept"] = replacement.untyped_storage().nbytes() == 400 and bool((replacement == 3).all())
    with zero3.zero.GatheredParameters([layer.weight]):
        out["assigned"] = layer.weight.detach().unique().tolist()
    return out


def engine_checks(rank: int, world: int) -> dict:
    """Engine paths: a parameter freed behind the engine's back, reuse after sharding."""
    import zero3
    from zero3.engine_parts.generation import gathered_for_generation

    model = make_model()
    engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(),
                                  config={**config(2, 1, threshold=30), "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    out = {"engine_state_dict": engine.module.state_dict()["embed.weight"].device.type}
    out["reuse_sharded"] = _error_of(lambda: zero3.initialize(model=nn.Sequential(engine.module.embed),
                                                              config=config(2, 1)))

    def build_on_sharded():
        with zero3.zero.Init(config_dict_or_path=INIT_CONFIG):
            tied = nn.Linear(13, 24)
            tied.weight = engine.module.embed.weight
    out["init_on_sharded"] = _error_of(build_on_sharded)
    x, y = make_batches(1, 2)[0]
    engine.backward(engine(x, y))
    resident = engine.module.head.bias  # 5 elements: persistent, FULL between steps
    resident.untyped_storage().resize_(0)  # something outside zero3 frees it
    out["refresh"] = _error_of(engine.step)
    out["generation"] = _error_of(lambda: gathered_for_generation(engine).__enter__())
    out["gathered"] = _error_of(lambda: zero3.GatheredParameters([resident]).__enter__())
    return out


def _user_touches(model: nn.Module, param: nn.Parameter) -> dict:
    """What user code between steps might do to a sharded parameter: each must raise."""
    full = {k: torch.zeros(v.shape) for k, v in model.state_dict().items()}
    calls = {
        "sum": lambda: param.sum(),
        "clone": lambda: param.clone(),
        "add_": lambda: param.add_(0.0),
        "copy_": lambda: param.copy_(torch.zeros(param.shape)),
        "mul": lambda: param * 2,
        "data_norm": lambda: param.data.norm(),
        "detach_clone": lambda: param.detach().clone(),
        "transpose_attr": lambda: param.T.sum(),
        "view": lambda: param.view(-1),
        "index": lambda: param[0],
        "tolist": lambda: param.tolist(),
        "numpy": lambda: param.numpy(),
        "ema": lambda: torch.zeros(param.shape).mul_(0.9).add_(param),
        "to_vector": lambda: torch.nn.utils.parameters_to_vector(model.parameters()),
        "torch_save": lambda: torch.save(param, io.BytesIO()),
        "deepcopy": lambda: copy.deepcopy(model),
        "half": lambda: model.half(),
        "load_state_dict": lambda: model.load_state_dict(full),
    }
    out = {}
    with torch.no_grad():
        for key, call in calls.items():
            out[key] = _error_of(call)
    return out


def _metadata_of(model: nn.Module, param: nn.Parameter) -> dict:
    """What must keep working on a sharded parameter: metadata, no-op moves, printing."""
    model.to(param.device)
    model.to(torch.float32)
    model.zero_grad()
    alias = param.data
    return {"shape": tuple(param.shape), "dtype": str(param.dtype), "numel": param.numel(),
            "requires_grad": param.requires_grad, "is_parameter": isinstance(param, nn.Parameter),
            "repr": repr(param), "format": f"{param}", "alias_shape": tuple(alias.shape),
            "same_object": model.to("cpu") is model,
            "cpu_index": model.to(torch.device("cpu", 0)) is model}  # Accelerate's prepare_model on CPU


def _full_values(model: nn.Module) -> dict[str, torch.Tensor]:
    import zero3

    with zero3.GatheredParameters(list(model.parameters())):
        return {name: p.detach().clone() for name, p in model.named_parameters()}


def direct_touch_checks(rank: int, world: int) -> dict:
    """User code touching sharded parameters directly, outside the engine's paths."""
    import zero3

    model = make_model()
    engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(),
                                  config={**config(2, 1, threshold=30), "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    batches = make_batches(3, 2)
    x, y = batches[0]
    engine.backward(engine(x, y))
    engine.step()
    weight = engine.module.embed.weight  # 312 elements: sharded between steps
    before = _full_values(engine.module)
    alias = weight.data
    out = {"touches": _user_touches(engine.module, weight), "metadata": _metadata_of(engine.module, weight),
           "status": weight.ds_status.name}
    after = _full_values(engine.module)
    out["values_kept"] = sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
    with zero3.GatheredParameters([weight]):
        out["gathered_sum"] = float(weight.detach().sum())
        out["alias_sum_while_gathered"] = float(alias.sum())
    out["expected_sum"] = float(before["embed.weight"].sum())
    out["sealed_again"] = _error_of(lambda: alias.sum())
    losses = []
    for x, y in batches[1:]:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    out["losses"] = losses

    l1, _ = _two_linears()  # zero3.Init, before initialize
    with zero3.zero.Init(config_dict_or_path=INIT_CONFIG):
        kept = nn.Linear(6, 6)
        kept_data, kept_view, kept_t = kept.weight.data, kept.weight.t(), kept.weight.T  # kept past the settle
        nn.Linear(6, 6)
    out["init_touches"] = {"kept_data": _error_of(lambda: kept_data.sum()),
                           "kept_view": _error_of(lambda: kept_view.add_(1.0)),
                           "kept_T": _error_of(lambda: kept_t.sum()),"add_": _error_of(lambda: l1.weight.data.add_(1.0)),
                           "sum": _error_of(lambda: l1.weight.sum()),
                           "to_half": _error_of(lambda: l1.to(torch.float16)),
                           "to_same": _error_of(lambda: l1.to("cpu")),
                           "to_cpu_index": _error_of(lambda: l1.to(torch.device("cpu", 0)))}
    with zero3.zero.GatheredParameters([l1.weight]):
        out["init_gathered"] = float(l1.weight.detach().sum())
    return out


def storage_worker(rank: int, world: int) -> dict:
    return {"gathered": gathered_init_checks(rank), "init": init_misuse_checks(rank),
            "engine": engine_checks(rank, world), "direct": direct_touch_checks(rank, world)}


@pytest.fixture(scope="module")
def results():
    return run_ranks(storage_worker, 2, timeout=120)


def test_gathered_parameters_on_init_model_no_longer_crashes(results):
    for out in results:
        checks = out["gathered"]
        assert checks["unchanged"].startswith("GatheredParametersError") and "in-place" in checks["unchanged"]
        assert checks["modified"].startswith("GatheredParametersError"), checks["modified"]
        assert "rank 0" in checks["modified"] and "rank 1" in checks["modified"]
        assert checks["undone"] is True
        assert checks["adopted"] == [7.0]
        assert checks["released_after"] == 0


def test_init_model_touched_before_initialize(results):
    for out in results:
        checks = out["init"]
        assert checks["forward"].startswith("ReleasedParameterError"), checks["forward"]
        assert "zero3.initialize" in checks["forward"] and "'weight'" in checks["forward"]
        assert checks["state_dict"] == ("meta", (10, 10))
        assert "meta" in checks["state_dict_read"], checks["state_dict_read"]
        assert checks["wrong_shape"].startswith("InitError"), checks["wrong_shape"]
        assert checks["replacement_kept"] is True
        assert checks["assigned"] == [3.0]


def test_engine_paths_refuse_released_storage(results):
    for out in results:
        checks = out["engine"]
        assert checks["engine_state_dict"] == "meta"
        assert checks["reuse_sharded"].startswith("ReleasedParameterError"), checks["reuse_sharded"]
        assert checks["init_on_sharded"].startswith("ReleasedParameterError"), checks["init_on_sharded"]
        assert checks["refresh"].startswith("ReleasedParameterError"), checks["refresh"]
        assert "'head.bias'" in checks["refresh"]
        assert checks["generation"].startswith("ReleasedParameterError"), checks["generation"]
        assert "'head.bias'" in checks["generation"]
        assert checks["gathered"].startswith("ReleasedParameterError"), checks["gathered"]


def test_user_code_touching_a_sharded_parameter_gets_a_named_error(results):
    for out in results:
        checks = out["direct"]
        for call, error in checks["touches"].items():
            assert error.startswith("ReleasedParameterError"), (call, error)
        assert "'embed.weight'" in checks["touches"]["sum"], checks["touches"]["sum"]
        assert "GatheredParameters" in checks["touches"]["add_"]
        assert "nothing was loaded" in checks["touches"]["load_state_dict"]
        assert "deepcopy" in checks["touches"]["deepcopy"] and "pickling" in checks["touches"]["torch_save"]
        assert checks["values_kept"] is True
        assert checks["status"] == "NOT_AVAILABLE"


def test_metadata_and_no_op_moves_of_a_sharded_parameter_still_work(results):
    for out in results:
        meta = out["direct"]["metadata"]
        assert meta["shape"] == (24, 13) and meta["dtype"] == "torch.float32" and meta["numel"] == 312
        assert meta["requires_grad"] is True and meta["is_parameter"] is True
        assert "sharded by zero3" in meta["repr"] and "sharded by zero3" in meta["format"]
        assert meta["alias_shape"] == (24, 13) and meta["same_object"] is True and meta["cpu_index"] is True


def test_values_come_back_inside_gathered_parameters_and_training_goes_on(results):
    first, second = results
    for out in results:
        checks = out["direct"]
        assert checks["gathered_sum"] == pytest.approx(checks["expected_sum"], rel=1e-6)
        assert checks["alias_sum_while_gathered"] == checks["gathered_sum"]
        assert checks["sealed_again"].startswith("ReleasedParameterError"), checks["sealed_again"]
        assert len(checks["losses"]) == 2 and all(loss == loss for loss in checks["losses"])
    assert first["direct"]["losses"] != [] and first["direct"]["expected_sum"] == second["direct"]["expected_sum"]


def test_init_parameters_touched_before_initialize_get_a_named_error(results):
    for out in results:
        touches = out["direct"]["init_touches"]
        for call in ("add_", "sum", "to_half", "kept_data", "kept_view", "kept_T"):
            assert touches[call].startswith("ReleasedParameterError"), (call, touches[call])
        assert touches["to_same"] == "no error" and touches["to_cpu_index"] == "no error"
        assert out["direct"]["init_gathered"] == out["direct"]["init_gathered"]  # a number, gathered
