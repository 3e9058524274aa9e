"""The compat tests use the suite's harness and models (tests/harness.py, tests/common.py)."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
