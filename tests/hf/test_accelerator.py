"""`zero3.hf.Accelerator`: an Accelerate custom loop (examples/accelerate_loop.py) on 2 gloo
ranks, in a venv without DeepSpeed, one launch:

- the loop trains (losses fall), `clip_grad_norm_` returns the engine's norms, no step is
  reported skipped, the scheduler is Accelerate's (stepped once per process per update);
- `save_state` mid-run and `load_state` in a new Accelerator resume exactly (the losses of
  the rest of the run and the final weights bit for bit, dropout included);
- `get_state_dict` gives whole tensors on rank 0 only, `save_model` writes them for
  `from_pretrained`, `unwrap_model` gives the user's module;
- errors on every rank: no config, an optimizer in the config and in the code, a second
  trained model;
- `zero3 launch` with an Accelerate DeepSpeed yaml; the loop's losses equal DeepSpeed's
  through Accelerate (a fixture DeepSpeed wrote).
"""

from __future__ import annotations

import importlib.util

import pytest
from trl_setup import ENV, ROOT  # first: skips without the hf extra, puts examples/ on sys.path

# isort: split
import accelerate_loop as L  # noqa: E402
import torch  # noqa: E402
from harness import run_ranks  # noqa: E402

STEPS, SAVE_AT = 6, 3


def accelerator_flow(rank: int, world: int, folder: str) -> dict:
    import os

    os.environ.update(ENV)
    out = {"straight": L.train("zero3", folder, STEPS, 0, save_at=SAVE_AT)}
    out["resumed"] = L.train("zero3", folder, STEPS, SAVE_AT, resume_from=os.path.join(folder, "state"))
    out["errors"] = _errors()
    return out


