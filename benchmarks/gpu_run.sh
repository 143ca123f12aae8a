#!/usr/bin/env bash
# One device call: the test suite on the GPU (lowering tests excluded: they are proved on CPU),
# then the benchmarks named as arguments (default: all single-GPU ones). Everything lands in
# $OUT (tests.log, junit.xml, <benchmark>.json, <benchmark>.log).
# Usage on the device: bash benchmarks/gpu_run.sh <commit-sha> [rmsnorm_quant fp8_matmul ...]
set -uo pipefail
commit=${1:?commit sha of the code being measured}; shift
benches=("${@:-rmsnorm_quant fp8_matmul}")
export PYTHONUNBUFFERED=1
out=${OUT:-out}; mkdir -p "$out"
# Eight workers share the GPU: cap each one's memory pool instead of preallocating 75%.
XLA_PYTHON_CLIENT_MEM_FRACTION=0.08 timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -n 8 -q -rf \
  -p no:cacheprovider -p no:benchmark -m "not lowering" --junitxml="$out/junit.xml" tests \
  2>&1 | grep -v -e PytestBenchmarkWarning -e "warner(" | tee "$out/tests.log" | tail -20
for b in ${benches[@]}; do
  timeout "${BENCH_TIMEOUT:-300}" python3 "benchmarks/$b.py" --out "$out" --commit "$commit" \
    2>&1 | tee "$out/$b.log" | tail -40
done
