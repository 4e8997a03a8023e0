#!/usr/bin/env bash
# Set up the venv and run the main job: a local 1 prefill + 1 decode cluster on the built-in tiny
# model (CPU), a few requests (one streaming), outputs and TTFT/ITL, clean shutdown.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/kvwire demo "$@"
