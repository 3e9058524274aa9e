#!/usr/bin/env bash
# Regenerate the DeepSpeed ZeRO-3 checkpoint fixtures (tests/fixtures/deepspeed/) with real
# DeepSpeed 0.19.8 on CPU (gloo ranks). DeepSpeed lives in its own venv and is never a
# dependency of zero3:
#
#   bash scripts/make_deepspeed_fixtures.sh                 # every fixture
#   VENV=/path/to/venv bash scripts/make_deepspeed_fixtures.sh seed_fp32_w2 mlp_fp16_w3
#   ZERO3_PYTHON=/path/to/zero3/venv/bin/python bash scripts/make_deepspeed_fixtures.sh --check-export
#   ZERO3_PYTHON=/path/to/zero3/venv/bin/python bash scripts/make_deepspeed_fixtures.sh --check-trainer-export
#   ZERO3_PYTHON=/path/to/zero3/venv/bin/python bash scripts/make_deepspeed_fixtures.sh --check-export-config-adam
#
# --check-export-config-adam: a run trained under zero3 with the config's AdamW (two param
# groups, sub_group_size 1000), exported with only --world-size, loaded and stepped by
# DeepSpeed with each optimizer it builds (FusedAdam, DeepSpeedCPUAdam under offload_optimizer,
# torch's AdamW with torch_adam; tests/deepspeed_compare/export_config_adam.py): one JSON line
# per case, recorded in tests/deepspeed_compare/RESULTS.md. The CPU Adam ops are JIT-built
# (ninja and a C++ compiler) the first time.
#
# --check-export: `zero3 checkpoint export-deepspeed` of the committed zero3 checkpoint
# tests/fixtures/deepspeed/export_llama_lora_bf16_w2/zero3 (run with zero3's Python), then
# DeepSpeed loads the export on 2 gloo ranks and compares it with zero3's values
# (check_export.py), writing export_llama_lora_bf16_w2/deepspeed_result.json.
#
# --check-trainer-export: the same for a Hugging Face Trainer checkpoint: zero3.hf's committed
# tests/fixtures/deepspeed/hf_trainer_export_lora_w2/zero3/checkpoint-2 is exported (the
# Trainer's files and DeepSpeed's layout), the Trainer with `deepspeed=` resumes it on 2 gloo
# ranks and logs steps 3-4 into hf_trainer_export_lora_w2/deepspeed_result.json
# (hf_trainer_export.py); then zero3's own continuation is checked against those numbers
# (tests/hf/test_hf_trainer_export.py). `python tests/fixtures/deepspeed/hf_trainer_export.py`
# (zero3's Python) rewrites the zero3 checkpoint first, when wanted.
#
# --accelerate-loop: examples/accelerate_loop.py under DeepSpeed through Accelerate
# (`accelerate.Accelerator(deepspeed_plugin=...)`) on 2 gloo ranks, its losses, learning rates
# and gradient norms into tests/fixtures/deepspeed/accelerate_loop_w2/deepspeed_result.json
# (tests/hf/test_accelerator.py runs zero3.hf.Accelerator on the same loop against them).
#
# wide_fp32_w2_nvme is saved with offload_optimizer "nvme": DeepSpeed's async_io op is JIT-built
# (ninja, g++) against libaio. Where the system has no libaio headers, the Debian packages are
# fetched with `apt-get download` (no root, nothing installed) and unpacked with `dpkg -x` into
# $LIBAIO_PREFIX (default /tmp/libaio); CPATH, LIBRARY_PATH, LD_LIBRARY_PATH, CFLAGS and LDFLAGS
# point DeepSpeed's compatibility check, its build and the loaded op at it. A prefix holding
# usr/include/libaio.h is used as it is.
#
# DS_BUILD_OPS=0: no C++/CUDA op is compiled at install time (on CPU, DeepSpeed builds its
# shared-memory comm op with ninja the first time it runs, into ~/.cache/torch_extensions).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv-deepspeed}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
if ! "$VENV/bin/python" -c "import deepspeed, transformers, peft" 2>/dev/null; then
    $PIP install --upgrade pip setuptools wheel
    $PIP install "torch==2.13.0"
    # DeepSpeed's setup.py imports torch and these: install them first.
    $PIP install numpy packaging psutil py-cpuinfo pydantic tqdm hjson msgpack ninja einops
    DS_BUILD_OPS=0 $PIP install --no-build-isolation "deepspeed==0.19.8"
    $PIP install "transformers==5.19.0" "peft==0.21.2" "accelerate==1.16.0"
