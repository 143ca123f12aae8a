"""Tensor-parallel benchmark: all-reduce + (add +) RMSNorm + per-group FP8 quant, per strategy.

Runs on a mesh over every device there is (two H200s is the target: `--smoke` runs tiny shapes on
whatever exists, e.g. 8 simulated CPU devices). Each device holds a partial sum `x_i [T, H]`
(bf16); the result is `rmsnorm_quant(psum(x_i) + residual)` (jfusedq.parallel). Rows:
  psum                psum alone (the bf16 all-reduce every strategy starts with)
  fused               psum + the fused add + norm + quant kernel
  ar_norm_then_quant  psum + add + norm kernel (bf16 out) + a separate quant kernel
  generic             psum + the plain jnp composition (XLA)
  sequence_parallel   psum_scatter + fused kernel on T/N rows + all_gather of fp8 + scales
                      (residual token-sharded; T must divide by N, else the row is skipped)

Bytes, per device, N devices, B = 2 (bf16), g = ceil(H/128), hp = T*H*B with --keep-bf16 else 0:
  link (ring model, bytes each device sends; `tbps` = these / time, NCCL's "bus bandwidth"):
    all-reduce strategies:  2 (N-1)/N * T*H*B
    sequence_parallel:      (N-1)/N * (T*H*B + T*H + 4*T*g + hp)   (reduce-scatter + all-gather:
                            about 24% fewer than the all-reduce without hp)
  memory after the collective (`hbm_bytes`):
    fused / generic:        T*H*B (sum) + T*H*B (residual) + H*B + T*H*B (residual out)
                            + T*H + 4*T*g + hp
    ar_norm_then_quant:     the same + 2*T*H*B (bf16 norm written, then read by the quant)
    sequence_parallel:      fused's with T/N rows, + gathered T*H + 4*T*g + hp written
`time_us` is the wall-clock slope per call inside one jit (harness `chain_s`): collectives
synchronise devices, so launch gaps and peer waits count. The profiler's kernel time (mean
per device) is reported as `kernel_us`.
`roofline_frac` = t(psum alone) / t: 1.0 means the norm + quant cost nothing on top of the
bare all-reduce (sequence_parallel may exceed 1). `vs_xla` = t(generic) / t.

Each strategy is checked against `generic` on the same inputs before it is timed, with the test
suite's tolerances (fused, sequence_parallel: scales 1e-6, 0.1% of codes one step apart;
ar_norm_then_quant quantises the bf16 norm: scales 2**-8, 5% of codes), residual_out bit-equal
(sequence_parallel: within a bf16 rounding) and every replicated output equal on all devices;
generic itself against the single-device XLA op on the psum.

Run: python benchmarks/allreduce_fusion.py [--keep-bf16] [--ts 1 ...] [--hs 4096 ...] [--smoke]
     [--impls fused ...] [--out DIR] [--commit SHA] [--tag TAG]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness  # noqa: E402
from jfusedq import QuantizedActivation, Unsupported, rmsnorm_quant  # noqa: E402
from jfusedq.fp8 import BLOCK as G  # noqa: E402
from jfusedq.parallel import allreduce_rmsnorm_quant_sharded, chosen_strategy  # noqa: E402
from jfusedq.testing import quant_mismatch  # noqa: E402
from models import run as runner  # noqa: E402

AXIS = "tp"
TS = (1, 16, 64, 256, 1024, 4096, 16384)
HS = (4096, 7168)
IMPLS = ("psum", "fused", "ar_norm_then_quant", "generic", "sequence_parallel")
# (scale_rtol, max_code_frac) against generic; see tests/parallel/test_allreduce.py for why.
TOL = {"ar_norm_then_quant": (2.0**-8 + 1e-6, 0.05)}
DEFAULT_TOL = (1e-6, 1e-3)


def link_bytes(impl, t, h, n, keep):
  hp = t * h * 2 if keep else 0
  if impl == "sequence_parallel":
    return (n - 1) / n * (t * h * 2 + t * h + 4 * t * -(-h // G) + hp)
  return 2 * (n - 1) / n * t * h * 2


def hbm_bytes(impl, t, h, n, keep):
  if impl == "psum":
    return 0
  hp = t * h * 2 if keep else 0
  quant = t * h + 4 * t * -(-h // G) + hp
  if impl == "sequence_parallel":
    rows = t // n
    return 3 * rows * h * 2 + h * 2 + rows * h + 4 * rows * -(-h // G) + quant
  b = 3 * t * h * 2 + h * 2 + quant
  return b + 2 * t * h * 2 if impl == "ar_norm_then_quant" else b


def make_inputs(mesh, t, h, sp, seed):
  n = mesh.shape[AXIS]
  res_spec = P(AXIS) if sp else P()

  @jax.jit
  def gen(key):
    kx, kr = jax.random.split(key)
    # Per-row magnitudes spread over two decades, like the test inputs: amax varies by group.
    mag = jnp.exp(jax.random.uniform(kr, (t, 1), minval=-2.3, maxval=2.3))
    xs = (jax.random.normal(kx, (n, t, h)) * mag).astype(jnp.bfloat16)
    res = (jax.random.normal(kr, (t, h)) * mag).astype(jnp.bfloat16)
    return (jax.lax.with_sharding_constraint(xs, NamedSharding(mesh, P(AXIS))),
            jax.lax.with_sharding_constraint(res, NamedSharding(mesh, res_spec)))

  w = jax.device_put(jax.random.normal(jax.random.key(seed + 7), (h,), jnp.bfloat16) * 0.5 + 0.2,
                     NamedSharding(mesh, P()))

  def make(count):
    keys = jax.random.split(jax.random.key(seed), count)
    return [(*gen(k), w) for k in keys]
  return make


def op_for(impl, mesh, keep):
  if impl == "psum":
    body = jax.shard_map(lambda x: jax.lax.psum(x[0], AXIS), mesh=mesh, in_specs=P(AXIS),
                         out_specs=P(), check_vma=False)
    return lambda xs, r, w: body(xs)
  sp = impl == "sequence_parallel"

  def op(xs, r, w):
    quant, res_out = allreduce_rmsnorm_quant_sharded(
        xs, r, w, mesh=mesh, axis_name=AXIS, keep_bf16=keep, sequence_parallel=sp,
        strategy=None if sp else impl)
    return quant.q, quant.scale, quant.hp, res_out
  return op


def replication_error(tree):
  for a in jax.tree.leaves(tree):
    if a.sharding.is_fully_replicated:
      first = np.asarray(a.addressable_shards[0].data).tobytes()
      if any(np.asarray(s.data).tobytes() != first for s in a.addressable_shards[1:]):
        return "replicated output differs between devices"
  return None


def check(impl, mesh, make, keep, generic_out):
  """`impl` against generic on the same inputs; generic against the single-device XLA op."""
  xs, r, w = make(1)[0]
  if impl == "psum":
    got = jax.jit(op_for(impl, mesh, keep))(xs, r, w)
    want = np.asarray(xs, np.float32).sum(0)
    bound = (xs.shape[0] + 1) * 2.0**-8 * np.abs(np.asarray(xs, np.float32)).sum(0)
    why = replication_error(got)
    if why is None and not np.all(np.abs(np.asarray(got, np.float32) - want) <= bound):
      why = "psum differs from the sum of the partials"
    return why
  got = jax.jit(op_for(impl, mesh, keep))(xs, r, w)
  why = replication_error(got)
  if impl == "generic":
    h = jax.jit(op_for("psum", mesh, keep))(xs, r, w)
    ref = rmsnorm_quant(h, w, residual=r, keep_hp=keep, implementation="xla")
    want = (ref.quant.q, ref.quant.scale, ref.quant.hp, ref.residual)
  else:
    want = generic_out(xs, r, w)
  rtol, frac = TOL.get(impl, DEFAULT_TOL)
  quant = lambda o: QuantizedActivation(o[0], o[1])
  why = why or quant_mismatch(quant(got), quant(want), max_code_frac=frac, scale_rtol=rtol)
  if why is None:
    g, wr = np.asarray(got[3], np.float32), np.asarray(want[3], np.float32)
    if impl == "sequence_parallel":
      if not np.allclose(g, wr, rtol=2.0**-7, atol=0):
        why = "residual_out beyond a bf16 rounding"
    elif not np.array_equal(g, wr):
      why = "residual_out differs"
  if why is None and keep:
    g, wh = np.asarray(got[2], np.float32), np.asarray(want[2], np.float32)
    if not np.allclose(g, wh, rtol=2.0**-7, atol=1e-30):
      why = "bf16 copy beyond a bf16 rounding"
  if why:
    print(f"  CHECK FAILED ({impl}): {why}")
  return why


def chain_len(nbytes):
  """Calls per timed jit: enough for ~3 ms of work at ~0.3 TB/s per link, 5 to 10 (each Pallas
  call in the jit compiles separately)."""
  return int(min(10, max(5, 3e-3 * 3e11 / max(nbytes, 1))))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--keep-bf16", action="store_true", help="also return the bf16 copy (GDN)")
  ap.add_argument("--smoke", action="store_true",
                  help="tiny shapes, any devices: check that everything runs and agrees")
  ap.add_argument("--ts", nargs="+", type=int, default=TS)
  ap.add_argument("--hs", nargs="+", type=int, default=HS)
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  ap.add_argument("--commit", default="unknown")
  ap.add_argument("--tag", default="", help="results file allreduce_fusion_<tag>.json")
  ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS,
                  help="rows to run (psum and generic always run: the others' yardsticks)")
  args = ap.parse_args()
  keep = args.keep_bf16

  devices = jax.devices()
  n = len(devices)
  mesh = jax.sharding.Mesh(np.array(devices), (AXIS,))
  ts, hs = ((1, 8, 2 * n), (576, 2112)) if args.smoke else (args.ts, args.hs)
  bw = None if args.smoke else runner.copy_tbps()
  print(f"{n} x {devices[0].device_kind}; copy bandwidth "
        f"{'not measured (smoke)' if bw is None else f'{bw:.2f} TB/s'}")
  print("link bytes: all-reduce 2(N-1)/N*T*H*2, sequence-parallel (N-1)/N*(T*H*2 + T*H + "
        "4*T*ceil(H/128)); time = wall slope per call inside one jit; kern = profiler kernel "
        "time per call per device")
  print(f"{'case':>24} {'impl':>18} {'us':>9} {'kern':>8} {'busTB/s':>7} {'vs_psum':>7} "
        f"{'vs_xla':>6} default ok")
  rows = []
  path = None
  for n_case, (h, t) in enumerate((h, t) for h in hs for t in ts):
    case = dict(T=t, H=h, N=n, keep_bf16=keep)
    default = chosen_strategy(jax.ShapeDtypeStruct((t, h), jnp.bfloat16),
                              jax.ShapeDtypeStruct((h,), jnp.bfloat16),
                              residual=jax.ShapeDtypeStruct((t, h), jnp.bfloat16), keep_bf16=keep)
    make_rep = make_inputs(mesh, t, h, False, seed=n_case)
    make_sp = make_inputs(mesh, t, h, True, seed=n_case)
    generic = jax.jit(op_for("generic", mesh, keep))
    times = {}
    impls = ["psum", "generic"] + [i for i in args.impls if i not in ("psum", "generic")]
    for impl in impls:
      sp = impl == "sequence_parallel"
      if sp and t % n:
        print(f"{str(dict(T=t, H=h)):>24} {impl:>18} skipped: T={t} does not divide by N={n}")
        continue
      make = make_sp if sp else make_rep
      try:
        # generic's reference runs on the same inputs with a replicated residual.
        gen_out = (lambda xs, r, w: generic(xs, jax.device_put(r, NamedSharding(mesh, P())), w))
        ok = check(impl, mesh, make, keep, gen_out) is None
        nbytes = link_bytes(impl, t, h, n, keep)
        m = _harness.measure(op_for(impl, mesh, keep), make, 2 if args.smoke else chain_len(nbytes))
      except Unsupported as e:
        print(f"{str(dict(T=t, H=h)):>24} {impl:>18} unsupported: {e}")
        continue
      sec = m["chain_s"]
      times[impl] = sec
      kern = m["kernel_s"]
      rows.append(dict(
          case=case, impl=impl, time_us=round(sec * 1e6, 3),
          tbps=round(nbytes / sec / 1e12, 4), tflops=None,
          roofline_frac=round(times["psum"] / sec, 3) if "psum" in times else None,
          vs_xla=round(times["generic"] / sec, 3) if "generic" in times else None,
          correct=ok, default=impl == default, link_bytes=int(nbytes),
          hbm_bytes=hbm_bytes(impl, t, h, n, keep),
          kernel_us=None if kern is None else round(kern * 1e6, 3),
          kernels_per_call=m["kernels_per_call"], top_kernels=m.get("top_kernels")))
      r = rows[-1]
      num = lambda v, w: f"{'-':>{w}}" if v is None else f"{v:{w}.2f}"
      print(f"{str(dict(T=t, H=h)):>24} {impl:>18} {sec * 1e6:9.2f} {num(r['kernel_us'], 8)} "
            f"{r['tbps']:7.3f} {num(r['roofline_frac'], 7)} {num(r['vs_xla'], 6)} "
            f"{'*' if r['default'] else ' ':>7} {'yes' if ok else 'NO'}", flush=True)
      # Rewritten after every row so that a run cut short still leaves its measurements.
      path = _harness.write_results(
          f"allreduce_fusion_{args.tag}" if args.tag else "allreduce_fusion", rows,
          {} if bw is None else {"copy_tbps": round(bw, 3)}, args.commit, args.out)
  print("wrote", path)
  if not all(r["correct"] for r in rows):
    sys.exit(1)


if __name__ == "__main__":
  main()
