"""A tag, from `latest` or an argument, names a folder directly inside the directory.

One 2-rank launch saves a good checkpoint in `ckpt/` and a complete one elsewhere
(`outside/tag`), then points `ckpt/latest` outside (absolute, `../`), makes it a directory,
and passes escaping tags: every load raises CheckpointPathError on both ranks, naming the
file and the value, and the good checkpoint still loads exactly afterwards. The CLI
(`verify`, `export`, `inspect`) is then run on the same files: exit 1, no traceback.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from common import config, make_batches, make_model
from harness import run_ranks

os.environ.setdefault("ZERO3_ACCELERATOR", "cpu")


def _engine():
    import zero3

    model = make_model()
    engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(),
                                  config={**config(2, 1), "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    return engine


def _train(engine, rank: int, steps: int) -> None:
    for x, y in make_batches(steps * 2, 2)[rank::2]:
        engine.backward(engine(x, y))
        engine.step()


def _load_error(engine, load_dir: Path, tag=None) -> str:
    from zero3.checkpoint.errors import CheckpointError

    try:
        engine.load_checkpoint(str(load_dir), tag=tag)
    except CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def _set_latest(rank: int, ckpt: Path, value: str | None, as_dir: bool = False) -> None:
    import torch.distributed as dist

    if rank == 0:
        latest = ckpt / "latest"
        if latest.is_dir():
            latest.rmdir()
        elif latest.exists():
            latest.unlink()
        if as_dir:
            latest.mkdir()
        elif value is not None:
            latest.write_text(value)
    dist.barrier()


def paths_worker(rank: int, world: int, root: str) -> dict:
    from zero3.checkpoint.export import consolidated_state_dict

    root = Path(root)
    ckpt, outside = root / "ckpt", root / "outside"
    engine = _engine()
    _train(engine, rank, 1)
    engine.save_checkpoint(str(outside), tag="tag")
    _train(engine, rank, 1)
    engine.save_checkpoint(str(ckpt), tag="good")
    good = consolidated_state_dict(engine)
    _train(engine, rank, 1)  # the engine moves on: a silent load of `outside` would be seen below
    out = {}
    for name, value in {"absolute": str(outside / "tag"), "dotdot": "../outside/tag"}.items():
        _set_latest(rank, ckpt, value)
        out[name] = _load_error(engine, ckpt)
    _set_latest(rank, ckpt, None, as_dir=True)
    out["latest_dir"] = _load_error(engine, ckpt)
    out["tag_arg"] = _load_error(engine, ckpt, tag="../outside/tag")
    out["tag_abs"] = _load_error(engine, ckpt, tag=str(outside / "tag"))
    _set_latest(rank, ckpt, "good")
    out["good"] = _load_error(engine, ckpt)
    state = consolidated_state_dict(engine)
    out["exact"] = all(torch.equal(state[k], good[k]) for k in good)
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("paths")


@pytest.fixture(scope="module")
def results(root):
    return run_ranks(paths_worker, 2, str(root), timeout=120)


def test_load_refuses_a_tag_outside_the_directory_on_every_rank(results, root):
    for out in results:
        for case in ("absolute", "dotdot"):
            assert out[case].startswith("CheckpointError"), out[case]
            assert "CheckpointPathError" in out[case] or "latest" in out[case]
            assert str(root / "ckpt" / "latest") in out[case], out[case]
        assert str(root / "outside" / "tag") in out["absolute"]
        assert "'../outside/tag'" in out["dotdot"]
        assert "not a regular file" in out["latest_dir"], out["latest_dir"]
        assert "the tag argument" in out["tag_arg"] and "'../outside/tag'" in out["tag_arg"]
        assert "absolute" in out["tag_abs"], out["tag_abs"]
        assert out["good"] == "loaded" and out["exact"] is True


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    from zero3.cli import main

    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_cli_refuses_a_latest_outside_the_directory(results, root, capsys):
    ckpt, outside = root / "ckpt", root / "outside" / "tag"
    out_file = root / "export.safetensors"
    for value in (str(outside), "../outside/tag"):
        (ckpt / "latest").write_text(value)
        for argv in (["checkpoint", "verify", str(ckpt)], ["checkpoint", "export", str(ckpt), str(out_file)],
                     ["checkpoint", "inspect", str(ckpt)]):
            code, text = _cli(argv, capsys)
            assert code == 1, (argv, text)
            assert str(ckpt / "latest") in text and repr(value) in text, text
            assert "Traceback" not in text
        assert not out_file.exists()
    code, text = _cli(["checkpoint", "verify", str(ckpt), "--tag", "../outside/tag"], capsys)
    assert code == 1 and "tag argument" in text and "Traceback" not in text, text
    (ckpt / "latest").unlink()
    (ckpt / "latest").mkdir()
    code, text = _cli(["checkpoint", "verify", str(ckpt)], capsys)
    assert code == 1 and "not a regular file" in text, text
    shutil.rmtree(ckpt / "latest")
    (ckpt / "latest").write_text("good")
    code, text = _cli(["checkpoint", "verify", str(ckpt)], capsys)
    assert code == 0, text
