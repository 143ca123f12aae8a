"""Two processes x 4 CPU devices under jax.distributed (collectives through gloo) against one
process x 8 devices: the models' prefill + decode step under tensor parallelism, every
all-reduce strategy and a checkpoint loaded onto the mesh (tests/multiprocess/worker.py) give
the same bits, and each process reads only its shards of the checkpoint.

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
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A guard against a hung collective, not a speed bar: the three processes take 81 s of CPU in
# all (each builds and compiles everything), 1-3 min of wall clock on 2 cores shared with
# other jobs.
TIMEOUT = 600  # seconds


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def launch(out, devices: int, *flags: str) -> subprocess.Popen:
  # The child's device count is set explicitly: the XLA_FLAGS of this pytest process (8
  # simulated devices, from conftest.py) must not reach a child that wants 4. LLVM's
  # optimisations off: compiling is most of the children's CPU time, level 0 cut it from 93 s
  # to 81 s, and every child compiles alike. (A persistent compilation cache shared by the
  # three saved 5 s more: not kept, as they compile the same programs at the same moments.)
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
  env["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={devices} "
                      f"--xla_backend_optimization_level=0")
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


def same_bits(k, a, b):
  a, b = np.asarray(a), np.asarray(b)
  assert a.shape == b.shape and a.dtype == b.dtype, k
  assert a.tobytes() == b.tobytes(), (
      f"{k}: {np.mean(a != b):.2%} of the entries differ (max |diff| "
      f"{np.abs(a.astype(np.float32) - b.astype(np.float32)).max():.3g})")


def run_both(tmp_path, *flags: str) -> tuple[dict, dict]:
  """The worker's results in 1 process x 8 devices and in 2 processes x 4, run side by side
  (one launch does every case: each process pays JAX's start and its compiles once)."""
  port = free_port()
  dist = ["--coordinator", f"localhost:{port}", "--num-processes", "2"]
  procs = {"1 process x 8": launch(tmp_path / "one.pkl", 8, *flags),
           **{f"process {i} of 2": launch(tmp_path / "two.pkl", 4, *flags, *dist, "--process-id",
                                          str(i)) for i in range(2)}}
  finish(procs)
  with open(tmp_path / "one.pkl", "rb") as f:
    one = pickle.load(f)
  with open(tmp_path / "two.pkl", "rb") as f:
    two = pickle.load(f)
  return one, two


def test_two_processes_match_one(tmp_path):
  """The checkpoint loads onto the mesh, so each process reads only its devices' slices: one
  process reads every tensor once; each of two reads half of every projection (the TP 8 shards
  of its 4 devices) and all of the replicated embedding and norms."""
  one, two = run_both(tmp_path)
  a, b = one["results"], two["results"]
  assert a.keys() == b.keys()
  assert any(k.startswith("qwen3.5") for k in a) and any(k.startswith("reduce_scatter/")
                                                         for k in a)
  for k in a:
    same_bits(k, a[k], b[k])
  assert one["read"] == [one["total"]]
  assert two["read"] == [(two["total"] + two["replicated"]) // 2] * 2


def test_run_forward_fn_below_device_count(tmp_path):
  """`jfusedq run --tp 4`'s forward (models.run.forward_fn) over 2 processes x 4 devices gives
  the prefill logits of 4 of one process's 8 devices."""
  one, two = run_both(tmp_path, "--cases", "forward_fn")
  assert two["forward_fn"] is not None, "process 1 holds no device of forward_fn's mesh"
  same_bits("forward_fn", one["forward_fn"], two["forward_fn"])
