#!/usr/bin/env bash
# Set up the venv and run the main job: a local 1 prefill + 1 decode cluster on CPU with a real chat
# model (smollm2-135m), a few questions (one streaming), answers with TTFT/ITL, a check that P/D
# answers equal a colocated engine's token for token, clean shutdown. Flags go to `kvwire demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/kvwire demo "$@"
