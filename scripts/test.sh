#!/usr/bin/env bash
# The test suite: real multi-process runs on the gloo backend (CPU), 2 and 4 ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements-hf.txt -r requirements-monitor.txt  # the PEFT / generate / monitor tests
export OMP_NUM_THREADS=1 ZERO3_ACCELERATOR=cpu
exec .venv/bin/python -m pytest -q -p no:cacheprovider tests "$@"
