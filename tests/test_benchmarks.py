"""Every benchmark's `--smoke` run on CPU: device time goes only to scripts that run, and whose
correctness checks pass on tiny shapes."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).parent.parent / "benchmarks"
SMOKE = {
    "allreduce_fusion": [],  # over the 8 simulated CPU devices (conftest's XLA_FLAGS)
    "decode": ["--batches", "1"],
    "fp8_matmul": [],
    "moe_gemm": ["--experts", "4", "--topk", "2", "--ms", "1", "3"],
    "rmsnorm_quant": [],
}


@pytest.mark.parametrize("name", sorted(SMOKE))
def test_smoke(name, tmp_path):
  proc = subprocess.run(
      [sys.executable, str(BENCHMARKS / f"{name}.py"), "--smoke", "--out", str(tmp_path),
       *SMOKE[name]], env=dict(os.environ), capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  doc = json.loads((tmp_path / f"{name}.json").read_text())
  assert doc["rows"] and all(row["correct"] for row in doc["rows"]), doc["rows"]


def test_idle_gaps():
  """Idle time counts only where no stream is busy, named by the kernels either side."""
  sys.path.insert(0, str(BENCHMARKS))
  from _harness import idle_gaps
  spans = [(100, 130, "c"), (0, 10, "a"), (5, 40, "b"),  # b overlaps a on another stream
           (50, 60, "c"), (135, 150, "a")]
  assert idle_gaps(spans) == {"b -> c": 10, "c -> c": 40, "c -> a": 5}
  # a kernel inside a longer one on another stream leaves no gap of its own
  assert idle_gaps([(0, 100, "long"), (10, 20, "short"), (110, 120, "x")]) == {"long -> x": 10}
  assert idle_gaps([]) == {} and idle_gaps([(3, 9, "a")]) == {}
