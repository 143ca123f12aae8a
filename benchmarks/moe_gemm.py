"""H200 benchmark: MoE expert GEMMs at the released models' expert counts (`jf.ragged_fp8_matmul`).

Cases: DeepSeek-V3's experts (E = 256, top 8; `up`: gate or up projection, N = 2048, K = 7168;
`down`: N = 7168, K = 2048) and Qwen3.5-397B's (E = 512, top 10; N, K = 1024, 4096 and 4096,
1024), over T tokens routed top-k to distinct experts, `uniform`ly or `skewed` (eight experts
favoured, so a few take most pairs). `up` reads each sorted (token, expert) pair's token row
in place (`rows`); `down` reads the T * k sorted rows as they are; `gate_up` is the experts'
first half as the models run it (`jf.ragged_swiglu`: gate and up products of the same rows,
DeepSeek-V3's activation, the hidden quantised for `down`; N, K as `up`'s). Activations come
quantised, their scales in the layout the norm hands over for their row count.
Implementations:
  default   `ragged_fp8_matmul` / `ragged_swiglu` as a user calls it (Triton on a GPU)
  triton    the same, named
  mosaic_gpu  the Mosaic GPU kernel (Hopper; `up` and `gate_up` gather their rows in XLA first;
            `gate_up` its gate and up pair, the activation and its quantisation in the
            epilogue)
  xla       the XLA loop over filled row tiles (timed up to --xla-max tokens; the reference
            every row is checked against at every size)
  gathered  `grouped_fp8_matmul` with a product per pair (the decode path, up to 64 tokens)
  unfused   `gate_up` as separate steps: two Triton ragged products, the activation and
            `group_quant` in XLA
  --tiles BM,BN,WARPS,STAGES[,SPLITS] ...: the Triton kernel at each of these tilings
            besides (impl "triton BMxBN/WARPS/STAGES", "/kSPLITS" added with a K split; gate_up
            takes BN = 128 and no split only), to set
            `triton.heuristics`; entries mosaic:BN,CHUNKS,STAGES[,BAND] the Mosaic GPU kernel,
            persistent (impl "mosaic_gpu BN/CHUNKSc/STAGESs/bBAND"; gate_up takes BN = 128,
            one chunk), to set `mosaic_gpu.heuristics`
Routed FLOPs = 2 T k N K (twice that for gate_up); bytes = the distinct experts' fp8 weights
and scales + activation in + bf16 out (gate_up: fp8 codes and scales out); roofline_frac =
max(FLOPs / FP8 peak, bytes / copy bandwidth) / time, FP8 peak taken as twice XLA's bf16 dot
measured in the same run. Weights are fresh per call (a model reads each layer's experts
once), so L2 does not serve them.

No cuBLAS column: PyTorch's grouped FP8 GEMM (`scaled_grouped_mm`) takes row-wise and MX
scales, not the 1x128 / 128x128 blocks, and a loop of per-expert `scaled_mm` calls pays a
launch per expert; fp8_matmul.py --prefill holds one expert's GEMM to cuBLAS.

Run: python benchmarks/moe_gemm.py [--models deepseek-v3 qwen3.5] [--tokens 1 16 ...]
     [--routings uniform skewed] [--projs up down] [--out DIR] [--commit SHA] [--smoke]
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
from jfusedq import (QuantizedActivation, default_format, group_quant,  # noqa: E402
                     grouped_fp8_matmul, ragged_fp8_matmul, ragged_swiglu)
from jfusedq.nn import quantize_weight  # noqa: E402
from jfusedq.ops.fp8_matmul import Config, scale_layout  # noqa: E402
from jfusedq.ops.fp8_matmul.mosaic_gpu import Config as MosaicConfig  # noqa: E402
from jfusedq.ops.ragged_fp8_matmul.reference import swiglu  # noqa: E402
from jfusedq.testing import rel_rms  # noqa: E402
from models import cost  # noqa: E402
from models import run as runner  # noqa: E402

# name -> (experts, top-k, {projection: (N, K)})
MODELS = {
    "deepseek-v3": (256, 8, {"up": (2048, 7168), "down": (7168, 2048),
                             "gate_up": (2048, 7168)}),
    "qwen3.5": (512, 10, {"up": (1024, 4096), "down": (4096, 1024), "gate_up": (1024, 4096)}),
}
SMOKE_MODELS = {"smoke": (16, 2, {"up": (256, 384), "down": (384, 256), "gate_up": (256, 384)})}
TOKENS = (1, 16, 64, 256, 1024, 4096, 16384)
# The hidden against the XLA path's: the products' f32 sums in another order move a bf16
# rounding of g or u now and then, and with it an FP8 code by a step (2**-4 of that value);
# tests/ops measure under 1%. A wrong block, expert or row is O(1).
TOL_HIDDEN = 2e-2


def route(key, t, e, topk, skewed):
  """idx `[T, k]`: distinct experts per token, by Gumbel top-k over flat (or skewed) logits."""
  logits = jax.random.gumbel(key, (t, e))
  if skewed:
    logits = logits + jnp.where(jnp.arange(e) < 8, 4.0, 0.0)
  return jax.lax.top_k(logits, topk)[1].astype(jnp.int32)


def make_problem(t, e, topk, n, k, proj, skewed, seed):
  fmt = default_format()

  def make(count):
    sets = []
    for i in range(count):
      kw, kx, kr = jax.random.split(jax.random.fold_in(jax.random.key(seed), i), 3)
      # One expert at a time: the whole [E, N, K] in f32 with its quantisation temporaries
      # passed an H100's 80 GB at DeepSeek-V3's 256 experts.
      weights = lambda key: jax.lax.map(lambda i: quantize_weight(
          jax.random.normal(jax.random.fold_in(key, i), (n, k), jnp.float32), fmt),
          jnp.arange(e))
      qw, sw = weights(kw)
      if proj == "gate_up":  # (gate, up) pairs
        qu, su = weights(jax.random.fold_in(kw, e))
        qw, sw = (qw, qu), (sw, su)
      idx = route(kr, t, e, topk, skewed)
      flat = idx.reshape(-1)
      order = jnp.argsort(flat, stable=True)
      sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
      rows_in = t * topk if proj == "down" else t
      x = jax.random.normal(kx, (rows_in, k), jnp.bfloat16)
      qa = group_quant(x, fmt=fmt, layout=scale_layout(rows_in))
      rows = None if proj == "down" else (order // topk).astype(jnp.int32)
      sets.append((qa, qw, sw, sizes, rows, idx))
    return sets
  return make


def gathered(qa, qw, sw, sizes, rows, idx):
  """The decode path: a product per (token, expert) pair, pairs in sorted order."""
  del sizes
  flat = idx.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  q = qa.with_layout("row")
  if rows is None:  # down: sorted row r is its own group
    a = QuantizedActivation(q.q[:, None], q.scale[:, None])
    return grouped_fp8_matmul(a, qw, sw, flat[order], implementation="triton")[:, 0]
  a = QuantizedActivation(q.q[:, None], q.scale[:, None])  # [T, 1, K]: token t's k products
  out = grouped_fp8_matmul(a, qw, sw, flat, implementation="triton")[:, 0]  # pair order
  return out[order]


IMPLS = {
    "default": lambda qa, qw, sw, sizes, rows, idx: ragged_fp8_matmul(qa, qw, sw, sizes,
                                                                      rows=rows),
    "triton": lambda qa, qw, sw, sizes, rows, idx: ragged_fp8_matmul(
        qa, qw, sw, sizes, rows=rows, implementation="triton"),
    "mosaic_gpu": lambda qa, qw, sw, sizes, rows, idx: ragged_fp8_matmul(
        qa, qw, sw, sizes, rows=rows, implementation="mosaic_gpu"),
    "xla": lambda qa, qw, sw, sizes, rows, idx: ragged_fp8_matmul(
        qa, qw, sw, sizes, rows=rows, implementation="xla"),
    "gathered": gathered,
}


def hidden(impl, config=None):
  """`gate_up` by `ragged_swiglu` on `impl` (at `config`): the hidden's (codes, scales)."""
  def run(qa, qw, sw, sizes, rows, idx):
    h = ragged_swiglu(qa, qw[0], sw[0], qw[1], sw[1], sizes, rows=rows, config=config,
                      implementation=impl)
    return h.q, h.scale
  return run


