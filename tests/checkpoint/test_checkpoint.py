"""Checkpoint format, commit protocol, verification, load options, model mismatch.

Most checks run on a one-process engine inside the test process (no process group: the
engine's communicator is then world size 1), which costs no spawn. What must be seen on
several ranks (every rank raising the same error) runs on 2 gloo processes.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from common import config, make_batches, make_model, two_param_groups
from harness import run_ranks
from safetensors import safe_open
from torch import nn

os.environ.setdefault("ZERO3_ACCELERATOR", "cpu")

MICRO = 2


# ------------------------------------------------------------------ helpers
def local_engine(model: nn.Module | None = None, ga: int = 1, threshold: int = 30, scheduler: bool = True,
                 lr: float = 1e-2, **top):
    """A world-size-1 engine in this process (dist_init_required=False: no process group)."""
    import zero3

    model = model if model is not None else make_model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5) if scheduler else None
    cfg = config(MICRO, ga, threshold)
    cfg.update(top)
    engine, _, _, _ = zero3.initialize(model=model, optimizer=optimizer, lr_scheduler=sched, config=cfg,
                                       dist_init_required=False)
    return engine


def train(engine, steps: int, seed: int = 1, inputs: int = 13, outputs: int = 5) -> list[float]:
    """`steps` micro-steps on fixed batches; the losses."""
    losses = []
    for x, y in make_batches(steps, MICRO, inputs=inputs, outputs=outputs, seed=seed):
        dtype = torch.bfloat16 if engine.compute_dtype == torch.bfloat16 else x.dtype
        x, y = x.to(engine.device, dtype), y.to(engine.device, dtype)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def snapshot(engine) -> dict:
    """Everything a load may change, copied: shards, full resident values, masters,
    optimizer state, buffers, counters, scheduler, RNG."""
    opt = engine.optimizer
    return {
        "shards": {sp.name: sp.shard.clone() for sp in engine.table.values()},
        "resident": {sp.name: sp.param.detach().clone() for sp in engine.table.values() if sp.persistent},
        "masters": [m.clone() for m in opt.masters] if opt else [],
        "optim": [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.optimizer.state.get(m, {}).items()}
                  for m in opt.masters] if opt else [],
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.optimizer.param_groups] if opt else [],
        "buffers": {n: b.clone() for n, b in engine.module.named_buffers()},
        "counters": (engine.global_steps, engine.micro_steps, engine.global_samples, engine.skipped_steps),
        "sched": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "rng": torch.get_rng_state(),
    }


def same(a, b) -> bool:
    """Deep, exact equality of snapshots (tensors bit for bit)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def reseal(folder: Path, changed: list[str]) -> None:
    """Rewrite the manifest as an attacker with write access would: new sizes, sha256s
    and manifest checksum for the `changed` files, so verification passes."""
    from zero3.checkpoint.format import MANIFEST, file_digest, seal

    manifest = json.loads((folder / MANIFEST).read_text())
    for name in changed:
        manifest["files"][name] = file_digest(folder / name)
    (folder / MANIFEST).write_text(json.dumps(seal(manifest)))


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    index = len(data) // 2 if offset is None else offset
    data[index] ^= 0x40
    path.write_bytes(bytes(data))


