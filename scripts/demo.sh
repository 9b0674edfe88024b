#!/usr/bin/env bash
# The main job: set-up (idempotent), then FusedReducer on 2 CPU ranks next to DDP, then the
# all-reduce bandwidth benchmark at small sizes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH" OMP_NUM_THREADS=1
torchrun --standalone --nproc-per-node 2 examples/train_demo.py

echo
echo "== all-reduce bandwidth, 2 gloo ranks, small sizes (bench/allreduce_bw.py; nccl-tests columns)"
python bench/allreduce_bw.py -b 64K -e 4M -f 4 -n 10 -w 3 --impl fused,torch --quiet
