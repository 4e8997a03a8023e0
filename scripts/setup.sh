#!/usr/bin/env bash
# Create (or refresh) the project virtualenv in .venv with kvwire and its dev tools.
# CPU install path: torch is pinned to 2.13.0, whose CPU wheel lies on the dev/CI disk;
# an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.kvwire-setup-stamp
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/setup.sh -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[dev]"
  touch "$stamp"
fi
