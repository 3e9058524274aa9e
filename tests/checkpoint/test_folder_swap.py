"""A tag's folder replaced whole (zero3/checkpoint/folder_swap.py), with and without an atomic exchange.

Single-process: these are file-system steps of rank 0. The multi-process crash tests
(test_checkpoint_faults.py) kill a real save over a committed tag at two points.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zero3.checkpoint import folder_swap
from zero3.checkpoint.errors import CheckpointError
from zero3.checkpoint.format import resolve_tag


def _folder(path: Path, content: str) -> Path:
    path.mkdir()
    (path / "rank00000-of-00001.safetensors").write_text(content)
    return path


@pytest.mark.parametrize("exchange", [True, False], ids=["atomic-exchange", "two-renames"])
def test_put_in_place_replaces_the_folder_whole(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(folder_swap, "_exchange", lambda a, b: False)
    target = _folder(tmp_path / "last", "old")
    staging = _folder(folder_swap.staging_folder(target), "new")
    assert staging.name == ".last.incoming"
    folder_swap.put_in_place(staging, target)
    assert (target / "rank00000-of-00001.safetensors").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]  # nothing hidden is left


def test_this_file_system_exchanges_atomically(tmp_path):
    a, b = _folder(tmp_path / "a", "A"), _folder(tmp_path / "b", "B")
    assert folder_swap._exchange(a, b) is True
    assert (a / "rank00000-of-00001.safetensors").read_text() == "B"


def test_a_crash_between_two_renames_is_named_when_loading(tmp_path):
    """The tag is missing; its previous save waits in .<tag>.replaced, the new one in .incoming."""
    for name in (".last.replaced", ".last.incoming"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(json.dumps({"stand-in": True}))
    (tmp_path / "latest").write_text("last")
    with pytest.raises(CheckpointError) as caught:
        resolve_tag(tmp_path, None)
    message = str(caught.value)
    assert ".last.incoming" in message and ".last.replaced" in message and "rename one to 'last'" in message
