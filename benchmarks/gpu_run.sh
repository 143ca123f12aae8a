#!/usr/bin/env bash
# One device call: the kernel tests on the GPU, then the benchmarks named as arguments, each
# "name" or "name:flags" (e.g. "fp8_matmul:--extra triton mosaic_gpu --ms 1 4096"); none named:
# none run. Everything lands in $OUT (tests.log, junit.xml, <benchmark>.json, <benchmark>.log).
# Left out, as proved on CPU: lowering tests (abstract devices), tests/parallel and test_hlo
# (meshes of simulated CPU devices), tests/models (they read the HF reference under build/,
# too big to carry). TESTS=0 skips the tests, TEST_K="expr" runs those pytest's -k selects
# (e.g. TEST_K="ragged and mosaic"); TEST_TIMEOUT and BENCH_TIMEOUT (each benchmark)
# bound the parts; BENCH_MEM_FRACTION (default 0.92) is the benchmarks' share of the GPU.
# The model benchmarks (decode, prefill) need flax: `make gpu-wheels` here, and carry .whl.
# Usage on the device: bash benchmarks/gpu_run.sh <commit-sha> [name[:flags] ...]
# Write the sha out as this checkout's (`git rev-parse --short HEAD` here): the device machine's
# copy of the tree carries the files, but its git HEAD can be an older commit.
# Then, here: copy $OUT/<benchmark>.json over benchmarks/results/ and run benchmarks/report.py.
set -uo pipefail
commit=${1:?commit sha of the code being measured}; shift
export PYTHONUNBUFFERED=1
# The models' packages the machine lacks, carried as wheels (`make gpu-wheels`).
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
out=${OUT:-out}; mkdir -p "$out"
# WORKERS (default 8) share GPU 0: cap each one's memory pool instead of preallocating 75%.
# -v prints each result as it lands, so a run cut off by the timeout still names its failures.
# The triton cases run where the triton package imports (the GPU machine has it).
workers=${WORKERS:-8}
if [ "${TESTS:-1}" != 0 ]; then
  XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round(0.7 / $workers, 3))") \
    timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -n "$workers" -v -rf \
    -p no:cacheprovider -p no:benchmark -m "not lowering" --junitxml="$out/junit.xml" \
    ${TEST_K:+-k "$TEST_K"} \
    tests/ops tests/nn tests/test_fp8.py tests/test_triton.py \
    2>&1 | tee "$out/tests.log" | grep -E "FAILED|ERROR|[0-9]+ (passed|failed)" | tail -30
fi
# The benchmarks run one process each: JAX's default pool, 75% of the GPU (104 GiB of an
# H200), leaves 3 GiB beside deepseek-v3-moe's 109 GB (101.5 GiB) of bf16 and FP8 weights;
# 92% still leaves cuBLAS, cuDNN and the Triton launches their workspace outside it.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${BENCH_MEM_FRACTION:-0.92}
for spec in "$@"; do
  name=${spec%%:*}
  flags=""
  [ "$spec" != "$name" ] && flags=${spec#*:}
  log="$out/$name.log"
  i=2; while [ -e "$log" ]; do log="$out/$name.$i.log"; i=$((i + 1)); done  # a benchmark run twice
  # shellcheck disable=SC2086  # flags are meant to split into words
  timeout "${BENCH_TIMEOUT:-300}" python3 "benchmarks/$name.py" --out "$out" --commit "$commit" \
    $flags 2>&1 | tee "$log" | tail -40
done
