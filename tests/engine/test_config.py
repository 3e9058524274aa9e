"""zero3.config: DeepSpeed's JSON config parsed into typed dataclasses (pure Python, fast)."""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import pathlib
import sys

import pytest
import torch

from zero3 import config as cfg
from zero3.config import ConfigError, from_deepspeed

SEED = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": 16,
        "stage3_prefetch_bucket_size": 0,
        "stage3_max_reuse_distance": 0,
        "offload_param": {"device": "cpu", "pin_memory": False},
    },
}


def parse(extra: dict | None = None, world_size: int = 2, **top) -> cfg.Zero3Config:
    """Parse a minimal valid config plus `extra` top-level keys."""
    config = {"train_micro_batch_size_per_gpu": 1, **(extra or {}), **top}
    return from_deepspeed(config, world_size)


def zero(**keys) -> cfg.Zero3Config:
    return parse({"zero_optimization": {"stage": 3, **keys}})


def error_of(config: dict, world_size: int = 2) -> str:
    with pytest.raises(ConfigError) as info:
        from_deepspeed(config, world_size)
    return str(info.value)


# ------------------------------------------------------------------------- seed config

def test_seed_config_parses_to_the_expected_fields():
    c = from_deepspeed(SEED, world_size=2)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (16, 2, 4)
    z = c.zero
    assert z.stage == 3
    assert z.param_persistence_threshold == 16
    assert z.prefetch_bucket_size == 0
    assert z.max_reuse_distance == 0
    assert z.max_live_parameters == 1_000_000_000
    assert z.reduce_bucket_size == 500_000_000
    assert z.model_persistence_threshold == sys.maxsize
    assert z.offload_param == cfg.OffloadConfig(device="cpu", pin_memory=False)
    assert z.offload_optimizer == cfg.OffloadConfig()
    assert z.overlap_comm is True
    assert c.precision.dtype == torch.float32
    assert c.gradient_clipping == 1.0  # DeepSpeed 0.19.8's GRADIENT_CLIPPING_DEFAULT
    assert c.optimizer is None and c.scheduler is None
    assert c.raw == SEED and c.raw is not SEED
    assert c.raw["zero_optimization"] is not SEED["zero_optimization"]


def test_result_is_frozen():
    c = from_deepspeed(SEED, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.train_batch_size = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.zero.stage = 2  # type: ignore[misc]


# --------------------------------------------------------------------------- input forms

def test_path_input(tmp_path: pathlib.Path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(SEED))
    assert from_deepspeed(path, 2) == from_deepspeed(str(path), 2) == from_deepspeed(SEED, 2)


def test_base64_input_as_deepspeed_accepts():
    encoded = base64.urlsafe_b64encode(json.dumps(SEED).encode()).decode()
    assert from_deepspeed(encoded, 2).train_batch_size == 16


def test_missing_file_and_bad_json(tmp_path: pathlib.Path):
    with pytest.raises(ConfigError, match="no such file"):
        from_deepspeed(str(tmp_path / "absent.json"), 2)
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 4,,}')
    with pytest.raises(ConfigError, match="not valid JSON.*line 1"):
        from_deepspeed(bad, 2)
    dup = tmp_path / "dup.json"
    dup.write_text('{"train_batch_size": 4, "train_batch_size": 8}')
    with pytest.raises(ConfigError, match="train_batch_size: duplicate key"):
        from_deepspeed(dup, 2)


def test_bad_world_size():
    with pytest.raises(ConfigError, match="world_size"):
        from_deepspeed(SEED, 0)


# ----------------------------------------------------------------------------- batch sizes

@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize(
    "given, expected",
    [
        # (train_batch_size, micro, gas) given (None: absent) -> expected for world size W (as lambdas)
        ((None, 3, 5), lambda w: (15 * w, 3, 5)),
        ((None, 3, None), lambda w: (3 * w, 3, 1)),
        (("tbs", 3, 5), lambda w: (15 * w, 3, 5)),
        (("tbs", 3, None), lambda w: (15 * w, 3, 5)),
        (("tbs", None, 5), lambda w: (15 * w, 3, 5)),
        (("tbs", None, None), lambda w: (15 * w, 15, 1)),
    ],
)
def test_batch_size_arithmetic(world, given, expected):
    tbs, micro, gas = given
    config = {}
    if tbs is not None:
        config["train_batch_size"] = 15 * world
    if micro is not None:
        config["train_micro_batch_size_per_gpu"] = micro
    if gas is not None:
        config["gradient_accumulation_steps"] = gas
    c = from_deepspeed(config, world)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == expected(world)


def test_inconsistent_batch_sizes_show_the_arithmetic():
    message = error_of({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
                        "gradient_accumulation_steps": 3}, world_size=2)
    assert message.startswith("train_batch_size:")
    assert "2 * 3 * 2 = 12" in message and "16" in message


@pytest.mark.parametrize(
    "config, fragment",
    [
        ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2}, "= 4"),
        ({"train_batch_size": 10, "gradient_accumulation_steps": 3}, "= 6"),
        ({"train_batch_size": 5}, "world_size = 2"),
        ({"train_batch_size": 2, "train_micro_batch_size_per_gpu": 4}, "= 8"),
    ],
)
def test_underivable_batch_sizes(config, fragment):
    message = error_of(config, world_size=2)
    assert "not a multiple" in message and fragment in message


