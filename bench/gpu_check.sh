#!/usr/bin/env bash
# One-shot GPU check of openmla (about 5-8 minutes on an H200):
#   1. the whole test suite on the GPU (the triton tests run compiled on CUDA tensors),
#   2. bench/gpu_graph.py: a decode step over all layers captured in one CUDA graph from a plan with fixed
#      capacities, replayed after plan.refill for several steps, compared with eager runs,
#   3. bench/gpu_bench.py: decode (bf16, fp8_ds_mla and fp8_e4m3 caches) / prefill / cache-write timings against this GPU's
#      measured copy bandwidth and bf16 matmul rate, plus a small tile sweep.
# Usage: bench/gpu_check.sh            (from anywhere; results in $OUT, else bench/out)
# Env:   PYTHON=...  the interpreter to use (default: the first with CUDA torch among
#        .venv/bin/python, python3, python); TEST_TIMEOUT / BENCH_TIMEOUT in seconds.
# Each stage has its own time limit and a failing stage does not stop the next one;
# the exit status is non-zero if any stage failed.
set -u
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-bench/out}"
mkdir -p "$OUT_DIR"
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
echo "== tests (limit ${TEST_TIMEOUT:-300} s)" | tee -a "$OUT_DIR/gpu_check.log"
timeout -k 10 "${TEST_TIMEOUT:-300}" "$PY" -m pytest tests -q -p no:cacheprovider -rfEs --durations=15 \
  --junitxml="$OUT_DIR/gpu_tests.xml" 2>&1 | tee "$OUT_DIR/gpu_tests.log"
rc=${PIPESTATUS[0]}
echo "tests exit status: $rc" | tee -a "$OUT_DIR/gpu_check.log"
[ "$rc" -eq 0 ] || status=1

echo "== CUDA graph of a decode step over all layers (limit 120 s)" | tee -a "$OUT_DIR/gpu_check.log"
timeout -k 10 120 "$PY" bench/gpu_graph.py 2>&1 | tee "$OUT_DIR/gpu_graph.log"
rc=${PIPESTATUS[0]}
echo "cuda graph exit status: $rc" | tee -a "$OUT_DIR/gpu_check.log"
[ "$rc" -eq 0 ] || status=1

echo "== benchmark (limit ${BENCH_TIMEOUT:-240} s)" | tee -a "$OUT_DIR/gpu_check.log"
timeout -k 10 "${BENCH_TIMEOUT:-240}" "$PY" bench/gpu_bench.py --out "$OUT_DIR" --budget-s "$(( ${BENCH_TIMEOUT:-240} - 40 ))" \
  2>&1 | tee "$OUT_DIR/gpu_bench.log"
rc=${PIPESTATUS[0]}
echo "benchmark exit status: $rc (results: $OUT_DIR/gpu_bench.json)" | tee -a "$OUT_DIR/gpu_check.log"
[ "$rc" -eq 0 ] || status=1
exit $status
