#!/usr/bin/env bash
# The GPU runs of the compile, asynchronous-save and sharded-Hugging-Face work, in stages
# (each stage's log under $OUT). DeepSpeed 0.19.8 (built with DS_BUILD_OPS=0) and what it
# lacks come from wheels in build/wheels; the Hugging Face extras from .whl.
#   STAGE=hf,hf_w1,async,ds_compile_1b,compile_7b_lora,state_offload
# Each of async and compile_7b_lora may take most of a 10-minute device call: run them in
# calls of their own (STAGE=hf with tests/gpu/sharded_tier.sh STAGE=train fits in one).
set -u
out=${OUT:-bench/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
if ls build/wheels/deepspeed-*.whl >/dev/null 2>&1; then
    DS_BUILD_OPS=0 python3 -m pip install -q --no-index --find-links build/wheels deepspeed==0.19.8 2>&1 | tail -2
fi
source bench/carried_wheels.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage=${STAGE:-hf,async,ds_compile_1b}
llama_1b="--model llama --width 2048 --layers 16 --intermediate 5632 --heads 16 --vocab 32000 --seq 2048"
if [[ $stage == *hf_w1* ]]; then
    # World size 1 on NCCL: Accelerate's gathers refuse CUDA tensors on gloo. The sharded
    # collectives still run (ZERO3_COLLECTIVES_AT_WORLD_SIZE_1=1); the DeepSpeed-written Trainer
    # checkpoint (2 ranks) resumes with twice the micro-batch, the same samples a step.
    ZERO3_TEST_DEVICE=cuda ZERO3_TEST_BACKEND=nccl ZERO3_TEST_WORLD_SIZE=1 ZERO3_COLLECTIVES_AT_WORLD_SIZE_1=1 \
        HF_HUB_OFFLINE=1 timeout ${HF_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -rs \
        tests/hf/test_hf_trainer.py tests/hf/test_hf_deepspeed_resume.py > "$out/hf_cuda_w1_nccl.log" 2>&1
    echo "== hf on CUDA, world size 1 on NCCL with the collectives on (exit $?)"; tail -6 "$out/hf_cuda_w1_nccl.log"
fi
if [[ $stage == *hf,* || $stage == hf || $stage == *,hf ]]; then
    ZERO3_TEST_DEVICE=cuda ZERO3_TEST_BACKEND=gloo HF_HUB_OFFLINE=1 timeout ${HF_TIMEOUT:-200} \
        python3 -m pytest -q -p no:cacheprovider tests/hf/test_hf_trainer.py tests/hf/test_hf_deepspeed_resume.py \
        "tests/checkpoint/test_deepspeed_import.py::test_load_every_fixture[2]" \
        > "$out/hf_cuda_w2.log" 2>&1
    echo "== hf on CUDA, 2 ranks over gloo on one GPU (exit $?)"; tail -4 "$out/hf_cuda_w2.log"
fi
if [[ $stage == *async* ]]; then
    # A save of the 1B full fine-tune is 14.3 GiB. The local disk unless it writes slower than
    # 0.4 GiB/s (then ~36 s a save, 3 saves a mode, would not fit a 10-minute call) and
    # /dev/shm has room for two copies; the log says which.
    async_dir=${ASYNC_DIR:-$(python3 -c "
import shutil, sys; from pathlib import Path; sys.path.insert(0, 'bench')
from async_save_bench import disk_bandwidth
bw = disk_bandwidth(Path('/tmp/async_probe')); shm = shutil.disk_usage('/dev/shm').free
print(f'# /tmp: {bw / 2**30:.2f} GiB/s write + fsync; /dev/shm free {shm / 2**30:.0f} GiB', file=sys.stderr)
print('/dev/shm/async_save_bench' if bw < 0.4 * 2**30 and shm > 40 * 2**30 else '/tmp/async_save_bench')")}
    echo "== async save bench into $async_dir"
    timeout ${ASYNC_TIMEOUT:-540} torchrun --standalone --nproc_per_node=1 bench/async_save_bench.py --device cuda \
        --dtype bf16 --hidden 2048 --layers 16 --intermediate 5632 --heads 16 --vocab 32000 --seq 2048 \
        --micro-batch 2 --steps ${ASYNC_STEPS:-12} --save-every auto --dir "$async_dir" 2>&1 \
        | grep -v Warning | tee "$out/async_save_1b.log" | tail -30
    rm -rf "$async_dir" /tmp/async_probe
fi
if [[ $stage == *ds_compile_1b* ]]; then
    (cd bench && timeout ${DS_TIMEOUT:-200} torchrun --standalone --nproc_per_node=1 compile_bench.py --device cuda \
        --dtype bf16 $llama_1b --micro-batch 2 --steps 6 --warmup 3 --rounds 1 \
        --peers deepspeed_compiled,zero3_compiled 2>&1 | grep -v "Warning\|warn(" | tee "$out/compile_1b_deepspeed.log" | tail -14)
fi
if [[ $stage == *compile_7b_lora* ]]; then
    (cd bench && timeout ${LORA_TIMEOUT:-540} torchrun --standalone --nproc_per_node=1 compile_bench.py --device cuda \
        --dtype bf16 --model llama --width 4096 --layers 32 --intermediate 11008 --heads 32 --vocab 32000 --seq 2048 \
        --micro-batch 1 --steps 4 --warmup 3 --rounds 1 --lora 16 --build-on device \
        --peers ${LORA_PEERS:-plain_compiled,plain_autocast_compiled,zero3_compiled,fsdp2_compiled,zero3} \
        2>&1 | grep -v "Warning\|warn(" | tee "$out/compile_7b_lora.log" | tail -14)
fi
if [[ $stage == *state_offload* ]]; then
    # offload_states()/reload_states() and cpu_checkpointing on the 1B Llama (about 3 minutes)
    timeout ${OFFLOAD_TIMEOUT:-540} torchrun --standalone --nproc_per_node=1 bench/state_offload_bench.py \
        --device cuda --dtype bf16 --width 2048 --layers 16 --intermediate 5632 --heads 16 --vocab 32000 \
        --seq 2048 --micro-batch 2 2>&1 | grep -v "Warning\|warn(" | tee "$out/state_offload_1b.log" | tail -20
fi
