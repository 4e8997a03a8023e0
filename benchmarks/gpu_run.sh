#!/usr/bin/env bash
# Reproduces the GPU runs (NCCL data plane on a 2-GPU machine; serving on one GPU):
#   benchmarks/gpu_run.sh [all|tests|probe|bench|serve|cpu-ratio] [bench args...]
# serve: `kvwire bench serve` 1P1D (IPC) vs colocated on the GPU, llama3-8b-random, long prompts
#   (SERVE_ARGS overrides the defaults; JSON to $OUT/serve.json).
# cpu-ratio: issue 36's CPU run (`kvwire bench serve --input-len 128 --request-rate 4 --num-prompts 48`,
#   tiny model, CPU, one torch thread per instance) on 2, 3 and 4 of this host's physical cores (taskset)
#   and on all of them; 1p1d,colocated beside colocated,colocated (the noise floor), interleaved until
#   CPU_RATIO_BUDGET_S (default 540) is spent. One JSON line per run to $OUT/cpu_ratio.jsonl.
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
if [ "$MODE" = cpu-ratio ]; then
  { lscpu; lscpu -e; } > "$OUT/lscpu.txt" 2>&1
  # the first N logical CPUs on distinct physical cores, as taskset's list
  cores() { lscpu -p=CPU,CORE | grep -v '^#' | sort -t, -k2,2n -u | head -n "$1" | cut -d, -f1 | paste -sd, -; }
  start=$(date +%s)
  one="--serve-arg=--cpu-threads=1"
  # label|cpus|setups|extra serve args (one torch thread per instance everywhere, as on the 2-vCPU box)
  pd="1p1d,colocated" cc="colocated,colocated"
  all="0-$(( $(nproc) - 1 ))"
  # the most telling first: each core count once, then the floors, then repeats
  configs=("2cores|$(cores 2)|$pd|$one" "4cores|$(cores 4)|$pd|$one" "all|$all|$pd|$one"
           "2cores|$(cores 2)|$cc|$one" "all|$all|$cc|$one" "3cores|$(cores 3)|$pd|$one"
           "4cores|$(cores 4)|$cc|$one" "2cores|$(cores 2)|$pd|$one" "all|$all|$pd|$one"
           "4cores|$(cores 4)|$pd|$one" "3cores|$(cores 3)|$pd|$one" "2cores|$(cores 2)|$cc|$one"
           "all|$all|$cc|$one" "2cores|$(cores 2)|$pd|$one" "4cores|$(cores 4)|$pd|$one"
           "all|$all|$pd|$one")
  n=0
  for cfg in "${configs[@]}"; do
      n=$((n + 1))
      IFS='|' read -r label cpus setups extra <<< "$cfg"
      if [ $(( $(date +%s) - start )) -gt "${CPU_RATIO_BUDGET_S:-540}" ]; then break; fi
      # shellcheck disable=SC2086
      timeout 120 taskset -c "$cpus" python3 -m kvwire.cli bench serve --setups "$setups" --input-len 128 \
        --request-rate 4 --num-prompts 48 --no-progress --json $extra > "$OUT/run.json" 2>> "$OUT/cpu_ratio.log"
      python3 - "$label" "$cpus" "$setups" "$n" "$OUT/run.json" >> "$OUT/cpu_ratio.jsonl" <<'PY'
import json, sys
label, cpus, setups, rnd, path = sys.argv[1:]
try:
    runs = json.load(open(path))
except (OSError, ValueError) as e:
    runs = []
    print(f"{label} {setups}: no result ({e})", file=sys.stderr)
line = {"label": label, "cpus": cpus, "setups": setups, "run": int(rnd), "runs": runs}
if len(runs) == 2:
    a, b = runs
    line["ttft_ratio"] = a["ttft_s"]["p50"] / b["ttft_s"]["p50"]
    line["tpot_ratio"] = a["tpot_s"]["p50"] / b["tpot_s"]["p50"]
    print(f"{label:12s} {setups:20s} #{rnd} ttft p50 {a['ttft_s']['p50'] * 1e3:6.2f} / {b['ttft_s']['p50'] * 1e3:6.2f} ms"
          f" = {line['ttft_ratio']:.3f}  tpot {a['tpot_s']['p50'] * 1e3:.3f} / {b['tpot_s']['p50'] * 1e3:.3f}"
          f" = {line['tpot_ratio']:.3f}  handover p50 {(a.get('handover') or {}).get('p50_s', 0) * 1e3:.2f} ms",
          file=sys.stderr)
print(json.dumps(line))
PY
  done 2>&1 | tee -a "$OUT/cpu_ratio.summary"
  rm -f "$OUT/run.json"
  tail -c 2000 "$OUT/cpu_ratio.log"
fi
exit $rc
