#!/usr/bin/env bash
# zero3's NVMe tier beside DeepSpeed's ZeRO-Infinity on this CPU machine (no GPU): one GPT
# (bench/nvme_bench.py train --device cpu), all of its optimizer state in swap files under
# NVME_DIR, one process each, in turn; zero3's host tier beside them. zero3 runs from
# $ZERO3_PY (default .venv/bin/python), DeepSpeed 0.19.8 from $DS_PY (a venv of its own:
# torch 2.13.0 CPU, `DS_BUILD_OPS=0 pip install deepspeed==0.19.8`; its CPU Adam and async_io
# ops are built at first use, the latter against libaio: LIBAIO_PREFIX, default .whl/libaio,
# holds the libaio1 and libaio-dev .deb files unpacked with `dpkg -x`).
set -u
out=${OUT:-bench/out}
mkdir -p "$out"
rows="$out/nvme_cpu_rows.jsonl"
rm -f "$rows"
dir=${NVME_DIR:-/tmp/zero3_nvme_cpu_bench}
mkdir -p "$dir"
aio=${LIBAIO_PREFIX:-$PWD/.whl/libaio}
lib=$aio/usr/lib/x86_64-linux-gnu
export CPATH="$aio/usr/include" LIBRARY_PATH="$lib" LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    CFLAGS="-I$aio/usr/include" LDFLAGS="-L$lib" DS_ACCELERATOR=cpu ZERO3_ACCELERATOR=cpu \
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} PYTHONWARNINGS=ignore
model="--device cpu ${MODEL:---width 512 --layers 8 --vocab 8192 --seq 128 --micro-batch 2} --steps ${STEPS:-4} \
    --warmup 1 --dir $dir --threads 2 --block-mib 8 --rows $rows"
df -h "$dir" | tail -1
for run in "zero3 --tier nvme --host-share 0" "deepspeed --tier nvme --engine deepspeed" "zero3 --tier host"; do
    set -- $run
    py=${ZERO3_PY:-.venv/bin/python}
    [ "$1" = deepspeed ] && py=${DS_PY:-.venv-deepspeed/bin/python}
    shift
    echo "CMD: $py bench/nvme_bench.py train $model $*"
    timeout ${TIMEOUT:-900} "$py" bench/nvme_bench.py train $model "$@" 2>&1 | grep -v Warning | tail -2
done
"${ZERO3_PY:-.venv/bin/python}" bench/nvme_bench.py table --rows "$rows"
rm -rf "$dir"
