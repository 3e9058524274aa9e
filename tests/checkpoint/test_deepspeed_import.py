"""Resuming DeepSpeed 0.19.8 ZeRO-3 checkpoints: `engine.load_checkpoint` on DeepSpeed's
layout, `zero3 checkpoint import-deepspeed` / `inspect`, and damaged folders refused.

The fixtures under tests/fixtures/deepspeed/ were written by real DeepSpeed 0.19.8 on CPU
(scripts/make_deepspeed_fixtures.sh), each with DeepSpeed's own view of the saved state
(`safe_get_full_fp32_param` / `safe_get_full_optimizer_state`, frozen weights, buffers,
counters, scheduler, loss scaler) and the losses of one more step. Each is loaded on 1, 2,
3 and 4 ranks (one process launch per world size for all of them), with a sub_group_size
unlike the saving run's, and every master and moment must equal DeepSpeed's exactly;
then one more step is trained and its losses compared with DeepSpeed's.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import DEVICE, run_ranks

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed"
sys.path.insert(0, str(FIXTURES))
import models as M  # noqa: E402

pytest.importorskip("transformers", reason="the Llama + LoRA fixtures need the hf extra")
pytest.importorskip("peft", reason="the Llama + LoRA fixtures need the hf extra")

ENV = {"HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(FIXTURES), os.environ.get("PYTHONPATH", "")])}
LOADABLE = [name for name, fixture in M.FIXTURES.items() if fixture.stage == 3]
SUB_GROUP_SIZE = {1: None, 2: 7, 3: 1000, 4: 16}  # elements per optimizer call in the loading engine
STATE_KEYS = ("exp_avg", "exp_avg_sq")
NVME_FIXTURE = "wide_fp32_w2_nvme"  # saved by DeepSpeed with offload_optimizer "nvme"


def _expected(name: str) -> dict:
    return torch.load(FIXTURES / name / "expected.pt", weights_only=True)


def _engine(fixture: M.Fixture, world: int, offload_optimizer: bool = False):
    """The fixture's model under zero3 with its DeepSpeed config; frozen weights differ from
    the checkpoint's unless the save left them out (then the model's own are the truth)."""
    import zero3

    cfg = M.config(fixture)
    if offload_optimizer:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    cfg["zero_optimization"].pop("sub_group_size", None)
    if SUB_GROUP_SIZE[world] is not None:
        cfg["zero_optimization"]["sub_group_size"] = SUB_GROUP_SIZE[world]
    if fixture.dtype == "fp16":
        # DeepSpeed's ZeRO-3 divides fp16 gradients by the world size before reducing them;
        # zero3 does with prescale_gradients (else the sum may overflow where DeepSpeed's did not).
        cfg["prescale_gradients"] = True
    model = M.build_model(fixture, seed=0 if fixture.exclude_frozen else 1)
    optimizer = M.make_optimizer(fixture, model)
    scheduler = M.make_torch_scheduler(optimizer) if fixture.scheduler is None else None
    engine, _, _, _ = zero3.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=cfg)
    return engine


def _state_problems(engine, expected: dict) -> list[str]:
    """Every parameter's fp32 master, moments and step, frozen weights and buffers against
    DeepSpeed's recorded values: equal bit for bit."""
    from zero3.checkpoint.export import full_fp32_param, full_optimizer_state

    tensors = expected["tensors"]
    problems = []

    def same(what: str, got: torch.Tensor, key: str) -> None:
        got = got.cpu()  # loaded on the engine's device (ZERO3_TEST_DEVICE=cuda: a GPU)
        if key in expected.get("sha256", {}):  # a large tensor of an NVMe fixture: its digest
            if _sha256(got) != expected["sha256"][key]:
                problems.append(f"{what}: differs from DeepSpeed's (sha256 of the fp32 bytes)")
            return
        want = tensors[key].float() if key.startswith("frozen/") else tensors[key]
        if not torch.equal(got.reshape(want.shape).to(want.dtype), want):
            diff = (got.reshape(want.shape).double() - want.double()).abs().max().item()
            problems.append(f"{what}: differs from DeepSpeed's (max abs diff {diff:g})")

    for name, param in engine.module.named_parameters():
        value = full_fp32_param(engine, param)
        if param.requires_grad:
            same(f"fp32 {name}", value, f"fp32/{name}")
            for key in STATE_KEYS:
                same(f"{key} {name}", full_optimizer_state(engine, param, key), f"{key}/{name}")
            step = float(full_optimizer_state(engine, param, "step"))
            if [step] != expected["steps_of_sub_groups"]:
                problems.append(f"step of {name}: {step}, DeepSpeed {expected['steps_of_sub_groups']}")
        else:
            same(f"frozen {name}", value, f"frozen/{name}")
    for name, buffer in engine.module.named_buffers():
        if f"buffer/{name}" in tensors:
            same(f"buffer {name}", buffer, f"buffer/{name}")
    return problems


