"""What the TRL test files share: skip without the hf extra, stay offline, import the examples.

Importing this module skips the importing test module when trl or peft is missing. It puts
examples/ on sys.path (this process) and in `ENV["PYTHONPATH"]` (the rank processes).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="the hf extra is not installed: pip install zero3[hf]")
pytest.importorskip("peft", reason="the hf extra is not installed: pip install zero3[hf]")

os.environ["HF_HUB_OFFLINE"] = "1"  # models are built from a config: never reach the hub
ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = str(ROOT / "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)

ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "PYTHONPATH": EXAMPLES + os.pathsep + os.environ.get("PYTHONPATH", "")}