fi

libaio_env() {
    if [ -f /usr/include/libaio.h ]; then
        return 0
    fi
    local prefix="${LIBAIO_PREFIX:-/tmp/libaio}"
    if [ ! -f "$prefix/usr/include/libaio.h" ]; then
        local debs
        debs="$(mktemp -d)"
        (cd "$debs" && apt-get download libaio-dev "$(apt-cache depends libaio-dev | sed -n 's/ *Depends: //p' | head -1)")
        for deb in "$debs"/*.deb; do dpkg -x "$deb" "$prefix"; done
        rm -rf "$debs"
    fi
    local lib
    lib="$(dirname "$(find "$prefix/usr/lib" -name 'libaio.so*' | head -1)")"
    export CPATH="$prefix/usr/include${CPATH:+:$CPATH}"
    export LIBRARY_PATH="$lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
    export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export CFLAGS="-I$prefix/usr/include ${CFLAGS:-}" LDFLAGS="-L$lib ${LDFLAGS:-}"
}

cd "$ROOT"
if [ "${1:-}" = "--check-export" ]; then
    EXPORTED="$(mktemp -d)"
    trap 'rm -rf "$EXPORTED"' EXIT
    PYTHONPATH="$ROOT" "${ZERO3_PYTHON:-python3}" -m zero3.cli checkpoint export-deepspeed \
        tests/fixtures/deepspeed/export_llama_lora_bf16_w2/zero3 "$EXPORTED" --world-size 2 --sub-group-size 40
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore HF_HUB_OFFLINE=1 \
        "$VENV/bin/python" tests/fixtures/deepspeed/check_export.py "$EXPORTED"
    exit $?
fi
if [ "${1:-}" = "--check-export-config-adam" ]; then
    WORK="$(mktemp -d)"
    trap 'rm -rf "$WORK"' EXIT
    for CASE in fused cpu-adam torch; do
        PYTHONPATH="$ROOT" ZERO3_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore \
            "${ZERO3_PYTHON:-python3}" tests/deepspeed_compare/export_config_adam.py zero3 "$WORK" "$CASE"
        DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore \
            "$VENV/bin/python" tests/deepspeed_compare/export_config_adam.py deepspeed "$WORK" "$CASE" | tail -1
    done
    exit 0
fi
if [ "${1:-}" = "--check-trainer-export" ]; then
    SCRATCH="$(mktemp -d)"
    trap 'rm -rf "$SCRATCH"' EXIT
    ZPY="${ZERO3_PYTHON:-python3}"
    PYTHONPATH="$ROOT" "$ZPY" -m zero3.cli checkpoint export-deepspeed \
        tests/fixtures/deepspeed/hf_trainer_export_lora_w2/zero3/checkpoint-2 "$SCRATCH/exported/checkpoint-2" \
        --world-size 2
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore HF_HUB_OFFLINE=1 \
        "$VENV/bin/python" tests/fixtures/deepspeed/hf_trainer_export.py --deepspeed \
        "$SCRATCH/exported/checkpoint-2" "$SCRATCH/deepspeed"
    PYTHONPATH="$ROOT" OMP_NUM_THREADS=1 ZERO3_ACCELERATOR=cpu HF_HUB_OFFLINE=1 \
        "$ZPY" -m pytest -q -p no:cacheprovider tests/hf/test_hf_trainer_export.py
    exit $?
fi
if [ "${1:-}" = "--accelerate-loop" ]; then
    SCRATCH="$(mktemp -d)"
    trap 'rm -rf "$SCRATCH"' EXIT
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore HF_HUB_OFFLINE=1 \
        "$VENV/bin/python" -m torch.distributed.run --standalone --nproc_per_node=2 examples/accelerate_loop.py \
        --engine deepspeed --no-accelerate-cpu --dir "$SCRATCH" \
        --out tests/fixtures/deepspeed/accelerate_loop_w2/deepspeed_result.json
    exit $?
fi
libaio_env
DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore HF_HUB_OFFLINE=1 \
    "$VENV/bin/python" tests/fixtures/deepspeed/generate.py "$@"
