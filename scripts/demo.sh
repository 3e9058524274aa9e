#!/usr/bin/env bash
# The demo: a small LoRA model trained sharded on 2 CPU ranks, saved, and resumed exactly
# in a new set of processes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=1 ZERO3_ACCELERATOR=cpu
workdir=$(mktemp -d)
trap 'rm -rf "$workdir"' EXIT
run() { .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node=2 examples/demo.py "$@" 2>&1 | grep -v -E "^W[0-9]{4} |^\*+$|OMP_NUM_THREADS|^$"; }
run --phase first --dir "$workdir"
run --phase resume --dir "$workdir"