@pytest.mark.parametrize("config", [{}, {"gradient_accumulation_steps": 4}])
def test_no_batch_size_is_an_error(config):
    assert "no batch size given" in error_of(config)


@pytest.mark.parametrize("value", [0, -2, 2.5, True, "8"])
def test_batch_values_are_type_checked(value):
    message = error_of({"train_micro_batch_size_per_gpu": value})
    assert message.startswith("train_micro_batch_size_per_gpu:")


def test_integral_float_batch_size_accepted():
    assert parse(train_micro_batch_size_per_gpu=4.0).train_micro_batch_size_per_gpu == 4


# ---------------------------------------------------------------------------------- "auto"

@pytest.mark.parametrize("key", ["train_batch_size", "train_micro_batch_size_per_gpu",
                                 "gradient_accumulation_steps", "gradient_clipping"])
def test_auto_at_top_level_needs_a_concrete_value(key):
    config = {"train_micro_batch_size_per_gpu": 1, key: "auto"}
    message = error_of(config)
    assert message.startswith(f"{key}:") and "'auto'" in message and "concrete value" in message


def test_auto_in_pydantic_sections_means_the_deepspeed_default():
    c = zero(reduce_bucket_size="auto", stage3_prefetch_bucket_size="auto",
             stage3_param_persistence_threshold="auto",
             stage3_gather_16bit_weights_on_model_save="auto")
    assert c.zero == cfg.ZeroConfig()
    assert parse({"bf16": {"enabled": "auto"}}).precision.dtype == torch.float32


