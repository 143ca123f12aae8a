"""H200 benchmark: block-scaled W8A8 GEMM (DeepSeek format) against XLA's bf16 dot and XLA's
dequantise-then-dot, in one run.

Per call: FLOPs = 2*M*N*K. Bytes = N*K (fp8 weight) + ceil(N/128)*ceil(K/128)*4 (weight scales)
+ M*K (fp8 activation) + M*ceil(K/128)*4 (activation scales) + M*N*2 (bf16 output).
Roofline time = max(FLOPs / FP8 peak, bytes / copy bandwidth); the FP8 peak used is
2 x the bf16 dot rate measured in the same run (Hopper's FP8 tensor-core rate is twice bf16's).
"weight TB/s" = N*K / time, the decode figure of merit. For M <= 64, `same_size_frac` = time
of a copy moving the same bytes / time: the ceiling a kernel of that size can reach.

Implementations timed: `pallas` (input already quantised: the fused-norm handoff),
`pallas+quant` (bf16 input, quantised per call by group_quant), `xla_bf16` (bf16 x bf16 dot,
unquantised weight), `xla_dequant` (dequantise the fp8 weight to bf16, then the bf16 dot).

With --sweep, every case instead times the kernel of `--sweep-impl` (pallas, triton or
mosaic_gpu) under the candidate tilings of `sweep_configs` (input already quantised) and writes
fp8_matmul_sweep[_<impl>].json: the data the heuristics are set from. --nks picks shapes
(e.g. 12288x4096; default: the models' projections, `jfusedq.testing.PROJECTIONS`) and --tag
suffixes the results file (fp8_matmul[_sweep[_<impl>]]_<tag>.json).

Run: python benchmarks/fp8_matmul.py [--ms 1 4096 ...] [--nks NxK ...] [--extra triton mosaic_gpu]
     [--out DIR] [--commit SHA] [--tag T] [--smoke] [--sweep [--sweep-impl triton]]
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
from jfusedq import default_format, fp8_matmul, group_quant  # noqa: E402
from jfusedq.nn import quantize_weight  # noqa: E402
from jfusedq.ops.fp8_matmul import mosaic_gpu as mm_mosaic  # noqa: E402
from jfusedq.ops.fp8_matmul import pallas as mm_pallas  # noqa: E402
from jfusedq.ops.fp8_matmul import triton as mm_triton  # noqa: E402
from jfusedq.ops.fp8_matmul.reference import dequantize_weight  # noqa: E402
from jfusedq.ops._common import pow2_floor  # noqa: E402
from jfusedq.testing import (DECODE_TOKENS, EDGE_PROJECTIONS, PREFILL_TOKENS,  # noqa: E402
                             PROJECTIONS, rel_rms)

MS = DECODE_TOKENS + PREFILL_TOKENS
SWEEP_MS = (1, 64, 256, 4096)  # M = 16 tiles like M = 1 (block_m 16): ask for it with --ms
NKS = tuple(PROJECTIONS.values())


def bf16_tflops(n: int = 8192) -> float:
  def make(count):
    keys = jax.random.split(jax.random.key(0), 2 * count)
    return [(jax.random.normal(keys[2 * i], (n, n), jnp.bfloat16),
             jax.random.normal(keys[2 * i + 1], (n, n), jnp.bfloat16)) for i in range(count)]

  m = _harness.measure(lambda a, b: a @ b, make, 3)
  return 2 * n**3 / (m["kernel_s"] or m["chain_s"]) / 1e12


def make_problem(m, n, k, seed):
  key = jax.random.key(seed)

  def make(count):
    # A fresh weight per call, as in a model where every projection reads its own: one weight
    # shared by the chain would be served from L2 (50 MB on the H200) at the smaller shapes.
    sets = []
    for i in range(count):
      kw, kx = jax.random.split(jax.random.fold_in(key, i))
      w = jax.random.normal(kw, (n, k), jnp.float32)
      qw, sw = quantize_weight(w, _fmt())
      x = jax.random.normal(kx, (m, k), jnp.bfloat16)
      sets.append((x, group_quant(x, fmt=_fmt()), qw, sw, w.astype(jnp.bfloat16)))
    return sets
  return make


def _fmt():
  return default_format()


IMPLS = {
    "pallas": lambda x, qa, qw, sw, wb: fp8_matmul(qa, qw, sw, implementation="pallas"),
    "pallas+quant": lambda x, qa, qw, sw, wb: fp8_matmul(x, qw, sw, implementation="pallas"),
    "xla_bf16": lambda x, qa, qw, sw, wb: x @ wb.T,
    "xla_dequant": lambda x, qa, qw, sw, wb: x @ dequantize_weight(qw, sw).astype(jnp.bfloat16).T,
}
# Opt-in columns (--extra): the Triton-language kernel and the Hopper Mosaic GPU kernel.
EXTRA_IMPLS = {
    "triton": lambda x, qa, qw, sw, wb: fp8_matmul(qa, qw, sw, implementation="triton"),
    "mosaic_gpu": lambda x, qa, qw, sw, wb: fp8_matmul(qa, qw, sw, implementation="mosaic_gpu"),
}


HEURISTICS = {"pallas": mm_pallas.heuristics, "triton": mm_triton.heuristics,
              "mosaic_gpu": mm_mosaic.heuristics}


def sweep_configs(impl: str, m: int, n: int, k: int) -> list:
  """The heuristic's pick and its neighbours: tile width, K split, warps, stages."""
  h = HEURISTICS[impl](m, n, k)
  if impl == "mosaic_gpu":  # tile widths dividing N; 2 to 4 TMA stages (192 x 5 overflows SMEM)
    cands = [mm_mosaic.Config(bn, st) for bn in (64, 128, 192) if n % bn == 0
             for st in (2, 3, 4)]
    cands += [mm_mosaic.Config(h.block_n, st, persistent=True) for st in (3, 4)]
    return [h] + [c for c in cands if c != h]
  kb = -(-k // mm_pallas.BLOCK_K)
  if m <= 64:
    # Half the splits too: their f32 partials were the suspect for M = 64 taking 10-40% longer
    # than M = 1 on the H200; half the splits ran 4-25% slower there.
    cands = [mm_pallas.Config(h.block_m, bn, s, 4, 4) for bn in (32, 64, 128)
             for s in dict.fromkeys((max(1, h.k_splits // 2), h.k_splits,
                                     min(2 * h.k_splits, pow2_floor(kb))))]
    # One kernel with no f32 partials to reduce: narrow tiles for enough programs, deeper
    # pipelines for enough weight bytes in flight. 1.04-1.4x slower than the split at M = 1 on
    # the H200: the second kernel is not what small shapes lose.
    cands += [mm_pallas.Config(h.block_m, bn, 1, 4, st) for bn in (16, 32) for st in (4, 8)]
    # M = 64: two warp groups (4-38% slower on the H200) and other pipeline depths (-6% to
    # +26%).
    if m > 16:
      cands += [mm_pallas.Config(h.block_m, h.block_n, h.k_splits, w, st)
                for w in (4, 8) for st in (3, 5, 6)]
  elif impl == "pallas":
    cands = [mm_pallas.Config(bm, bn, 1, w, st)
             for bm, bn, w, st in ((64, 128, 4, 4), (128, 128, 4, 4), (128, 128, 8, 3),
                                   (128, 128, 8, 4), (256, 128, 8, 3))]
  else:  # Triton's wgmma tiles: one or two warp groups, 3 to 5 stages in flight
    cands = [mm_pallas.Config(bm, bn, 1, w, st)
             for bm, bn, w, st in ((64, 128, 4, 3), (64, 128, 4, 5), (128, 128, 4, 3),
                                   (128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 4, 4),
                                   (256, 128, 8, 3))]
  return [h] + [c for c in dict.fromkeys(cands) if c != h]


def run_sweep(impl, ms, nks, fp8_peak, bw, commit, out, tag=""):
  rows = []
  print(f"\nsweep ({impl}, quantised input): {'M':>5} {'N':>6} {'K':>6} {'us':>9} config")
  for seed, ((n, k), m) in enumerate((nk, m) for nk in nks for m in ms):
    make = make_problem(m, n, k, seed)
    x, qa, qw, sw, wb = make(1)[0]
    want = fp8_matmul(qa, qw, sw, implementation="xla")
    flops = 2 * m * n * k
    for cfg in sweep_configs(impl, m, n, k):
      op = lambda x, qa, qw, sw, wb, cfg=cfg: fp8_matmul(qa, qw, sw, implementation=impl,
                                                         config=cfg)
      ok = rel_rms(op(x, qa, qw, sw, wb), want) <= 2.0**-8
      # The slope (a second compile) only where no profiler trace gives kernel time: on CPU.
      t = _harness.measure(op, make, 4, chain=jax.devices()[0].platform == "cpu")
      sec = t["kernel_s"] or t["chain_s"]
      rows.append(dict(case=dict(M=m, N=n, K=k), impl=impl, time_us=round(sec * 1e6, 3),
                       tbps=round(n * k / sec / 1e12, 3), tflops=round(flops / sec / 1e12, 1),
                       roofline_frac=None, vs_xla=None, correct=bool(ok), config=str(cfg),
                       heuristic=cfg == HEURISTICS[impl](m, n, k),
                       top_kernels=t.get("top_kernels")))
      print(f"{m:>38} {n:>6} {k:>6} {sec * 1e6:9.2f} {cfg} {'' if ok else 'CHECK FAILED'}",
            flush=True)
    _harness.write_results("fp8_matmul_sweep" + ("" if impl == "pallas" else f"_{impl}")
                           + (f"_{tag}" if tag else ""), rows,
                           {"copy_tbps": round(bw, 3), "fp8_peak_tflops": round(fp8_peak, 1)},
                           commit, out)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  ap.add_argument("--commit", default="unknown")
  ap.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script on CPU")
  ap.add_argument("--sweep", action="store_true", help="only the tiling sweep (see docstring)")
  ap.add_argument("--sweep-impl", default="pallas", choices=sorted(HEURISTICS))
  ap.add_argument("--ms", nargs="+", type=int, default=None,
                  help=f"default {MS}; with --sweep {SWEEP_MS}")
  ap.add_argument("--nks", nargs="+", default=None, help="N x K shapes, e.g. 12288x4096")
  ap.add_argument("--tag", default="", help="results file fp8_matmul_<tag>.json")
  ap.add_argument("--extra", nargs="*", default=[], choices=sorted(EXTRA_IMPLS),
                  help="also time these implementations")
  ap.add_argument("--impls", nargs="+", default=None, choices=sorted({**IMPLS, **EXTRA_IMPLS}),
                  help="time only these (xla_bf16, the ratios' base, is always timed)")
  args = ap.parse_args()
  nks = tuple(tuple(int(d) for d in nk.split("x")) for nk in args.nks) if args.nks else NKS
  ms, nks = ((1, 16), (EDGE_PROJECTIONS["small"],)) if args.smoke else (args.ms or MS, nks)
  name = "fp8_matmul" + (f"_{args.tag}" if args.tag else "")
  impls = dict(IMPLS, **{extra: EXTRA_IMPLS[extra] for extra in args.extra})
  if args.impls:
    every = {**IMPLS, **EXTRA_IMPLS}
    impls = {i: every[i] for i in dict.fromkeys(["xla_bf16", *args.impls])}

  bw = _harness.copy_tbps(0.05 if args.smoke else 2.0)
  bf16 = bf16_tflops(256 if args.smoke else 8192)
  fp8_peak = 2 * bf16
  print(f"device {jax.devices()[0].device_kind}: copy {bw:.2f} TB/s, bf16 dot {bf16:.0f} TFLOP/s,"
        f" FP8 peak taken as {fp8_peak:.0f} TFLOP/s")
  if args.sweep:
    return run_sweep(args.sweep_impl, (1,) if args.smoke else args.ms or SWEEP_MS, nks,
                     fp8_peak, bw, args.commit, args.out, args.tag)
  print(__doc__.split("\n\n")[1])
  rows = []
  print(f"{'M':>5} {'N':>6} {'K':>6} {'impl':>13} {'us':>9} {'TFLOP/s':>8} {'wTB/s':>6} "
        f"{'roof':>5} {'vs_bf16':>7} config / ok")
  for seed, ((n, k), m) in enumerate((nk, m) for nk in nks for m in ms):
    make = make_problem(m, n, k, seed)
    x, qa, qw, sw, wb = make(1)[0]
    want = fp8_matmul(qa, qw, sw, implementation="xla")
    ok = {impl: rel_rms(fp8_matmul(qa, qw, sw, implementation=impl), want) <= 2.0**-8
          for impl in {i.split("+")[0] for i in impls} - {"xla_bf16", "xla_dequant"}}
    flops = 2 * m * n * k
    kb = -(-k // 128)
    nbytes = n * k + (-(-n // 128)) * kb * 4 + m * k + m * kb * 4 + m * n * 2
    floor = max(flops / (fp8_peak * 1e12), nbytes / (bw * 1e12))
    # The same bytes copied: the ceiling of a kernel this size (launch and tail included).
    same = _harness.copy_seconds(nbytes) if m <= 64 else None
    configs = {impl: str(h(m, n, k)) for impl, h in HEURISTICS.items()}
    # Few calls per jit: each Pallas call in it is compiled separately (seconds per case).
    n_calls = 4
    base, secs = None, []
    for impl, op in impls.items():
      t = _harness.measure(op, make, n_calls)
      sec = t["kernel_s"] or t["chain_s"]
      secs.append(sec)
      if impl == "xla_bf16":
        base = sec
      rows.append(dict(case=dict(M=m, N=n, K=k), impl=impl, time_us=round(sec * 1e6, 3),
                       tbps=round(n * k / sec / 1e12, 3), tflops=round(flops / sec / 1e12, 1),
                       roofline_frac=round(floor / sec, 3), vs_xla=None,
                       same_size_frac=same and round(same / sec, 3),
                       correct=bool(ok.get(impl.split("+")[0], True)),
                       config=configs.get(impl.split("+")[0]),
                       chain_us=round(t["chain_s"] * 1e6, 3) if t["chain_s"] else None,
                       kernels_per_call=t["kernels_per_call"],
                       top_kernels=t.get("top_kernels")))
    # From the unrounded times: on a loaded CPU (--smoke) a slope can round to 0 us.
    for row, sec in zip(rows[-len(impls):], secs, strict=True):
      row["vs_xla"] = round(base / sec, 3)
      print(f"{m:>5} {n:>6} {k:>6} {row['impl']:>13} {row['time_us']:9.2f} {row['tflops']:8.1f} "
            f"{row['tbps']:6.2f} {row['roofline_frac']:5.2f} {row['vs_xla']:7.2f} "
            f"{row['config'] or ''} {'' if row['correct'] else 'CHECK FAILED'}", flush=True)
    _harness.write_results(name, rows,
                           {"copy_tbps": round(bw, 3), "bf16_tflops": round(bf16, 1)},
                           args.commit, args.out)


if __name__ == "__main__":
  main()
