"""The `jfusedq` command (also `python -m models`).

  jfusedq run    a model's jit-compiled prefill + decode, fused vs unfused (the main job)
  jfusedq demo   the fused add + RMSNorm + FP8 quant op alone, on the default device
  jfusedq plot   a PNG of a benchmark results file
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jfusedq import _target, default_format, rmsnorm_quant
from jfusedq.ops._dispatch import Unsupported, default_order
from jfusedq.testing import quant_mismatch


def demo(args) -> int:
  target = _target.current()
  fmt = default_format()
  print(f"jax {jax.__version__} on {target.platform} ({target.device_kind}); fp8 format {fmt.name}"
        f" (max {fmt.max:g})")
  t, h = args.tokens, args.hidden
  k = jax.random.split(jax.random.key(args.seed), 3)
  x = jax.random.normal(k[0], (t, h), jnp.bfloat16)
  residual = jax.random.normal(k[1], (t, h), jnp.bfloat16)
  weight = (1.0 + 0.1 * jax.random.normal(k[2], (h,))).astype(jnp.bfloat16)
  print(f"input x [{t}, {h}] bf16 + residual; group size 128")

  impls = list(default_order(target))
  if "pallas" not in impls:
    impls.append("pallas")  # CPU: Pallas runs in interpret mode (correct, not fast)
  results = {}
  for impl in impls:
    fn = jax.jit(lambda x, r, w, impl=impl: rmsnorm_quant(x, w, residual=r, implementation=impl))
    try:
      out = jax.block_until_ready(fn(x, residual, weight))
    except Unsupported as e:  # e.g. triton without the triton package
      print(f"  {impl:>6}: skipped ({e})")
      continue
    times = []
    for _ in range(args.reps):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(x, residual, weight))
      times.append(time.perf_counter() - t0)
    results[impl] = out
    print(f"  {impl:>6}: median {np.median(times) * 1e6:9.1f} us per call (wall clock, includes"
          f" dispatch)")
  ref = results["xla"].quant
  q = results[next(iter(results))].quant
  print(f"q {q.q.shape} {q.q.dtype}, scale {q.scale.shape} {q.scale.dtype}")
  print("row 0, first 8 codes :", np.asarray(q.q[0, :8].astype(jnp.float32)))
  print("row 0, first 4 scales:", np.asarray(q.scale[0, :4]))
  deq = np.asarray(q.dequantize())
  exact = np.asarray(jax.jit(lambda x, r, w: rmsnorm_quant(x, w, residual=r, implementation="xla",
                                                           keep_hp=True))(x, residual, weight)
                     .quant.hp, np.float32)
  print(f"dequantised vs bf16 norm output: relative RMS error "
        f"{np.linalg.norm(deq - exact) / np.linalg.norm(exact):.4f}")
  for impl in impls:
    if impl != "xla":
      why = quant_mismatch(results[impl].quant, ref, max_code_frac=1e-3, scale_rtol=1e-6)
      print(f"{impl} vs xla: {'agree' if why is None else 'DISAGREE: ' + why}")
      if why:
        return 1
  return 0


def run(args) -> int:
  if args.tp > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Simulated CPU devices for --tp on a machine without accelerators; ignored by GPU backends.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.tp}").strip()
  # Imported once XLA_FLAGS holds the device count: JAX reads it when its backend starts.
  from models import run as runner

  if args.tp > jax.device_count():
    print(f"--tp {args.tp} needs {args.tp} devices; {jax.device_count()} available",
          file=sys.stderr)
    return 2
  result = runner.run(args.model if not args.checkpoint else None, args.checkpoint,
                      batch=args.batch, prompt_len=args.prompt_len, steps=args.steps, tp=args.tp,
                      compare=args.compare, fp8=not args.bf16, seed=args.seed)
  print(runner.table(result))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(runner.to_json(result), f, indent=1, default=float)
    print(f"wrote {args.json}")
  return 0


def plot(args) -> int:
  """PNG of a benchmark results file: time per case for each implementation."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("jfusedq plot needs matplotlib: pip install 'jfusedq[plot]'", file=sys.stderr)
    return 2
  with open(args.results) as f:
    doc = json.load(f)
  cases = list(dict.fromkeys(json.dumps(r["case"], sort_keys=True) for r in doc["rows"]))
  impls = list(dict.fromkeys(r["impl"] for r in doc["rows"] if "(" not in r["impl"]))
  fig, ax = plt.subplots(figsize=(max(8, 0.5 * len(cases)), 5))
  width = 0.8 / max(len(impls), 1)
  for j, impl in enumerate(impls):
    by_case = {json.dumps(r["case"], sort_keys=True): r for r in doc["rows"] if r["impl"] == impl}
    xs = [i for i, c in enumerate(cases) if c in by_case]
    bars = ax.bar([x + j * width for x in xs], [by_case[cases[x]]["time_us"] for x in xs],
                  width, label=impl)
    # A row whose correctness check failed is drawn hatched: a time, never a speed-up.
    for bar, x in zip(bars, xs):
      if by_case[cases[x]].get("correct") is False:
        bar.set_hatch("xx")
        bar.set_edgecolor("black")
  ax.set_yscale("log")
  ax.set_ylabel("time per call (us); hatched: check failed")
  # Every case key that varies across the file names the bar group.
  varying = [k for k in json.loads(cases[0])
             if len({json.dumps(json.loads(c).get(k)) for c in cases}) > 1] if cases else []
  labels = [",".join(f"{k}={json.loads(c).get(k)}" for k in varying) for c in cases]
  ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))], labels, rotation=70,
                fontsize=7)
  ax.set_title(f"{doc['benchmark']} on {doc['device']} (jax {doc['jax']}, {doc['date']})")
  ax.legend()
  fig.tight_layout()
  fig.savefig(args.out, dpi=120)
  print(f"wrote {args.out}")
  return 0


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="jfusedq")
  sub = ap.add_subparsers(dest="cmd", required=True)
  d = sub.add_parser("demo", help="run fused add + RMSNorm + FP8 quant on the default device")
  d.add_argument("--tokens", type=int, default=64)
  d.add_argument("--hidden", type=int, default=7168)
  d.add_argument("--reps", type=int, default=20)
  d.add_argument("--seed", type=int, default=0)
  r = sub.add_parser("run", help="model prefill + decode, fused vs unfused, with kernel counts")
  r.add_argument("--model", default="deepseek-v3-tiny",
                 help="preset: deepseek-v3-tiny, deepseek-v3-layers, ...")
  r.add_argument("--checkpoint", help="a Hugging Face checkpoint directory instead of a preset")
  r.add_argument("--batch", type=int, default=2)
  r.add_argument("--prompt-len", type=int, default=16)
  r.add_argument("--steps", type=int, default=8, help="decode steps")
  r.add_argument("--tp", type=int, default=1, help="tensor-parallel devices")
  r.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                 help="also run the unfused path and compare (default on)")
  r.add_argument("--bf16", action="store_true", help="unquantised (bf16) projections")
  r.add_argument("--json", help="write the results to this file")
  r.add_argument("--seed", type=int, default=0)
  p = sub.add_parser("plot", help="PNG of a benchmarks/results/*.json file")
  p.add_argument("results")
  p.add_argument("--out", default="benchmark.png")
  args = ap.parse_args(argv)
  return {"demo": demo, "run": run, "plot": plot}[args.cmd](args)


if __name__ == "__main__":
  sys.exit(main())
