"""DeepSpeed 0.19.8's defaults for what a config or a script leaves out: the config's
`optimizer` and `scheduler` sections, and zero3's DeepSpeed-named classes built directly.

Each expected value names the DeepSpeed 0.19.8 source it was read from (paths inside the
`deepspeed` package). A config that omits a value must train as it would under DeepSpeed:
torch's AdamW defaults to weight_decay 0.01, DeepSpeed's Adam and AdamW to 0.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from zero3.config import from_deepspeed
from zero3.optim.optimizers import build_optimizer, build_scheduler

REQUIRED = object()

# ops/adam/fused_adam.py, FusedAdam.__init__ (what runtime/engine.py's
# get_optimizer_configuration builds for "Adam" / "AdamW" without offload_optimizer):
# lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0., amsgrad=False.
# ops/adam/cpu_adam.py, DeepSpeedCPUAdam.__init__ (built instead under offload_optimizer): the same.
DEEPSPEED_ADAM = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False}
# runtime/engine.py, get_optimizer_configuration: with "torch_adam": true, torch.optim.AdamW (Adam
# with adam_w_mode false) is built from the params as given, so torch's own defaults apply.
TORCH_ADAMW = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2, "amsgrad": False}
TORCH_ADAM = {**TORCH_ADAMW, "weight_decay": 0.0}
# runtime/engine.py, _configure_basic_optimizer: any other name is getattr(torch.optim, name)(params,
# **optimizer_parameters), so "SGD" is torch's SGD with torch's defaults.
TORCH_SGD = {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False}

CONFIG_OPTIMIZERS = [
    # runtime/config.py, ADAM_W_MODE_DEFAULT = True: "Adam" is AdamW unless adam_w_mode is false
    ({"type": "Adam"}, torch.optim.AdamW, DEEPSPEED_ADAM),
    ({"type": "AdamW"}, torch.optim.AdamW, DEEPSPEED_ADAM),
    ({"type": "Adam", "params": {"adam_w_mode": False}}, torch.optim.Adam, DEEPSPEED_ADAM),
    ({"type": "AdamW", "params": {"torch_adam": True}}, torch.optim.AdamW, TORCH_ADAMW),
    ({"type": "Adam", "params": {"torch_adam": True, "adam_w_mode": False}}, torch.optim.Adam, TORCH_ADAM),
    ({"type": "SGD"}, torch.optim.SGD, TORCH_SGD),
]


def _config(**sections) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, **sections}


@pytest.mark.parametrize("offload", [False, True], ids=["fused_adam", "cpu_adam"])
@pytest.mark.parametrize("section, cls, expected", CONFIG_OPTIMIZERS,
                         ids=["Adam", "AdamW", "Adam-L2", "AdamW-torch_adam", "Adam-L2-torch_adam", "SGD"])
def test_config_optimizer_defaults_are_deepspeeds(section, cls, expected, offload):
    cfg = _config(optimizer=section)
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    spec = from_deepspeed(cfg, world_size=1).optimizer
    optimizer = build_optimizer(spec, [torch.nn.Parameter(torch.ones(3))])
    assert type(optimizer) is cls
    group = optimizer.param_groups[0]
    assert {key: group[key] for key in expected} == expected


def test_a_value_given_wins_over_the_default():
    spec = from_deepspeed(_config(optimizer={"type": "AdamW", "params": {"weight_decay": 0.1, "lr": 3e-4}}),
                          world_size=1).optimizer
    group = build_optimizer(spec, [torch.nn.Parameter(torch.ones(3))]).param_groups[0]
    assert (group["weight_decay"], group["lr"], group["eps"]) == (0.1, 3e-4, 1e-8)


# runtime/lr_schedules.py, each class's __init__ (the config's params are passed to it as keywords).
SCHEDULER_DEFAULTS = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log",
                 "last_batch_iteration": -1},
    "WarmupDecayLR": {"total_num_steps": REQUIRED, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                      "warmup_num_steps": 1000, "warmup_type": "log", "last_batch_iteration": -1},
    "WarmupCosineLR": {"total_num_steps": REQUIRED, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                       "cos_min_ratio": 0.0001, "warmup_type": "log", "last_batch_iteration": -1},
    "OneCycle": {"cycle_min_lr": REQUIRED, "cycle_max_lr": REQUIRED, "decay_lr_rate": 0.0,
                 "cycle_first_step_size": 2000, "cycle_second_step_size": None, "cycle_first_stair_count": 0,
                 "cycle_second_stair_count": None, "decay_step_size": 0, "cycle_momentum": True,
                 "cycle_min_mom": 0.8, "cycle_max_mom": 0.9, "decay_mom_rate": 0.0, "last_batch_iteration": -1},
    "LRRangeTest": {"lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 2000,
                    "lr_range_test_step_rate": 1.0, "lr_range_test_staircase": False, "last_batch_iteration": -1},
}
REQUIRED_VALUES = {"total_num_steps": 100, "cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2}


@pytest.mark.parametrize("name", sorted(set(SCHEDULER_DEFAULTS) - {"LRRangeTest"}))
def test_config_scheduler_defaults_are_deepspeeds(name):
    expected = SCHEDULER_DEFAULTS[name]
    given = {key: REQUIRED_VALUES[key] for key, value in expected.items() if value is REQUIRED}
    cfg = _config(optimizer={"type": "SGD", "params": {"lr": 0.1}}, scheduler={"type": name, "params": given})
    spec = from_deepspeed(cfg, world_size=1).scheduler
    assert spec.kwargs == {key: given.get(key, value) for key, value in expected.items()}
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1, momentum=0.9)
    build_scheduler(spec, optimizer).step()


@pytest.mark.parametrize("name", sorted(SCHEDULER_DEFAULTS))
def test_scheduler_classes_take_deepspeeds_defaults(name):
    """zero3.runtime.lr_schedules.<name> built directly, as a script does."""
    import zero3.runtime.lr_schedules as schedules

    parameters = list(inspect.signature(getattr(schedules, name)).parameters.values())[1:]  # after optimizer
    found = {p.name: REQUIRED if p.default is inspect.Parameter.empty else p.default for p in parameters}
    assert found == SCHEDULER_DEFAULTS[name]


# ops/adam/fused_adam.py FusedAdam.__init__ and ops/adam/cpu_adam.py DeepSpeedCPUAdam.__init__.
CLASS_DEFAULTS = {
    "FusedAdam": {"lr": 1e-3, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-8, "adam_w_mode": True,
                  "weight_decay": 0.0, "amsgrad": False, "set_grad_none": True},
    "DeepSpeedCPUAdam": {"lr": 1e-3, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-8,
                         "weight_decay": 0, "amsgrad": False, "adamw_mode": True, "fp32_optimizer_states": True},
}


@pytest.mark.parametrize("name", sorted(CLASS_DEFAULTS))
def test_ops_adam_classes_take_deepspeeds_defaults(name):
    import zero3.ops.adam as adam

    built = getattr(adam, name)
    parameters = list(inspect.signature(built).parameters.values())[1:]  # after the parameters
    assert {p.name: p.default for p in parameters} == CLASS_DEFAULTS[name]
    group = built([torch.nn.Parameter(torch.ones(3))]).param_groups[0]
    assert {key: group[key] for key in DEEPSPEED_ADAM} == DEEPSPEED_ADAM
