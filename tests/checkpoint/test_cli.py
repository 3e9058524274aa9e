"""The `zero3` command, run as a subprocess: inspect, verify and export checkpoints.

Checkpoints come from one 2-rank run; the commands (each a fresh process: no
torch.distributed, only the files) run side by side to keep the wall time down.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from common import config, make_batches, make_model, two_param_groups
from harness import run_ranks
from safetensors.torch import load_file

MICRO = 2


def make_checkpoints(rank: int, world: int, root: str) -> None:
    import zero3
    from zero3.checkpoint.export import consolidated_state_dict, full_fp32_param, save_fp32_model

    root = Path(root)
    batches = make_batches(8 * world, MICRO)

    def run(engine, steps: range, bf16: bool = False):
        for step in steps:
            x, y = batches[step * world + rank]
            if bf16:
                x, y = x.bfloat16(), y.bfloat16()
            engine.backward(engine(x, y))
            engine.step()

    model = make_model(seed=0)
    engine, _, _, _ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model)),
                                       config=config(MICRO, 1, threshold=30))
    run(engine, range(2))
    engine.save_checkpoint(root / "ckpt", tag="step2")
    run(engine, range(2, 4))
    engine.save_checkpoint(root / "ckpt")  # tag global_step4, `latest`
    state = consolidated_state_dict(engine)
    if rank == 0:
        torch.save(state, root / "fp32_state.pt")

    model = make_model(seed=1)
    cfg = config(MICRO, 1, threshold=30)
    cfg["bf16"] = {"enabled": True}
    engine, _, _, _ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model)), config=cfg)
    run(engine, range(3), bf16=True)
    engine.save_checkpoint(root / "bf16")
    engine.save_16bit_model(root, "bf16_model.safetensors")
    save_fp32_model(engine, root, "bf16_fp32.safetensors")
    masters = {n: full_fp32_param(engine, p) for n, p in engine.module.named_parameters()}
    if rank == 0:
        torch.save(masters, root / "bf16_masters.pt")


def zero3_command() -> list[str]:
    script = Path(sys.executable).with_name("zero3")
    return [str(script)] if script.exists() else [sys.executable, "-m", "zero3.cli"]


def run_all(commands: dict[str, list[str]]) -> dict[str, subprocess.CompletedProcess]:
    """Run every `zero3 ...` command at once; name -> finished process (text output)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", ZERO3_ACCELERATOR="cpu")
    procs = {name: subprocess.Popen(zero3_command() + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=env)
             for name, args in commands.items()}
    done = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=240)
        done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    run_ranks(make_checkpoints, 2, str(root))
    ckpt = root / "ckpt"
    shutil.copytree(ckpt / "step2", ckpt / "broken")
    (ckpt / "broken" / "manifest.json").unlink()  # as after a crash before the manifest
    damaged = ckpt / "damaged"
    shutil.copytree(ckpt / "step2", damaged)
    data = (damaged / "rank00000-of-00002.safetensors").read_bytes()
    (damaged / "rank00000-of-00002.safetensors").write_bytes(data[:-3])
    data = bytearray((damaged / "rank00001-of-00002.safetensors").read_bytes())
    data[-5] ^= 0x01
    (damaged / "rank00001-of-00002.safetensors").write_bytes(bytes(data))
    (damaged / "rank00001-of-00002.state.pt").unlink()
    (damaged / "leftover.bin").write_bytes(b"x")
    return root


@pytest.fixture(scope="module")
def results(root) -> dict[str, subprocess.CompletedProcess]:
    ckpt = str(root / "ckpt")
    return run_all({
        "inspect": ["checkpoint", "inspect", ckpt],
        "verify": ["checkpoint", "verify", ckpt],
        "verify-damaged": ["checkpoint", "verify", ckpt, "--tag", "damaged"],
        "export": ["checkpoint", "export", ckpt, str(root / "out32.safetensors")],
        "export-damaged": ["checkpoint", "export", ckpt, str(root / "never.safetensors"), "--tag", "damaged"],
        "export-bf16": ["checkpoint", "export", str(root / "bf16"), str(root / "out16.safetensors"),
                        "--dtype", "bf16"],
        "export-fp16": ["checkpoint", "export", str(root / "bf16" / "global_step3"),
                        str(root / "outfp16.safetensors"), "--dtype", "fp16"],
    })