def product(config, impl="triton"):
  """`up` / `down` by the `impl` ragged kernel at `config`."""
  return lambda qa, qw, sw, sizes, rows, idx: ragged_fp8_matmul(
      qa, qw, sw, sizes, rows=rows, config=config, implementation=impl)


def unfused(qa, qw, sw, sizes, rows, idx):
  """`gate_up` as the steps it fuses: two ragged products, the activation, `group_quant`."""
  g, u = (ragged_fp8_matmul(qa, w, s, sizes, rows=rows, implementation="triton")
          for w, s in zip(qw, sw))
  h = group_quant(swiglu(g, u, "silu_mul", jnp.bfloat16), fmt=default_format(),
                  layout="row")
  return h.q, h.scale


SWIGLU_IMPLS = {"default": hidden(None), "triton": hidden("triton"),
                "mosaic_gpu": hidden("mosaic_gpu"), "xla": hidden("xla"), "unfused": unfused}


def tiled(proj: str, tiles: list[str]) -> dict:
  """{"triton BMxBN/WARPS/STAGES[/kSPLITS]" or "mosaic_gpu BN/Cc/Ss/bB": op} for each --tiles
  entry `proj` can take."""
  ops = {}
  for spec in tiles:
    if spec.startswith("mosaic:"):
      bn, chunks, stages, band = (list(map(int, spec[len("mosaic:"):].split(","))) + [16])[:4]
      if proj == "gate_up" and (bn != 128 or chunks != 1):
        continue
      cfg = MosaicConfig(bn, stages=stages, persistent=True, chunks=chunks, band=band)
      ops[f"mosaic_gpu {bn}/{chunks}c/{stages}s/b{band}"] = (
          hidden("mosaic_gpu", cfg) if proj == "gate_up" else product(cfg, "mosaic_gpu"))
      continue
    bm, bn, warps, stages, splits = (list(map(int, spec.split(","))) + [1])[:5]
    if proj == "gate_up" and (bn != 128 or splits != 1):
      continue
    cfg = Config(bm, bn, splits, num_warps=warps, num_stages=stages)
    name = f"triton {bm}x{bn}/{warps}/{stages}" + (f"/k{splits}" if splits > 1 else "")
    ops[name] = hidden("triton", cfg) if proj == "gate_up" else product(cfg)
  return ops