def _errors() -> dict[str, str]:
    from zero3.hf import Accelerator, Zero3AcceleratorError

    seen = {}
    try:
        Accelerator(cpu=True)
    except Zero3AcceleratorError as exc:
        seen["no_config"] = str(exc)
    accelerator = Accelerator(cpu=True, zero3_config={**L.DS_CONFIG, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    model = L.build_model()
    try:
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    except Zero3AcceleratorError as exc:
        seen["twice"] = str(exc)
    accelerator = Accelerator(cpu=True, zero3_config={**L.DS_CONFIG, "train_micro_batch_size_per_gpu": 2})  # no loader here
    first = L.build_model()
    accelerator.prepare(first, torch.optim.SGD(first.parameters(), lr=0.1))
    second = L.build_model()
    try:
        accelerator.prepare(second, torch.optim.SGD(second.parameters(), lr=0.1))
    except Zero3AcceleratorError as exc:
        seen["second"] = str(exc)
    accelerator.free_memory()
    return seen


@pytest.fixture(scope="module")
def flow(tmp_path_factory):
    folder = tmp_path_factory.mktemp("accelerate")
    return folder, run_ranks(accelerator_flow, 2, str(folder), timeout=600)


def test_the_venv_has_no_deepspeed():
    assert importlib.util.find_spec("deepspeed") is None


def test_the_loop_trains_with_the_engines_norms_and_accelerates_scheduler(flow):
    _, ranks = flow
    straight = ranks[0]["straight"]
    assert len(straight["losses"]) == STEPS * L.ACCUMULATION
    assert sum(straight["losses"][-4:]) < sum(straight["losses"][:4])
    assert ranks[0]["straight"]["losses"] != ranks[1]["straight"]["losses"]  # each rank its own batches
    assert len(straight["norms"]) == STEPS and all(n > 0 and n == n for n in straight["norms"])
    assert straight["norms"] == ranks[1]["straight"]["norms"]  # one global norm
    assert straight["skipped"] == [False] * STEPS
    # get_linear_schedule_with_warmup(2 warm-up, 4 * STEPS total) stepped by Accelerate's
    # AcceleratedScheduler: once per process (2) per update, as it steps DeepSpeed's optimizer
    expected = [3e-3 * min((2 * k) / 2, max(0.0, (4 * STEPS - 2 * k) / (4 * STEPS - 2))) for k in range(1, STEPS + 1)]
    assert straight["lrs"] == pytest.approx(expected, rel=1e-9)


def test_save_state_and_load_state_resume_exactly(flow):
    _, ranks = flow
    for seen in ranks:
        assert seen["resumed"]["losses"] == seen["straight"]["losses"][SAVE_AT * L.ACCUMULATION:]
        assert seen["resumed"]["norms"] == seen["straight"]["norms"][SAVE_AT:]
    straight, resumed = ranks[0]["straight"]["state"], ranks[0]["resumed"]["state"]
    assert straight.keys() == resumed.keys()
    for name, value in straight.items():
        assert torch.equal(resumed[name], value), name


def test_whole_weights_on_rank_0_and_save_model(flow):
    from safetensors.torch import load_file

    folder, ranks = flow
    state = ranks[0]["straight"]["state"]
    assert ranks[1]["straight"]["state"] is None
    reference = L.build_model()
    assert {k: tuple(v.shape) for k, v in state.items()} == \
        {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    assert ranks[0]["straight"]["unwrapped"] == "LlamaForCausalLM"
    written = load_file(str(folder / "model" / "model.safetensors"))
    resumed = ranks[0]["resumed"]["state"]  # the last save_model: the resumed run's
    assert written.keys() == resumed.keys()
    for name, value in written.items():
        assert torch.equal(value.float(), resumed[name]), name


def test_errors_on_every_rank(flow):
    _, ranks = flow
    for seen in ranks:
        assert "zero3_config=" in seen["errors"]["no_config"]
        assert "in the DeepSpeed config and in the code" in seen["errors"]["twice"]
        assert "second Accelerator" in seen["errors"]["second"]


def test_zero3_launch_with_an_accelerate_deepspeed_yaml(tmp_path):
    """`zero3 launch --config_file ds.yaml` (Accelerate's flags and yaml; DeepSpeed not
    installed) starts 2 CPU ranks whose `Accelerator()` takes the yaml's DeepSpeed JSON: the
    loop trains with the JSON's accumulation (2: 12 micro-batches for 6 steps) and resumes
    exactly."""
    import json
    import os
    import subprocess
    import sys

    from harness import free_port

    (tmp_path / "ds.json").write_text(json.dumps({**L.DS_CONFIG, "gradient_accumulation_steps": 2}))
    (tmp_path / "ds.yaml").write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n"
        f"  deepspeed_config_file: {tmp_path / 'ds.json'}\n  zero3_init_flag: false\nnum_processes: 2\n"
        f"num_machines: 1\nmachine_rank: 0\nmain_process_ip: 127.0.0.1\nmain_process_port: {free_port()}\n"
        "use_cpu: true\n")
    out = tmp_path / "losses.json"
    done = subprocess.run([sys.executable, "-m", "zero3.cli", "launch", "--config_file", str(tmp_path / "ds.yaml"),
                           str(ROOT / "examples" / "accelerate_loop.py"), "--dir", str(tmp_path), "--engine",
                           "zero3_launched", "--out", str(out)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **ENV, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "after the resume the same" in done.stdout, done.stdout[-2000:]
    seen = json.loads(out.read_text())
    assert len(seen["losses"]) == STEPS * 2 and len(seen["norms"]) == STEPS


def loop_as_deepspeed_runs_it(rank: int, world: int, folder: str) -> dict:
    import os

    os.environ.update(ENV)
    return L.train("zero3", folder, STEPS, 0, accelerate_cpu=False)


def test_the_loop_gives_deepspeeds_losses_through_accelerate(tmp_path):
    """The same loop under DeepSpeed 0.19.8 through accelerate.Accelerator (recorded by
    `scripts/make_deepspeed_fixtures.sh --accelerate-loop` in DeepSpeed's own venv): on a CPU
    machine Accelerate runs DeepSpeed with its state at one process (cpu=False), so zero3 runs
    the loop the same way here. Losses and learning rates bit for bit, gradient norms to 1e-6."""
    import json

    expected = json.loads((ROOT / "tests" / "fixtures" / "deepspeed" / "accelerate_loop_w2" /
                           "deepspeed_result.json").read_text())
    seen = run_ranks(loop_as_deepspeed_runs_it, 2, str(tmp_path), timeout=600)[0]
    assert seen["losses"] == expected["losses"]
    assert seen["lrs"] == expected["lrs"]
    assert seen["norms"] == pytest.approx(expected["norms"], rel=1e-6, abs=1e-7)


def _short_loop(prebuilt: bool) -> list[float]:
    import zero3
    from zero3.hf import Accelerator

    config = {**L.DS_CONFIG, "train_micro_batch_size_per_gpu": L.MICRO, "gradient_accumulation_steps": L.ACCUMULATION,
              "gradient_clipping": 1.0, "zero_optimization": {"stage": 3}}
    accelerator = Accelerator(zero3_config=config, cpu=True, gradient_accumulation_steps=L.ACCUMULATION)
    model = L.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if prebuilt:  # what a script written for deepspeed.initialize hands to prepare
        model, optimizer, _, _ = zero3.initialize(model=model, optimizer=optimizer, config=config)
    loader = torch.utils.data.DataLoader(L.dataset(3 * L.ACCUMULATION * L.MICRO * 2), batch_size=L.MICRO)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    accelerator.free_memory()
    return losses


def prebuilt_engine(rank: int, world: int) -> tuple[list[float], list[float]]:
    return _short_loop(prebuilt=False), _short_loop(prebuilt=True)


def test_an_engine_from_initialize_handed_to_prepare_trains_as_one_prepare_builds():
    for built_by_prepare, handed_over in run_ranks(prebuilt_engine, 2):
        assert len(handed_over) == 3 * L.ACCUMULATION
        assert handed_over == built_by_prepare


def overflowing_fp16(rank: int, world: int) -> dict:
    """fp16 with a loss scale of 2**40: the first updates overflow and are skipped."""
    from transformers import get_constant_schedule_with_warmup

    from zero3.hf import Accelerator

    config = {**L.DS_CONFIG, "fp16": {"enabled": "auto", "initial_scale_power": 40}}
    accelerator = Accelerator(zero3_config=config, cpu=True, mixed_precision="fp16", gradient_accumulation_steps=1)
    model = L.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = get_constant_schedule_with_warmup(optimizer, num_warmup_steps=10)
    loader = torch.utils.data.DataLoader(L.dataset(4 * L.MICRO * 2), batch_size=L.MICRO)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    seen = {"skipped": [], "optimizer_skipped": [], "lrs": [], "precision": accelerator.mixed_precision}
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        seen["skipped"].append(accelerator.optimizer_step_was_skipped)
        seen["optimizer_skipped"].append(optimizer.step_was_skipped)
        seen["lrs"].append(scheduler.get_last_lr()[0])
    accelerator.free_memory()
    return seen


def test_an_overflow_is_a_skipped_step_and_the_scheduler_waits():
    for seen in run_ranks(overflowing_fp16, 2):
        assert seen["precision"] == "fp16"
        assert seen["skipped"] == [True] * 4 and seen["optimizer_skipped"] == [True] * 4
        assert seen["lrs"] == [0.0] * 4  # Accelerate steps no scheduler after a skipped update


def automatic_naming(rank: int, world: int, folder: str) -> dict:
    """Accelerate's ProjectConfiguration: save_state() names checkpoint_<n> folders, keeps
    total_limit of them, and load_state() with no folder takes the newest."""
    import os

    from accelerate.utils import ProjectConfiguration

    from zero3.hf import Accelerator

    project = ProjectConfiguration(project_dir=folder, automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(zero3_config={**L.DS_CONFIG, "train_micro_batch_size_per_gpu": 2}, cpu=True,
                              project_config=project)
    model = L.build_model()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    batch = L.dataset(2)
    inputs = {k: torch.stack([row[k] for row in batch]) for k in batch[0]}
    steps = []
    for _ in range(3):
        accelerator.backward(model(**inputs).loss)
        accelerator.save_state()
        steps.append(model.global_steps)
    accelerator.backward(model(**inputs).loss)  # a fourth update, then back to the third's state
    accelerator.load_state()
    seen = {"steps": steps, "after_load": model.global_steps,
            "folders": sorted(os.listdir(os.path.join(folder, "checkpoints")))}
    accelerator.free_memory()
    return seen


def test_automatic_checkpoint_naming(tmp_path):
    for seen in run_ranks(automatic_naming, 2, str(tmp_path)):
        assert seen["steps"] == [1, 2, 3]
        assert seen["folders"] == ["checkpoint_1", "checkpoint_2"]
        assert seen["after_load"] == 3
    assert (tmp_path / "checkpoints" / "checkpoint_2" / "pytorch_model").is_dir()