# ------------------------------------------------------------ format, commit
def test_layout_manifest_and_latest(tmp_path):
    from zero3.checkpoint.export import consolidated_state_dict
    from zero3.checkpoint.format import MANIFEST, file_digest, read_manifest

    engine = local_engine(ga=2)
    train(engine, 4)
    assert engine.save_checkpoint(tmp_path, client_state={"epoch": 1})
    folder = tmp_path / "global_step2"
    assert (tmp_path / "latest").read_text() == "global_step2"
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["common.pt", MANIFEST, "rank00000-of-00001.safetensors", "rank00000-of-00001.state.pt"]
    manifest = read_manifest(folder)  # also checks the manifest's own checksum
    assert manifest["world_size"] == 1 and manifest["global_steps"] == 2 and manifest["micro_steps"] == 4
    assert manifest["zero3_version"] == "0.1.0" and manifest["torch_version"] == torch.__version__
    for name, entry in manifest["files"].items():
        assert entry == file_digest(folder / name), name
    params = dict(engine.module.named_parameters())
    assert list(manifest["params"]) == list(params)
    for name, entry in manifest["params"].items():
        assert entry["shape"] == list(params[name].shape) and entry["dtype"] == "float32"
        assert entry["numel"] == params[name].numel() == entry["shard_numel"]
        assert entry["trainable"] == params[name].requires_grad
        assert entry["optim"] == ({"step": "whole", "exp_avg": "elementwise", "exp_avg_sq": "elementwise"}
                                  if params[name].requires_grad else {})
    whole = consolidated_state_dict(engine)
    with safe_open(str(folder / "rank00000-of-00001.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert torch.equal(f.get_tensor("param/embed.weight"), whole["embed.weight"].reshape(-1))
    assert "optim/embed.weight/exp_avg" in keys and "optim_whole/embed.weight/step" in keys
    assert not any(k.startswith("master/") for k in keys)  # fp32: the master is the shard


def test_save_latest_false_keeps_latest_and_a_resave_replaces_the_tag(tmp_path):
    from zero3.checkpoint.format import list_tags

    engine = local_engine()
    train(engine, 1)
    engine.save_checkpoint(tmp_path, tag="a")
    train(engine, 1)
    engine.save_checkpoint(tmp_path, tag="b", save_latest=False)
    assert (tmp_path / "latest").read_text() == "a"
    assert [i.tag for i in list_tags(tmp_path) if i.complete] == ["a", "b"]
    # leftovers of an interrupted earlier save of the same tag are cleared by a new save
    (tmp_path / "b" / "rank00000-of-00001.safetensors.tmp").write_bytes(b"half")
    train(engine, 1)
    engine.save_checkpoint(tmp_path, tag="b")
    assert not (tmp_path / "b" / "rank00000-of-00001.safetensors.tmp").exists()
    fresh = local_engine(make_model(seed=5))
    path, _ = fresh.load_checkpoint(tmp_path)
    assert path == str(tmp_path / "b") and fresh.global_steps == 3


def test_foreign_files_in_a_tag_folder_are_refused_and_nothing_changes(tmp_path):
    from zero3 import CheckpointError
    from zero3.checkpoint.format import verify_checkpoint

    engine = local_engine()
    train(engine, 1)
    engine.save_checkpoint(tmp_path, tag="t")
    (tmp_path / "t" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"notes\.txt"):
        engine.save_checkpoint(tmp_path, tag="t")
    assert (tmp_path / "t" / "manifest.json").exists() and (tmp_path / "t" / "notes.txt").exists()
    (tmp_path / "t" / "notes.txt").unlink()
    assert verify_checkpoint(tmp_path / "t") == []


def test_client_state_round_trips_plain_values_and_tensors(tmp_path):
    engine = local_engine()
    train(engine, 1)
    client = {
        "epoch": 3, "lr": 1e-3, "inf": float("inf"), "name": "run-7", "done": False, "none": None,
        "pair": (1, "two"), "list": [1, [2.5, {"deep": torch.arange(4)}]], 5: "int key",
        "weights": torch.randn(3, 2), "half": torch.ones(2, dtype=torch.bfloat16), "scalar": torch.tensor(7),
    }
    engine.save_checkpoint(tmp_path, client_state=client)
    _, loaded = local_engine(make_model(seed=3)).load_checkpoint(tmp_path)
    assert same(loaded, client)
    assert type(loaded["pair"]) is tuple and loaded["half"].dtype == torch.bfloat16


@pytest.mark.parametrize("bad,where", [
    (lambda: {"a": {"b": __import__("numpy").zeros(2)}}, "client_state['a']['b']: numpy.ndarray"),
    (lambda: {"s": {1, 2}}, "client_state['s']: builtins.set"),
    (lambda: {"f": logging.getLogger}, "client_state['f']: builtins.function"),
    (lambda: {(1, 2): 3}, "key (1, 2) of type tuple"),
])
def test_client_state_that_needs_code_to_load_is_refused_before_writing(tmp_path, bad, where):
    from zero3 import CheckpointError

    engine = local_engine()
    train(engine, 1)
    with pytest.raises(CheckpointError, match="client_state holds a value") as info:
        engine.save_checkpoint(tmp_path, client_state=bad())
    assert where in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_no_code_from_the_checkpoint_is_ever_run(tmp_path):
    """A common.pt that would run a command when unpickled, with a manifest resealed to
    match it (the attacker can write every file): the load refuses it, names the file,
    changes nothing and the command never runs."""
    from zero3 import CheckpointError

    engine = local_engine()
    train(engine, 1)
    engine.save_checkpoint(tmp_path, tag="t")
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (tmp_path / "t" / "common.pt").write_bytes(pickle.dumps({"client_state": Exploit()}, protocol=2))
    reseal(tmp_path / "t", ["common.pt"])
    victim = local_engine(make_model(seed=9))
    before = snapshot(victim)
    with pytest.raises(CheckpointError, match=r"common\.pt: refused to load.*weights_only"):
        victim.load_checkpoint(tmp_path, tag="t")
    assert not marker.exists()
    assert same(snapshot(victim), before)


def test_pause_setting_with_an_unknown_phase_is_refused(tmp_path, monkeypatch):
    from zero3 import CheckpointError

    engine = local_engine()
    train(engine, 1)
    monkeypatch.setenv("ZERO3_CHECKPOINT_PAUSE", "shard-partail@1")
    with pytest.raises(CheckpointError, match=r"ZERO3_CHECKPOINT_PAUSE='shard-partail@1'.*shard-partial"):
        engine.save_checkpoint(tmp_path)
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


# ----------------------------------------------------------- choosing a tag
def test_missing_latest_or_tag_loads_nothing_and_warns_naming_the_directory(tmp_path, caplog):
    engine = local_engine()
    before = snapshot(engine)
    with caplog.at_level(logging.WARNING, logger="zero3"):
        assert engine.load_checkpoint(tmp_path) == (None, None)
    assert str(tmp_path) in caplog.text and "no 'latest' file" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zero3"):
        assert engine.load_checkpoint(tmp_path / "nowhere", tag="global_step9") == (None, None)
    assert str(tmp_path / "nowhere") in caplog.text and "'global_step9' not found" in caplog.text
    assert same(snapshot(engine), before)


def _three_tags(root: Path):
    """Tags s1 (step 1), s2 (step 2) committed; s3 (step 3) without its manifest."""
    engine = local_engine()
    for tag in ("s1", "s2", "s3"):
        train(engine, 1)
        engine.save_checkpoint(root, tag=tag)
    (root / "s3" / "manifest.json").unlink()
    return engine


def test_an_incomplete_tag_is_never_loaded(tmp_path, caplog):
    from zero3 import CheckpointError

    _three_tags(tmp_path)
    engine = local_engine(make_model(seed=4))
    before = snapshot(engine)
    with pytest.raises(CheckpointError, match=r"s3 is incomplete: it has no manifest\.json"):
        engine.load_checkpoint(tmp_path, tag="s3")
    assert same(snapshot(engine), before)
    # `latest` names s3: a tag-less load takes the newest complete tag, and says so
    assert (tmp_path / "latest").read_text() == "s3"
    with caplog.at_level(logging.WARNING, logger="zero3"):
        path, _ = engine.load_checkpoint(tmp_path)
    assert path == str(tmp_path / "s2") and engine.global_steps == 2
    assert "names tag 's3'" in caplog.text and "'s2'" in caplog.text
    # `latest` naming a folder that is gone: the same
    shutil.rmtree(tmp_path / "s3")
    assert local_engine().load_checkpoint(tmp_path)[0] == str(tmp_path / "s2")


def test_latest_naming_an_incomplete_tag_with_nothing_to_fall_back_to_raises(tmp_path):
    from zero3 import CheckpointError

    engine = local_engine()
    train(engine, 1)
    engine.save_checkpoint(tmp_path, tag="only")
    (tmp_path / "only" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="refusing to start from scratch silently"):
        local_engine().load_checkpoint(tmp_path)


def test_a_damaged_latest_checkpoint_is_not_skipped(tmp_path):
    """Damage (unlike an interrupted save) raises even when an older good tag exists."""
    from zero3 import CheckpointError

    _three_tags(tmp_path)
    (tmp_path / "latest").write_text("s2")
    flip_byte(tmp_path / "s2" / "rank00000-of-00001.safetensors")
    with pytest.raises(CheckpointError, match=r"s2/rank00000-of-00001\.safetensors: sha256 differs"):
        local_engine().load_checkpoint(tmp_path)


# --------------------------------------------------- verification, on 2 ranks
def damage(root: Path) -> dict[str, tuple[str, str]]:
    """Copies of tag `good`, each damaged one way: tag -> (file named, what is said)."""
    good = root / "good"
    cases = {
        "truncated": ("rank00001-of-00002.safetensors", "truncated"),
        "flipped": ("rank00000-of-00002.safetensors", "sha256 differs"),
        "missing": ("rank00001-of-00002.state.pt", "missing"),
        "extra": ("stray.bin", "extra file not listed"),
        "common-flipped": ("common.pt", "sha256 differs"),
        "manifest-flipped": ("manifest.json", ""),
    }
    for tag, (name, _) in cases.items():
        shutil.copytree(good, root / tag)
        path = root / tag / name
        if tag == "truncated":
            path.write_bytes(path.read_bytes()[:-10])
        elif tag == "missing":
            path.unlink()
        elif tag == "extra":
            path.write_bytes(b"\0" * 16)
        elif tag == "manifest-flipped":
            text = path.read_text()
            index = text.index('"global_steps": ') + len('"global_steps": ')
            path.write_text(text[:index] + "7" + text[index + 1:])  # still valid JSON
        else:
            flip_byte(path)
    return cases


def verification_run(rank: int, world: int, root: str):
    import zero3

    root = Path(root)
    model = make_model()
    optimizer = torch.optim.AdamW(two_param_groups(model))
    engine, _, _, _ = zero3.initialize(model=model, optimizer=optimizer, config=config(MICRO, 1, threshold=30))
    batches = make_batches(4, MICRO)
    for x, y in batches[rank::2]:
        engine.backward(engine(x, y))
        engine.step()
    engine.save_checkpoint(root, tag="good")
    cases = damage(root) if rank == 0 else None
    cases = engine.comm.gather_objects(cases)[0]
    engine.backward(engine(*batches[0]))  # move on, so that a load would change something
    engine.step()
    before = snapshot(engine)
    messages = {}
    for tag in cases:
        try:
            engine.load_checkpoint(root, tag=tag)
            messages[tag] = None
        except zero3.CheckpointError as exc:
            messages[tag] = str(exc)
    untouched = same(snapshot(engine), before)
    path, _ = engine.load_checkpoint(root, tag="good")
    return cases, messages, untouched, path, engine.global_steps


def test_damaged_checkpoints_are_refused_on_every_rank_naming_the_file(tmp_path):
    results = run_ranks(verification_run, 2, str(tmp_path))
    for rank, (cases, messages, untouched, path, steps) in enumerate(results):
        assert untouched, f"rank {rank}: a failed load changed the engine"
        for tag, (name, said) in cases.items():
            message = messages[tag]
            assert message is not None, f"rank {rank} loaded the damaged copy {tag!r}"
            assert str(tmp_path / tag / name) in message, (tag, message)
            assert said in message, (tag, message)
            if tag == "manifest-flipped":
                assert "checksum does not match" in message
            else:
                assert "failed verification, nothing was loaded" in message
        assert path == str(tmp_path / "good") and steps == 2
    assert results[0][1] == results[1][1]  # the same error on both ranks


# ------------------------------------------------------------- load options
class Small(nn.Module):
    def __init__(self, extra: bool = False, bias: bool = True, width: int = 6, head_dtype=torch.float32,
                 rename: bool = False) -> None:
        super().__init__()
        setattr(self, "inp" if rename else "first", nn.Linear(3, width, bias=bias))
        self.norm = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, 2).to(head_dtype)
        if extra:
            self.extra = nn.Parameter(torch.ones(4))

    def forward(self, x, y):
        first = self.inp if hasattr(self, "inp") else self.first
        h = torch.relu(self.norm(first(x)))
        out = self.head(h.to(self.head.weight.dtype)).float()
        if hasattr(self, "extra"):
            out = out + self.extra.sum()
        return torch.nn.functional.mse_loss(out, y)


def small_train(engine, steps: int, seed: int = 1) -> list[float]:
    return train(engine, steps, seed=seed, inputs=3, outputs=2)


def test_module_strict_false_loads_shared_names_and_keeps_the_rest(tmp_path):
    from zero3.checkpoint.export import consolidated_state_dict

    torch.manual_seed(0)
    source = local_engine(Small(), threshold=0)
    small_train(source, 2)
    source.save_checkpoint(tmp_path)
    saved = consolidated_state_dict(source)
    torch.manual_seed(1)
    target = local_engine(Small(extra=True, bias=False), threshold=0)
    extra_before = consolidated_state_dict(target)["extra"]
    path, _ = target.load_checkpoint(tmp_path, load_module_strict=False)
    loaded = consolidated_state_dict(target)
    assert "first.bias" not in loaded and torch.equal(loaded["extra"], extra_before)
    for name in ("first.weight", "head.weight", "head.bias", "norm.weight", "norm.running_mean",
                 "norm.num_batches_tracked"):
        assert torch.equal(loaded[name], saved[name]), name
    assert target.global_steps == 2


def test_model_mismatch_is_one_error_listing_every_difference(tmp_path):
    from zero3 import CheckpointError

    torch.manual_seed(0)
    source = local_engine(Small(), threshold=0)
    small_train(source, 1)
    source.save_checkpoint(tmp_path)
    torch.manual_seed(0)
    # renamed first -> inp, added `extra`, reshaped (width 6 -> 7), head in float64
    target = local_engine(Small(extra=True, width=7, head_dtype=torch.float64, rename=True), threshold=0)
    before = snapshot(target)
    with pytest.raises(CheckpointError) as info:
        target.load_checkpoint(tmp_path)
    text = str(info.value)
    expected = [
        "missing in checkpoint: inp.weight (7, 3) float32",
        "missing in checkpoint: inp.bias (7,) float32",
        "missing in checkpoint: extra (4,) float32",
        "unexpected in checkpoint (not in model): first.weight (6, 3) float32",
        "unexpected in checkpoint (not in model): first.bias (6,) float32",
        "shape of norm.weight: model (7,), checkpoint (6,)",
        "shape of head.weight: model (2, 7), checkpoint (2, 6)",
        "dtype of head.weight: model float64, checkpoint float32",
        "dtype of head.bias: model float64, checkpoint float32",
        "shape of buffer norm.running_mean: model (7,), checkpoint (6,)",
    ]
    for line in expected:
        assert line in text, f"{line!r} not in:\n{text}"
    assert "nothing was loaded" in text and text.count("\n  ") >= len(expected)
    assert same(snapshot(target), before)
    # a pure rename gets a hint
    torch.manual_seed(0)
    renamed = local_engine(Small(rename=True), threshold=0)
    with pytest.raises(CheckpointError, match=r"renamed\? checkpoint first.weight -> model inp.weight"):
        renamed.load_checkpoint(tmp_path)


def test_load_optimizer_states_false_and_scheduler_false_and_module_only(tmp_path):
    from zero3.checkpoint.export import consolidated_state_dict

    torch.manual_seed(0)
    source = local_engine(Small(), threshold=0)
    small_train(source, 3)
    source.save_checkpoint(tmp_path, client_state={"k": 1})
    saved = consolidated_state_dict(source)
    saved_state = snapshot(source)

    def fresh():
        torch.manual_seed(5)
        return local_engine(Small(), threshold=0)

    # load_optimizer_states=False: weights, counters, scheduler; the optimizer as it was
    engine = fresh()
    engine.load_checkpoint(tmp_path, load_optimizer_states=False)
    assert all(torch.equal(consolidated_state_dict(engine)[k], v) for k, v in saved.items())
    assert engine.optimizer.optimizer.state == {} and engine.global_steps == 3
    assert engine.lr_scheduler.state_dict() == saved_state["sched"]
    # load_lr_scheduler_states=False: everything but the scheduler
    engine = fresh()
    engine.load_checkpoint(tmp_path, load_lr_scheduler_states=False)
    assert engine.lr_scheduler.last_epoch == 0 and engine.global_steps == 3
    assert same(snapshot(engine)["optim"], saved_state["optim"])
    # load_module_only=True: weights (and buffers) only; client_state still returned
    engine = fresh()
    before = snapshot(engine)
    _, client = engine.load_checkpoint(tmp_path, load_module_only=True)
    after = snapshot(engine)
    assert client == {"k": 1}
    assert all(torch.equal(consolidated_state_dict(engine)[k], v) for k, v in saved.items())
    assert after["counters"] == before["counters"] == (0, 0, 0, 0)
    assert after["sched"] == before["sched"] and same(after["optim"], before["optim"])
    assert same(after["rng"], before["rng"])
    # and the full load restores everything (the scheduler class must match) but the RNG,
    # which stays as it was, as under DeepSpeed
    engine = fresh()
    before = snapshot(engine)
    engine.load_checkpoint(tmp_path)
    got = snapshot(engine)
    for key in ("shards", "masters", "optim", "groups", "buffers", "counters", "sched"):
        assert same(got[key], saved_state[key]), key
    assert same(got["rng"], before["rng"]) and not same(got["rng"], saved_state["rng"])
    # with the config's checkpoint.load_rng_state, the RNG comes from the checkpoint too
    torch.manual_seed(5)
    engine = local_engine(Small(), threshold=0, checkpoint={"load_rng_state": True})
    engine.load_checkpoint(tmp_path)
    assert same(snapshot(engine)["rng"], saved_state["rng"])


def test_a_different_scheduler_is_refused_unless_its_state_is_skipped(tmp_path):
    import zero3

    torch.manual_seed(0)
    source = local_engine(Small(), threshold=0)
    small_train(source, 1)
    source.save_checkpoint(tmp_path)
    model = Small()
    optimizer = torch.optim.AdamW(model.parameters())
    other = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)
    engine, _, _, _ = zero3.initialize(model=model, optimizer=optimizer, lr_scheduler=other,
                                       config=config(MICRO, 1, 0), dist_init_required=False)
    with pytest.raises(zero3.CheckpointError, match="StepLR scheduler, the engine has a ExponentialLR"):
        engine.load_checkpoint(tmp_path)
    engine.load_checkpoint(tmp_path, load_lr_scheduler_states=False)
    assert engine.global_steps == 1


