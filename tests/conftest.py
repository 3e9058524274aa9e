"""The suite's shared helpers (harness.py, common.py, access_cases.py, trl_setup.py) live in
tests/ and are imported by plain name from every folder of tests."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
