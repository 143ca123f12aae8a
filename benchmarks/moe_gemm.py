"""H200 benchmark: MoE expert GEMMs, one grouped launch against a launch per expert product.

Cases are DeepSeek-V3's expert projections (`jfusedq.testing.EXPERTS`; gate/up: N = 2048,
K = 7168; down: N = 7168, K = 2048) over E experts with top-k routing:
  gathered  M tokens x k experts each (decode): B = M*k products, `ids` from the router
  dense     every expert on the same M tokens (B = E)
Implementations (activation already quantised, row scales):
  grouped   `grouped_fp8_matmul(..., implementation="triton")`: one launch, weights read in place
  pallas    the same on the Pallas kernel (one launch, experts read in place by `ids`); both
            kernels are captured in XLA's CUDA graph
  mapped    `jax.vmap(fp8_matmul)` over `weight[ids]` (Triton): a launch per product, the
            gather and the launcher's sequential vmap copying every product's weight
  xla       `grouped_fp8_matmul(..., implementation="xla")`: dequantise + dot per product
Bytes per call = the distinct experts' fp8 weights (U * N * K) + their scales + activations
and bf16 outputs; roofline = bytes / copy bandwidth measured in the same run. Weights are fresh
per call (a model reads each layer's experts once), so L2 does not serve them.

No cuBLAS column: PyTorch's grouped FP8 GEMM (`scaled_grouped_mm`) takes row-wise and MX
scales, not the 1x128 / 128x128 blocks (`benchmarks/_cublas.py --probe` tries one), and a loop
of per-expert `scaled_mm` calls pays a launch per expert that one grouped launch does not, so
it is no fair peer; fp8_matmul.py --prefill holds one expert's GEMM to cuBLAS.

Run: python benchmarks/moe_gemm.py [--ms 1 8] [--experts 16] [--topk 8] [--out DIR]
     [--commit SHA] [--impls grouped pallas ...] [--tag T] [--smoke]
--tag suffixes the results file (moe_gemm_<tag>.json).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness  # noqa: E402
from jfusedq import default_format, fp8_matmul, group_quant, grouped_fp8_matmul  # noqa: E402
from jfusedq.nn import quantize_weight  # noqa: E402
from jfusedq.testing import EDGE_PROJECTIONS, EXPERTS, rel_rms  # noqa: E402

NKS = tuple(EXPERTS.values())


def make_problem(m, n, k, e, topk, dense, seed):
  key = jax.random.key(seed)
  fmt = default_format()

  def make(count):
    sets = []
    for i in range(count):
      kw, kx, ki = jax.random.split(jax.random.fold_in(key, i), 3)
      qw, sw = jax.vmap(lambda w: quantize_weight(w, fmt))(
          jax.random.normal(kw, (e, n, k), jnp.float32))
      # Dense: one group of M rows for every expert; gathered: M groups of one row each.
      x = jax.random.normal(kx, (1, m, k) if dense else (m, 1, k), jnp.bfloat16)
      # Distinct experts per token, as top-k routing picks them.
      ids = None if dense else jax.vmap(lambda r: jax.random.permutation(r, e)[:topk])(
          jax.random.split(ki, m)).reshape(-1).astype(jnp.int32)
      sets.append((group_quant(x, fmt=fmt), qw, sw, ids))
    return sets
  return make


def mapped(qa, qw, sw, ids):
  b = qw.shape[0] if ids is None else ids.shape[0]
  g = qa.q.shape[0]
  w, s = (qw, sw) if ids is None else (qw[ids], sw[ids])
  rep = lambda t: jnp.repeat(t, b // g, axis=0)
  one = lambda q, sa, w, s: fp8_matmul(type(qa)(q, sa), w, s, implementation="triton")
  return jax.vmap(one)(rep(qa.q), rep(qa.scale), w, s)


IMPLS = {
    "grouped": lambda qa, qw, sw, ids: grouped_fp8_matmul(qa, qw, sw, ids,
                                                          implementation="triton"),
    "pallas": lambda qa, qw, sw, ids: grouped_fp8_matmul(qa, qw, sw, ids,
                                                         implementation="pallas"),
    "mapped": mapped,
    "xla": lambda qa, qw, sw, ids: grouped_fp8_matmul(qa, qw, sw, ids, implementation="xla"),
}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  ap.add_argument("--commit", default="unknown")
  ap.add_argument("--ms", nargs="+", type=int, default=[1, 8])
  ap.add_argument("--experts", type=int, default=16)
  ap.add_argument("--topk", type=int, default=8)
  ap.add_argument("--impls", nargs="+", default=None, choices=sorted(IMPLS),
                  help="columns to time (xla, the baseline, always runs first)")
  ap.add_argument("--tag", default="", help="results file moe_gemm_<tag>.json")
  ap.add_argument("--smoke", action="store_true", help="tiny shapes, XLA only, on CPU")
  args = ap.parse_args()
  impls = {i: IMPLS[i] for i in dict.fromkeys(["xla", *(args.impls or IMPLS)])}
  if args.smoke:
    nks, impls = (EDGE_PROJECTIONS["small"],), {"xla": IMPLS["xla"]}
  else:
    nks = NKS
  e, topk = args.experts, args.topk
  bw = _harness.copy_tbps(0.05 if args.smoke else 2.0)
  print(f"device {jax.devices()[0].device_kind}: copy {bw:.2f} TB/s")
  print(__doc__.split("\n\n")[1])
  rows = []
  print(f"{'case':>34} {'impl':>8} {'us':>9} {'wTB/s':>6} {'roof':>5} {'vs_xla':>6} ok")
  cases = [(m, n, k, dense) for n, k in nks for m in args.ms for dense in (False, True)]
  for seed, (m, n, k, dense) in enumerate(cases):
    make = make_problem(m, n, k, e, topk, dense, seed)
    qa, qw, sw, ids = make(1)[0]
    b = e if dense else m * topk
    unique = e if dense else len(np.unique(np.asarray(ids)))
    kb, nb = -(-k // 128), -(-n // 128)
    rows_per = m if dense else 1
    nbytes = (unique * (n * k + nb * kb * 4) + qa.q.size + qa.scale.size * 4
              + b * rows_per * n * 2)
    want = IMPLS["xla"](qa, qw, sw, ids)
    base, secs = None, []
    case = dict(M=m, N=n, K=k, E=e, topk=topk, mode="dense" if dense else "gathered")
    for impl, op in impls.items():
      ok = rel_rms(op(qa, qw, sw, ids), want) <= 2.0**-8
      t = _harness.measure(op, make, 4)
      sec = t["kernel_s"] or t["chain_s"]
      secs.append(sec)
      base = sec if impl == "xla" else base
      rows.append(dict(case=case, impl=impl, time_us=round(sec * 1e6, 3),
                       tbps=round(unique * n * k / sec / 1e12, 3), tflops=None,
                       roofline_frac=round(nbytes / (bw * 1e12) / sec, 3), vs_xla=None,
                       correct=bool(ok), kernels_per_call=t["kernels_per_call"],
                       top_kernels=t.get("top_kernels")))
    # From the unrounded times: on a loaded CPU (--smoke) a slope can round to 0 us.
    for row, sec in zip(rows[-len(impls):], secs, strict=True):
      row["vs_xla"] = round(base / sec, 3)
      print(f"{str(case):>34} {row['impl']:>8} {row['time_us']:9.2f} {row['tbps']:6.2f} "
            f"{row['roofline_frac']:5.2f} {row['vs_xla']:6.2f} "
            f"{'yes' if row['correct'] else 'CHECK FAILED'}", flush=True)
    _harness.write_results("moe_gemm" + (f"_{args.tag}" if args.tag else ""), rows,
                           {"copy_tbps": round(bw, 3)}, args.commit, args.out)


if __name__ == "__main__":
  main()
