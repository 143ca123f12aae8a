"""Timing, ceilings and results files shared by the GPU benchmarks.

Device time per call is the slope between a jit that runs the op on N distinct input sets and
one that runs it on 2N: (t(2N) - t(N)) / N. The fixed cost of dispatching a jit (~50 us)
cancels, every output is returned (so XLA removes nothing), and distinct inputs keep XLA from
merging identical calls and the L2 from serving repeated reads.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp


def wall(fn, *args, reps: int = 7) -> float:
  """Median wall seconds of fn(*args) after a warm-up, synchronised."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def per_call_seconds(op: Callable, make_inputs: Callable[[int], list], n: int) -> float:
  """Device seconds per `op(*inputs)` call by the N / 2N slope."""
  sets = make_inputs(2 * n)

  def chain(sets):
    return [op(*s) for s in sets]

  f = jax.jit(chain)
  t1 = wall(f, sets[:n])
  t2 = wall(f, sets)
  return max(t2 - t1, 1e-9) / n


def copy_tbps(gib: float = 2.0) -> float:
  """Measured device copy bandwidth (bytes read + written per second), in TB/s."""
  n = int(gib * 2**30) // 4
  x = jnp.arange(n, dtype=jnp.float32)
  f = jax.jit(lambda a: a * 2.0)  # one read and one write per element, no arithmetic limit
  jax.block_until_ready(f(x))
  reps = 20
  t0 = time.perf_counter()
  outs = [f(x) for _ in range(reps)]  # async dispatch queues them back to back
  jax.block_until_ready(outs)
  return 2 * n * 4 * reps / (time.perf_counter() - t0) / 1e12


def write_results(name: str, rows: list[dict], ceilings: dict, commit: str, out_dir: str) -> str:
  dev = jax.devices()[0]
  doc = {
      "benchmark": name,
      "device": dev.device_kind,
      "devices": jax.device_count(),
      "jax": jax.__version__,
      "commit": commit,
      "date": datetime.date.today().isoformat(),
      "ceilings": ceilings,
      "rows": rows,
  }
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, f"{name}.json")
  with open(path, "w") as f:
    json.dump(doc, f, indent=1)
  return path
