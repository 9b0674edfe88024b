#!/usr/bin/env bash
# One prepared GPU run (about 5 minutes on one H200): build, GPU tests, GPU benchmarks, and a short
# table last. Uses the machine's own python3 and torch (a GPU machine has no package mirror).
#
#   bash bench/gpu_check.sh            # results and logs under $OUT (default bench/out/gpu)
#
# World size 1 (one GPU: NCCL refuses two ranks on one GPU). Multi-GPU numbers: run
# `torchrun --nproc-per-node 8 bench/allreduce_bw.py` and `... bench/step_bench.py` on your node.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-bench/out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
[ -d /usr/local/cuda ] && export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"

echo "== build (in place, against this machine's torch)"
t0=$(date +%s)
$PY setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
export PYTHONPATH="$PWD/python:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
$PY -c "import fused_reducer; print(fused_reducer.build_info())" | tee "$OUT/build_info.txt"
echo "build took $(( $(date +%s) - t0 )) s"

echo "== GPU tests"
$PY -m pytest -q tests/test_gpu.py tests/test_backend.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
tests_rc=${PIPESTATUS[0]}

echo "== copy kernel bandwidth"
$PY bench/copy_bench.py --sizes 1M,16M,64M,256M --json "$OUT/copy.json" 2>&1 | tee "$OUT/copy.log"

echo "== all-reduce bandwidth, world size 1"
torchrun --standalone --nproc-per-node 1 bench/allreduce_bw.py -b 1M -e 256M -f 4 -n 20 -w 5 \
  --impl fused,torch,cupy --json "$OUT/allreduce_bw.json" --plot "$OUT/allreduce_bw.png" 2>&1 \
  | tee "$OUT/allreduce_bw.log" | tail -25

echo "== step time vs DDP, world size 1"
torchrun --standalone --nproc-per-node 1 bench/step_bench.py --model large,many-small --steps 30 \
  --json "$OUT/step.json" 2>&1 | tee "$OUT/step.log" | tail -25

echo "== summary"
$PY - "$OUT" "$tests_rc" <<'PYEOF'
import json, os, sys
out, tests_rc = sys.argv[1], int(sys.argv[2])
print(f"{'check':<44} {'result':>20}")
print(f"{'GPU tests (tests/test_gpu.py)':<44} {'passed' if tests_rc == 0 else 'FAILED':>20}")
def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None
copy = load("copy.json")
for row in (copy or {}).get("rows", []):
    print(f"{'copy fused/D2D at ' + str(row['bytes'] >> 20) + ' MiB':<44} {row['fused_over_d2d']:>20.2f}")
bw = load("allreduce_bw.json")
if bw:
    big = [r for r in bw["rows"] if r["bytes"] >= 64 << 20 and not r["inplace"]]
    for impl in sorted({r["impl"] for r in big}):
        vals = [r["algbw_GBps"] for r in big if r["impl"] == impl]  # busbw is 0 at world size 1
        print(f"{'all-reduce ' + impl + ' >=64MiB mean algbw GB/s':<44} {sum(vals) / len(vals):>20.1f}")
step = load("step.json")
for row in (step or {}).get("rows", []):
    if row["impl"] == "fused":
        print(f"{'step time ' + row['model'] + ' FusedReducer/DDP':<44} {row['ratio_to_ddp']:>20.3f}")
PYEOF
