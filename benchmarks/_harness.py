"""Timing and results files shared by the GPU benchmarks; the ceilings (`copy_tbps`,
`copy_seconds`, `bf16_tflops`) are `models.run`'s, which `jfusedq run` holds its paths to too.

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

from models.run import chain_seconds, gpu_kernels, profile, top_kernels


def measure(op: Callable, make_inputs: Callable[[int], list], n: int, chain: bool = True,
            hlo: bool = False, steady: int = 0, donate: tuple[int, ...] = ()) -> dict:
  """Time `op` two ways on distinct input sets, every output kept.

  chain_s:  device seconds per call by the N / 2N slope of wall time (dispatch cancels;
            launch gaps between kernels count).
  kernel_s: kernel seconds per call and device summed from a profiler trace of the N-call jit
            (launch gaps excluded; averaged over the GPUs of an SPMD program), with
            kernels_per_call (per device); None where no GPU trace is available.
  chain=False skips the slope (None), and so the second compile: for sweeps of Pallas
  kernels, whose every call in the jit is a separate Triton compile.
  steady=K adds steady_s, enqueue_s and dispatch_s: the N-call jit launched K times back to
  back, then synchronised, wall seconds per call (median of 7 rounds), as a server runs one
  step after another: kernels, the gaps between them and any host time the queue does not
  hide; the host's seconds per call to enqueue those K (enqueue_s: near steady_s when either
  the host sets the pace or a full launch queue holds it back); and the host's seconds per
  call to enqueue a burst of 2 onto an idle device (dispatch_s: the host's own cost, no queue
  to wait on; the host is the bound when it nears steady_s).
  top_kernels: the twelve kernels taking the most time, {name: us per call}: the profile that
  explains a time. idle_us: per call and GPU, time between its first and last kernel with no
  stream busy; top_gaps: the eight largest sums of it, by the kernels either side.
  top_host: the fifteen host events (runtime and driver calls, XLA thunks; Python frames left
  out) taking the most time in the traced call, {name: [us, count] per call}: where the host's
  time to launch a call goes. Nested events each count, so the figures overlap.
  graph_launches: XLA command buffers (CUDA graphs) executed per call, summed over the GPUs;
  a kernel outside them is launched by the host on its own. hlo=True adds the compiled N-call
  program's text (no extra compile).
  donate: positions of `op`'s arguments the timed jit donates, as a serving loop donates a
  decode step's cache: an array the op updates in place (and returns) is then not copied
  first, which a kernel time over a non-donated cache would count (a whole-cache copy a step).
  Each run then takes fresh sets from `make_inputs`, which must make new buffers for those
  arguments; only with chain=False and steady=0 (both rerun one set).
  """
  if donate and (chain or steady):
    raise ValueError("measure: donated arguments are consumed by a run; chain and steady "
                     "rerun the same inputs")

  def join(kept, given):
    """One set's arguments in `op`'s order from its kept and donated halves."""
    kept, given, size = iter(kept), iter(given), len(kept) + len(given)
    return [next(given) if i in donate else next(kept) for i in range(size)]

  # Each set as its (kept, donated) halves: donate_argnums takes whole arguments.
  args = lambda sets: ([[a for i, a in enumerate(s) if i not in donate] for s in sets],
                       [[a for i, a in enumerate(s) if i in donate] for s in sets])
  f = jax.jit(lambda kept, given: [op(*join(k, g)) for k, g in zip(kept, given)],
              donate_argnums=(1,) if donate else ())
  sets = make_inputs(2 * n if chain else n)
  first = args(sets[:n])  # split once: the steady loops below time the host's launches
  result = {"chain_s": None, "kernel_s": None, "kernels_per_call": None}
  if hlo:  # before any run: a donated set's arrays are gone after it
    result["hlo"] = f.lower(*first).compile().as_text()
  if chain:
    result["chain_s"] = chain_seconds(lambda sets: f(*args(sets)), sets, n)
  else:
    jax.block_until_ready(f(*first))
  timed = args(make_inputs(n)) if donate else first  # the warm-up consumed a donated set
  data = profile(lambda: f(*timed))
  if steady:
    per, enqueue = [], []
    for _ in range(7):
      t0 = time.perf_counter()
      outs = [f(*first) for _ in range(steady)]
      t1 = time.perf_counter()
      jax.block_until_ready(outs)
      per.append((time.perf_counter() - t0) / steady / n)
      enqueue.append((t1 - t0) / steady / n)
    burst = []
    for _ in range(7):
      t0 = time.perf_counter()
      outs = [f(*first) for _ in range(2)]
      burst.append((time.perf_counter() - t0) / 2 / n)
      jax.block_until_ready(outs)
    result.update(steady_s=statistics.median(per), enqueue_s=statistics.median(enqueue),
                  dispatch_s=statistics.median(burst))
  host = {}
  for plane in data.planes if data else ():
    if plane.name.startswith("/host:"):
      for line in plane.lines:
        for ev in line.events:
          if not ev.name.startswith("$"):  # a Python frame
            us, calls = host.get(name := ev.name[:80], (0.0, 0))
            host[name] = (us + ev.duration_ns * 1e-3, calls + 1)
  # Only GPUs that ran something (gpu_kernels): a one-GPU program on a two-GPU host halved its
  # times.
  per_gpu = gpu_kernels(data)
  total_ns, count, gpus, idle_ns, gaps = 0.0, 0, len(per_gpu), 0.0, {}
  for spans in per_gpu:
    total_ns += sum(end - start for start, end, _ in spans)
    count += len(spans)
    for key, ns in idle_gaps(spans).items():
      idle_ns += ns
      gaps[key] = gaps.get(key, 0.0) + ns
  if count:
    result.update(kernel_s=total_ns * 1e-9 / n / gpus, kernels_per_call=count / n / gpus,
                  top_kernels=top_kernels(per_gpu, n),
                  idle_us=round(idle_ns * 1e-3 / n / gpus, 3),
                  top_gaps={k: round(v * 1e-3 / n / gpus, 3)
                            for k, v in sorted(gaps.items(), key=lambda kv: -kv[1])[:8]})
  if host:
    result["graph_launches"] = host.get("command_buffer::execute", (0.0, 0))[1] / n
    result["top_host"] = {k: [round(us / n, 3), round(calls / n, 2)]
                          for k, (us, calls) in sorted(host.items(), key=lambda kv: -kv[1][0])[:15]}
  return result


def idle_gaps(spans: list[tuple[int, int, str]]) -> dict[str, int]:
  """{"before -> after": ns}: time between the first kernel's start and the last one's end
  when no stream is busy, summed per pair of kernels either side of each gap (the one that
  ended last before it, the one that starts it). spans: (start_ns, end_ns, name), any order,
  streams overlapping. Where a wall time above the kernel sum comes from."""
  gaps: dict[str, int] = {}
  spans = sorted(spans)
  end, prev = (spans[0][1], spans[0][2]) if spans else (0, "")
  for start, stop, name in spans[1:]:
    if start > end:
      key = f"{prev[:40]} -> {name[:40]}"
      gaps[key] = gaps.get(key, 0) + start - end
    if stop > end:
      end, prev = stop, name
  return gaps


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
      # Settings that change what was measured (a collective's protocol or algorithm).
      "env": {k: os.environ[k] for k in ("XLA_FLAGS", "NCCL_PROTO", "NCCL_ALGO")
              if k in os.environ},
      "rows": rows,
  }
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, f"{name}.json")
  with open(path, "w") as f:
    json.dump(doc, f, indent=1)
  return path
