"""Model-level decode benchmark: one decode step per path (bf16, FP8 unfused, FP8 fused, all on
one set of weights), per preset and batch.

Time per step two ways: device time, the profiler's kernel time summed per step (harness
`measure`: `kernel_us`, the default `time_us`), and the steady state of the serving loop
`jfusedq run` times (`models.run.decode_round`: 32 greedy steps in calls of 8, each call
donating its tokens, cache and position, launched back to back from the same context, wall
clock per step, the median of 7 rounds after a warm-up; `steady_us`, `time_us` with --wall),
which adds the idle gaps between kernels (`idle_us`, `top_gaps`) and any host time the launch
queue does not hide (`enqueue_us`: the host's time per step to launch the 32; `dispatch_us`: to
launch one call onto an idle device, per step). Kernels per step counted from the compiled HLO;
`graph_launches`: the CUDA graphs XLA launched for a step (one when every kernel is captured: a
kernel XLA cannot capture, as jax-triton's were, is launched by the host between graphs, which
cost 277-1455 us of idle GPU a step on the H200).

Floor = bytes a step must read, per device, / copy bandwidth (`models.cost`: `weight_bytes`,
the weights a step touches, and `cache_bytes`, every slot of the cache as the step returns it).
With --tp > 1 no floor is given (`roofline_frac` null): the weights' per-device split is the
model's own (heads, intermediate dims; embeddings and norms replicated), not counted there.

Paths: `bf16` runs the bf16 master weights with no FP8 (its own `weight_bytes`), `unfused` and
`fused` the same FP8 weights; `vs_xla` is each row's speed-up over the unfused FP8 step.

Correctness, per row: the step's logits against the same path (bf16, fused or unfused) on
`implementation="xla"`, holding the very same weight arrays (`Built.make`: no second copy, so
the deep presets, whose bf16 masters and FP8 weights take half an H200, are checked too), run
on the same device and tokens. Both round at the same places; what is left is the kernels' f32
summation order and the FP8 codes it moves by a step, which the random-weight presets amplify
layer by layer.
`correct` = finite and within `xla_tol` of the preset: a gate for broken kernels (O(1)
apart), the tight numerics being in tests/. The fused-vs-unfused distance is reported but
does not gate: the paths differ by design (one bf16 rounding of the norm; 0.07-0.47 measured on
the H200).
--no-xla-check skips the reference (then `correct` is finiteness only).

--impls builds the kernel paths more than one way, each timed against its own unfused path:
`default` (each op's own best order), or one backend for every op that has it, XLA for the
rest (`pallas`: kernels XLA compiles from Pallas-Triton; `triton`: Triton-language kernels,
also compiled by XLA).

Run: python benchmarks/decode.py [--presets deepseek-v3-layers ...] [--batches 1 8 32 64]
     [--tp N] [--context 256 ...] [--paths unfused fused bf16] [--wall] [--no-xla-check] [--impls default pallas triton]
     [--tag TAG] [--out DIR] [--commit SHA] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness  # noqa: E402
from jfusedq.hlo import kernel_counts  # noqa: E402
from jfusedq.testing import rel_rms  # noqa: E402
from models import cost  # noqa: E402
from models import run as runner  # noqa: E402


STEADY = 32  # steps a serving round launches back to back


def xla_tol(layers: int) -> float:
  """The relative RMS a path's logits may be from its XLA build. Both round at the same places;
  what is left, the kernels' summation order and the FP8 codes it moves by a step, random
  weights amplify layer by layer: measured 0.0 to 0.185 on CPU (Pallas interpreted; tiny
  presets, B = 1 / 8 / 32, two token draws, both paths), 0.33 on CPU under JAX 0.12
  (deepseek-v3-tiny fused, a prefill in chunks of 9: a code moved by a step re-routed 7 of 37
  tokens in the second MoE layer, whose random router is full of near-ties), and 0.29
  (unfused) / 0.37-0.46 (fused, two runs) on the H200 at 24 layers (deepseek-v3-deep, B = 1),
  where fused and unfused are 0.35 apart by design.
  A wrong scale or tile gives O(1); unrelated logits are sqrt(2) apart."""
  return 0.5 if layers <= 4 else 0.6


# Unfused first: every row's `vs_xla` is its speed-up over the unfused FP8 step.
PATHS = ("unfused", "fused", "bf16")
IMPLS = {"default": None, "pallas": ("pallas", "xla"), "triton": ("triton", "xla")}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--presets", nargs="+", default=["deepseek-v3-layers", "qwen3.5-layers"])
  ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64])
  ap.add_argument("--tp", type=int, default=1)
  ap.add_argument("--context", nargs="+", type=int, default=[256],
                  help="tokens already in the cache (each a row)")
  ap.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS),
                  help="the paths timed (vs_xla needs unfused)")
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  ap.add_argument("--commit", default="unknown")
  ap.add_argument("--smoke", action="store_true", help="tiny presets, to check the script on CPU")
  ap.add_argument("--wall", action="store_true",
                  help="time by the steady state (32 steps launched back to back, wall clock per "
                       "step, launch gaps and host time included) instead of the profiler's "
                       "kernel sum: under TP the kernel sum counts each GPU's spin-wait for its "
                       "peer inside XLA's all-reduce kernels, which varies run to run")
  ap.add_argument("--xla-check", action=argparse.BooleanOptionalAction, default=True,
                  help="check each path against itself on XLA (module docstring)")
  ap.add_argument("--impls", nargs="+", choices=sorted(IMPLS), default=["default"],
                  help="kernel backends the paths are built on (module docstring)")
  ap.add_argument("--tag", default="", help="results file decode_<tag>.json")
  args = ap.parse_args()
  presets = [p.replace("-layers", "-tiny") for p in args.presets] if args.smoke else args.presets
  bw = runner.copy_tbps(0.05 if args.smoke else 2.0)
  print(f"measured copy bandwidth {bw:.2f} TB/s; floor = weight bytes / copy bandwidth")
  rows = []
  print(f"{'preset':>20} {'impl':>7} {'B':>3} {'path':>8} {'step us':>9} {'steady us':>9} "
        f"{'host us':>8} {'kernels':>7} {'vs unfused':>10} {'roof':>5} ok")
  for preset in presets:
    if preset not in runner.PRESETS:
      print(f"{preset}: not a preset here, skipped")
      continue

    # One set of weights for every backend and the XLA reference: each is the same arrays
    # rebound with another `implementation`.
    built = runner.build(preset, tp=args.tp, master="bf16" in args.paths)

    def paths(impl) -> dict:
      """{path: (model, forward, params)} on backend `impl`."""
      models = {p: built.path(p, implementation=impl) for p in args.paths}
      return {p: (m, *runner.forward_fn(m, args.tp)) for p, m in models.items()}

    ref_paths = paths("xla") if args.xla_check else None
    ref_logits = {}  # (path, batch) -> the XLA reference's logits, shared by every --impls entry
    for impl in args.impls:
      kernel_paths = paths(IMPLS[impl])
      for b in args.batches:
        for context in args.context:
          run_batch(args, preset, impl, b, context, built, kernel_paths, ref_paths, ref_logits,
                    bw, rows)
        # after every batch: a run cut off by a time limit keeps the rows it finished
        _harness.write_results(f"decode_{args.tag}" if args.tag else "decode", rows,
                               {"copy_tbps": round(bw, 3)}, args.commit, args.out)
      del kernel_paths
    del built, ref_paths, ref_logits  # the next preset's weights need the memory


def serving(forward, params, model, b, context, tok0):
  """(wall seconds per step, host seconds per step to launch a round, host seconds per step to
  launch one call onto an idle device) of the serving loop from `context` (module docstring)."""
  decode = runner.step_fns(forward)[1]
  pos0 = jnp.int32(context)
  cache = runner.new_cache(model, b, context + 1 + STEADY)
  decode = decode.lower(params, runner.first_toks(tok0, STEADY), cache, pos0).compile()
  _, _, _, cache = runner.decode_round(decode, params, tok0, cache, pos0, STEADY)  # warm-up
  per, enqueue = [], []
  for _ in range(7):
    s, e, _, cache = runner.decode_round(decode, params, tok0, cache, pos0, STEADY)
    per.append(s)
    enqueue.append(e)
  one = []
  for _ in range(5):
    toks, pos = runner.first_toks(tok0, STEADY), jnp.copy(pos0)
    jax.block_until_ready((toks, pos, cache))
    t0 = time.perf_counter()
    toks, cache, pos = decode(params, toks, cache, pos)
    one.append((time.perf_counter() - t0) / toks.shape[1])
  jax.block_until_ready(cache)
  return statistics.median(per), statistics.median(enqueue), statistics.median(one)


def run_batch(args, preset, impl, b, context, built, kernel_paths, ref_paths, ref_logits, bw,
              rows):
  """Every path of one preset, backend choice, batch and context: times and checks, into
  `rows`."""
  times, logits = {}, {}
  for path in args.paths:
    model, forward, params = kernel_paths[path]
    weight_bytes = cost.weight_bytes(model, b)
    vocab = model.cfg.vocab_size
    tok0 = jax.random.randint(jax.random.key(b), (b, 1), 0, vocab, jnp.int32)
    logits[path], new_cache = forward(params, tok0, model.init_cache(b, context + 1),
                                      jnp.int32(context))

    # Weights and cache are arguments of the timed jit: closed over, they would be
    # compiled in as constants. The cache and tokens are placed as a serving loop has
    # them, the cache as the step returns it: a fresh one, on one device, made every
    # step of --tp copy each shard to its device first (MemcpyP2P, and the host waiting
    # for its peer at every copy: 3 ms a step on two H200s).
    where = logits[path].sharding  # replicated over the mesh under --tp
    where = (NamedSharding(where.mesh, P()) if isinstance(where, NamedSharding) else where)

    # The step updates its cache in place, as the serving loop's donated call does: each set
    # holds a copy of it for the timed jit to donate (a cache not donated would be copied
    # whole first, every step: 538 us of a 10.0 ms deepseek-v3-deep step at 32768 slots on
    # an H100).
    def make(n, b=b, params=params, cache=new_cache, where=where):
      keys = jax.random.split(jax.random.key(b), n)
      return [(params, jax.tree.map(jnp.copy, cache),
               jax.device_put(jax.random.randint(k, (b, 1), 0, vocab, jnp.int32), where))
              for k in keys]

    step = lambda params, cache, tok, forward=forward: forward(
        params, tok, cache, jnp.int32(context))
    cache_bytes = cost.cache_bytes(new_cache)
    xla_diff = None
    if ref_paths is not None:
      if (path, b, context) not in ref_logits:
        ref_model, ref_forward, ref_params = ref_paths[path]
        ref_logits[path, b, context] = ref_forward(ref_params, tok0,
                                                   ref_model.init_cache(b, context + 1),
                                                   jnp.int32(context))[0]
      xla_diff = rel_rms(logits[path], ref_logits[path, b, context])
    read = weight_bytes + cache_bytes if args.tp == 1 else None
    # One step per timed jit, one compile (the counts read the same program): a step is a
    # whole model, and its compile dominates the run.
    m = _harness.measure(step, make, 1, chain=False, hlo=True, donate=(1,))
    counts = kernel_counts(m["hlo"])
    steady_s, enqueue_s, dispatch_s = serving(forward, params, model, b, context,
                                              jax.device_put(tok0, where))
    sec = (not args.wall and m["kernel_s"]) or steady_s
    times[path] = sec
    diff = rel_rms(logits[path], logits["unfused"]) if "unfused" in logits else None
    finite = bool(jnp.all(jnp.isfinite(logits[path])))
    ok = finite and (xla_diff is None or xla_diff <= xla_tol(len(model.layers)))
    rows.append(dict(case=dict(preset=preset, batch=b, tp=args.tp, context=context,
                                implementation=impl),
                     impl=path, time_us=round(sec * 1e6, 2),
                     tbps=read and round(read / sec / 1e12, 3), tflops=None,
                     roofline_frac=read and round(cost.step_floor(read, bw) / sec, 3),
                     vs_xla=round(times["unfused"] / sec, 4) if "unfused" in times else None,
                     correct=ok,
                     logits_rel_rms_vs_xla=xla_diff and round(xla_diff, 6),
                     logits_rel_rms_vs_unfused=diff and round(diff, 5),
                     weight_bytes=weight_bytes,
                     cache_bytes=cache_bytes,
                     steady_us=round(steady_s * 1e6, 2), dispatch_us=round(dispatch_s * 1e6, 2),
                     enqueue_us=round(enqueue_s * 1e6, 2),
                     kernel_us=m["kernel_s"] and round(m["kernel_s"] * 1e6, 2), kernels=counts,
                     top_kernels=m.get("top_kernels"), idle_us=m.get("idle_us"),
                     top_gaps=m.get("top_gaps"), graph_launches=m.get("graph_launches"),
                     top_host=m.get("top_host")))
    print(f"{preset:>20} {impl:>7} {b:>3} {path:>8} {sec * 1e6:9.1f} {steady_s * 1e6:9.1f} "
          f"{enqueue_s * 1e6:8.1f} {counts['total']:7d} "
          f"{format(times['unfused'] / sec, '10.3f') if 'unfused' in times else '-':>10} "
          f"{'-' if read is None else format(rows[-1]['roofline_frac'], '5.2f'):>5} "
          f"{'yes' if rows[-1]['correct'] else 'NO'}", flush=True)


if __name__ == "__main__":
  main()