def _sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().float().contiguous().numpy().tobytes()).hexdigest()


def _counter_problems(engine, fixture: M.Fixture, expected: dict, client_state: dict) -> list[str]:
    problems = []
    for key in ("global_steps", "global_samples", "skipped_steps"):
        if getattr(engine, key) != expected[key]:
            problems.append(f"{key}: {getattr(engine, key)}, DeepSpeed {expected[key]}")
    groups = engine.optimizer.optimizer.param_groups
    for index, (group, saved) in enumerate(zip(groups, expected["param_groups"])):
        for key in ("lr", "betas", "eps", "weight_decay"):
            value = list(group[key]) if key == "betas" else group[key]
            if value != saved[key]:
                problems.append(f"param group {index} {key}: {value}, DeepSpeed {saved[key]}")
    saved_scheduler = expected["lr_scheduler"]
    ours = engine.lr_scheduler.state_dict()
    for key in ("last_batch_iteration", "last_epoch"):
        if key in saved_scheduler and ours.get(key) != saved_scheduler[key]:
            problems.append(f"scheduler {key}: {ours.get(key)}, DeepSpeed {saved_scheduler[key]}")
    if fixture.dtype == "fp16":
        scaler, saved = engine.loss_scaler, expected["loss_scaler"]
        pairs = [("scale", "cur_scale"), ("iteration", "cur_iter"), ("hysteresis_left", "cur_hysteresis"),
                 ("last_overflow_iteration", "last_overflow_iter")]
        problems += [f"loss scaler {ours_key}: {getattr(scaler, ours_key)}, DeepSpeed {saved[ds_key]}"
                     for ours_key, ds_key in pairs if getattr(scaler, ours_key) != saved[ds_key]]
    if set(client_state) != set(fixture.client_state) or any(
            not torch.equal(client_state[k], v) if isinstance(v, torch.Tensor) else client_state[k] != v
            for k, v in fixture.client_state.items()):
        problems.append(f"client_state {client_state}, saved {fixture.client_state}")
    return problems


def _next_step(engine, fixture: M.Fixture, expected: dict, rank: int, world: int) -> dict:
    """One more optimizer step on the fixture's data: its micro-batch losses (rank r < the
    saving world sees DeepSpeed's rank r batches) and, on the saving world size, how far
    the new masters are from DeepSpeed's after the same step."""
    from zero3.checkpoint.export import full_fp32_param

    losses = M.train(fixture, engine, rank, fixture.steps, 1)
    result = {"losses": losses, "ds_losses": expected["next_losses"][rank] if rank < fixture.world else None}
    if world == fixture.world:
        diffs = [(full_fp32_param(engine, p) - expected["tensors"][f"next_fp32/{n}"]).abs().max().item()
                 for n, p in engine.module.named_parameters()
                 if p.requires_grad and f"next_fp32/{n}" in expected["tensors"]]  # not digested ones
        result["max_master_diff"] = max(diffs)
    return result


def load_and_check(rank: int, world: int, name: str, folder: str, offload_optimizer: bool = False) -> dict:
    """Load one checkpoint folder (DeepSpeed's, or the zero3 import of it) into a fresh engine
    and compare it with what DeepSpeed recorded; then train one more step."""
    fixture, expected = M.FIXTURES[name], _expected(name)
    engine = _engine(fixture, world, offload_optimizer)
    path, client_state = engine.load_checkpoint(folder)
    problems = [] if path else [f"nothing loaded from {folder}"]
    steps = [state["step"] for state in engine.optimizer.optimizer.state.values()]
    if not steps or not all(isinstance(step, torch.Tensor) and step.dim() == 0 for step in steps):
        problems.append(f"optimizer steps after the load are {steps}, not torch's 0-dim tensors")
    problems += _state_problems(engine, expected)
    problems += _counter_problems(engine, fixture, expected, client_state)
    result = {"problems": problems, **_next_step(engine, fixture, expected, rank, world)}
    engine.destroy()
    return result


