#!/usr/bin/env bash
# The placement's GPU runs (one lent card), logs into $OUT (or bench/out):
#   STAGE=checks  tests/gpu/placement_checks.py at world size 1 (NCCL) and 2 (gloo, one card);
#                 STAGE=checks_w1 at world size 1 only
#   STAGE=3b      bench/placement_bench.py: a 3.1B Llama full fine-tune, resident / offload under
#                 the auto budget at micro-batch 2 and 4, both plain PyTorch peers beside it
#   STAGE=ds      the 3.1B model under DeepSpeed 0.19.8 (carried in .whl, DS_BUILD_OPS=0, its CPU Adam
#                 built at first use): both offloads, its offload_optimizer.ratio 0.5, super_offload
#   STAGE=7b      a 6.7B Llama (does not fit resident): offload under the auto budget
# GA=N accumulates N micro-batches per optimizer step in every case (default 1); OMP_THREADS
# sets the CPU threads of the host optimizer step (default 8).
# Each case runs in a process of its own (bench/placement_bench.py says why).
set -u
out=${OUT:-bench/out}
mkdir -p "$out"
source bench/carried_wheels.sh
export DS_BUILD_OPS=0
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_THREADS:-8} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage=${STAGE:-checks,3b}
if [[ $stage == *checks* ]]; then
    timeout 150 torchrun --standalone --nproc_per_node=1 tests/gpu/placement_checks.py --backend nccl \
        2>&1 | tee "$out/placement_checks_w1.log" | grep -E "^(PASS|FAIL|CHECKS)|Error|error" | head -30
fi
if [[ $stage == *checks* && $stage != *checks_w1* ]]; then
    timeout 150 torchrun --standalone --nproc_per_node=2 tests/gpu/placement_checks.py --backend gloo \
        2>&1 | tee "$out/placement_checks_w2.log" | grep -E "^(PASS|FAIL|CHECKS)|Error|error" | head -30
fi
cases() {  # cases NAME "MODEL FLAGS" "kind:micro ..." : one process per case, then the table
    local name=$1 model=$2 list=$3 rows="$out/placement_$1.jsonl"
    rm -f "$rows"
    for case in $list; do
        timeout ${CASE_TIMEOUT:-150} torchrun --standalone --nproc_per_node=1 bench/placement_bench.py $model \
            --cases "$case" --steps ${STEPS:-6} --warmup ${WARMUP:-3} --ga ${GA:-1} --rows "$rows" 2>&1 \
            | grep -v -E "Warning|^\|" | tee -a "$out/placement_$name.log"
    done
    python3 bench/placement_bench.py --table "$rows" | tee -a "$out/placement_$name.log"
}
llama_3b="--layers 26 --width 3072 --intermediate 8192 --heads 24 --seq 2048"
[[ $stage == *ds* ]] && cases 3b_deepspeed "$llama_3b" "${CASES_DS:-ds_offload:2 ds_ratio=0.5:2 ds_super:2}"
[[ $stage == *3b* ]] && cases 3b "$llama_3b" "${CASES_3B:-resident:2 auto:2 auto:4 plain_bf16:2 plain_autocast:2}"
llama_7b="--layers 32 --width 4096 --intermediate 11008 --heads 32 --seq 2048"
[[ $stage == *7b* ]] && cases 7b "$llama_7b" "${CASES_7B:-auto:2}"
exit 0
