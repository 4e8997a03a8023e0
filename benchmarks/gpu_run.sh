#!/usr/bin/env bash
# Reproduces the GPU runs (NCCL data plane on a 2-GPU machine; serving on one GPU):
#   benchmarks/gpu_run.sh [all|tests|probe|bench|serve] [bench args...]
# serve: `kvwire bench serve` 1P1D (IPC) vs colocated on the GPU, llama3-8b-random, long prompts
#   (SERVE_ARGS overrides the defaults; JSON to $OUT/serve.json).
# GPU tests (pytest -m gpu tests/gpu) and `python -m kvwire.bench.transfer_nccl` (= kvwire bench transfer
# --backend nccl). Logs and JSON go to $OUT (default ./out). pyzmq/msgspec wheels for Python 3.12 are
# installed from .whl/ when the image lacks them (see docs/decisions/061-nccl-data-plane.md).
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-all}
[ $# -gt 0 ] && shift
OUT=${OUT:-out}
mkdir -p "$OUT"
# NVLink multicast stays off on shared machines
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# only the wheels whose module the image lacks (a newer huggingface_hub would shadow the one its
# transformers wants)
missing=()
for pair in zmq:pyzmq msgspec:msgspec gguf:gguf huggingface_hub:huggingface_hub; do
  python3 -c "import ${pair%%:*}" 2>/dev/null || missing+=(.whl/${pair#*:}-*.whl)
done
if [ ${#missing[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${missing[@]}"
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=src:${PYTHONPATH:-}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvidia-smi topo -m; } > "$OUT/gpus.txt" 2>&1
rc=0
if [ "$MODE" = all ] || [ "$MODE" = tests ]; then
  # TESTS: which GPU test files (default: all of tests/gpu)
  timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -m gpu -q -p no:cacheprovider ${TESTS:-tests/gpu} --timeout 240 -rfE 2>&1 | tee "$OUT/gpu_tests.log"
  rc=$((rc | ${PIPESTATUS[0]}))
fi
if [ "$MODE" = all ] || [ "$MODE" = probe ]; then
  timeout 200 python3 benchmarks/nccl_probe.py 2>&1 | tee "$OUT/probe.log"
  rc=$((rc | ${PIPESTATUS[0]}))
fi
if [ "$MODE" = all ] || [ "$MODE" = bench ]; then
  timeout "${BENCH_TIMEOUT:-400}" python3 -m kvwire.bench.transfer_nccl --json --out "$OUT/bench_nccl.json" "$@" 2>&1 | tee "$OUT/bench.log"
  rc=$((rc | ${PIPESTATUS[0]}))
fi
if [ "$MODE" = serve ]; then
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-500}" python3 -m kvwire.cli bench serve --setups 1p1d,colocated --device cuda \
    --model llama3-8b-random ${SERVE_ARGS:---num-prompts 16 --input-len 8192 --output-len 32 --request-rate 0.5 --serve-arg=--max-model-len=32768} \
    --no-progress --json "$@" > "$OUT/serve.json" 2> "$OUT/serve.log"
  rc=$((rc | $?))
  tail -c 3000 "$OUT/serve.log"
fi
exit $rc
