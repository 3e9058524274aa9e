#!/usr/bin/env bash
# The placement's GPU runs (one lent card), logs into $OUT (or bench/out):
#   STAGE=checks  tests/gpu/placement_checks.py at world size 1 (NCCL) and 2 (gloo, one card);
#                 STAGE=checks_w1 at world size 1 only, STAGE=checks_w2 at world size 2 only
#   STAGE=3b      bench/placement_bench.py: a 3.1B Llama full fine-tune, resident / offload under
#                 the auto budget at micro-batch 2 and 4, both plain PyTorch peers beside it
#   STAGE=ds      the 3.1B model under DeepSpeed 0.19.8 (carried in .whl, DS_BUILD_OPS=0, its CPU Adam
#                 built at first use): both offloads, its offload_optimizer.ratio 0.5, super_offload
#   STAGE=7b      a 6.7B Llama (does not fit resident): offload under the auto budget
#   STAGE=7b_ds   the 6.7B Llama under DeepSpeed 0.19.8 (CASES_7B_DS, default its ZeRO-Offload at
#                 micro-batch 4, plain, with offload_optimizer.ratio 0.85 and with super_offload)
#   STAGE=7b_compile  the 6.7B Llama offloaded under the auto budget with engine.compile()
#                 (CASES_7B_COMPILE, default auto+compile:2); CASE_TIMEOUT covers the compilation
#   STAGE=7b_ceiling  the 6.7B Llama's forward and backward alone in plain bf16 PyTorch, no optimizer
#                 (CASES_7B_CEILING, default plain_bf16_fwdbwd+compile:4): the card's ceiling for it
#   STAGE=lora27b         bench/lora_cap_bench.py: the seed's scale, a 26.8B Llama LoRA (GA 4, reentrant
#                         checkpointing), zero3 on the whole card, then capped at 40 GiB with offload_param
#                         and the auto budget (about 5 minutes)
#   STAGE=lora27b_ds      the uncapped zero3 baseline again, then DeepSpeed 0.19.8's offload_param on the
#                         40 GiB cap (about 6-7 minutes)
#   STAGE=lora27b_budget  the 40 GiB cap under placement.gpu_budget (LORA_BUDGET_GIB, default 30) beside
#                         the auto budget (about 5-6 minutes)
# Stages are comma-separated names (STAGE=checks,3b); run each lora27b* stage in a call of its own.
# LORA_ARGS adds flags to bench/lora_cap_bench.py (e.g. "--seq 1024"; "--device cpu" runs it all on the CPU).
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
has() { [[ ",$stage," == *",$1,"* ]]; }  # whole names: lora27b_ds is not ds, lora27b is not 7b
if has checks || has checks_w1; then
    timeout 150 torchrun --standalone --nproc_per_node=1 tests/gpu/placement_checks.py --backend nccl \
        2>&1 | tee "$out/placement_checks_w1.log" | grep -E "^(PASS|FAIL|CHECKS)|Error|error" | head -30
fi
if has checks || has checks_w2; then
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
has ds && cases 3b_deepspeed "$llama_3b" "${CASES_DS:-ds_offload:2 ds_ratio=0.5:2 ds_super:2}"
has 3b && cases 3b "$llama_3b" "${CASES_3B:-resident:2 auto:2 auto:4 plain_bf16:2 plain_autocast:2}"
llama_7b="--layers 32 --width 4096 --intermediate 11008 --heads 32 --seq 2048"
has 7b && cases 7b "$llama_7b" "${CASES_7B:-auto:2}"
has 7b_ds && cases 7b_deepspeed "$llama_7b" "${CASES_7B_DS:-ds_opt_offload:4 ds_opt_ratio=0.85:4 ds_opt_super:4}"
has 7b_compile && cases 7b_compiled "$llama_7b" "${CASES_7B_COMPILE:-auto+compile:2}"
has 7b_ceiling && cases 7b_ceiling "$llama_7b" "${CASES_7B_CEILING:-plain_bf16_fwdbwd+compile:4}"
lora_cases() {  # lora_cases NAME "case ..." : bench/lora_cap_bench.py, one process per case, then the table
    local name=$1 list=$2 rows="$out/lora27b_$1.jsonl"
    rm -f "$rows"
    for case in $list; do
        local limit=${LORA_CASE_TIMEOUT:-300}
        [[ $case == deepspeed* ]] && limit=${LORA_DS_TIMEOUT:-420}
        timeout $limit torchrun --standalone --nproc_per_node=1 bench/lora_cap_bench.py ${LORA_ARGS:-} --case "$case" \
            --steps ${STEPS:-3} --warmup ${WARMUP:-2} --budget-gib ${LORA_BUDGET_GIB:-30} --rows "$rows" 2>&1 \
            | grep -v -E "Warning|warn\(|return func|^\|" | tee -a "$out/lora27b_$name.log"
        echo "# $case: exit ${PIPESTATUS[0]}" | tee -a "$out/lora27b_$name.log"
    done
    python3 bench/lora_cap_bench.py --table "$rows" | tee -a "$out/lora27b_$name.log"
}
has lora27b && lora_cases auto "${CASES_LORA:-zero3_uncapped zero3_cap40}"
has lora27b_ds && lora_cases deepspeed "${CASES_LORA_DS:-zero3_uncapped deepspeed_cap40}"
has lora27b_budget && lora_cases budget "${CASES_LORA_BUDGET:-zero3_cap40_budget zero3_cap40}"
exit 0
