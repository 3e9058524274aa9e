#!/usr/bin/env bash
# The sharded CUDA tier on one GPU (tests/gpu/sharded_checks.py), run on the lent card:
#   - world sizes 2 and 4 over gloo with CUDA tensors (every rank on the one GPU);
#   - world size 1 on NCCL with ZERO3_COLLECTIVES_AT_WORLD_SIZE_1=1 (the path of world size N),
#     and once more with PYTORCH_NO_CUDA_MEMORY_CACHING=1;
#   - bit-exact resume in new processes and resharding 2->4, 4->2, 2->1, 1->2;
#   - with STAGE containing hf: the Hugging Face Trainer tests (SFT + PEFT LoRA exact resume,
#     a DeepSpeed-written checkpoint resumed) on CUDA at world size 2 over gloo.
#   STAGE=train,resume,hf (default: train,resume)   OUT=folder for the logs
set -u
out=${OUT:-/tmp/sharded_tier}
mkdir -p "$out"
source bench/carried_wheels.sh
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
stage=${STAGE:-train,resume}
launch() {  # launch NAME NPROC ARGS...: one torchrun, its log kept, its verdict lines shown
    local name=$1 nproc=$2
    shift 2
    timeout ${LAUNCH_TIMEOUT:-300} torchrun --standalone --nproc_per_node="$nproc" tests/gpu/sharded_checks.py "$@" \
        > "$out/$name.log" 2>&1
    echo "== $name (exit $?)"
    grep -E "^(PASS|FAIL|CHECKS|COMM_VOLUME|world )" "$out/$name.log" || tail -20 "$out/$name.log"
}
if [[ $stage == *train* ]]; then
    launch gloo_w2 2 --backend gloo --phase train
    launch gloo_w4 4 --backend gloo --phase train
    ZERO3_COLLECTIVES_AT_WORLD_SIZE_1=1 launch nccl_w1_collectives 1 --backend nccl --phase train
    ZERO3_COLLECTIVES_AT_WORLD_SIZE_1=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
        launch nccl_w1_collectives_no_caching 1 --backend nccl --phase train
fi
if [[ $stage == *resume* ]]; then
    dir=$(mktemp -d)
    ZERO3_COLLECTIVES_AT_WORLD_SIZE_1=1 launch save_w1 1 --backend nccl --phase save --dir "$dir"
    launch save_w2 2 --backend gloo --phase save --dir "$dir"
    launch save_w4 4 --backend gloo --phase save --dir "$dir"
    launch load_w2 2 --backend gloo --phase load --dir "$dir" --from 2,1,4
    launch load_w4 4 --backend gloo --phase load --dir "$dir" --from 4,2
    ZERO3_COLLECTIVES_AT_WORLD_SIZE_1=1 launch load_w1 1 --backend nccl --phase load --dir "$dir" --from 2
fi
if [[ $stage == *hf* ]]; then
    ZERO3_TEST_DEVICE=cuda ZERO3_TEST_BACKEND=gloo HF_HUB_OFFLINE=1 timeout ${HF_TIMEOUT:-400} \
        python3 -m pytest -q -p no:cacheprovider tests/hf/test_hf_trainer.py tests/hf/test_hf_deepspeed_resume.py \
        > "$out/hf_cuda_w2.log" 2>&1
    echo "== hf on CUDA, 2 ranks over gloo (exit $?)"
    tail -15 "$out/hf_cuda_w2.log"
fi
