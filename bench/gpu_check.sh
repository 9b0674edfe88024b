#!/usr/bin/env bash
# One prepared GPU run that fits one short lease (one H200; issue 21 item 6): prerequisites, a
# CUDA build for sm_90 only, the GPU tests, then short GPU benchmarks, and a table last.
#
#   bash bench/gpu_check.sh      # $OUT set (device tool): writes there; else bench/out/gpu_check/
#
# Budget: every stage runs under `timeout` (plus 5 s --kill-after grace) and the limits below
# add up to 420 s (tests/test_gpu_check_script.py parses and checks the sum), so a rerun fits in a
# 15-minute lease with the machine's start; the tests come before the benchmarks.
#   prereq 15 + build 150 + build_info 15 + gpu_tests 130 + no_skips 5 + ft_gpu 20
#   + copy_bench 25 + allreduce_bw 25 + step_bench 30 + report 5 = 420
# ft_gpu (tests/test_ft_gpu.py: fused_reducer.torchft over torchft's ProcessGroupNCCL and
# ProcessGroupBabyNCCL, one replica on the GPU, against float64) needs torchft, whose 0.2.0 wheel
# is cp311 only: where it cannot be imported the stage records "torchft missing" in the summary
# and does not fail the check (the rest still must pass); where it can, a failure or a skip fails.
# Output: exactly two files in the output folder, gpu_check_logs.tar.gz (every log, the pytest
# junit XML, the benchmarks' JSON) and gpu_check_summary.txt; both are rewritten after each stage,
# so a run killed from outside still leaves them. The summary table (stage, status, seconds) is
# the last thing printed.
# It fails (exit 1) when any stage fails, when the build is not a CUDA build
# (fused_reducer.build_info()["cuda"] is not True: a CPU-only build would skip every GPU test),
# and when any selected test is skipped; exit 2 when a prerequisite is missing.
#
# Versions: uses the machine's own python3 and torch (the GPU machine has torch 2.11; this
# project's CI uses 2.14.1). Nothing here needs a newer torch than 2.11: only
# torch.utils.cpp_extension (via setup.py), torch.distributed.run and the tests' and benchmarks'
# own code; no torch API is called from this script itself.
#
# World size 1 for NCCL (one GPU: NCCL refuses two ranks on one GPU); two ranks on the one GPU run
# over gloo with CUDA tensors (tests/test_gpu_ordering.py, tests/test_module_surface_like_ddp.py's
# SyncBatchNorm).
# Multi-GPU numbers: `python -m torch.distributed.run --nproc-per-node 8 bench/allreduce_bw.py`
# and `... bench/step_bench.py` on your node.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-bench/out/gpu_check}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ARCHIVE="$OUT/gpu_check_logs.tar.gz"
SUMMARY="$OUT/gpu_check_summary.txt"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")  # logs live here, outside $OUT
trap 'rm -rf "$WORK" "$WORK.tar.gz"' EXIT

# sm_90 only (H200): one arch compiles in about half the time of setup.py's default "8.0;9.0".
export TORCH_CUDA_ARCH_LIST=9.0
unset FUSED_REDUCER_NO_CUDA
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-$(nproc)}
[ -d /usr/local/cuda ] && export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PYTHONPATH="$PWD/python:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"

PLANNED=(prereq build build_info gpu_tests no_skips ft_gpu copy_bench allreduce_bw step_bench)
NAMES=() STATUS=() SECS=()
STARTED=$SECONDS

# Archive every log (to a temporary file beside $WORK, then moved), so $OUT only ever holds the
# archive and the summary.
pack() {
  tar -czf "$WORK.tar.gz" -C "$WORK" . 2>/dev/null && mv -f "$WORK.tar.gz" "$ARCHIVE"
}

# The table: one row per planned stage, then the overall row.
table() {
  local overall=$1 i name status secs
  printf '%-14s %-18s %8s\n' stage status seconds
  for name in "${PLANNED[@]}"; do
    status="not run" secs="-"
    for i in "${!NAMES[@]}"; do
      [ "${NAMES[$i]}" = "$name" ] && status=${STATUS[$i]} secs=${SECS[$i]}
    done
    printf '%-14s %-18s %8s\n' "$name" "$status" "$secs"
  done
  printf '%-14s %-18s %8s\n' overall "$overall" "$((SECONDS - STARTED))"
}

write_summary() {
  {
    echo "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    [ -s "$WORK/gpu.txt" ] && cat "$WORK/gpu.txt"
    [ -s "$WORK/build_info.json" ] && echo "build_info: $(cat "$WORK/build_info.json")"
    [ -s "$WORK/results.txt" ] && cat "$WORK/results.txt"
    echo
    table "$1"
  } > "$WORK/summary.txt"
  cp "$WORK/summary.txt" "$SUMMARY"
}

