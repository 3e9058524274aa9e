#!/usr/bin/env bash
# The precision runs of issue 34 on one lent GPU (bench/precision_bench.py), one process per
# case, logs and rows into $OUT (or bench/out), the table at the end:
#   1B Llama (width 2048, 16 layers, intermediate 5632, 16 heads, vocab 32000, seq 2048,
#   micro-batch 2), world size 1: zero3 with bf16 masters + bf16 optimizer state against plain
#   PyTorch with a bf16 model and fused AdamW, zero3 with torch_autocast against an fp32 model
#   under bf16 autocast, eager and each decoder layer compiled; FSDP2 and DeepSpeed (carried in
#   .whl, skipped with a line when absent) with the same keys;
#   7B Llama (width 4096, 32 layers, intermediate 11008, 32 heads) full fine-tune with
#   bf16_master_weights_and_grads + bf16_optimizer_states, nothing offloaded, micro-batch 1
#   (micro-batch 2's activations do not fit beside the 54 GB of state on an 80 GB card),
#   built on the device in bf16; plain PyTorch beside it.
# Cases run in priority order and a case is started only while BUDGET seconds (default 540)
# leave room for it, so the call ends inside a 10-minute device call with the table printed.
#   CASES_1B, CASES_7B, CASES_COMPILED, CASES_PEERS override the lists (space separated); EXTRA
#   is appended to every case's flags (the last value of a flag wins), e.g. the CPU dry run:
#   EXTRA="--device cpu --layers 2 --width 64 --intermediate 128 --heads 4 --vocab 256 --seq 32
#   --compile-backend eager" bash bench/precision_gpu.sh
set -u
out=${OUT:-bench/out}
mkdir -p "$out"
source bench/carried_wheels.sh
export DS_BUILD_OPS=0 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
start=$(date +%s)
budget=${BUDGET:-540}
rows="$out/precision.jsonl"
rm -f "$rows"
llama_1b="--layers 16 --width 2048 --intermediate 5632 --heads 16 --vocab 32000 --seq 2048 --micro-batch 2"
llama_7b="--layers 32 --width 4096 --intermediate 11008 --heads 32 --vocab 32000 --seq 2048 --micro-batch 1"
run() {  # run LABEL "MODEL FLAGS" NEEDED_S CASE...: each case in its own process while the budget lasts
    local label=$1 model=$2 needed=$3
    shift 3
    for case in "$@"; do
        local left=$(( budget - ($(date +%s) - start) ))
        if (( left < needed )); then
            echo "== $label $case: not started ($left s of the budget left, it needs about $needed s)"
            continue
        fi
        echo "== $label $case (budget left $left s)"
        timeout $(( left < 200 ? left : 200 )) python3 bench/precision_bench.py $model ${EXTRA:-} --case "$case" \
            --label "$label" --steps ${STEPS:-6} --warmup ${WARMUP:-3} --rows "$rows" 2>&1 \
            | grep -v -E "Warning|warn\(" | tee -a "$out/precision_$label.log" | tail -4
    done
}
run 1b "$llama_1b" 30 ${CASES_1B:-plain_bf16 zero3_bf16 plain_autocast zero3_autocast}
run 7b "$llama_7b" 60 ${CASES_7B:-zero3_bf16 plain_bf16}
run 1b "$llama_1b" 70 ${CASES_COMPILED:-plain_bf16_compiled zero3_bf16_compiled plain_autocast_compiled zero3_autocast_compiled}
run 1b "$llama_1b" 45 ${CASES_PEERS:-fsdp2_bf16 deepspeed_bf16 fsdp2_autocast deepspeed_autocast fsdp2_bf16_compiled deepspeed_bf16_compiled}
python3 bench/precision_bench.py --table "$rows" | tee "$out/precision_table.log"
echo "== total $(( $(date +%s) - start )) s"
exit 0
