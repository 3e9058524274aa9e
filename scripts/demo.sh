#!/usr/bin/env bash
# The demo: a small Llama with PEFT LoRA, built partitioned (zero3.Init), trained sharded on
# 2 CPU ranks (gradient accumulation, HF activation checkpointing, CPU parameter offload),
# saved, resumed exactly in a new set of processes, and exported in PEFT's and HF's formats.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements-hf.txt
export OMP_NUM_THREADS=1 ZERO3_ACCELERATOR=cpu HF_HUB_OFFLINE=1
workdir=$(mktemp -d)
trap 'rm -rf "$workdir"' EXIT
run() { .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node=2 examples/peft_lora.py "$@" 2>&1 | grep -v -E "^W[0-9]{4} |^\*+$|OMP_NUM_THREADS|^$"; }
run --phase first --dir "$workdir"
run --phase resume --dir "$workdir"