def test_auto_in_optimizer_params_is_an_error():
    message = error_of({"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})
    assert message.startswith("optimizer.params.lr:") and "concrete value" in message


# ---------------------------------------------------------------------------- precision

@pytest.mark.parametrize(
    "extra, dtype",
    [
        ({}, torch.float32),
        ({"bf16": {"enabled": True}}, torch.bfloat16),
        ({"bfloat16": {"enabled": True}}, torch.bfloat16),
        ({"fp16": {"enabled": True}}, torch.float16),
        ({"fp16": {"enabled": False}, "bf16": {"enabled": False}}, torch.float32),
    ],
)
def test_dtype_mapping(extra, dtype):
    assert parse(extra).precision.dtype == dtype


def test_fp16_and_bf16_both_enabled_is_an_error():
    message = error_of({"train_batch_size": 2, "fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert "cannot both be enabled" in message and "bf16.enabled" in message and "fp16.enabled" in message


def test_bf16_and_its_alias_together_is_an_error():
    assert "same option as 'bf16'" in error_of({"train_batch_size": 2, "bf16": {}, "bfloat16": {}})


def test_fp16_loss_scale_fields():
    p = parse({"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
                        "loss_scale_window": 500, "hysteresis": 3, "consecutive_hysteresis": True,
                        "min_loss_scale": 2}}).precision
    assert (p.loss_scale, p.initial_scale_power, p.loss_scale_window, p.hysteresis) == (0.0, 12, 500, 3)
    assert p.consecutive_hysteresis is True and p.min_loss_scale == 2.0
    assert p.dynamic_loss_scale and p.initial_loss_scale == 4096.0 and p.check_grad_overflow
    static = parse({"fp16": {"enabled": True, "loss_scale": 128}}).precision
    assert not static.dynamic_loss_scale and static.initial_loss_scale == 128.0


@pytest.mark.parametrize("fp16", [{"enabled": True, "loss_scale_window": 0},
                                  {"enabled": True, "min_loss_scale": 0},
                                  {"enabled": True, "loss_scale": -1},
                                  {"enabled": True, "loss_scale": True},
                                  {"enabled": True, "min_loss_scale": 0.5}])
def test_fp16_bad_values(fp16):
    assert error_of({"train_batch_size": 2, "fp16": fp16}).startswith("fp16.")


def test_bf16_overflow_check_and_auto_cast():
    assert parse({"bf16": {"enabled": True}}).precision.check_grad_overflow is True
    assert parse({"bf16": {"enabled": True, "check_grad_overflow": False}}).precision.check_grad_overflow is False
    assert parse().precision.check_grad_overflow is False
    assert parse({"fp16": {"enabled": True, "auto_cast": True}}).precision.auto_cast is True
    assert parse({"fp16": {"auto_cast": True}}).precision.auto_cast is False  # DeepSpeed ignores it with fp16 off


@pytest.mark.parametrize("name, dtype", [("fp32", torch.float32), ("BF16", torch.bfloat16),
                                         ("fp16", torch.float16), (None, None)])
def test_communication_data_type(name, dtype):
    p = parse(communication_data_type=name).precision
    assert p.communication_data_type == dtype
    assert p.reduce_dtype == (dtype or torch.float32)


def test_communication_data_type_bad_value():
    assert error_of({"train_batch_size": 2, "communication_data_type": "int8"}).startswith(
        "communication_data_type:")


def test_data_types():
    assert parse({"bf16": {"enabled": True}, "data_types": {"param_dtype": "bf16",
                                                            "grad_accum_dtype": "fp32"}})
    assert "conflicts" in error_of({"train_batch_size": 2, "data_types": {"param_dtype": "bf16"}})
    message = error_of({"train_batch_size": 2, "data_types": {"grad_accum_dtype": "bf16"}})
    assert message.startswith("data_types.grad_accum_dtype:") and "Enable the bf16 section" in message
    assert parse({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}}).precision.grad_accum_dtype \
        == torch.bfloat16
    assert parse({"fp16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp16"}}).precision.grad_accum_dtype \
        == torch.float16
    assert parse({"bf16": {"enabled": True}}).precision.grad_accum_dtype is None  # zero3's fp32 sums


# ---------------------------------------------------------------------------- zero section

@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stages_other_than_3_are_refused(stage):
    message = error_of({"train_batch_size": 2, "zero_optimization": {"stage": stage}})
    assert message.startswith("zero_optimization.stage:") and "stage 3 only" in message


def test_stage_absent_means_3():
    assert parse().zero.stage == 3
    assert parse({"zero_optimization": {}}).zero.stage == 3


def test_zero_optimization_boolean_form_refused():
    assert "deprecated" in error_of({"train_batch_size": 2, "zero_optimization": True})


def test_offload_param_nvme_keys():
    p = zero(offload_param={"device": "nvme", "nvme_path": "/nvme", "buffer_count": 3, "buffer_size": 1e6,
                            "max_in_cpu": 5e8, "pin_memory": False}).zero.offload_param
    assert (p.nvme, p.enabled, p.nvme_path, p.buffer_count, p.buffer_size, p.max_in_cpu, p.pin_memory) == \
        (True, True, "/nvme", 3, 1_000_000, 500_000_000, False)
    d = zero(offload_param={"device": "nvme", "nvme_path": "/nvme"}).zero.offload_param
    assert (d.buffer_count, d.buffer_size, d.max_in_cpu, d.pin_memory) == (5, 100_000_000, 1_000_000_000, True)
    no_path = error_of({"train_batch_size": 2, "zero_optimization": {"offload_param": {"device": "nvme"}}})
    assert no_path.startswith("zero_optimization.offload_param.nvme_path:") and "(got null)" in no_path
    assert 'needs the folder of the swap files' in no_path and 'Add "nvme_path"' in no_path
    on_cpu = error_of({"train_batch_size": 2, "zero_optimization": {"offload_param": {
        "device": "cpu", "max_in_cpu": 10}}})
    assert on_cpu.startswith("zero_optimization.offload_param.max_in_cpu:") and 'only with device "nvme"' in on_cpu
    # DeepSpeed's defaults change nothing with another device, and are accepted
    assert zero(offload_param={"device": "cpu", "buffer_count": 5, "buffer_size": 1e8,
                               "max_in_cpu": 1e9}).zero.offload_param.nvme_path is None
    small = error_of({"train_batch_size": 2, "zero_optimization": {"offload_param": {
        "device": "nvme", "nvme_path": "/nvme", "buffer_size": 0}}})
    assert small.startswith("zero_optimization.offload_param.buffer_size:") and ">= 1" in small
    both = {"offload_param": {"device": "nvme", "nvme_path": "/nvme"}}
    assert "offload_param.device" in error_of({"train_batch_size": 2, "zero_optimization": both,
                                               "checkpoint": {"async_save": True}})


def test_offload_optimizer_nvme_keys():
    z = zero(offload_optimizer={"device": "nvme", "nvme_path": "/nvme", "buffer_count": 2, "pipeline_read": False},
             offload_param=None).zero.offload_optimizer
    assert (z.nvme, z.enabled, z.nvme_path, z.buffer_count, z.pipeline_read, z.pipeline_write) == \
        (True, True, "/nvme", 2, False, True)
    no_path = error_of({"train_batch_size": 2, "zero_optimization": {"offload_optimizer": {"device": "nvme"}}})
    assert no_path.startswith("zero_optimization.offload_optimizer.nvme_path:") and "nvme_path" in no_path
    on_cpu = error_of({"train_batch_size": 2, "zero_optimization": {"offload_optimizer": {
        "device": "cpu", "nvme_path": "/nvme"}}})
    assert 'only with device "nvme"' in on_cpu
    assert zero(offload_optimizer={"device": "cpu", "buffer_count": 4}).zero.offload_optimizer.nvme_path is None
    budget = error_of({"train_batch_size": 2, "placement": {"host_budget": "1GiB"}})
    assert budget.startswith("placement.host_budget:")
    nvme = {"offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}
    assert "async_save" in error_of({"train_batch_size": 2, "zero_optimization": nvme,
                                     "checkpoint": {"async_save": True}})


def test_aio_section():
    c = parse(aio={"block_size": 8192, "queue_depth": 4, "thread_count": 3, "single_submit": True,
                   "overlap_events": False, "use_gds": False})
    assert c.aio == cfg.AioConfig(8192, 4, 3, True, False)
    assert "multiple of 4096" in error_of({"train_batch_size": 2, "aio": {"block_size": 5000}})
    assert "GPUDirect" in error_of({"train_batch_size": 2, "aio": {"use_gds": True}})


def test_offload_pin_memory_defaults_to_deepspeeds_true():
    z = zero(offload_optimizer={"device": "cpu"}, offload_param=None).zero
    assert z.offload_optimizer == cfg.OffloadConfig("cpu", True) and z.offload_optimizer.enabled
    assert z.offload_param == cfg.OffloadConfig()


@pytest.mark.parametrize("field", ["param_persistence_threshold", "prefetch_bucket_size",
                                   "max_live_parameters", "max_reuse_distance",
                                   "model_persistence_threshold", "module_granularity_threshold"])
def test_stage3_prefix_and_plain_names(field):
    assert getattr(zero(**{f"stage3_{field}": 7}).zero, field) == 7
    assert getattr(zero(**{field: 7}).zero, field) == 7
    message = error_of({"train_batch_size": 2,
                        "zero_optimization": {f"stage3_{field}": 7, field: 7}})
    assert "same option" in message


def test_gather_16bit_aliases():
    for key in ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
                "stage3_gather_fp16_weights_on_model_save"):
        assert zero(**{key: True}).zero.gather_16bit_weights_on_model_save is True


def test_sizes_are_type_checked():
    assert zero(stage3_prefetch_bucket_size=5e7).zero.prefetch_bucket_size == 50_000_000
    for bad in (-1, 2.5, True, "5e7", float("inf")):
        assert error_of({"train_batch_size": 2, "zero_optimization": {"reduce_bucket_size": bad}}).startswith(
            "zero_optimization.reduce_bucket_size:")
    assert "must be >= 1" in error_of({"train_batch_size": 2, "zero_optimization": {"reduce_bucket_size": 0}})
    assert "must be >= 0" in error_of({"train_batch_size": 2,
                                       "zero_optimization": {"stage3_max_live_parameters": -5}})


def test_overlap_comm_and_leaf_module():
    assert zero(overlap_comm=None).zero.overlap_comm is True
    assert zero(overlap_comm=False).zero.overlap_comm is False
    leaf = zero(leaf_module={"classes": "MyBlock", "names": ["a", "a", "b"]}).zero.leaf_module
    assert leaf == cfg.LeafModuleConfig(classes=("MyBlock",), names=("a", "b"))
    assert error_of({"train_batch_size": 2, "zero_optimization": {"leaf_module": {"class": []}}}).startswith(
        "zero_optimization.leaf_module.class: unknown key")


# The sample values tried for every key DeepSpeed accepts: each key must be mapped or refused.
SAMPLES = [True, False, None, 0, 1, 5e8, 0.5, "cpu", "none", "x", {}, {"device": "cpu"},
           {"enabled": True}, ["a"]]


def _outcomes(section_of, prefix, keys):
    """Every key parses or is refused with its own error; never "unknown key" for the key itself
    (a sample value may hold an unknown nested key, which is that nested key's error)."""
    for key in keys:
        for value in SAMPLES:
            try:
                from_deepspeed(section_of(key, value), 2)
            except ConfigError as exc:
                assert not str(exc).startswith(f"{prefix}{key}: unknown key"), (key, value, str(exc))


def test_every_deepspeed_zero_key_is_mapped_or_refused():
    assert set(cfg.DEEPSPEED_ZERO_KEYS) == set(cfg._ZERO_RULES)
    _outcomes(lambda k, v: {"train_batch_size": 2, "zero_optimization": {"stage": 3, k: v}},
              "zero_optimization.", cfg.DEEPSPEED_ZERO_KEYS)


def test_every_deepspeed_top_level_key_is_mapped_or_refused():
    assert set(cfg.DEEPSPEED_TOP_LEVEL_KEYS) | set(cfg.ZERO3_TOP_LEVEL_KEYS) == set(cfg._TOP_RULES)
    _outcomes(lambda k, v: {"train_micro_batch_size_per_gpu": 1, k: v}, "", cfg.DEEPSPEED_TOP_LEVEL_KEYS)


@pytest.mark.parametrize("section, keys", [
    ("offload_param", cfg.DEEPSPEED_OFFLOAD_PARAM_KEYS),
    ("offload_optimizer", cfg.DEEPSPEED_OFFLOAD_OPTIMIZER_KEYS),
])
def test_every_deepspeed_offload_key_is_mapped_or_refused(section, keys):
    rules = cfg._OFFLOAD_PARAM_RULES if section == "offload_param" else cfg._OFFLOAD_OPTIMIZER_RULES
    zero3_only = {"overlap_step"} if section == "offload_optimizer" else set()
    assert set(keys) == set(rules) - zero3_only
    _outcomes(lambda k, v: {"train_batch_size": 2, "zero_optimization": {section: {k: v}}},
              f"zero_optimization.{section}.", keys)


@pytest.mark.parametrize("section, keys", [("bf16", cfg.DEEPSPEED_BF16_KEYS), ("fp16", cfg.DEEPSPEED_FP16_KEYS)])
def test_every_deepspeed_precision_key_is_mapped_or_refused(section, keys):
    assert set(keys) == set(cfg._BF16_RULES if section == "bf16" else cfg._FP16_RULES)
    _outcomes(lambda k, v: {"train_batch_size": 2, section: {k: v}}, f"{section}.", keys)


# ------------------------------------------------------------------- refused / accepted-only

CANDIDATES = [True, False, None, 0, 1, 2, 12345, 0.5, "x", "sum", "bf16", {"enabled": True},
              {"deepcompile": True}, {"autotp_size": 2}, {"x": 1}, ["a"]]

REFUSABLE = [
    (prefix, section, key, rule)
    for prefix, section, rules in [
        ("", lambda k, v: {"train_batch_size": 2, k: v}, cfg._TOP_RULES),
        ("zero_optimization.", lambda k, v: {"train_batch_size": 2, "zero_optimization": {k: v}},
         cfg._ZERO_RULES),
        ("zero_optimization.offload_param.", lambda k, v: {
            "train_batch_size": 2, "zero_optimization": {"offload_param": {k: v}}}, cfg._OFFLOAD_PARAM_RULES),
        ("zero_optimization.offload_optimizer.", lambda k, v: {
            "train_batch_size": 2, "zero_optimization": {"offload_optimizer": {k: v}}},
         cfg._OFFLOAD_OPTIMIZER_RULES),
        ("bf16.", lambda k, v: {"train_batch_size": 2, "bf16": {k: v}}, cfg._BF16_RULES),
        ("fp16.", lambda k, v: {"train_batch_size": 2, "fp16": {k: v}}, cfg._FP16_RULES),
        ("data_types.", lambda k, v: {"train_batch_size": 2, "data_types": {k: v}}, cfg._DATA_TYPES_RULES),
        ("checkpoint.", lambda k, v: {"train_batch_size": 2, "checkpoint": {k: v}}, cfg._CHECKPOINT_RULES),
    ]
    for key, rule in rules.items()
    if not isinstance(rule, (cfg._Map, cfg._Inert))
]
INERT = [(prefix, section, key) for prefix, section, key, _ in [
    ("", lambda k, v: {"train_batch_size": 2, k: v}, "pipeline", None),
    ("zero_optimization.", lambda k, v: {"train_batch_size": 2, "zero_optimization": {k: v}},
     "pipeline_loading_checkpoint", None),
    ("checkpoint.", lambda k, v: {"train_batch_size": 2, "checkpoint": {k: v}}, "parallel_write", None),
]]


@pytest.mark.parametrize("prefix, section, key", INERT, ids=[f"{p}{k}" for p, _, k in INERT])
def test_keys_meaningless_without_pipeline_parallelism_warn(prefix, section, key, caplog):
    for value in (True, {"stages": 4}, "bf16"):
        caplog.clear()
        with caplog.at_level("WARNING", logger="zero3"):
            from_deepspeed(section(key, value), 2)
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and f"{prefix}{key}=" in lines[0] and "no effect" in lines[0], lines


# Keys DeepSpeed reads only at stages 1/2 (or, for elastic_checkpoint, only warns about at
# stage 3): DeepSpeed's default passes in silence, any other value with one warning.
DEFAULT_QUIET = {"use_multi_rank_bucket_allreduce": True, "allgather_partitions": True,
                 "allgather_bucket_size": 500_000_000, "round_robin_gradients": False,
                 "parameter_alignment": False, "legacy_stage1": False, "ignore_unused_parameters": True,
                 "elastic_checkpoint": False}


@pytest.mark.parametrize("key", sorted(DEFAULT_QUIET))
def test_keys_deepspeed_ignores_at_stage_3_are_accepted(key, caplog):
    default = DEFAULT_QUIET[key]
    other = (not default) if isinstance(default, bool) else 200_000_000
    for value, warnings in ((default, 0), (other, 1)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="zero3"):
            from_deepspeed({"train_batch_size": 2, "zero_optimization": {"stage": 3, key: value}}, 2)
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == warnings, (value, lines)
        assert all(f"zero_optimization.{key}=" in line and "no effect" in line for line in lines)


def test_every_inert_rule_is_listed():
    rules = [cfg._TOP_RULES, cfg._ZERO_RULES, cfg._CHECKPOINT_RULES]
    inert = {k for rules_ in rules for k, r in rules_.items() if isinstance(r, cfg._Inert)}
    assert inert == {key for _, _, key in INERT} | set(DEFAULT_QUIET)


@pytest.mark.parametrize("value, expected", [(True, True), (False, False), (1, True), (0, False),
                                             ("true", True), ("False", False), ("yes", True), ("no", False),
                                             ("on", True), ("off", False), ("1", True), ("0", False)])
def test_booleans_take_deepspeeds_truthy_values(value, expected):
    c = from_deepspeed({"train_batch_size": 2, "zero_allow_untested_optimizer": value,
                        "zero_optimization": {"contiguous_gradients": value}}, 2)
    assert c.zero_allow_untested_optimizer is expected


@pytest.mark.parametrize("value", [2, "maybe", [], {"enabled": True}, None])
def test_non_boolean_flags_are_refused(value):
    message = error_of({"train_batch_size": 2, "zero_allow_untested_optimizer": value})
    assert message.startswith("zero_allow_untested_optimizer:") and "true or false" in message


def test_engine_config_reads_as_the_given_json():
    given = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    c = from_deepspeed(given, 2)
    assert c["zero_optimization"] == given["zero_optimization"] and c["zero_optimization"] is not given["zero_optimization"]
    assert c.get("zero_optimization")["offload_param"]["device"] == "cpu"
    assert c.get("bf16") is None and c.get("bf16", {}) == {} and "bf16" not in c and "zero_optimization" in c
    assert dict(c.items()) == given and list(c.keys()) == list(given)
    with pytest.raises(KeyError):
        c["fp16"]


@pytest.mark.parametrize("prefix, section, key, rule", REFUSABLE, ids=[f"{p}{k}" for p, _, k, _ in REFUSABLE])
def test_every_refused_key_gives_its_error(prefix, section, key, rule):
    refused = [v for v in CANDIDATES if isinstance(rule, cfg._Refuse) or not rule.accepts(v)]
    if not refused:  # accepted with any value (e.g. contiguous_gradients: true or false)
        return
    for value in refused:
        message = error_of(section(key, value))
        assert message.startswith(f"{prefix}{key}:"), message
        assert "zero3" in message and "(got " in message
    if isinstance(rule, cfg._Only):
        accepted = [v for v in CANDIDATES if rule.accepts(v)]
        for value in accepted:
            try:
                from_deepspeed(section(key, value), 2)
            except ConfigError as exc:  # an accepted value may still fail a cross-check elsewhere
                assert not str(exc).startswith(f"{prefix}{key}:"), str(exc)


@pytest.mark.parametrize("key", ["autotuning", "hybrid_engine", "data_efficiency", "expert_parallel"])
def test_feature_blocks_accepted_only_when_disabled(key):
    assert parse({key: {"enabled": False, "output_path": "x"}})
    assert parse({key: {}})
    message = error_of({"train_batch_size": 2, key: {"enabled": True}})
    assert message.startswith(f"{key}:") and "does not implement" in message


def test_flops_profiler_section():
    c = parse({"flops_profiler": {"enabled": True, "profile_step": 3, "module_depth": 2, "top_modules": 4,
                                  "detailed": False, "output_file": "prof/out.txt", "recompute_fwd_factor": 1.0}})
    f = c.flops_profiler
    assert (f.enabled, f.profile_step, f.module_depth, f.top_modules, f.detailed, f.output_file,
            f.recompute_fwd_factor) == (True, 3, 2, 4, False, "prof/out.txt", 1.0)
    assert not parse({"flops_profiler": {"enabled": "auto"}}).flops_profiler.enabled  # DeepSpeed's default
    assert error_of({"train_batch_size": 2, "flops_profiler": {"top_modules": 0}}).startswith(
        "flops_profiler.top_modules: must be >= 1")
    assert error_of({"train_batch_size": 2, "flops_profiler": {"profile_stpe": 1}}).startswith("flops_profiler.")


@pytest.mark.parametrize("key", ["nebula", "compression_training", "amp", "quantize_training",
                                 "sparse_gradients", "eigenvalue", "sparse_attention", "elasticity",
                                 "graph_harvesting", "curriculum_learning", "progressive_layer_drop"])
def test_keys_removed_from_deepspeed_are_refused(key):
    message = error_of({"train_batch_size": 2, key: {"enabled": False}})
    assert message.startswith(f"{key}: zero3 does not support this key") and "removed" in message


def test_default_only_blocks():
    assert parse({"activation_checkpointing": {"partition_activations": False, "number_checkpoints": None}})
    assert parse({"activation_checkpointing": {"cpu_checkpointing": True}}).activation_checkpointing.cpu_checkpointing
    assert parse({"aio": {"block_size": 1048576}})
    assert parse({"tensor_parallel": {"autotp_size": 1}})


# ------------------------------------------------------------------------ unknown keys

@pytest.mark.parametrize(
    "config, key, suggestion",
    [
        ({"train_batch_size": 2, "gradient_cliping": 1.0}, "gradient_cliping", "gradient_clipping"),
        ({"train_batch_size": 2, "zero_optimization": {"stage3_prefetch_bucket": 1}},
         "zero_optimization.stage3_prefetch_bucket", "zero_optimization.stage3_prefetch_bucket_size"),
        ({"train_batch_size": 2, "zero_optimization": {"offload_param": {"pin_mem": True}}},
         "zero_optimization.offload_param.pin_mem", "zero_optimization.offload_param.pin_memory"),
        ({"train_batch_size": 2, "zero_optimization": {"offload_optimizer": {"devices": "cpu"}}},
         "zero_optimization.offload_optimizer.devices", "zero_optimization.offload_optimizer.device"),
        ({"train_batch_size": 2, "bf16": {"enable": True}}, "bf16.enable", "bf16.enabled"),
        ({"train_batch_size": 2, "bf16": {"check_overflow": True}}, "bf16.check_overflow",
         "bf16.check_grad_overflow"),
        ({"train_batch_size": 2, "fp16": {"initial_scale": 8}}, "fp16.initial_scale", "fp16.initial_scale_power"),
        ({"train_batch_size": 2, "optimizer": {"type": "Adam", "param": {}}}, "optimizer.param", "optimizer.params"),
        ({"train_batch_size": 2, "scheduler": {"typ": "WarmupLR"}}, "scheduler.typ", "scheduler.type"),
    ],
)
def test_unknown_key_suggests_the_nearest(config, key, suggestion):
    message = error_of(config)
    assert message.startswith(f"{key}: unknown key")
    assert f"Did you mean '{suggestion}'?" in message


def test_unknown_key_far_from_everything_still_names_the_closest():
    message = error_of({"train_batch_size": 2, "zero_optimization": {"qqqqqqqq": 1}})
    assert message.startswith("zero_optimization.qqqqqqqq: unknown key") and "closest known key" in message


@pytest.mark.parametrize("key", ["comms_config", "monitor_config", "qqqqqqqq"])
def test_unknown_top_level_keys_are_ignored_with_a_warning_as_deepspeed_does(key, caplog):
    with caplog.at_level(logging.WARNING, logger="zero3"):
        c = cfg.from_deepspeed({"train_batch_size": 2, key: {"verbose": True}}, 2)
    assert c.train_batch_size == 2
    assert [r.getMessage() for r in caplog.records if key in r.getMessage()] == [
        f'zero3: config key {key}={{"verbose": true}} is accepted and has no effect: DeepSpeed 0.19.8 ignores '
        "top-level keys it does not know, and so does zero3 (docs/config.md lists the known ones)"]


def test_deepspeed_lenient_values_are_accepted(caplog):
    """fp16.auto_cast with fp16 off (DeepSpeed reads it only with fp16 on) warns and does
    nothing; steps_per_print Infinity (what Accelerate writes) is never."""
    with caplog.at_level(logging.WARNING, logger="zero3"):
        c = cfg.from_deepspeed({"train_batch_size": 2, "fp16": {"enabled": False, "auto_cast": True},
                                "steps_per_print": float("inf")}, 2)
    assert c.steps_per_print is None and c.precision.dtype == torch.float32 and not c.precision.auto_cast
    assert any("fp16.auto_cast=true is accepted and has no effect" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------- optimizer and scheduler

@pytest.mark.parametrize(
    "section, resolved",
    [
        ({"type": "Adam", "params": {"lr": 1e-3}}, "AdamW"),  # DeepSpeed: adam_w_mode defaults to true
        ({"type": "adam", "params": {"lr": 1e-3, "adam_w_mode": False}}, "Adam"),
        ({"type": "ADAMW", "params": {"lr": 1e-3, "adam_w_mode": False}}, "AdamW"),
        ({"type": "sgd", "params": {"lr": 0.1, "momentum": 0.9}}, "SGD"),
    ],
)
def test_optimizer_types(section, resolved):
    spec = parse(optimizer=section).optimizer
    assert spec.type in cfg.SUPPORTED_OPTIMIZERS and spec.resolved == resolved
    assert spec.params == section["params"]
    assert "adam_w_mode" not in spec.kwargs


def test_optimizer_kwargs_drop_deepspeed_only_params():
    spec = parse(optimizer={"type": "AdamW", "params": {
        "lr": 2e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "torch_adam": True,
        "bias_correction": True, "fp32_optimizer_states": True}}).optimizer
    assert spec.kwargs == {"lr": 2e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


@pytest.mark.parametrize(
    "section, fragment",
    [
        ({"type": "Lamb"}, "Adam, AdamW, SGD"),
        ({"type": "AdamW", "params": {"max_grad_norm": 1.0}}, "gradient_clipping"),
        ({"type": "AdamW", "params": {"betas": [0.9]}}, "two numbers"),
        ({"type": "AdamW", "params": {"weight_decy": 0.1}}, "did you mean 'weight_decay'"),
        ({"type": "AdamW", "params": {"bias_correction": False}}, "only the default"),
        ({"type": "SGD", "params": {"betas": [0.9, 0.9]}}, "unknown SGD parameter"),
        ({"type": "AdamW", "legacy_fusion": True}, "legacy"),
        ({"params": {}}, "optimizer.type"),
    ],
)
def test_optimizer_errors(section, fragment):
    assert fragment in error_of({"train_batch_size": 2, "optimizer": section})


def test_scheduler_defaults_filled():
    spec = parse(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 10}}).scheduler
    assert spec.type == spec.resolved == "WarmupLR"
    assert spec.params == {"warmup_num_steps": 10}
    assert spec.kwargs == {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 10,
                           "warmup_type": "log", "last_batch_iteration": -1}
    cosine = parse(scheduler={"type": "WarmupCosineLR", "params": {"total_num_steps": 100}}).scheduler
    assert cosine.kwargs["cos_min_ratio"] == 0.0001 and cosine.kwargs["total_num_steps"] == 100
    cycle = parse(scheduler={"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1}})
    assert cycle.scheduler.kwargs["cycle_first_step_size"] == 2000
    assert parse(scheduler={"type": "WarmupDecayLR", "params": {"total_num_steps": 50}}).scheduler


@pytest.mark.parametrize(
    "section, fragment",
    [
        ({"type": "LRRangeTest"}, "LRRangeTest is not supported"),
        ({"type": "warmuplr"}, "Did you mean 'WarmupLR'?"),
        ({"type": "StepLR"}, "WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle"),
        ({"type": "WarmupLR", "params": {"warmup_max": 1e-3}}, "did you mean 'warmup_max_lr'"),
        ({"type": "WarmupDecayLR", "params": {}}, "total_num_steps: required"),
        ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}}, "must be >= 1"),
        ({"type": "WarmupLR", "params": {"warmup_type": "cosine"}}, "warmup_type"),
    ],
)
def test_scheduler_errors(section, fragment):
    assert fragment in error_of({"train_batch_size": 2, "scheduler": section})


