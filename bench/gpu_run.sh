#!/usr/bin/env bash
# The H200 benchmark runs recorded in bench/README.md, in one go (world size 1).
# DeepSpeed 0.19.8 (built with DS_BUILD_OPS=0) and its missing dependencies are installed
# from wheels in build/wheels when present. Logs go to $OUT (or bench/out).
set -u
out=${OUT:-bench/out}
mkdir -p "$out"
if ls build/wheels/deepspeed-*.whl >/dev/null 2>&1; then
    DS_BUILD_OPS=0 python3 -m pip install -q --no-index --find-links build/wheels deepspeed==0.19.8 2>&1 | tail -2
fi
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 110 torchrun --standalone --nproc_per_node=1 tests/gpu/gpu_checks.py 2>&1 | tee "$out/gpu_checks.log" | grep -E "PASS|FAIL|CHECKS|Error"
llama_1b="--model llama --width 2048 --layers 16 --intermediate 5632 --heads 16 --vocab 32000 --seq 2048"
timeout 270 torchrun --standalone --nproc_per_node=1 bench/cpu_bench.py --device cuda --dtype bf16 $llama_1b \
    --micro-batch 2 --steps 6 --warmup 2 --rounds 2 --peers "${PEERS_1B:-plain,fsdp2,deepspeed,zero3}" \
    2>&1 | tee "$out/h200_1b.log" | grep -v Warning
offload='{"zero_optimization":{"offload_param":{"device":"cpu","pin_memory":true},"offload_optimizer":{"device":"cpu","pin_memory":true}}}'
timeout 190 torchrun --standalone --nproc_per_node=1 bench/cpu_bench.py --device cuda --dtype bf16 \
    --model llama --width 3072 --layers 26 --intermediate 8192 --heads 24 --vocab 32000 --seq 2048 \
    --micro-batch 1 --steps 4 --warmup 2 --rounds 1 --peers zero3 --config-extra "$offload" \
    2>&1 | tee "$out/h200_3b_offload.log" | grep -v Warning
# Diagnostics quoted in bench/README.md (where the 3B step's time goes; the CPU optimizer
# against host memory traffic): with DIAGNOSTICS=1, after the runs above.
if [ "${DIAGNOSTICS:-0}" = 1 ]; then
    timeout 170 torchrun --standalone --nproc_per_node=1 tests/gpu/offload_breakdown.py --layers 26 \
        2>&1 | grep -E "^step|Error" | tee "$out/breakdown.log"
    timeout 120 python3 tests/gpu/cpu_adam_probe.py --numel 500e6 2>&1 | tee "$out/probe.log"
fi
