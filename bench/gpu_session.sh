#!/usr/bin/env bash
# One GPU session's runs, on the lent H200 (world size 1): the Hugging Face / DeepSpeed
# wheels carried in .whl/ installed into /tmp/site, the CUDA checks, then the 1B Llama
# step-time comparison of bench/gpu_run.sh (plain, FSDP2, DeepSpeed 0.19.8, zero3).
#   STAGE=checks|llama1b|hf  (default: checks and llama1b)
#   ZERO3_TREE=dir           import zero3 from dir instead (a baseline tree, for A/B runs)
set -u
out=${OUT:-bench/out}
mkdir -p "$out"
source bench/carried_wheels.sh
python3 - <<'PY'
import importlib
for name in ["torch", "transformers", "peft", "trl", "accelerate", "datasets", "pyarrow", "deepspeed"]:
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"))
    except Exception as exc:  # report and go on: each stage needs only some of them
        print(name, "unavailable:", type(exc).__name__, str(exc)[:120])
PY
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage=${STAGE:-checks,llama1b}
if [[ $stage == *checks* ]]; then
    timeout 150 torchrun --standalone --nproc_per_node=1 tests/gpu/gpu_checks.py 2>&1 | tee "$out/gpu_checks.log" \
        | grep -E "PASS|FAIL|CHECKS|Error"
fi
if [[ $stage == *llama1b* ]]; then
    llama_1b="--model llama --width 2048 --layers 16 --intermediate 5632 --heads 16 --vocab 32000 --seq 2048"
    timeout 330 torchrun --standalone --nproc_per_node=1 bench/cpu_bench.py --device cuda --dtype bf16 $llama_1b \
        --micro-batch 2 --steps 6 --warmup 2 --rounds 2 --peers "${PEERS_1B:-plain,fsdp2,deepspeed,zero3}" \
        2>&1 | tee "$out/llama1b.log" | grep -v Warning | tail -40
fi
if [[ $stage == *hf* ]]; then
    timeout ${HF_TIMEOUT:-500} python3 bench/hf_sft_bench.py ${HF_ARGS:-} 2>&1 | tee "$out/hf_sft.log" | grep -v Warning | tail -40
fi
