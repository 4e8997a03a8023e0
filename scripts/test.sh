#!/usr/bin/env bash
# Set up the venv (scripts/setup.sh) and run lint, type checks and the CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# etcd for the etcd discovery tests (skipped, saying so, only where it cannot be installed).
bash scripts/install_etcd.sh || echo "test.sh: etcd unavailable: tests/integration/test_router_etcd.py will skip" >&2
.venv/bin/ruff check src tests benchmarks
.venv/bin/mypy
.venv/bin/python -m pytest -q "$@"
