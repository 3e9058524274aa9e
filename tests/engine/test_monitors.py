"""DeepSpeed's monitor sections on 2 gloo ranks: rank 0 writes each optimizer step's events
with DeepSpeed 0.19.8's names at the global sample count, as CSV files (`Train_Samples_lr.csv`,
header `step,lr`) and TensorBoard event files under `<output_path>/<job_name>/`; an enabled
monitor whose package is missing is an error on every rank naming the install command."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest
import torch
from common import config, make_batches, make_model
from harness import run_ranks

MICRO, GA, STEPS = 2, 2, 3
NAMES = ["lr", "loss_scale", "elapsed_time_ms_forward", "elapsed_time_ms_backward", "elapsed_time_ms_backward_inner",
         "elapsed_time_ms_backward_allreduce", "elapsed_time_ms_step"]


def train_with_monitors(rank: int, world: int, folder: str, sections: dict) -> str:
    import zero3

    cfg = {**config(MICRO, GA), "fp16": {"enabled": True, "initial_scale_power": 8}, "wall_clock_breakdown": True,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **sections}
    try:
        engine, *_ = zero3.initialize(model=make_model(), config=cfg)
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"
    batches = make_batches(STEPS * GA * world, MICRO)
    for step in range(STEPS):
        for micro in range(GA):
            x, y = batches[(step * GA + micro) * world + rank]
            engine.backward(engine(x.half(), y.half()))
            engine.step()
    engine.destroy()
    return "trained"


def _rows(path: Path) -> list[list[str]]:
    with open(path, newline="") as handle:
        return list(csv.reader(handle))


def test_csv_and_tensorboard_events_with_deepspeeds_names(tmp_path):
    pytest.importorskip("tensorboard", reason="the monitor extra is not installed: pip install zero3[monitor]")
    sections = {"csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "job"},
                "tensorboard": {"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "job"}}
    assert run_ranks(train_with_monitors, 2, str(tmp_path), sections) == ["trained", "trained"]
    samples = [str(MICRO * GA * 2 * (step + 1)) for step in range(STEPS)]  # train_batch_size a step
    folder = tmp_path / "csv" / "job"
    assert sorted(p.name for p in folder.iterdir()) == sorted(f"Train_Samples_{n}.csv" for n in NAMES)
    lr = _rows(folder / "Train_Samples_lr.csv")
    assert lr == [["step", "lr"]] + [[s, "0.1"] for s in samples], "one row a step, written by rank 0 only"
    assert [r[0] for r in _rows(folder / "Train_Samples_loss_scale.csv")[1:]] == samples
    assert float(_rows(folder / "Train_Samples_loss_scale.csv")[1][1]) == 256.0
    forward = _rows(folder / "Train_Samples_elapsed_time_ms_forward.csv")
    assert forward[0] == ["step", "elapsed_time_ms_forward"] and all(float(v) > 0 for _, v in forward[1:])

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb" / "job"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == sorted(f"Train/Samples/{n}" for n in NAMES)
    scalars = events.Scalars("Train/Samples/lr")
    assert [e.step for e in scalars] == [int(s) for s in samples]
    assert [e.value for e in scalars] == pytest.approx([0.1] * STEPS)


def test_a_missing_monitor_package_is_an_error_on_every_rank(tmp_path):
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    seen = run_ranks(train_with_monitors, 2, str(tmp_path), {"wandb": {"enabled": True, "project": "p"}})
    for text in seen:
        assert text.startswith("MonitorUnavailableError: the config's wandb section is enabled, but the wandb "
                               "package is not installed: pip install wandb"), text


def comms_logged(rank: int, world: int) -> tuple[str, dict]:
    import contextlib
    import io

    import zero3
    from zero3.platform.comms_log import COMMS_LOGGER

    cfg = {**config(MICRO, 1), "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "comms_logger": {"enabled": True, "prof_all": True}}
    engine, *_ = zero3.initialize(model=make_model(), config=cfg)
    COMMS_LOGGER.reset()
    before = engine.comm.counters.snapshot()
    for x, y in make_batches(2, MICRO, seed=rank):
        engine.backward(engine(x, y))
        engine.step()
    after = engine.comm.counters.snapshot()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        zero3.comm.log_summary()
    calls = {op: after[op][0] - before.get(op, (0, 0))[0] for op in after}
    engine.destroy()
    return printed.getvalue(), calls


def test_comms_logger_times_every_collective_and_prints_deepspeeds_table():
    (table, calls), (other, _) = run_ranks(comms_logged, 2)
    assert other == "", "only rank 0 prints the summary"
    lines = table.splitlines()
    assert lines[0] == "zero3 communication summary:" and lines[1].split()[:3] == ["Comm.", "Op", "Message"]
    counted: dict[str, int] = {}
    for line in lines[2:]:
        op, count = line.split()[0], int(line.split()[3])
        counted[op] = counted.get(op, 0) + count
        assert float(line.split()[4]) > 0, line  # total latency
    assert counted == {op: n for op, n in calls.items() if n}, (counted, calls)
    assert counted["all_gather"] > 0 and counted["reduce_scatter"] > 0


def test_flops_profiler_prints_deepspeeds_summary_at_profile_step(tmp_path):
    """rank 0 profiles the first forward of optimizer step 1 (the second window) and writes
    DeepSpeed's summary: the parameters of the whole model, 2 flops a multiply-accumulate of
    each Linear, every latency line (wall_clock_breakdown is on), the aggregated profile per
    depth and the module tree. Rank 1 writes nothing."""
    out = tmp_path / "rank0" / "profile.txt"
    section = {"flops_profiler": {"enabled": True, "profile_step": 1, "module_depth": -1, "top_modules": 2,
                                  "detailed": True, "output_file": str(out)}}
    assert run_ranks(train_with_monitors, 2, str(tmp_path), section) == ["trained", "trained"]
    text = out.read_text()
    model = make_model()
    linear_flops = sum(2 * MICRO * m.in_features * m.out_features for m in model.modules()
                       if isinstance(m, torch.nn.Linear))
    params = sum(p.numel() for p in model.parameters())
    assert "Profile Summary at step 1:" in text
    fields = dict(re.match(r"^(.*?:)\s+(.*?)\s*$", line).groups() for line in text.splitlines()
                  if re.match(r"^[a-z].*:\s{2,}\S", line))
    from zero3.monitor.flops_profiler import number_to_string, params_to_string
    assert fields["world size:"] == "2" and fields["batch size per GPU:"] == str(MICRO)
    assert fields["params per GPU:"] == params_to_string(params)
    assert fields["fwd flops per GPU:"] == number_to_string(linear_flops)
    assert fields["fwd MACs per GPU:"] == number_to_string(linear_flops // 2) + "MACs"
    for label in ("fwd latency:", "bwd latency:", "step latency:", "iter latency:", "samples/second:"):
        assert label in fields, label
    block = sum(2 * MICRO * 24 * 24 for _ in model.blocks)  # a ModuleList is never called: its children's sum
    assert f"'ModuleList': '{number_to_string(block // 2)}MACs'" in text  # the aggregated profile, by class
    head = 2 * MICRO * 24 * 5
    assert f"(head): Linear({params_to_string(24 * 5 + 5)} = " in text
    assert f"{number_to_string(head // 2)}MACs" in text
    assert not (tmp_path / "rank1").exists()
