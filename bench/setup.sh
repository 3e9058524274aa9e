#!/usr/bin/env bash
# Create the benchmark venv (.venv-bench) with torch, DeepSpeed and zero3 side by side,
# so that every peer of bench/cpu_bench.py runs from one interpreter.
#
#   bash bench/setup.sh            # CPU (torch 2.13.0; pip picks the CPU build here)
#   WITH_HF=1 bash bench/setup.sh  # also transformers, for --model llama
#
# DeepSpeed is installed with DS_BUILD_OPS=0: no C++/CUDA op is compiled at install time.
# On CPU run it with DS_ACCELERATOR=cpu (cpu_bench.py sets this itself when --device cpu).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv-bench}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"

$PIP install --upgrade pip setuptools wheel
$PIP install "torch==2.13.0"
# DeepSpeed imports these at runtime; install them first so that its setup.py
# (which imports torch) finds torch already present.
$PIP install numpy packaging psutil py-cpuinfo pydantic tqdm hjson msgpack ninja einops
DS_BUILD_OPS=0 $PIP install --no-build-isolation "deepspeed==0.19.8"
$PIP install -e "$ROOT"
if [ "${WITH_HF:-0}" = "1" ]; then
    $PIP install "transformers==5.19.0"
fi

# Check: DeepSpeed imports with the CPU accelerator and zero3 is importable.
DS_ACCELERATOR=cpu "$VENV/bin/python" - <<'EOF'
import torch, deepspeed
from deepspeed.accelerator import get_accelerator
print("torch", torch.__version__, "deepspeed", deepspeed.__version__,
      "accelerator", get_accelerator().device_name())
try:
    import zero3
    print("zero3 from", zero3.__file__, "initialize:", hasattr(zero3, "initialize"))
except Exception as e:  # the engine may not exist yet
    print("zero3 not importable yet:", type(e).__name__, e)
EOF

# Smoke run: DeepSpeed ZeRO-3 on 2 CPU ranks over gloo. On CPU, DeepSpeed's comm backend
# JIT-compiles its shared-memory op (deepspeed_shm_comm_op, needs c++ and ninja) into
# ~/.cache/torch_extensions the first time; doing it here keeps that minute out of the
# first benchmark.
"$VENV/bin/torchrun" --standalone --nproc_per_node=2 "$ROOT/bench/cpu_bench.py" \
    --peers deepspeed --width 32 --layers 1 --seq 16 --vocab 256 --micro-batch 1 \
    --steps 1 --warmup 1 --rounds 1
echo "bench venv ready: $VENV"
