"""H200 benchmark: fused add + RMSNorm + per-group FP8 quant, and the standalone per-group
quant (`jf.group_quant`, cases with `op: "group_quant"`), every implementation and the default
order (`impl: "default"`: implementation=None, as a user calls it).

Bytes each call must move (B = bytes per input element, 2 for bf16, G = 128):
  main case (with residual):  T*H*B (x) + T*H*B (residual in) + H*B (weight)
                              + T*H*B (residual out) + T*H (fp8 codes) + T*ceil(H/G)*4 (scales)
                              [+ T*H*B with the bf16 side output, `hp` (keep_hp), at T >= 4096]
  MLA pair (no residual):     T*H*B + H*B + T*H + T*ceil(H/G)*4       (q_a_layernorm, quantised)
                              + T*H2*B + H2*B + T*H2*B                (kv_a_layernorm, bf16)
  group_quant:                T*H*B + T*H + T*ceil(H/G)*4
Roofline = those bytes / the device copy bandwidth measured in the same run (a 2 GiB copy).
`same_size_frac` = time of a copy moving the case's bytes / the kernel's time: the ceiling a
kernel of that size can reach, fixed launch and tail costs included.

Run: python benchmarks/rmsnorm_quant.py [--impls xla pallas triton default] [--ts 1 4096 ...]
     [--hs 4096 7168 ...] [--ops rmsnorm_quant group_quant] [--sweep] [--chain] [--out DIR]
     [--commit SHA] [--tag T] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness  # noqa: E402
from jfusedq import group_quant, rmsnorm_quant  # noqa: E402
from jfusedq.ops.group_quant import Config  # noqa: E402
from jfusedq.testing import quant_mismatch  # noqa: E402
from models import run as runner  # noqa: E402

G = 128
TS = (1, 64, 4096, 16384)
HS = (1536, 2048, 4096, 5120, 7168)  # DeepSeek-V3 and Qwen3.5 hidden and q_a sizes


def case_bytes(t, h, h2=0, residual=True, hp=False, quant_only=False):
  groups = -(-h // G)
  if quant_only:
    return t * h * 2 + t * h + t * groups * 4
  b = t * h * 2 * (3 if residual else 1) + h * 2 + t * h + t * groups * 4 + (t * h * 2 if hp else 0)
  if h2:
    b += 2 * t * h2 * 2 + h2 * 2
  return b


def make_inputs(t, h, h2, residual, seed):
  def make(n):
    keys = jax.random.split(jax.random.key(seed), 4 * n + 2)
    w = jax.random.normal(keys[-1], (h,), jnp.bfloat16)
    w2 = jax.random.normal(keys[-2], (h2,), jnp.bfloat16) if h2 else None
    sets = []
    for i in range(n):
      x = jax.random.normal(keys[4 * i], (t, h), jnp.bfloat16)
      r = jax.random.normal(keys[4 * i + 1], (t, h), jnp.bfloat16) if residual else None
      x2 = jax.random.normal(keys[4 * i + 2], (t, h2), jnp.bfloat16) if h2 else None
      sets.append((x, r, w, x2, w2))
    return sets
  return make


def op_for(impl, config=None, hp=False, quant_only=False):
  impl = None if impl == "default" else impl

  def op(x, r, w, x2, w2):
    if quant_only:
      out = group_quant(x, implementation=impl, config=config)
      return out.q, out.scale
    out = rmsnorm_quant(x, w, residual=r, x2=x2, weight2=w2, keep_hp=hp, implementation=impl,
                        config=config)
    return out.quant.q, out.quant.scale, out.quant.hp, out.residual, out.norm2
  return op


def relative_error(a, b):
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return float(jnp.max(jnp.abs(a - b) / (jnp.abs(b) + 1e-3)))


def check(make, impl, config=None, hp=False, quant_only=False):
  """A kernel vs XLA on one input set: the same tolerances as the test suite."""
  x, r, w, x2, w2 = make(1)[0]
  impl = None if impl == "default" else impl
  if quant_only:
    why = quant_mismatch(group_quant(x, implementation=impl, config=config),
                         group_quant(x, implementation="xla"), max_code_frac=1e-3,
                         scale_rtol=1e-6)
  else:
    kw = dict(residual=r, x2=x2, weight2=w2, keep_hp=hp)
    a = rmsnorm_quant(x, w, implementation=impl, config=config, **kw)
    b = rmsnorm_quant(x, w, implementation="xla", **kw)
    why = quant_mismatch(a.quant, b.quant, max_code_frac=1e-3, scale_rtol=1e-6)
  if why is None and r is not None and not bool(jnp.array_equal(a.residual, b.residual)):
    why = "residual_out differs"
  # bf16 outputs of the norm: one bf16 rounding of f32 values that differ in summation order.
  if why is None and x2 is not None and (err := relative_error(a.norm2, b.norm2)) > 2**-7:
    why = f"norm2 relative error {err:.3g}"
  if why is None and hp and (err := relative_error(a.quant.hp, b.quant.hp)) > 2**-7:
    why = f"hp relative error {err:.3g}"
  if why:
    print("  CHECK FAILED:", why)
  return why is None


def chain_len(nbytes):
  """Calls per timed jit: enough for ~3 ms of work at ~3 TB/s, 5 to 20."""
  return int(min(20, max(5, 3e-3 * 3e12 / nbytes)))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--sweep", action="store_true", help="also time other tilings")
  ap.add_argument("--impls", nargs="+", default=["xla", "pallas", "triton", "default"],
                  help="xla first: the baseline")
  ap.add_argument("--ts", nargs="+", type=int, default=TS)
  ap.add_argument("--hs", nargs="+", type=int, default=HS)
  ap.add_argument("--ops", nargs="+", choices=("rmsnorm_quant", "group_quant"),
                  default=["rmsnorm_quant", "group_quant"])
  ap.add_argument("--chain", action="store_true",
                  help="also time the wall-clock slope (a second compile per row)")
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  ap.add_argument("--commit", default="unknown")
  ap.add_argument("--tag", default="", help="results file rmsnorm_quant_<tag>.json")
  ap.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script on CPU")
  args = ap.parse_args()
  ts, hs = ((1, 16), (576, 2112)) if args.smoke else (args.ts, args.hs)
  on_gpu = jax.devices()[0].platform == "gpu"
  impls = args.impls if on_gpu else [i for i in args.impls if i != "triton"]  # GPU only
  chain = args.chain or not on_gpu  # no profiler kernel time without a GPU

  bw = runner.copy_tbps(0.05 if args.smoke else 2.0)
  print(f"device {jax.devices()[0].device_kind}; measured copy bandwidth {bw:.2f} TB/s")
  print("bytes = T*H*2*(3 if residual else 1) + H*2 + T*H + T*ceil(H/128)*4 [+ T*H*2 with hp]"
        " [+ 2*T*H2*2 + H2*2 for the MLA pair]; time = profiler kernel time per call;"
        " chain = wall-clock slope per call inside one jit (launch gaps included)")
  cases = []
  if "rmsnorm_quant" in args.ops:
    cases += [dict(T=t, H=h) for h in hs for t in ts]
    hp_ts = [t for t in ts if t >= 4096] or ts[-1:]  # the bandwidth cases (smoke: its largest T)
    cases += [dict(T=t, H=h, hp=True) for h in hs for t in hp_ts]
    cases += [dict(T=t, H=1536, H2=512) for t in ts]
  if "group_quant" in args.ops:
    cases += [dict(T=t, H=h, op="group_quant") for h in hs for t in ts]
  rows = []
  print(f"{'case':>32} {'impl':>24} {'us':>8} {'chain':>8} {'kern':>4} {'TB/s':>5} {'roof':>5}"
        f" {'same':>5} {'vs_xla':>6} ok")
  for n_case, case in enumerate(cases):
    t, h, h2, hp = case["T"], case["H"], case.get("H2", 0), case.get("hp", False)
    quant_only = case.get("op") == "group_quant"
    residual = not h2 and not quant_only
    nbytes = case_bytes(t, h, h2, residual, hp, quant_only)
    make = make_inputs(t, h, h2, residual, seed=n_case)
    n = 2 if args.smoke else chain_len(nbytes)  # the smoke run checks the script, not speed
    configs = [(impl, None) for impl in impls]
    if args.sweep:  # below 4096 rows (one wave or less) a program holds one row
      configs += [(f"{impl}(br={br},nw={nw})", Config(br, nw))
                  for impl in ("pallas", "triton") if on_gpu or impl != "triton"
                  for br in ((1, 2, 4) if t >= 4096 else (1,))
                  for nw in (4, 8, 16, 32)]
    same = runner.copy_seconds(nbytes)
    xla = None
    for impl, config in configs:
      ok = True if impl == "xla" else check(make, impl.split("(")[0], config, hp, quant_only)
      m = _harness.measure(op_for(impl.split("(")[0], config, hp, quant_only), make, n,
                           chain=chain)
      sec = m["kernel_s"] or m["chain_s"]
      xla = xla or sec
      tbps = nbytes / sec / 1e12
      rows.append(dict(case=dict(case, residual=residual), impl=impl, time_us=round(sec * 1e6, 3),
                       tbps=round(tbps, 3), tflops=None, roofline_frac=round(tbps / bw, 3),
                       vs_xla=round(xla / sec, 3), correct=ok, bytes=nbytes,
                       copy_same_bytes_us=round(same * 1e6, 3),
                       same_size_frac=round(same / sec, 3),
                       chain_us=m["chain_s"] and round(m["chain_s"] * 1e6, 3),
                       config=None if config is None
                       else str(config),
                       kernels_per_call=m["kernels_per_call"],
                       kernels=list(m.get("top_kernels", {}))[:3]))
      print(f"{str(case):>32} {impl:>24} {sec * 1e6:8.2f} {(m['chain_s'] or 0) * 1e6:8.2f} "
            f"{m['kernels_per_call'] or 0:4.1f} {tbps:5.2f} {tbps / bw:5.2f} {same / sec:5.2f} "
            f"{xla / sec:6.2f} {'yes' if ok else 'NO'}", flush=True)
      # Rewritten after every row so that a run cut short still leaves its measurements.
      path = _harness.write_results(
          f"rmsnorm_quant_{args.tag}" if args.tag else "rmsnorm_quant", rows,
          {"copy_tbps": round(bw, 3)}, args.commit, args.out)
  print("wrote", path)


if __name__ == "__main__":
  main()