def refused_on_every_rank(rank: int, world: int, folder: str) -> str:
    import zero3

    engine = _engine(M.FIXTURES["seed_fp32_w2"], world)
    try:
        engine.load_checkpoint(folder)
    except zero3.CheckpointError as exc:
        return str(exc)
    finally:
        engine.destroy()
    return "loaded"


def world_worker(rank: int, world: int, jobs: list[tuple[str, str, str]]) -> dict:
    """Every job of one launch: ("load", fixture, folder), ("load_offloaded", fixture, folder)
    (the engine with offload_optimizer) or ("refuse", fixture, folder)."""
    out = {}
    for kind, name, folder in jobs:
        if kind == "refuse":
            out[(kind, name, folder)] = refused_on_every_rank(rank, world, folder)
        else:
            out[(kind, name, folder)] = load_and_check(rank, world, name, folder, kind == "load_offloaded")
    return out


# ------------------------------------------------------------------------ tests
def _import(src: Path, dst: Path) -> None:
    from zero3.cli import main

    assert main(["checkpoint", "import-deepspeed", str(src), str(dst)]) == 0
    assert not torch.distributed.is_initialized()
    assert main(["checkpoint", "verify", str(dst)]) == 0


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_load_every_fixture(world: int, tmp_path: Path):
    jobs = [("load", name, str(FIXTURES / name / "ckpt")) for name in LOADABLE]
    if world in (2, 3):  # the CLI import of a 3-rank bf16 save and of an fp16 one, loaded here
        for name in ("llama_lora_bf16_w3", "mlp_fp16_w3"):
            _import(FIXTURES / name / "ckpt", tmp_path / name)
            jobs.append(("load", name, str(tmp_path / name)))
    if world == 2:
        broken = tmp_path / "broken"
        shutil.copytree(FIXTURES / "seed_fp32_w2" / "ckpt", broken)
        (broken / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
        jobs.append(("refuse", "seed_fp32_w2", str(broken)))
        # DeepSpeedCPUAdam's Python-int steps, loaded directly and through the CLI import
        cpu_adam = _as_saved_by_cpu_adam("seed_fp32_w2", tmp_path)
        _import(cpu_adam, tmp_path / "cpu_adam_imported")
        jobs += [("load_offloaded", "seed_fp32_w2", str(cpu_adam)),
                 ("load_offloaded", "seed_fp32_w2", str(tmp_path / "cpu_adam_imported"))]
        # saved with offload_optimizer "nvme": the swapped state in offloaded_tensors/
        jobs.append(("load", "seed_fp32_w2", str(_as_saved_with_nvme("seed_fp32_w2", tmp_path))))
        # DeepSpeed's own NVMe save (the fixture is loaded directly on every world size above)
        _import(FIXTURES / NVME_FIXTURE / "ckpt", tmp_path / "nvme_imported")
        jobs.append(("load", NVME_FIXTURE, str(tmp_path / "nvme_imported")))
    results = run_ranks(world_worker, world, jobs, timeout=900, env=ENV)
    for job in jobs:
        per_rank = [r[job] for r in results]
        if job[0] == "refuse":
            for text in per_rank:
                assert "zero_pp_rank_1_mp_rank_00_optim_states.pt: missing" in text, text
            continue
        for rank, outcome in enumerate(per_rank):
            assert outcome["problems"] == [], f"{job[1]} from {job[2]}, rank {rank} of {world}: {outcome['problems']}"
            fp32 = M.FIXTURES[job[1]].dtype == "fp32"
            if outcome["ds_losses"] is not None:
                if DEVICE == "cpu":  # DeepSpeed's numbers were computed on the CPU, as here
                    assert outcome["losses"] == outcome["ds_losses"], (job, rank)
                else:  # the loaded state is compared bit for bit above; a GPU's kernels round otherwise
                    worst = max(abs(a - b) / abs(b) for a, b in zip(outcome["losses"], outcome["ds_losses"]))
                    assert worst <= (1e-5 if fp32 else 1e-2), (job, rank, worst)
            if "max_master_diff" in outcome and rank == 0:
                print(f"{job[1]} ({job[2]}) on {world} ranks: masters after one more step within "
                      f"{outcome['max_master_diff']:.1e} of DeepSpeed's")
                tolerance = 1e-6 if fp32 else 1e-4  # reduction order
                if DEVICE != "cpu":
                    tolerance *= 10
                assert outcome["max_master_diff"] <= tolerance, (job, outcome["max_master_diff"])


def _copy(name: str, tmp_path: Path) -> Path:
    target = tmp_path / name
    shutil.copytree(FIXTURES / name / "ckpt", target)
    return target


def _as_saved_by_cpu_adam(name: str, tmp_path: Path) -> Path:
    """A copy of fixture `name` as DeepSpeed writes it with `offload_optimizer` (its optimizer
    then is DeepSpeedCPUAdam): each sub-group's `step` a Python int, the param groups with
    DeepSpeedCPUAdam's keys, offload_optimizer in the saved config. The values are the
    fixture's, so DeepSpeed's recorded state and next step still apply."""
    from zero3.checkpoint.deepspeed.pickling import save_with_deepspeed_names
    from zero3.checkpoint.deepspeed.unpickle import load_deepspeed_file

    root = _copy(name, tmp_path / "cpu_adam")
    tag = root / (root / "latest").read_text().strip()
    for path in tag.glob("*optim_states.pt"):
        state = load_deepspeed_file(path)
        inner = state["optimizer_state_dict"]["optimizer_state_dict"]
        for entry in inner["state"].values():
            entry["step"] = int(entry["step"].item())
        cpu_adam_keys = ("params", "lr", "betas", "eps", "weight_decay", "bias_correction", "amsgrad")
        inner["param_groups"] = [{key: group.get(key, True) for key in cpu_adam_keys} for group in inner["param_groups"]]
        save_with_deepspeed_names(state, path.with_name(path.name + ".new"))
        os.replace(path.with_name(path.name + ".new"), path)
    for path in tag.glob("*model_states.pt"):
        _resave(path, lambda s: s["ds_config"]["zero_optimization"].update(
            offload_optimizer={"device": "cpu", "pin_memory": False}))
    return root


def _as_saved_with_nvme(name: str, tmp_path: Path) -> Path:
    """A copy of fixture `name` as DeepSpeed 0.19.x writes it with offload_optimizer "nvme"
    (its engine's save path and optimizer swapper): each sub-group's fp32 flat and elementwise
    optimizer state emptied in the optimizer file, their values in raw fp32 swap files under
    `<tag>/offloaded_tensors/rank{r:02d}/` named by the sub-group's first and last parameter ids
    (`{first}_{last}.tensor.swp`, `{key}-{first}_{last}.tensor.swp`), padded for alignment; a
    gradient swap file beside them; offload_optimizer nvme in the saved config."""
    from zero3.checkpoint.deepspeed.pickling import save_with_deepspeed_names
    from zero3.checkpoint.deepspeed.unpickle import load_deepspeed_file

    root = _copy(name, tmp_path / "nvme")
    tag = root / (root / "latest").read_text().strip()
    for rank, path in enumerate(sorted(tag.glob("*optim_states.pt"))):
        state = load_deepspeed_file(path)
        swap = tag / "offloaded_tensors" / f"rank{rank:02d}"
        swap.mkdir(parents=True)
        inner = state["optimizer_state_dict"]["optimizer_state_dict"]
        indices = [i for group in inner["param_groups"] for i in group["params"]]
        for i, flat in enumerate(state["optimizer_state_dict"]["fp32_flat_groups"]):
            stem = f"{9 * i + 2}_{9 * i + 8}"  # ids sort numerically, not as text (2 < 11)
            _write_swap(swap / f"{stem}.tensor.swp", flat)
            state["optimizer_state_dict"]["fp32_flat_groups"][i] = torch.empty(0)
            for key, value in inner["state"][indices[i]].items():
                if isinstance(value, torch.Tensor) and value.numel() == flat.numel():
                    _write_swap(swap / f"{key}-{stem}.tensor.swp", value)
                    inner["state"][indices[i]][key] = torch.empty(0)
        (swap / f"2_gradient_0_{flat.numel()}.tensor.swp").write_bytes(b"\0" * 64)
        save_with_deepspeed_names(state, path.with_name(path.name + ".new"))
        os.replace(path.with_name(path.name + ".new"), path)
    for path in tag.glob("*model_states.pt"):
        _resave(path, lambda s: s["ds_config"]["zero_optimization"].update(
            offload_optimizer={"device": "nvme", "nvme_path": "/local_nvme"}))
    return root


def _write_swap(path: Path, tensor: torch.Tensor) -> None:
    padded = torch.zeros(-(-tensor.numel() // 256) * 256, dtype=torch.float32)
    padded[:tensor.numel()] = tensor.detach().float().reshape(-1)
    path.write_bytes(padded.numpy().tobytes())


def _refusal(root: Path) -> str:
    from zero3.checkpoint.deepspeed.layout import DeepSpeedCheckpoint
    from zero3.checkpoint.deepspeed.unpickle import DeepSpeedCheckpointError

    with pytest.raises(DeepSpeedCheckpointError) as info:
        DeepSpeedCheckpoint.open(root)
    return str(info.value)


def _resave(path: Path, change) -> None:
    """Rewrite a model_states file (plain values and tensors only) with `change` applied."""
    state = torch.load(path, weights_only=True)
    change(state)
    torch.save(state, path)


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {_Payload.marker}",))


def test_damaged_folders_refused_by_name(tmp_path: Path):
    root = _copy("llama_lora_bf16_w3", tmp_path)
    tag = root / "global_step2"
    (tag / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt").unlink()
    assert "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt: missing" in _refusal(root)

    root = _copy("seed_bf16_w3_nofrozen", tmp_path)
    model_file = next((root / "global_step3").glob("zero_pp_rank_1_*model_states.pt"))
    model_file.write_bytes(model_file.read_bytes()[: model_file.stat().st_size // 2])
    text = _refusal(root)
    assert model_file.name in text and "truncated" in text, text

    root = _copy("seed_fp32_w2", tmp_path)
    _Payload.marker = tmp_path / "payload-ran"
    torch.save({"optimizer_state_dict": _Payload()}, root / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    text = _refusal(root)
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt: refused" in text and "posix.system" in text, text
    assert not _Payload.marker.exists()

    root = _copy("seed_fp32_w2", tmp_path / "shapes")
    _resave(root / "global_step2" / "zero_pp_rank_0_mp_rank_00_model_states.pt",
            lambda s: s["param_shapes"][0].update({"adapter.adapter_A.weight": torch.Size([2, 9])}))
    assert "param_shapes differ" in _refusal(root)
    for rank in (0, 1):
        _resave(root / "global_step2" / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt",
                lambda s: s["param_shapes"][0].update({"adapter.adapter_A.weight": torch.Size([2, 9])}))
    text = _refusal(root)
    assert "sub-group 0: the fp32 flat holds (16,) elements, its 2 parameters account for 17" in text, text


def test_unsupported_layouts_refused_by_name(tmp_path: Path):
    assert "ZeRO stage 0/1/2 layout" in _refusal(FIXTURES / "seed_stage2_w2" / "ckpt")

    cases = {
        "model-parallel rank files": lambda tag: shutil.copy(
            tag / "zero_pp_rank_0_mp_rank_00_model_states.pt", tag / "zero_pp_rank_0_mp_rank_01_model_states.pt"),
        "MoE expert files": lambda tag: (tag / "layer_0_expert_0_mp_rank_00_model_states.pt").write_bytes(b""),
        "universal checkpoint": lambda tag: (tag / "zero" / "adapter.adapter_A.weight").mkdir(parents=True),
    }
    for index, (needle, damage) in enumerate(cases.items()):
        root = _copy("seed_fp32_w2", tmp_path / str(index))
        damage(root / "global_step2")
        assert needle in _refusal(root), needle
    nvme = _as_saved_with_nvme("seed_fp32_w2", tmp_path / "nvme_missing")
    shutil.rmtree(nvme / "global_step2" / "offloaded_tensors" / "rank01")
    assert "offloaded_tensors/rank01: missing" in _refusal(nvme)


def test_inspect_recognizes_deepspeed(capsys):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-m", "zero3.cli", "checkpoint", "inspect",
                          str(FIXTURES / "llama_lora_bf16_w3" / "ckpt")], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "DeepSpeed ZeRO-3 checkpoint" in out.stdout and "saved on 3 ranks, bfloat16, global step 2" in out.stdout
    assert "client_state keys: epoch" in out.stdout

    from zero3.cli import main

    assert main(["checkpoint", "verify", str(FIXTURES / "seed_fp32_w2" / "ckpt")]) == 1
    assert "is a DeepSpeed ZeRO-3 checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["seed_bf16_w3_nofrozen", "llama_lora_bf16_w3", "mlp_fp16_w3"])
def test_padding_never_read(name: str):
    """NaN written into every partition's padding (in memory) changes nothing read: each
    parameter, master and moment read whole equals DeepSpeed's recorded value."""
    from zero3.checkpoint.deepspeed.layout import DeepSpeedCheckpoint

    source = DeepSpeedCheckpoint.open(FIXTURES / name / "ckpt")
    poisoned = 0
    for slot in source.slots.values():
        kinds = [("param", None)] + ([("optim", key) for key in STATE_KEYS] if slot.trainable else [])
        for rank in range(source.world_size):
            valid = max(0, min(slot.partition, slot.numel - rank * slot.partition))
            for kind, key in kinds:
                piece = source._rank_piece(rank, kind, slot, key)
                piece[valid:] = float("nan")
                poisoned += slot.partition - valid
    assert poisoned > 0
    tensors = _expected(name)["tensors"]
    for name_, slot in source.slots.items():
        if slot.trainable:
            wanted = {"master": tensors[f"fp32/{name_}"], **{f"optim/{k}": tensors[f"{k}/{name_}"] for k in STATE_KEYS}}
        else:
            wanted = {"param": tensors[f"frozen/{name_}"]}
        for kind, value in wanted.items():
            key = f"{kind}/{name_}" if "/" not in kind else f"optim/{name_}/{kind.split('/')[1]}"
            got = source.read_range(key, slot.numel, 0, slot.numel).reshape(value.shape)
            assert torch.equal(got.to(value.dtype), value), key
    source.close()


@pytest.mark.parametrize("name", [NVME_FIXTURE, "wide_fp32_w2_nvme_param"])
def test_deepspeed_nvme_save_read_from_its_swap_files(name: str, tmp_path: Path):
    """The fixtures DeepSpeed 0.19.8 saved with offload_optimizer "nvme" (async_io; the second
    with offload_param "nvme" as well, whose parameter swap files a save does not copy): the wide
    weight's sub-group is empty in both optimizer files, its master and moments only in the
    swap files under offloaded_tensors/; the small sub-group stayed in memory. Read offline,
    every master and moment equals DeepSpeed's recorded values; one changed byte of a swap
    file is seen as a difference."""
    from zero3.checkpoint.deepspeed.layout import DeepSpeedCheckpoint
    from zero3.checkpoint.deepspeed.unpickle import load_deepspeed_file

    root = FIXTURES / name / "ckpt"
    tag = root / "global_step2"
    for rank in range(2):
        optim = load_deepspeed_file(tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
        assert [f.numel() for f in optim["fp32_flat_groups"]] == [0, 2562]
        assert optim["optimizer_state_dict"]["state"][0]["exp_avg"].numel() == 0
        names = sorted(p.name for p in (tag / "offloaded_tensors" / f"rank{rank:02d}").iterdir())
        assert names == ["0_0.tensor.swp", "exp_avg-0_0.tensor.swp", "exp_avg_sq-0_0.tensor.swp"]

    def mismatches(folder: Path) -> list[str]:
        expected, source = _expected(name), DeepSpeedCheckpoint.open(folder)
        wrong = []
        for param, slot in source.slots.items():
            kinds = [("master", f"fp32/{param}")] + [(f"optim/{param}/{k}", f"{k}/{param}") for k in STATE_KEYS]
            for kind, key in kinds:
                got = source.read_range(f"master/{param}" if kind == "master" else kind, slot.numel, 0, slot.numel)
                if key in expected["sha256"]:
                    same = _sha256(got) == expected["sha256"][key]
                else:
                    same = torch.equal(got.reshape(expected["tensors"][key].shape), expected["tensors"][key])
                if not same:
                    wrong.append(key)
        source.close()
        return wrong

    assert mismatches(root) == []
    changed = _copy(name, tmp_path)
    swap = changed / "global_step2" / "offloaded_tensors" / "rank01" / "exp_avg_sq-0_0.tensor.swp"
    data = bytearray(swap.read_bytes())
    data[4 * 1000 + 3] ^= 0x01
    swap.write_bytes(bytes(data))
    assert mismatches(changed) == ["exp_avg_sq/wide.weight"]