# -------------------------------------------------------------------------- other fields

def test_top_level_fields():
    c = parse(gradient_clipping=0.0, steps_per_print=10, wall_clock_breakdown=True,
              zero_allow_untested_optimizer=True, prescale_gradients=True, gradient_predivide_factor=2,
              memory_breakdown=True, dump_state=True, disable_python_gc=True, dataloader_drop_last=True,
              log_level="INFO", vocabulary_size=50257,
              checkpoint={"tag_validation": "fail"},
              timers={"throughput": {"enabled": False, "synchronized": False}})
    assert c.gradient_clipping == 0.0 and c.steps_per_print == 10 and c.wall_clock_breakdown
    assert c.zero_allow_untested_optimizer and c.prescale_gradients and c.gradient_predivide_factor == 2.0
    assert c.memory_breakdown and c.dump_state and c.disable_python_gc and c.dataloader_drop_last
    assert c.log_level == "info" and c.vocabulary_size == 50257 and c.checkpoint_tag_validation == "FAIL"
    assert not c.throughput_timer_enabled and not c.throughput_timer_synchronized
    d = parse()
    assert d.steps_per_print is None and d.checkpoint_tag_validation == "WARN" and d.throughput_timer_enabled


def test_docs_list_every_key():
    docs = pathlib.Path(__file__).resolve().parents[2] / "docs" / "config.md"
    text = docs.read_text()
    missing = [f"{section}.{key}" for section, key, _, _ in cfg.describe_keys() if f"`{key}`" not in text]
    assert not missing


