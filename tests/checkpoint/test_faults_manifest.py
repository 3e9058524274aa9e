"""`verify` checks what load checks; a manifest of the wrong types is refused by name.

One 2-rank launch saves a good checkpoint, then rank 0 makes damaged copies whose
checksums all match (each file's size and sha256 updated in the manifest, the manifest
resealed), so that only the deeper checks can tell:
  - `pickle`: common.pt holds a payload that would run a command when unpickled;
  - `world_str`, `world_zero`, `dtype`, `file_path`: manifest fields of the wrong type
    or value (world_size "2" or 0, an unknown dtype, a file name with a path in it);
  - `incomplete`: no manifest.
Both ranks try to load each copy and must get a CheckpointError naming the problem (not
an IndexError, no code run), then load the good checkpoint exactly. The CLI (`verify`,
`export`, `inspect`) is run in this process on the same copies: exit 1, no traceback.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from common import config, make_batches, make_model
from harness import run_ranks

os.environ.setdefault("ZERO3_ACCELERATOR", "cpu")


class CodeRunningPayload:
    """Unpickling this would create the marker file (what an attacker's command would do)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _reseal(folder: Path, change) -> None:
    from zero3.checkpoint.format import file_digest, seal

    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    for name in manifest["files"]:
        if (folder / name).exists():
            manifest["files"][name] = file_digest(folder / name)
    path.write_text(json.dumps(seal({k: v for k, v in manifest.items() if k != "checksum"}), indent=1))


def _damaged_copies(root: Path) -> None:
    good = root / "good"
    for name in ("pickle", "world_str", "world_zero", "dtype", "file_path", "incomplete"):
        shutil.copytree(good, root / name)
    torch.save({"payload": CodeRunningPayload(str(root / "code_ran"))}, root / "pickle" / "common.pt")
    _reseal(root / "pickle", lambda m: None)
    _reseal(root / "world_str", lambda m: m.update(world_size="2"))
    _reseal(root / "world_zero", lambda m: m.update(world_size=0))
    _reseal(root / "dtype", lambda m: next(iter(m["params"].values())).update(dtype="float99"))
    _reseal(root / "file_path", lambda m: m["files"].update({"../../elsewhere": m["files"]["common.pt"]}))
    (root / "incomplete" / "manifest.json").unlink()


CASES = {
    "pickle": ["common.pt", "refused to load"],
    "world_str": ["world_size is '2' (a str)", "integer >= 1"],
    "world_zero": ["world_size is 0 (a int)", "integer >= 1"],
    "dtype": ["'float99'", "dtype"],
    "file_path": ["'../../elsewhere'", "plain file name"],
    "incomplete": ["incomplete", "manifest.json"],
}


def manifest_worker(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    import zero3
    from zero3.checkpoint.errors import CheckpointError
    from zero3.checkpoint.export import consolidated_state_dict

    root = Path(root)
    model = make_model()
    engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(),
                                  config={**config(2, 1), "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    x, y = make_batches(2, 2)[rank]
    engine.backward(engine(x, y))
    engine.step()
    engine.save_checkpoint(str(root), tag="good")
    good = consolidated_state_dict(engine)
    if rank == 0:
        _damaged_copies(root)
    dist.barrier()
    engine.backward(engine(x, y))
    engine.step()
    out = {}
    for case in CASES:
        try:
            engine.load_checkpoint(str(root), tag=case)
            out[case] = "loaded"
        except CheckpointError as exc:
            out[case] = f"{type(exc).__name__}: {exc}"
    engine.load_checkpoint(str(root), tag="good")
    state = consolidated_state_dict(engine)
    out["exact"] = all(torch.equal(state[k], good[k]) for k in good)
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("manifest")


@pytest.fixture(scope="module")
def results(root):
    return run_ranks(manifest_worker, 2, str(root), timeout=120)


@pytest.mark.parametrize("case", sorted(CASES))
def test_load_refuses_by_name_on_every_rank(results, root, case):
    for out in results:
        assert out[case].startswith("CheckpointError"), out[case]
        for fragment in CASES[case]:
            assert fragment in out[case], (case, fragment, out[case])
    assert not (root / "code_ran").exists()


def test_good_checkpoint_still_loads_exactly(results):
    assert all(out["exact"] is True for out in results)


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    from zero3.cli import main

    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize("case", sorted(CASES))
def test_cli_verify_and_export_refuse_by_name(results, root, case, capsys):
    code, text = _cli(["checkpoint", "verify", str(root), "--tag", case], capsys)
    assert code == 1, text
    assert "Traceback" not in text and CASES[case][0] in text, text
    out = root / f"{case}.safetensors"
    if case != "pickle":  # export reads no pickled state: only the weights, which are intact there
        code, text = _cli(["checkpoint", "export", str(root), str(out), "--tag", case], capsys)
        assert code == 1 and "Traceback" not in text, text
        assert not out.exists()
    assert not (root / "code_ran").exists()


def test_cli_inspect_exit_status(results, root, capsys):
    code, text = _cli(["checkpoint", "inspect", str(root / "incomplete")], capsys)
    assert code == 1, text
    code, text = _cli(["checkpoint", "inspect", str(root / "world_str")], capsys)
    assert code == 1 and "world_size" in text, text
    code, text = _cli(["checkpoint", "inspect", str(root / "good")], capsys)
    assert code == 0, text
    code, text = _cli(["checkpoint", "verify", str(root), "--tag", "good"], capsys)
    assert code == 0 and "pickled state loads safely" in text, text
