"""Two processes x 4 CPU devices under jax.distributed (collectives through gloo) against one
process x 8 devices: the models' prefill + decode step under tensor parallelism and every
all-reduce strategy (tests/multiprocess/worker.py) give the same bits.

The bar is bit-identical: both runs compile the same program for the same mesh, so only the
collectives differ (gloo across processes, XLA's in-process CPU collectives otherwise), and they
sum the partial sums (2 per all-reduce in the models, 8 in the strategies) to the same bits.
"""

import os
import pickle
import socket
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A guard against a hung collective, not a speed bar: the three processes take 100 s of CPU
# in all (each builds and compiles everything), 1.7-3 min of wall clock on 2 cores shared with
# other jobs.
TIMEOUT = 600  # seconds


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def launch(out, devices: int, *flags: str) -> subprocess.Popen:
  # The child's device count is set explicitly: the XLA_FLAGS of this pytest process (8
  # simulated devices, from conftest.py) must not reach a child that wants 4.
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return subprocess.Popen([sys.executable, "-m", "tests.multiprocess.worker", str(out), *flags],
                          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)


def finish(procs: dict[str, subprocess.Popen]) -> None:
  """Waits for every process; on a failure or timeout, fails showing every process's output."""
  logs, failed = {}, []
  for name, p in procs.items():
    try:
      logs[name], _ = p.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
      for q in procs.values():
        q.kill()
      logs[name], _ = p.communicate()
      failed.append(f"{name} timed out after {TIMEOUT} s")
      continue
    if p.returncode:
      failed.append(f"{name} exited with {p.returncode}")
  if failed:
    shown = "\n".join(f"----- {n} -----\n{logs.get(n, '')}" for n in procs)
    raise AssertionError("; ".join(failed) + "\n" + shown)


def test_two_processes_match_one(tmp_path):
  port = free_port()
  dist = ["--coordinator", f"localhost:{port}", "--num-processes", "2"]
  procs = {"1 process x 8": launch(tmp_path / "one.pkl", 8),
           **{f"process {i} of 2": launch(tmp_path / "two.pkl", 4, *dist, "--process-id", str(i))
              for i in range(2)}}
  finish(procs)
  with open(tmp_path / "one.pkl", "rb") as f:
    one = pickle.load(f)
  with open(tmp_path / "two.pkl", "rb") as f:
    two = pickle.load(f)
  assert one.keys() == two.keys()
  assert any(k.startswith("qwen3.5") for k in one) and any(k.startswith("reduce_scatter/")
                                                           for k in one)
  for k in one:
    a, b = np.asarray(one[k]), np.asarray(two[k])
    assert a.shape == b.shape and a.dtype == b.dtype, k
    assert a.tobytes() == b.tobytes(), (
        f"{k}: {np.mean(a != b):.2%} of the entries differ (max |diff| "
        f"{np.abs(a.astype(np.float32) - b.astype(np.float32)).max():.3g})")
