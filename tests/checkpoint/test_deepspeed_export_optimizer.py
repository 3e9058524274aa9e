"""What `zero3 checkpoint export-deepspeed` writes for the optimizer and sub_group_size the DeepSpeed run builds.

zero3 checkpoints record the engine's config (common.pt "ds_config"); the export takes the
DeepSpeed run's `sub_group_size` and optimizer from it (checkpoint/deepspeed/export_target.py).
One 2-rank run per config, each with two param groups and `sub_group_size` 40:

- `fused`: the config's AdamW, so DeepSpeed builds FusedAdam (groups need bias_correction,
  the step is a Python int);
- `cpu_adam`: the same under offload_optimizer cpu, DeepSpeedCPUAdam (also amsgrad);
- `torch_adam`: the same with torch_adam, torch.optim.AdamW (torch's groups, tensor step);
- `client`: a client torch optimizer and no optimizer section.

Real DeepSpeed 0.19.8 loading and stepping these exports: tests/deepspeed_compare/
export_config_adam.py and RESULTS.md. Here only the files are read, without DeepSpeed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import run_ranks
from torch import nn

WORLD = 2
SUB_GROUP_SIZE = 40
CASES = ("fused", "cpu_adam", "torch_adam", "client")


def case_config(case: str) -> dict:
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3, "sub_group_size": SUB_GROUP_SIZE}}
    if case != "client":
        params = {"lr": 1e-2, "weight_decay": 0.01, **({"torch_adam": True} if case == "torch_adam" else {})}
        config["optimizer"] = {"type": "AdamW", "params": params}
    if case == "cpu_adam":
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return config


def save_worker(rank: int, world: int, root: str) -> None:
    import zero3

    for case in CASES:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
        weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
        groups = [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0, "lr": 5e-3}]
        optimizer = torch.optim.AdamW(groups, lr=1e-2) if case == "client" else None
        engine, _, _, _ = zero3.initialize(model=model, optimizer=optimizer,
                                           model_parameters=None if optimizer else groups, config=case_config(case))
        for step in range(2):
            x = torch.randn(2, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            engine.backward(engine(x).square().mean())
            engine.step()
        engine.save_checkpoint(f"{root}/{case}")
        engine.destroy()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("export_optimizer")
    run_ranks(save_worker, WORLD, str(root), timeout=300)
    return root


def _export(src: Path, dst: Path, *extra: str) -> int:
    from zero3.cli import main

    return main(["checkpoint", "export-deepspeed", str(src), str(dst), "--world-size", str(WORLD), *extra])


def _optimizer_states(dst: Path) -> list[dict]:
    from zero3.checkpoint.deepspeed.unpickle import load_deepspeed_file

    return [load_deepspeed_file(dst / "global_step2" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
            ["optimizer_state_dict"]["optimizer_state_dict"] for rank in range(WORLD)]


def test_checkpoints_record_the_config_they_were_trained_with(saved):
    from zero3.checkpoint import format as ckpt

    common = ckpt.unpickle_file(saved / "cpu_adam" / "global_step2" / ckpt.COMMON)
    assert common["ds_config"]["zero_optimization"] == {"stage": 3, "sub_group_size": SUB_GROUP_SIZE,
                                                       "offload_optimizer": {"device": "cpu"}}
    assert common["ds_config"]["optimizer"]["type"] == "AdamW"


def test_without_flags_the_export_takes_the_recorded_sub_group_size(saved, tmp_path, capsys):
    assert _export(saved / "fused", tmp_path / "recorded") == 0
    out = capsys.readouterr().out
    assert "sub_group_size 40 (from the checkpoint's config)" in out
    # per rank: weights 32 + 32 + 8 elements, biases 4 + 4 + 1: the weights make 2 sub-groups, the biases 1
    assert "3 sub-groups" in out
    assert _export(saved / "fused", tmp_path / "flag", "--sub-group-size", "1000000000") == 0
    out = capsys.readouterr().out
    assert "2 sub-groups" in out and "sub_group_size 1000000000 (from --sub-group-size)" in out


@pytest.mark.parametrize("case, optimizer, extra_keys, step_type", [
    ("fused", "fused", {"bias_correction": True}, int),
    ("cpu_adam", "cpu-adam", {"bias_correction": True, "amsgrad": False}, int),
    ("torch_adam", "torch", {}, torch.Tensor),
    ("client", "torch", {}, torch.Tensor),
])
def test_groups_and_steps_are_written_for_the_optimizer_the_recorded_config_builds(
        saved, tmp_path, capsys, case, optimizer, extra_keys, step_type):
    assert _export(saved / case, tmp_path / "ds") == 0
    assert f"for DeepSpeed's {optimizer} optimizer (from the checkpoint's config" in capsys.readouterr().out
    for state in _optimizer_states(tmp_path / "ds"):
        groups = state["param_groups"]
        assert [g["params"] for g in groups] == [[0, 1], [2]]
        assert [(g["lr"], g["weight_decay"]) for g in groups] == [(1e-2, 0.1), (5e-3, 0.0)]
        for group in groups:
            assert {"lr", "betas", "eps", "weight_decay"} <= set(group)
            assert {k: group.get(k) for k in extra_keys} == extra_keys
        steps = [state["state"][i]["step"] for i in sorted(state["state"])]
        assert all(type(s) is step_type or isinstance(s, step_type) for s in steps)
        assert [float(s) for s in steps] == [2.0, 2.0, 2.0]


def test_the_optimizer_flag_overrides_the_recorded_config(saved, tmp_path, capsys):
    assert _export(saved / "client", tmp_path / "ds", "--optimizer", "cpu-adam") == 0
    assert "cpu-adam optimizer (from --optimizer" in capsys.readouterr().out
    for state in _optimizer_states(tmp_path / "ds"):
        assert all(g["bias_correction"] is True and g["amsgrad"] is False for g in state["param_groups"])
        assert all(type(entry["step"]) is int for entry in state["state"].values())


@pytest.mark.parametrize("config, size, optimizer", [
    (None, 1_000_000_000, "torch"),  # saved before zero3 recorded its config
    ({"zero_optimization": {"sub_group_size": "auto"}}, 1_000_000_000, "torch"),  # a Trainer's "auto"
    ({"zero_optimization": {"sub_group_size": 1e3}, "optimizer": {"type": "adam"}}, 1000, "fused"),
    ({"optimizer": {"type": "Adam", "params": {"torch_adam": "true"}}}, 1_000_000_000, "torch"),
    ({"optimizer": {"type": "AdamW"}, "zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
     1_000_000_000, "cpu-adam"),
    ({"optimizer": {"type": "SGD"}}, 1_000_000_000, "torch"),
])
def test_the_target_follows_deepspeeds_choice_for_the_recorded_config(config, size, optimizer):
    from zero3.checkpoint.deepspeed.export_target import resolve

    target = resolve({"ds_config": config}, None, None)
    assert (target.sub_group_size, target.optimizer) == (size, optimizer)
    overridden = resolve({"ds_config": config}, 7, "cpu-adam")
    assert (overridden.sub_group_size, overridden.sub_group_size_from) == (7, "from --sub-group-size")
    assert (overridden.optimizer, overridden.optimizer_from) == ("cpu-adam", "from --optimizer")


def test_a_group_that_lacks_what_the_optimizer_reads_is_refused_naming_it():
    from zero3.checkpoint import format as ckpt
    from zero3.checkpoint.deepspeed.export_target import deepspeed_param_group, resolve

    target = resolve({"ds_config": {"optimizer": {"type": "AdamW"}}}, None, None)
    with pytest.raises(ckpt.CheckpointError, match=r"param group 1 .* lacks \['betas', 'eps'\].*--optimizer"):
        deepspeed_param_group({"lr": 0.1, "weight_decay": 0.0}, target, 1)


def test_an_export_imported_back_exports_for_the_same_deepspeed_run(saved, tmp_path, capsys):
    from zero3.cli import main

    assert _export(saved / "cpu_adam", tmp_path / "ds") == 0
    assert main(["checkpoint", "import-deepspeed", str(tmp_path / "ds"), str(tmp_path / "back")]) == 0
    capsys.readouterr()
    assert _export(tmp_path / "back", tmp_path / "again") == 0
    out = capsys.readouterr().out
    assert "sub_group_size 40 (from the checkpoint's config)" in out and "cpu-adam optimizer" in out