def test_exclude_frozen_parameters(tmp_path):
    from zero3.checkpoint.export import consolidated_state_dict
    from zero3.checkpoint.format import read_manifest

    source = local_engine(make_model(seed=0))  # blocks.1 is frozen
    train(source, 2)
    source.save_checkpoint(tmp_path, exclude_frozen_parameters=True)
    frozen = {n for n, p in source.module.named_parameters() if not p.requires_grad}
    assert frozen and not frozen & set(read_manifest(tmp_path / "global_step2")["params"])
    with safe_open(str(tmp_path / "global_step2" / "rank00000-of-00001.safetensors"), framework="pt") as f:
        assert not any(k.split("/")[1] in frozen for k in f.keys())
    target = local_engine(make_model(seed=3))
    frozen_values = {k: v for k, v in consolidated_state_dict(target).items() if k in frozen}
    target.load_checkpoint(tmp_path)  # strict: frozen parameters excluded on purpose are not missing
    saved, loaded = consolidated_state_dict(source), consolidated_state_dict(target)
    for name in saved:
        expected = frozen_values[name] if name in frozen else saved[name]
        assert torch.equal(loaded[name], expected), name


def test_bf16_masters_are_restored_exactly_or_refreshed_from_the_weights(tmp_path):
    """Under bf16 the fp32 master is saved beside the weights. A full load restores it
    exactly; load_module_only (as DeepSpeed) rebuilds it from the loaded 16-bit weights."""
    source = local_engine(make_model(seed=0), bf16={"enabled": True})
    train(source, 3)
    source.save_checkpoint(tmp_path)
    masters = [m.clone() for m in source.optimizer.masters]
    assert any(not torch.equal(m, sp.shard.float()) for m, sp in zip(masters, source.optimizer.params))
    full = local_engine(make_model(seed=2), bf16={"enabled": True})
    full.load_checkpoint(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(full.optimizer.masters, masters))
    assert same(snapshot(full)["optim"], snapshot(source)["optim"])
    module_only = local_engine(make_model(seed=2), bf16={"enabled": True})
    module_only.load_checkpoint(tmp_path, load_module_only=True)
    for master, sp in zip(module_only.optimizer.masters, module_only.optimizer.params):
        assert torch.equal(master, sp.shard.float()), sp.name
    assert all(torch.equal(a.shard, b.shard) for a, b in zip(module_only.table.values(), source.table.values()))
