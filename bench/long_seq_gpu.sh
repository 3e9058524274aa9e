#!/usr/bin/env bash
# The long-sequence GPU runs (one lent card), logs and rows into $OUT (or bench/out):
#   STAGE=checks   tests/gpu/long_seq_checks.py (CUDA: tiled pieces and host offload against the plain model)
#   STAGE=zero3    bench/long_seq_bench.py --engine zero3 at SEQS (default 32768,65536,131072)
#   STAGE=lora     the same with LoRA (--engine zero3_lora)
#   STAGE=plain    plain HF bf16 forward+backward with gradient checkpointing (its out-of-memory length)
#   STAGE=deepspeed  DeepSpeed 0.19.8 with its ALST pieces (carried in .whl, DS_BUILD_OPS=0)
# STEPS (default 2) steps per length; CASE_TIMEOUT (default 560 s) bounds each process.
set -u
out=${OUT:-bench/out}
mkdir -p "$out"
rm -rf /tmp/site
if ls .whl/*.whl >/dev/null 2>&1; then  # the project's pinned HF versions over the machine's
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        2>&1 | grep -v "WARNING: Target directory" | tail -3
    export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH  # ninja: DeepSpeed builds its CPU Adam at first use
else
    export PYTHONPATH=$PWD
fi
export DS_BUILD_OPS=0 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_THREADS:-8} NCCL_NVLS_ENABLE=0 HF_HUB_OFFLINE=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
stage=${STAGE:-checks,zero3}
# the machine's used host memory every 5 s (a run killed for host memory leaves its trace here)
( while sleep 5; do echo "$(date +%T) $(free -m | awk '/^Mem/{print $3}') MiB used"; done ) >> "$out/host_used.log" &
host_logger=$!
trap 'kill $host_logger 2>/dev/null' EXIT
has() { [[ ",$stage," == *",$1,"* ]]; }
if has checks; then
    timeout 200 torchrun --standalone --nproc_per_node=1 tests/gpu/long_seq_checks.py 2>&1 \
        | grep -v Warning | tee "$out/long_seq_checks.log" | tail -12
fi
bench() {  # bench ENGINE
    timeout ${CASE_TIMEOUT:-560} torchrun --standalone --nproc_per_node=1 bench/long_seq_bench.py --engine $1 \
        --seqs ${SEQS:-32768,65536,131072} --steps ${STEPS:-2} --rows "$out/long_seq_rows.jsonl" ${BENCH_ARGS:-} 2>&1 \
        | grep -v -E "Warning|warn" | tee -a "$out/long_seq_$1.log" | tail -25
}
has zero3 && bench zero3
has lora && bench zero3_lora
has plain && bench plain
has deepspeed && bench deepspeed
[ -f "$out/long_seq_rows.jsonl" ] && python3 bench/long_seq_bench.py --table "$out/long_seq_rows.jsonl"
