"""The suite's shared helpers (harness.py, common.py, access_cases.py, trl_setup.py) live in
tests/ and are imported by plain name from every folder of tests; shared fixtures are here."""

import pathlib
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


@pytest.fixture(scope="module")
def tmpfs(tmp_path_factory):
    """A real 1 MiB tmpfs (a full disk on demand); skipped where mounting needs root we lack."""
    mount = tmp_path_factory.mktemp("tmpfs")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)
