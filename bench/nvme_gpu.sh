#!/usr/bin/env bash
# The NVMe tier on the lent GPU machine (one H100, 16 cores, 128 GiB host, 64 GiB disk), one
# process per case (bench/nvme_bench.py), logs and rows into $OUT (or bench/out):
#   1. disk   the drive's own bandwidth: an 8 GiB file written and read with O_DIRECT
#   2. swap   zero3's swap path (KvikIO when its wheels are carried in .whl/, else POSIX) over
#             the same 8 GiB, with its ratio to the disk (target >= 80%)
#   3. train  a 2.9B GPT (width 3072, 24 blocks, seq 1024, micro-batch 4, bf16) full fine-tune,
#             both offloads on: the optimizer state on the host, then half of it on NVMe
#   4. largest (LARGEST=1) the largest 4096-wide GPT the planner fits on this machine with the
#             optimizer state on the host, then with NVMe beside it, each trained 2 steps
#   5. versus (VERSUS=1) one model (VERSUS_MODEL, default a 0.94B GPT: width 2048, 16 blocks) with
#             its optimizer state off the GPU (ratio 1): zero3 all on NVMe (--host-share 0), then
#             DeepSpeed 0.19.8's (its defaults, then pipelined with 8 buffers)
#             ZeRO-Infinity (carried in .whl, DS_BUILD_OPS=0: its CPU Adam and async_io ops are
#             built at first use against libaio unpacked into .whl/libaio from the libaio1 and
#             libaio-dev .deb files, `dpkg -x`), zero3's host tier beside them, and zero3 all-NVMe
#             under its own GPU placement
#   then the table of ratios. IO=0 skips 1 and 2, TRAIN=0 skips 3, VERSUS_ALL=0 keeps 5's first pair; LARGEST_TIERS="nvme" runs 4 for one tier.
# NVME_DIR: a folder on the drive to measure (default: a folder under /tmp, i.e. the disk /tmp
# is on). KvikIO: carry kvikio_cu13, libkvikio_cu13 and rapids_logger wheels in .whl/
# (pip download --no-deps kvikio-cu13==26.10.0 libkvikio-cu13==26.10.0 rapids-logger==0.3.0);
# without them the POSIX backend runs. Expected wall time: about 6-8 minutes.
set -u
out=${OUT:-bench/out}
mkdir -p "$out"
source bench/carried_wheels.sh
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-14}
dir=${NVME_DIR:-/tmp/zero3_nvme_bench}
mkdir -p "$dir"
rows="$out/nvme_rows.jsonl"
rm -f "$rows"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
df -h "$dir" | tail -1
free -g | head -2
io="--dir $dir --gib ${GIB:-8} --threads ${THREADS:-8}"
[ "${IO:-1}" = 1 ] && timeout 120 python3 bench/nvme_bench.py disk $io --chunk-mib 64 --rows "$rows" 2>&1 | tee "$out/nvme_disk.log"
[ "${IO:-1}" = 1 ] && timeout 120 python3 bench/nvme_bench.py swap $io --group-mib 256 --block-mib ${BLOCK_MIB:-8} --queue-depth 8 \
    --buffers 4 --rows "$rows" 2>&1 | tee "$out/nvme_swap.log"
model="--width ${WIDTH:-3072} --layers ${LAYERS:-24} --seq 1024 --micro-batch 4 --steps ${STEPS:-4} --warmup 1"
for tier in $([ "${TRAIN:-1}" = 1 ] && echo host nvme); do
    timeout ${TRAIN_TIMEOUT:-200} python3 bench/nvme_bench.py train $model --tier $tier --host-share 0.5 \
        --dir "$dir" --threads ${THREADS:-8} --block-mib ${BLOCK_MIB:-8} --rows "$rows" 2>&1 \
        | grep -v Warning | tail -5 | tee "$out/nvme_train_$tier.log"
done
for tier in $([ "${LARGEST:-0}" = 1 ] && echo ${LARGEST_TIERS:-host nvme}); do
    timeout ${LARGEST_TIMEOUT:-280} python3 bench/nvme_bench.py largest --tier $tier --width 4096 --seq 1024 \
        --micro-batch 1 --steps 1 --warmup 1 --gpu-budget-gib ${LARGEST_GPU_GIB:-64} --dir "$dir" \
        --threads ${THREADS:-8} --block-mib ${BLOCK_MIB:-8} --rows "$rows" 2>&1 | grep -v Warning | tail -5 \
        | tee "$out/nvme_largest_$tier.log"
    free -g | head -2
done
if [ "${VERSUS:-0}" = 1 ]; then
    export DS_BUILD_OPS=0
    aio=$PWD/.whl/libaio lib=$PWD/.whl/libaio/usr/lib/x86_64-linux-gnu
    export CPATH="$aio/usr/include" LIBRARY_PATH="$lib" LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        CFLAGS="-I$aio/usr/include" LDFLAGS="-L$lib"
    versus="${VERSUS_MODEL:---width 2048 --layers 16} --seq 1024 --micro-batch 4 --steps 2 --warmup 1 --dir $dir \
        --threads ${THREADS:-8} --block-mib ${BLOCK_MIB:-8} --rows $rows"
    export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST_DS:-9.0}  # DeepSpeed's JIT builder reads no "9.0a"
    # DeepSpeed's defaults (buffer_count 4, no pipelining), then its pipelined swapper, which asserts
    # for want of buffers at buffer_count 4 (results/h100/nvme_versus_deepspeed.log) and gets 8
    runs=("--tier nvme --host-share 0 --ratio 1" "--tier nvme --engine deepspeed --ds-pipeline 0"
          "--tier nvme --engine deepspeed --ds-pipeline 1 --buffers 8")
    [ "${VERSUS_ALL:-1}" = 1 ] && runs+=("--tier host --ratio 1" "--tier nvme --host-share 0")
    for run in "${runs[@]}"; do
        timeout ${VERSUS_TIMEOUT:-240} python3 bench/nvme_bench.py train $versus $run 2>&1 | grep -v Warning \
            | tail -5 | tee -a "$out/nvme_versus.log"
    done
fi
python3 bench/nvme_bench.py table --rows "$rows" | tee "$out/nvme_table.log"
rm -rf "$dir"
exit 0