# stage NAME SECONDS COMMAND...: runs under timeout, logs to $WORK/NAME.log, records the result.
stage() {
  local name=$1 limit=$2 t0=$SECONDS rc status
  shift 2
  echo "== $name (limit ${limit}s)"
  timeout --kill-after=5 "$limit" "$@" > "$WORK/$name.log" 2>&1
  rc=$?
  tail -n 12 "$WORK/$name.log"
  case $rc in
    0) status=ok ;;
    124 | 137) status="TIMEOUT ${limit}s" ;;
    *) status="FAILED rc=$rc" ;;
  esac
  NAMES+=("$name") STATUS+=("$status") SECS+=("$((SECONDS - t0))")
  echo "   $name: $status after $((SECONDS - t0)) s"
  write_summary running
  pack
  return $rc
}

# finish CODE: results, summary, archive; the table is the last thing printed.
finish() {
  local code=$1 overall=ok
  [ "$code" -ne 0 ] && overall=FAILED
  timeout 5 "$PY" - "$WORK" > "$WORK/results.txt" 2> "$WORK/report.log" <<'PYEOF'
import json, os, sys
work = sys.argv[1]
def load(name):
    try:
        with open(os.path.join(work, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
for name, label in (("copy_fp32.json", "fp32 pack"), ("copy_fp32_to_bf16.json", "fp32->bf16 pack"),
                    ("copy_bf16_to_fp32_unpack.json", "bf16->fp32 unpack")):
    for row in (load(name) or {}).get("rows", []):
        print(f"{'copy fused/D2D ' + label + ' ' + str(row['bytes'] >> 20) + ' MiB':<52} "
              f"{row['fused_over_d2d']:>10.2f}")
bw = load("allreduce_bw.json")
if bw:
    big = [r for r in bw.get("rows", []) if r["bytes"] >= 64 << 20 and not r["inplace"]]
    for impl in sorted({r["impl"] for r in big}):
        vals = [r["algbw_GBps"] for r in big if r["impl"] == impl]  # busbw is 0 at world size 1
        print(f"{'all-reduce ' + impl + ' >=64MiB mean algbw GB/s':<52} {sum(vals) / len(vals):>10.1f}")
try:
    print(open(os.path.join(work, "ft_gpu.txt")).read().strip())
except OSError:
    pass
for row in (load("step.json") or {}).get("rows", []):
    if row.get("impl") == "fused" and "ratio_to_ddp" in row:
        print(f"{'step time ' + row['model'] + ' FusedReducer/DDP':<52} {row['ratio_to_ddp']:>10.3f}")
    if row.get("impl") in ("fused", "ddp") and "backward_host_ms" in row:
        print(f"{'backward() host ms ' + row['model'] + ' ' + row['impl']:<52} "
              f"{row['backward_host_ms']:>10.2f}")
PYEOF
  write_summary "$overall"
  pack
  echo "== logs: $ARCHIVE"
  echo "== summary: $SUMMARY"
  cat "$WORK/results.txt" 2>/dev/null
  echo
  table "$overall"
  exit "$code"
}
trap 'echo "gpu_check: interrupted"; finish 130' INT TERM

# -- prerequisites (exit 2 when one is missing) ---------------------------------------------------
PREREQ='
import importlib.util, os, shutil, subprocess, sys
missing = []
if not shutil.which("nvidia-smi"):
    missing.append("nvidia-smi (no NVIDIA driver)")
if not (shutil.which("nvcc") or os.path.exists(os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"))):
    missing.append("nvcc (a CUDA toolkit; set CUDA_HOME)")
for module in ("ninja", "pytest", "pytest_timeout", "hypothesis"):
    if importlib.util.find_spec(module) is None:
        missing.append("python module " + module)
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda)
if not torch.cuda.is_available():
    missing.append("a CUDA GPU visible to torch (torch.cuda.is_available() is False)")
if shutil.which("nvidia-smi"):
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    with open(sys.argv[1], "w") as f:
        f.write(f"gpu: {gpu}; torch {torch.__version__} (CUDA {torch.version.cuda})\n")
for m in missing:
    print("gpu_check: missing prerequisite:", m)
sys.exit(1 if missing else 0)
'
stage prereq 15 "$PY" -c "$PREREQ" "$WORK/gpu.txt" || finish 2

# -- build (sm_90 only) and the CUDA-build assertion ----------------------------------------------
stage build 150 "$PY" setup.py -q build_ext --inplace || finish 1
BUILD_INFO='
import json, sys
import fused_reducer
info = fused_reducer.build_info()
with open(sys.argv[1], "w") as f:
    json.dump(info, f)
print(info)
assert info["cuda"] is True, "not a CUDA build: build_info()[\"cuda\"] is %r (see build.log)" % info["cuda"]
assert info["cuda_arch_list"] == "9.0", "built for %r, expected 9.0" % info["cuda_arch_list"]
'
# A CPU-only build would make every GPU test skip: stop here, loudly.
stage build_info 15 "$PY" -c "$BUILD_INFO" "$WORK/build_info.json" \
  || { echo "gpu_check: fused_reducer.build_info()[\"cuda\"] is not True: not a CUDA build"; finish 1; }

failed=0
# -- GPU tests first ------------------------------------------------------------------------------
# --timeout 60 (pytest-timeout) bounds every test, a peer that never joins included, well inside
# the stage's 130 s; -rs lists skips in the log, the junit XML feeds the no_skips stage.
GPU_TESTS=(
  tests/test_packaging.py::test_the_extension_shares_torchs_libstdcxx
  tests/test_gpu.py
  tests/test_gpu_ordering.py
  tests/test_backend.py
  tests/test_reduce_dtype.py::test_cast_copy_cuda_one_launch
  tests/test_module_surface_like_ddp.py::test_syncbatchnorm_converted_model_trains_like_ddp_on_cuda
)
stage gpu_tests 130 "$PY" -m pytest -q -p no:cacheprovider --timeout 60 -rs \
  --junitxml "$WORK/gpu_tests.xml" "${GPU_TESTS[@]}" || failed=1

# Any skipped (or xfailed) test fails the check, and every GPU test of the selection must have run.
NO_SKIPS='
import re, sys
import xml.etree.ElementTree as ET
xml_path, sources = sys.argv[1], sys.argv[2:]
cases = list(ET.parse(xml_path).getroot().iter("testcase"))
ran = {c.get("name", "").split("[")[0] for c in cases}
skipped = [c for c in cases if c.find("skipped") is not None]
for c in skipped:
    print("SKIPPED:", c.get("classname"), c.get("name"), "-", c.find("skipped").get("message"))
expected = set()
for source in sources:
    path, _, test = source.partition("::")
    expected |= {test} if test else set(re.findall(r"^def (test_\w+)", open(path).read(), re.M))
missing = sorted(expected - ran)
for name in missing:
    print("NOT RUN:", name)
print(f"{len(cases)} tests, {len(skipped)} skipped, {len(missing)} expected but not run")
sys.exit(1 if skipped or missing or not cases else 0)
'
stage no_skips 5 "$PY" -c "$NO_SKIPS" "$WORK/gpu_tests.xml" "${GPU_TESTS[@]}" || failed=1

# -- fused_reducer.torchft on the GPU (torchft's NCCL process groups) -------------------------------
FT_GPU='
if ! "$0" -c "import torchft" 2>/dev/null; then
  echo "ft_gpu: torchft missing (cannot be imported by $("$0" --version 2>&1)): tests/test_ft_gpu.py not run" | tee "$1/ft_gpu.txt"
  exit 0
fi
"$0" -m pytest -q -p no:cacheprovider --timeout 15 -rs tests/test_ft_gpu.py > "$1/ft_gpu_pytest.log" 2>&1
rc=$?
cat "$1/ft_gpu_pytest.log"
if [ $rc -eq 0 ] && grep -qi skipped "$1/ft_gpu_pytest.log"; then rc=1; fi
echo "ft_gpu: tests/test_ft_gpu.py rc=$rc (skips count as failures)" > "$1/ft_gpu.txt"
exit $rc
'
stage ft_gpu 20 bash -c "$FT_GPU" "$PY" "$WORK" || failed=1

# -- short benchmarks -----------------------------------------------------------------------------
# Copy kernel on the reducer's 16-byte slot layout: fp32 pack, the reduce_dtype narrowing pack
# fp32 -> bf16, and the widening unpack bf16 bucket -> fp32 gradients (--unpack).
COPY='
rc=0
"$0" bench/copy_bench.py --sizes 1M,64M,256M --iters 20 --warmup 3 --json "$1/copy_fp32.json" || rc=1
"$0" bench/copy_bench.py --sizes 1M,64M,256M --iters 20 --warmup 3 --dtype float32 \
  --to-dtype bfloat16 --json "$1/copy_fp32_to_bf16.json" || rc=1
"$0" bench/copy_bench.py --sizes 1M,64M,256M --iters 20 --warmup 3 --dtype float32 \
  --to-dtype bfloat16 --unpack --json "$1/copy_bf16_to_fp32_unpack.json" || rc=1
exit $rc
'
stage copy_bench 25 bash -c "$COPY" "$PY" "$WORK" || failed=1
stage allreduce_bw 25 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
  bench/allreduce_bw.py -b 1M -e 256M -f 16 -n 10 -w 3 --impl fused,torch,cupy \
  --json "$WORK/allreduce_bw.json" || failed=1
stage step_bench 30 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
  bench/step_bench.py --model large --steps 10 --warmup 3 --aa none --no-ddp-default \
  --json "$WORK/step.json" || failed=1

finish "$failed"
