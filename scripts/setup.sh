#!/usr/bin/env bash
# Idempotent set-up: .venv with torch 2.14.1 and the tools, then build and install fused_reducer
# (skipped when the sources have not changed since the last install).
set -euo pipefail
cd "$(dirname "$0")/.."
# One set-up at a time per checkout: two at once (a test run and the mutation check, say) would
# install into the same .venv together.
if command -v flock > /dev/null; then
  exec 9> "${TMPDIR:-/tmp}/fused_reducer_setup.$(echo "$PWD" | cksum | cut -d' ' -f1).lock"
  flock 9
fi

PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PY=.venv/bin/python

if ! $PY -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.14.1') else 1)" 2>/dev/null; then
  echo "setup: installing torch==2.14.1 (about 1 minute, 5.5 GB)"
  $PY -m pip install -q torch==2.14.1
fi
if ! $PY -c "import pybind11, ninja, pytest, hypothesis, numpy, matplotlib, setuptools, wheel" 2>/dev/null; then
  echo "setup: installing build and test tools"
  $PY -m pip install -q pybind11 ninja pytest hypothesis numpy matplotlib setuptools wheel
fi
# The optional extras the tests and benchmarks use (setup.py: test, lightning, bench, hf, ft); torch==2.14.1
# in the same command so that no dependency can swap torch (torchvision 0.29.1 pairs with it).
# transformers and accelerate at the versions docs/INTEGRATIONS.md's "Hugging Face" section names as tested
# (fused_reducer.transformers/.accelerate check their non-public hook points against them);
# torchft 0.2.0 (the ft extra: fused_reducer.torchft reads its Manager's managed work at that version).
if ! $PY -c "import importlib.metadata as m, sys
pins = {'torchvision': '0.29.1', 'transformers': '5.25.0', 'accelerate': '1.16.0', 'torchft': '0.2.0'}
sys.exit(any(m.version(k) != v for k, v in pins.items())
         or not all(map(m.version, ['pytest-timeout', 'pytorch-lightning'])))" 2>/dev/null; then
  echo "setup: installing pytest-timeout, pytorch-lightning, torchvision, transformers, accelerate, torchft"
  $PY -m pip install -q torch==2.14.1 pytest-timeout pytorch-lightning torchvision==0.29.1 \
    transformers==5.25.0 accelerate==1.16.0 torchft==0.2.0
fi

# Rebuild only when a source file changed (the build takes a few minutes).
stamp=$(find ext cuda python setup.py pyproject.toml -type f \( -name '*.cpp' -o -name '*.h' \
          -o -name '*.cu' -o -name '*.py' -o -name '*.toml' \) -not -path '*/__pycache__/*' \
          -not -name _build_torch.py \
          | sort | xargs sha256sum | sha256sum | cut -d' ' -f1)
if [ "$(cat .venv/.fused_reducer_stamp 2>/dev/null)" != "$stamp" ] || ! $PY -c "import fused_reducer" 2>/dev/null; then
  echo "setup: building fused_reducer (pip install --no-build-isolation .; a few minutes)"
  # MAX_JOBS=2: the CI machine has 2 cores and 24 GiB; each torch translation unit needs ~1 GiB.
  MAX_JOBS=${MAX_JOBS:-2} PATH="$PWD/.venv/bin:$PATH" $PY -m pip install --no-build-isolation . \
    > .venv/build.log 2>&1 || { tail -60 .venv/build.log; echo "setup: build failed (log: .venv/build.log)"; exit 1; }
  echo "$stamp" > .venv/.fused_reducer_stamp
fi
$PY -c "import fused_reducer; print('setup: fused_reducer', fused_reducer.build_info())"
