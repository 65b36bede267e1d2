#!/usr/bin/env bash
# One-shot GPU check of openmla, at most 10 minutes (stage limits 540 s, plus 10 s grace each after SIGINT):
#   1. tests   the Triton tests compiled on the GPU (test_triton_backend / _fp8 / _bounds), 210 s;
#   2. report  bench/gpu_report_check.py: the compile report (openmla compile-report)
#              against what a real launch compiles on this GPU: registers, local memory, shared memory, 75 s;
#   3. graph   bench/gpu_graph.py: a 61-layer decode step (DeepSeek-V3's layer count) captured in one
#              CUDA graph from a plan with fixed capacities, replayed after plan.refill, compared with eager runs, 85 s;
#   4. bench   bench/gpu_bench.py: decode (bf16, fp8_ds_mla, fp8_e4m3 caches), prefill and cache-write timed
#              against this GPU's measured copy bandwidth and bf16 matmul rate (tile sweeps last, as time allows), 170 s;
#   5. bench/gpu_summary.py folds everything into one JSON: $OUT/gpu_check.json.
# Usage: bench/gpu_check.sh            (from anywhere; results in $OUT, else bench/out)
# Env:   PYTHON=...  the interpreter to use (default: the first with CUDA torch among .venv/bin/python,
#        python3, python). A failing stage does not stop the next; the exit status is non-zero if any failed.
set -u
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-bench/out}"
mkdir -p "$OUT_DIR"
: > "$OUT_DIR/stages.tsv"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET OPENMLA_BACKEND  # compiled kernels, automatic backend choice

has_cuda() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for cand in .venv/bin/python python3 python; do
    if command -v "$cand" >/dev/null 2>&1 && has_cuda "$cand"; then PY="$cand"; break; fi
  done
fi
if [ -z "$PY" ] || ! has_cuda "$PY"; then
  echo "gpu_check: no Python with CUDA-enabled torch found (set PYTHON=...)" | tee "$OUT_DIR/gpu_check.log"
  exit 2
fi

{
  echo "== environment ($(date -u +%FT%TZ))"
  nvidia-smi -L 2>/dev/null || true
  "$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))'
} 2>&1 | tee "$OUT_DIR/gpu_check.log"

status=0
# stage NAME LIMIT_S LOG CMD...: runs CMD under a time limit (SIGINT first: pytest still writes its JUnit
# file), logs it, and records "NAME<TAB>exit status<TAB>seconds" in stages.tsv.
stage() {
  local name=$1 limit=$2 log=$3
  shift 3
  echo "== $name (limit $limit s)" | tee -a "$OUT_DIR/gpu_check.log"
  local t0=$SECONDS
  timeout -s INT -k 10 "$limit" "$@" 2>&1 | tee "$OUT_DIR/$log"
  local rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >> "$OUT_DIR/stages.tsv"
  echo "$name exit status: $rc ($((SECONDS - t0)) s)" | tee -a "$OUT_DIR/gpu_check.log"
  [ "$rc" -eq 0 ] || status=1
}

stage tests 210 gpu_tests.log "$PY" -m pytest tests/test_triton_backend.py tests/test_triton_fp8.py tests/test_triton_bounds.py \
  -q -p no:cacheprovider -rfEs --durations=10 --junitxml="$OUT_DIR/gpu_tests.xml"
stage report 75 gpu_report_check.log "$PY" bench/gpu_report_check.py --out "$OUT_DIR"
stage graph 85 gpu_graph.log "$PY" bench/gpu_graph.py --layers 61
stage bench 170 gpu_bench.log "$PY" bench/gpu_bench.py --out "$OUT_DIR" --budget-s 135
"$PY" bench/gpu_summary.py "$OUT_DIR" | tee -a "$OUT_DIR/gpu_check.log"
exit $status
