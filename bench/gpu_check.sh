#!/usr/bin/env bash
# One prepared GPU run (about 8 minutes on one H200): prerequisites, build, GPU tests, GPU
# benchmarks, and a short table last. Uses the machine's own python3 and torch (a GPU machine has
# no package mirror). Exits non-zero when any stage fails; every stage runs under `timeout`.
#
#   bash bench/gpu_check.sh            # results and logs under $OUT (default bench/out/gpu)
#
# World size 1 for NCCL (one GPU: NCCL refuses two ranks on one GPU); two ranks on the one GPU run
# over gloo with CUDA tensors (tests/test_gpu_ordering.py). Multi-GPU numbers: run
# `python -m torch.distributed.run --nproc-per-node 8 bench/allreduce_bw.py` and
# `... bench/step_bench.py` on your node.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-bench/out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
[ -d /usr/local/cuda ] && export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
failed=()

# stage NAME SECONDS COMMAND...: runs under timeout, logs to $OUT/NAME.log, records failures.
stage() {
  local name=$1 seconds=$2
  shift 2
  echo "== $name (limit ${seconds}s)"
  local t0=$(date +%s)
  timeout --kill-after=10 "$seconds" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 15 "$OUT/$name.log"
  if [ $rc -ne 0 ]; then
    [ $rc -eq 124 ] && echo "!! $name timed out after ${seconds}s" || echo "!! $name failed (exit $rc)"
    failed+=("$name")
  fi
  echo "   $name took $(( $(date +%s) - t0 )) s"
  return $rc
}

echo "== prerequisites"
missing=()
command -v nvidia-smi > /dev/null || missing+=("nvidia-smi (no NVIDIA driver)")
$PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
  || missing+=("a CUDA GPU visible to torch (torch.cuda.is_available() is False)")
for module in ninja pytest matplotlib; do
  $PY -c "import $module" 2>/dev/null || missing+=("python module $module")
done
$PY -m torch.distributed.run --help > /dev/null 2>&1 || missing+=("python -m torch.distributed.run")
if [ ${#missing[@]} -gt 0 ]; then
  printf 'gpu_check: missing prerequisite: %s\n' "${missing[@]}"
  exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"

stage build 400 $PY setup.py -q build_ext --inplace || { echo "gpu_check: build failed"; exit 1; }
export PYTHONPATH="$PWD/python:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
$PY -c "import fused_reducer; print(fused_reducer.build_info())" | tee "$OUT/build_info.txt"

stage gpu_tests 300 $PY -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_ordering.py \
  tests/test_backend.py
stage copy_bench 120 $PY bench/copy_bench.py --sizes 1M,16M,64M,256M --json "$OUT/copy.json"
stage copy_bench_bf16 120 $PY bench/copy_bench.py --sizes 1M,16M,64M,256M --dtype bfloat16 \
  --json "$OUT/copy_bf16.json"
stage copy_bench_cast 120 $PY bench/copy_bench.py --sizes 16M,64M,256M --dtype float32 \
  --to-dtype bfloat16 --json "$OUT/copy_fp32_to_bf16.json"
stage copy_bench_cast_back 120 $PY bench/copy_bench.py --sizes 16M,64M,256M --dtype bfloat16 \
  --to-dtype float32 --json "$OUT/copy_bf16_to_fp32.json"
stage allreduce_bw 120 $PY -m torch.distributed.run --standalone --nproc-per-node 1 \
  bench/allreduce_bw.py -b 1M -e 256M -f 4 -n 20 -w 5 --impl fused,torch,cupy \
  --json "$OUT/allreduce_bw.json" --plot "$OUT/allreduce_bw.png"
stage step_bench 180 $PY -m torch.distributed.run --standalone --nproc-per-node 1 \
  bench/step_bench.py --model large,many-small --steps 30 --json "$OUT/step.json"

echo "== summary"
$PY - "$OUT" "${failed[*]:-}" <<'PYEOF'
import json, os, sys
out, failed = sys.argv[1], sys.argv[2].split()
print(f"{'check':<48} {'result':>20}")
for name in ("build", "gpu_tests", "copy_bench", "copy_bench_bf16", "copy_bench_cast",
             "copy_bench_cast_back", "allreduce_bw", "step_bench"):
    print(f"{name:<48} {'FAILED' if name in failed else 'ok':>20}")
def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None
for name, dtype in (("copy.json", "fp32"), ("copy_bf16.json", "bf16"),
                    ("copy_fp32_to_bf16.json", "fp32->bf16"), ("copy_bf16_to_fp32.json", "bf16->fp32")):
    for row in (load(name) or {}).get("rows", []):
        label = f"copy fused/D2D {dtype} at {row['bytes'] >> 20} MiB"
        print(f"{label:<48} {row['fused_over_d2d']:>20.2f}")
bw = load("allreduce_bw.json")
if bw:
    big = [r for r in bw["rows"] if r["bytes"] >= 64 << 20 and not r["inplace"]]
    for impl in sorted({r["impl"] for r in big}):
        vals = [r["algbw_GBps"] for r in big if r["impl"] == impl]  # busbw is 0 at world size 1
        print(f"{'all-reduce ' + impl + ' >=64MiB mean algbw GB/s':<48} {sum(vals) / len(vals):>20.1f}")
for row in (load("step.json") or {}).get("rows", []):
    if row["impl"] == "fused":
        print(f"{'step time ' + row['model'] + ' FusedReducer/DDP':<48} {row['ratio_to_ddp']:>20.3f}")
    if row["impl"] in ("fused", "ddp"):
        label = f"backward() host ms {row['model']} {row['impl']} (step {row['median_ms']:.1f})"
        print(f"{label:<48} {row['backward_host_ms']:>20.2f}")
PYEOF
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_check: FAILED stages: ${failed[*]}"
  exit 1
fi
echo "gpu_check: all stages passed"
