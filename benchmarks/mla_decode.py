"""H200 benchmark: MLA decode over the latent cache (`jf.mla_decode`), DeepSeek-V3's widths.

Cases: B tokens (one new token each) at position `context` - 1 of a cache of `context` slots,
NH query heads (128: one device; 16: one of 8 tensor-parallel devices), latent L = 512, rope
R = 64, the cache as the model stores it: `fp8` (e4m3 codes + one f32 scale a 1 x 128 group)
or `bf16` (a bf16 kv_b_proj). Implementations:
  triton    the kernel at its heuristic's config; with --sweep also its neighbours (slots a
            step, heads a program, warps), with --vary FIELD=V1,V2 the pick with that Config
            field changed, or F1:F2=A1:A2,B1:B2 two fields together (a tiling the device
            cannot build is named and skipped), `config` naming each
  xla       the f32 reference (every slot scored, the cache dequantised to f32): the peer, and
            what each row is checked against
bytes = the cache's visible slots (codes, scales, rope keys) + queries + the f32 output;
FLOPs = 2 B NH slots (2 L + R). roofline_frac = max(bytes / copy bandwidth, FLOPs / bf16
peak) / time, both measured in the run. The cache is fresh per call (a step reads each layer's
cache once), so L2 does not serve it across calls.

Run: python benchmarks/mla_decode.py [--contexts 256 4096 32768] [--batches 1 16]
     [--heads 128 16] [--caches fp8 bf16] [--sweep | --vary num_stages=3,4 ...] [--out DIR]
     [--commit SHA] [--smoke]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness  # noqa: E402
from jfusedq import default_format, group_quant, mla_decode  # noqa: E402
from jfusedq.ops.mla_decode import triton as mla_triton  # noqa: E402
from jfusedq.testing import rel_rms  # noqa: E402
from models import run as runner  # noqa: E402

L, R = 512, 64
# The kernel's test tolerance (tests/ops/test_mla_decode.py): bf16 probabilities and latent.
TOL = 2.0**-8


def make_problem(b, nh, s, cache, seed):
  def make(count):
    sets = []
    for i in range(count):
      k = jax.random.split(jax.random.fold_in(jax.random.key(seed), i), 4)
      q_lat = jax.random.normal(k[0], (b, 1, nh, L), jnp.bfloat16)
      q_pe = jax.random.normal(k[1], (b, 1, nh, R), jnp.bfloat16)
      lat = jax.random.normal(k[2], (b, s, L), jnp.bfloat16)
      k_pe = jax.random.normal(k[3], (b, s, R), jnp.bfloat16)
      if cache == "fp8":
        qa = group_quant(lat, fmt=default_format())
        sets.append((q_lat, q_pe, qa.q, qa.scale, k_pe))
      else:
        sets.append((q_lat, q_pe, lat, None, k_pe))
    return sets
  return make


# The sweep's tilings besides the pick: (block_h, block_s, num_warps, flat); each runs at the
# splits that give it about two programs an SM, at half and at twice those (a program loads its
# heads' queries once: fewer splits read them fewer times).
SWEEP = [(16, 32, 4, False), (32, 32, 4, False), (16, 32, 4, True), (32, 32, 4, True),
         (64, 16, 8, True), (64, 32, 8, True), (64, 64, 8, True)]


def configs(b, nh, s, sweep, vary=None):
  """(name, config) pairs: the heuristic's pick, and with `sweep` the SWEEP tilings, or with
  `vary` ({fields: [values]}) the pick with those fields changed, one entry at a time."""
  h = mla_triton.heuristics(b, nh, s)
  out = [("heuristic", h)]
  if vary:
    for fields, values in vary.items():
      for v in values:
        cfg = dataclasses.replace(h, **dict(zip(fields, v, strict=True)))
        if cfg != h:
          out.append((str(cfg), cfg))
  elif sweep:
    for bh, bs, w, flat in SWEEP:
      if bh > max(16, nh):
        continue
      base = mla_triton.splits(b, nh, s, bh)
      for sp in dict.fromkeys((max(1, base // 2), base, min(2 * base, -(-s // bs)))):
        cfg = mla_triton.Config(block_h=bh, block_s=bs, num_warps=w, splits=sp, flat=flat)
        if cfg != h:
          out.append((str(cfg), cfg))
  return out


def _value(text: str):
  """A --vary value: an int, a bool, or the text itself."""
  if text in ("True", "False"):
    return text == "True"
  return int(text) if text.lstrip("-").isdigit() else text


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  ap.add_argument("--commit", default="unknown")
  ap.add_argument("--contexts", nargs="+", type=int, default=[256, 4096, 32768])
  ap.add_argument("--batches", nargs="+", type=int, default=[1, 16])
  ap.add_argument("--heads", nargs="+", type=int, default=[128, 16])
  ap.add_argument("--caches", nargs="+", default=["fp8", "bf16"], choices=["fp8", "bf16"])
  ap.add_argument("--sweep", action="store_true", help="the kernel's configs around the pick")
  ap.add_argument("--vary", nargs="+", default=[], metavar="FIELD=V1,V2",
                  help="the pick with one Config field changed, e.g. num_stages=3,4, or "
                  "several together, e.g. block_s:num_stages=32:3,32:4")
  ap.add_argument("--calls", type=int, default=4, help="distinct input sets per timed jit")
  ap.add_argument("--tag", default="", help="results file mla_decode_<tag>.json")
  ap.add_argument("--smoke", action="store_true", help="tiny shapes, XLA only, on CPU")
  args = ap.parse_args()
  # FIELD=V1,V2 changes one field; F1:F2=A1:A2,B1:B2 changes fields together (e.g.
  # block_s:num_stages=32:3: a deeper pipeline where a wider step's stages would not fit).
  vary = {tuple(f.split(":")): [tuple(_value(v) for v in x.split(":")) for x in vs.split(",")]
          for f, vs in (item.split("=", 1) for item in args.vary)}
  contexts, batches, heads = ([40], [1], [4]) if args.smoke else (args.contexts, args.batches,
                                                                 args.heads)
  bw = runner.copy_tbps(0.05 if args.smoke else 2.0)
  peak = runner.bf16_tflops(256 if args.smoke else 8192)
  print(f"device {jax.devices()[0].device_kind}: copy {bw:.2f} TB/s, bf16 {peak:.0f} TFLOP/s")
  print(f"{'case':>58} {'impl':>30} {'us':>9} {'TB/s':>6} {'roof':>5} ok")
  rows, seed = [], 0
  for cache in args.caches:
    for nh in heads:
      for b in batches:
        for s in contexts:
          seed += 1
          make = make_problem(b, nh, s, cache, seed)
          problem = make(1)[0]
          pos = s - 1
          want = mla_decode(*problem, pos=pos, scale=0.1, implementation="xla")
          code = 1 if cache == "fp8" else 2
          nbytes = b * s * (L * code + (L // 128 * 4 if cache == "fp8" else 0) + R * 2) + \
              b * nh * (L + R) * 2 + b * nh * L * 4
          flops = 2 * b * nh * s * (2 * L + R)
          case = dict(cache=cache, heads=nh, batch=b, context=s)
          runs = [] if args.smoke else [("triton", n, c) for n, c in configs(b, nh, s,
                                                                              args.sweep,
                                                                              vary)]
          for impl, name, cfg in [*runs, ("xla", None, None)]:
            op = lambda *a, impl=impl, cfg=cfg: mla_decode(*a, pos=pos, scale=0.1,
                                                          implementation=impl, config=cfg)
            try:
              err = rel_rms(op(*problem), want)
            except jax.errors.JaxRuntimeError as e:
              if name in (None, "heuristic"):
                raise
              # A swept tiling the device cannot run (shared memory): named, and the sweep
              # goes on.
              print(f"{str(case):>58} {name:>30} not run: {str(e).splitlines()[0][:120]}",
                    flush=True)
              continue
            t = _harness.measure(op, make, args.calls, chain=args.smoke)
            sec = t["kernel_s"] or t["chain_s"]
            rows.append(dict(
                case=case, impl=impl, config=impl if cfg is None else str(cfg),
                heuristic=name == "heuristic", time_us=round(sec * 1e6, 3),
                tbps=round(nbytes / sec / 1e12, 3), tflops=round(flops / sec / 1e12, 1),
                roofline_frac=round(max(nbytes / (bw * 1e12), flops / (peak * 1e12)) / sec, 3),
                rel_rms=float(f"{err:.3g}"), correct=bool(err <= TOL),
                kernels_per_call=t["kernels_per_call"], top_kernels=t.get("top_kernels")))
            r = rows[-1]
            label = impl if name in (None, "heuristic") else name
            print(f"{str(case):>58} {label:>30} {r['time_us']:9.2f} {r['tbps']:6.2f} "
                  f"{r['roofline_frac']:5.2f} {'yes' if r['correct'] else 'CHECK FAILED'}",
                  flush=True)
          _harness.write_results("mla_decode" + (f"_{args.tag}" if args.tag else ""), rows,
                                 {"copy_tbps": round(bw, 3), "bf16_tflops": round(peak, 1)},
                                 args.commit, args.out)


if __name__ == "__main__":
  main()
