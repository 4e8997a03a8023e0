#!/usr/bin/env bash
# Set up the venv (scripts/setup.sh) and run lint, type checks and the CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests benchmarks
.venv/bin/mypy
.venv/bin/python -m pytest -q "$@"
