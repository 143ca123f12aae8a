"""Command line: `jfusedq demo` runs the fused op on the default device and times it."""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jfusedq import _target, default_format, rmsnorm_quant
from jfusedq.ops._dispatch import default_order
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
    out = jax.block_until_ready(fn(x, residual, weight))
    times = []
    for _ in range(args.reps):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(x, residual, weight))
      times.append(time.perf_counter() - t0)
    results[impl] = out
    print(f"  {impl:>6}: median {np.median(times) * 1e6:9.1f} us per call (wall clock, includes"
          f" dispatch)")
  ref = results["xla"].quant
  q = results[impls[0]].quant
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


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="jfusedq")
  sub = ap.add_subparsers(dest="cmd", required=True)
  d = sub.add_parser("demo", help="run fused add + RMSNorm + FP8 quant on the default device")
  d.add_argument("--tokens", type=int, default=64)
  d.add_argument("--hidden", type=int, default=7168)
  d.add_argument("--reps", type=int, default=20)
  d.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  return demo(args)


if __name__ == "__main__":
  sys.exit(main())