def dequantized(out):
  """A gate_up output (codes, scales) as f32 values; other outputs as they are."""
  if isinstance(out, tuple):
    return QuantizedActivation(*out).dequantize(jnp.float32)
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  ap.add_argument("--commit", default="unknown")
  ap.add_argument("--models", nargs="+", default=list(MODELS), choices=sorted(MODELS))
  ap.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
  ap.add_argument("--routings", nargs="+", default=["uniform", "skewed"],
                  choices=["uniform", "skewed"])
  ap.add_argument("--projs", nargs="+", default=["up", "down", "gate_up"],
                  choices=["up", "down", "gate_up"])
  ap.add_argument("--impls", nargs="+", default=list(IMPLS) + ["unfused"],
                  choices=sorted(set(IMPLS) | set(SWIGLU_IMPLS)))
  ap.add_argument("--tiles", nargs="*", default=[], metavar="BM,BN,WARPS,STAGES[,SPLITS]",
                  help="Triton (and mosaic:BN,CHUNKS,STAGES[,BAND] Mosaic GPU) tilings timed "
                  "besides the heuristic's")
  ap.add_argument("--xla-max", type=int, default=1024, help="time the XLA path up to T tokens")
  ap.add_argument("--calls", type=int, default=3, help="distinct input sets per timed jit")
  ap.add_argument("--tag", default="", help="results file moe_gemm_<tag>.json")
  ap.add_argument("--smoke", action="store_true", help="tiny shapes, XLA only, on CPU")
  args = ap.parse_args()
  models = SMOKE_MODELS if args.smoke else {m: MODELS[m] for m in args.models}
  impls = ["xla"] if args.smoke else args.impls
  tokens = [1, 3] if args.smoke else args.tokens
  bw = runner.copy_tbps(0.05 if args.smoke else 2.0)
  bf16 = runner.bf16_tflops(256 if args.smoke else 8192)
  peak = cost.FP8_PER_BF16 * bf16
  print(f"device {jax.devices()[0].device_kind}: copy {bw:.2f} TB/s, FP8 peak {peak:.0f} "
        f"TFLOP/s (2x bf16)")
  rows = []
  print(f"{'case':>62} {'impl':>8} {'us':>9} {'TFLOP/s':>7} {'roof':>5} ok")
  seed = 0
  for model, (e, topk, projs) in models.items():
    for proj in args.projs:
      n, k = projs[proj]
      for t in tokens:
        for routing in args.routings:
          seed += 1
          make = make_problem(t, e, topk, n, k, proj, routing == "skewed", seed)
          problem = make(1)[0]
          qa, qw, sw, sizes, rws, idx = problem
          ops = SWIGLU_IMPLS if proj == "gate_up" else IMPLS
          want = dequantized(ops["xla"](*problem))
          unique = int(np.count_nonzero(np.asarray(sizes)))
          m = t * topk
          weights = 2 if proj == "gate_up" else 1
          flops = 2 * m * n * k * weights
          out_bytes = m * (n + -(-n // 128) * 4) if proj == "gate_up" else m * n * 2
          nbytes = weights * unique * (n * k + -(-n // 128) * -(-k // 128) * 4) + \
              qa.q.size + qa.scale.size * 4 + out_bytes
          case = dict(model=model, proj=proj, T=t, E=e, topk=topk, N=n, K=k, routing=routing,
                      experts_touched=unique)
          ops = dict(ops, **tiled(proj, args.tiles))
          for impl in impls + [i for i in ops if i.startswith(("triton ", "mosaic_gpu "))]:
            if (impl not in ops or impl == "xla" and t > args.xla_max
                or impl == "gathered" and t > 64):
              continue
            op = ops[impl]
            try:
              err = rel_rms(dequantized(op(*problem)), want)
            except Exception as exc:  # noqa: BLE001  (one implementation's failure: no row)
              print(f"{impl} failed, no row: {type(exc).__name__}: {str(exc)[:500]}",
                    flush=True)
              continue
            tol = TOL_HIDDEN if proj == "gate_up" else 2.0**-8
            t_ = _harness.measure(op, make, args.calls, chain=args.smoke)
            sec = t_["kernel_s"] or t_["chain_s"]
            rows.append(dict(
                case=case, impl=impl, time_us=round(sec * 1e6, 3),
                tflops=round(flops / sec / 1e12, 1), tbps=round(nbytes / sec / 1e12, 3),
                roofline_frac=round(max(flops / (peak * 1e12), nbytes / (bw * 1e12)) / sec, 3),
                rel_rms=float(f"{err:.3g}"), correct=bool(err <= tol),
                kernels_per_call=t_["kernels_per_call"], top_kernels=t_.get("top_kernels")))
            r = rows[-1]
            print(f"{str({kk: case[kk] for kk in ('model', 'proj', 'T', 'routing')}):>62} "
                  f"{impl:>8} {r['time_us']:9.2f} {r['tflops']:7.1f} {r['roofline_frac']:5.2f} "
                  f"{'yes' if r['correct'] else 'CHECK FAILED'}", flush=True)
          _harness.write_results("moe_gemm" + (f"_{args.tag}" if args.tag else ""), rows,
                                 {"copy_tbps": round(bw, 3), "bf16_tflops": round(bf16, 1)},
                                 args.commit, args.out)


if __name__ == "__main__":
  main()