def test_sequence_parallel_keys():
    """Batch arithmetic over world / sequence_parallel_size (DeepSpeed's), the checked
    data_parallel_size, the reduce dtype under sequence parallelism, the long_sequence section."""
    c = from_deepspeed({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
                        "sequence_parallel_size": 2, "bf16": {"enabled": True}}, 8)
    assert (c.train_batch_size, c.sequence_parallel_size, c.data_parallel_size) == (24, 2, 4)
    assert c.gradient_reduce_dtype == torch.float32, "DeepSpeed reduces in fp32 under sequence parallelism"
    c = from_deepspeed({"train_batch_size": 8, "sequence_parallel_size": 4, "data_parallel_size": 2,
                        "seq_parallel_communication_data_type": "bf16"}, 8)
    assert c.train_micro_batch_size_per_gpu == 4 and c.gradient_reduce_dtype == torch.bfloat16
    assert from_deepspeed({"train_batch_size": 4, "bf16": {"enabled": True}}, 4).gradient_reduce_dtype == torch.bfloat16
    assert from_deepspeed({"train_batch_size": 4}, 4, sequence_parallel_size=2).train_micro_batch_size_per_gpu == 2
    with pytest.raises(ConfigError, match="does not divide the world size 6"):
        from_deepspeed({"train_batch_size": 4, "sequence_parallel_size": 4}, 6)
    with pytest.raises(ConfigError, match="data_parallel_size.*8 / 2 = 4"):
        from_deepspeed({"train_batch_size": 8, "sequence_parallel_size": 2, "data_parallel_size": 2}, 8)
    with pytest.raises(ConfigError, match="differs from the mpu"):
        from_deepspeed({"train_batch_size": 4, "sequence_parallel_size": 4}, 4, sequence_parallel_size=2)
    with pytest.raises(ConfigError, match="sequence_parallel_size"):
        from_deepspeed({"train_batch_size": 4, "sequence_parallel_size": 0}, 4)
    c = from_deepspeed({"train_batch_size": 2, "long_sequence": {"tiled_mlp": True, "mlp_tiles": "auto",
                                                                 "loss_tile_bytes": "256MiB", "tiled_loss": True}}, 2)
    assert c.long_sequence.tiled_mlp and c.long_sequence.mlp_tiles is None and c.long_sequence.tiled_loss
    assert c.long_sequence.loss_tile_bytes == 256 << 20 and not c.long_sequence.offload_hidden_states
    assert c.long_sequence.host_bytes is None and c.long_sequence.nvme_path is None
    c = from_deepspeed({"train_batch_size": 2, "long_sequence": {"offload_hidden_states": True, "host_bytes": "60GiB",
                                                                 "nvme_path": "/local_nvme"}}, 2)
    assert c.long_sequence.host_bytes == 60 << 30 and c.long_sequence.nvme_path == "/local_nvme"
    with pytest.raises(ConfigError, match="long_sequence.nvme_path"):
        from_deepspeed({"train_batch_size": 2, "long_sequence": {"nvme_path": ""}}, 2)
    with pytest.raises(ConfigError, match="long_sequence.tiled_mpl.*tiled_mlp"):
        from_deepspeed({"train_batch_size": 2, "long_sequence": {"tiled_mpl": True}}, 2)
    with pytest.raises(ConfigError, match="long_sequence.mlp_tiles"):
        from_deepspeed({"train_batch_size": 2, "long_sequence": {"mlp_tiles": 0}}, 2)
