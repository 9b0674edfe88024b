#!/usr/bin/env bash
# Mutation check: plants each bug of scripts/mutations.py, one at a time, in a scratch copy of the
# tree (never in this one) and runs the tests that must notice it; prints mutation -> killed by
# which test, or SURVIVED. See docs/TESTING.md. Options: --only ID,ID  --list  --no-baseline
# --timeout N  --scratch DIR (default /tmp/mutants/tree)  --out DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
exec "$PY" scripts/mutants.py "$@"