def test_inspect_lists_tags_steps_world_size_sizes_and_completeness(root, results):
    r = results["inspect"]
    assert r.returncode == 0, r.stderr
    lines = {line.split()[0]: line for line in r.stdout.splitlines()[3:]}
    assert "latest: global_step4\n" in r.stdout
    assert lines["step2"].split()[1:4] == ["yes", "2", "2"]
    assert lines["global_step4"].split()[1:4] == ["yes", "4", "2"]
    size = sum(p.stat().st_size for p in (root / "ckpt" / "global_step4").iterdir())
    assert f"{size / 1024:.1f} KiB" in lines["global_step4"]
    assert lines["broken"].split()[1] == "NO" and "no manifest.json: the save did not finish" in lines["broken"]


def test_verify_passes_a_good_checkpoint_and_names_each_problem(root, results):
    assert results["verify"].returncode == 0, results["verify"].stdout + results["verify"].stderr
    assert results["verify"].stdout.startswith(f"OK      {root / 'ckpt' / 'global_step4'}")
    r = results["verify-damaged"]
    assert r.returncode == 1
    folder = root / "ckpt" / "damaged"
    for expected in (f"{folder / 'rank00000-of-00002.safetensors'}: size",
                     f"{folder / 'rank00001-of-00002.safetensors'}: sha256 differs",
                     f"{folder / 'rank00001-of-00002.state.pt'}: missing",
                     f"{folder / 'leftover.bin'}: extra file"):
        assert expected in r.stdout, (expected, r.stdout)
    assert "4 problem(s)" in r.stderr


def test_export_writes_the_consolidated_weights_offline(root, results):
    r = results["export"]
    assert r.returncode == 0, r.stderr
    exported = load_file(root / "out32.safetensors")
    expected = torch.load(root / "fp32_state.pt", weights_only=True)
    assert exported.keys() == expected.keys()
    for name, value in expected.items():
        assert exported[name].dtype == torch.float32 and torch.equal(exported[name], value), name
    plain = make_model(seed=9)
    plain.load_state_dict(exported, strict=True)
    x, y = make_batches(1, MICRO, seed=5)[0]
    reference = make_model(seed=9)
    reference.load_state_dict(expected)
    assert torch.equal(plain(x, y), reference(x, y))


def test_export_in_16_bit_matches_the_engine(root, results):
    assert results["export-bf16"].returncode == 0, results["export-bf16"].stderr
    assert results["export-fp16"].returncode == 0, results["export-fp16"].stderr
    bf16 = load_file(root / "out16.safetensors")
    engine_bf16 = load_file(root / "bf16_model.safetensors")
    masters = torch.load(root / "bf16_masters.pt", weights_only=True)
    assert bf16.keys() == engine_bf16.keys() == masters.keys()
    fp16 = load_file(root / "outfp16.safetensors")
    for name, value in engine_bf16.items():
        assert bf16[name].dtype == torch.bfloat16 and torch.equal(bf16[name], value), name
        assert fp16[name].dtype == torch.float16 and torch.equal(fp16[name], masters[name].half()), name


def test_export_refuses_a_damaged_checkpoint_and_writes_nothing(root, results):
    r = results["export-damaged"]
    assert r.returncode == 1
    assert "failed verification; nothing exported" in r.stderr and "leftover.bin" in r.stderr
    assert not (root / "never.safetensors").exists() and not (root / "never.safetensors.tmp").exists()
