"""H200 benchmark: block-scaled W8A8 GEMM (DeepSeek format) against XLA's bf16 dot, XLA's
dequantise-then-dot and cuBLAS's blockwise FP8 GEMM, in one run.

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
fp8_matmul_sweep[_<impl>].json: the data the heuristics are set from (--sweep-vary FIELD ...:
only the configs that differ from the heuristic's pick in those fields; --merge FILE keeps
FILE's rows of the other configs and cases). --nks picks shapes
(e.g. 12288x4096; default: the models' projections, `jfusedq.testing.PROJECTIONS`) and --tag
suffixes the results file (fp8_matmul[_sweep[_<impl>]]_<tag>.json).

The peer: cuBLAS's blockwise FP8 GEMM (PyTorch's `scaled_mm`, 1x128 activation and 128x128
weight scales: exactly this format), `_cublas.py` in its own process (two profilers never share
one) on the first input set of every case, written to a temporary folder as codes and scales.
Its float32 output (every `sample_step`-th row) is checked against reference.py within 2^-8.
--cublas adds its row (`cublas_blockwise`) to the cases above.

With --prefill, the prefill comparison instead, written to fp8_matmul_prefill.json: M in
PREFILL_MS over the projections and the MoE experts' shapes (`jfusedq.testing.EXPERTS`), rows
`cublas_blockwise`, `xla_bf16` (XLA's bf16 dot of the dequantised operands: the product without
FP8), `default` (`jf.fp8_matmul` as a user calls it; `pick`: the implementation whose kernels it
ran) and one per implementation (`mosaic_gpu`, `triton`, `pallas`, `xla`; one that declines the
call gives no row). `vs_xla` and `vs_cublas` are speed-ups over XLA bf16 and cuBLAS. Checks,
on sampled rows: every row against reference.py in float32 (`err_vs_reference`, within 2^-8),
ours against cuBLAS's float32 output (`err_vs_cublas`: bf16 rounding alone, within 2^-8), and
the default with a float32 output against cuBLAS's within 1e-4 (two bf16 roundings, 2^-7, if
cuBLAS gave bf16). `time_us` is the mean kernel time per call on both sides; cuBLAS's rows add
the median and p10 / p90 per call. Ours take 2-4 input sets a jit (`prefill_calls`), cuBLAS 8-32
copies (`torch_calls`). --budget-s bounds the timing loop (M outermost: a run cut short loses
the last M); --peer-timeout the torch process. --merge FILE carries FILE's rows for what
this run does not measure (a comparison run in parts, e.g. --ms 256 1024 then --ms 4096 16384).

Run: python benchmarks/fp8_matmul.py [--ms 1 4096 ...] [--nks NxK ...] [--extra triton mosaic_gpu]
     [--out DIR] [--commit SHA] [--tag T] [--smoke] [--sweep [--sweep-impl triton]] [--cublas]
     python benchmarks/fp8_matmul.py --prefill [--impls ...] [--budget-s S] [--out DIR]
     python benchmarks/_cublas.py --probe   (torch's API and small checked calls, in seconds)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness  # noqa: E402
from jfusedq import Unsupported, _target, default_format, fp8_matmul, group_quant  # noqa: E402
from jfusedq.nn import quantize_weight  # noqa: E402
from jfusedq.ops.fp8_matmul import mosaic_gpu as mm_mosaic  # noqa: E402
from jfusedq.ops.fp8_matmul import scale_layout  # noqa: E402
from jfusedq.ops.fp8_matmul import pallas as mm_pallas  # noqa: E402
from jfusedq.ops.fp8_matmul import triton as mm_triton  # noqa: E402
from jfusedq.ops.fp8_matmul.reference import dequantize_weight  # noqa: E402
from jfusedq.ops._common import pow2_floor  # noqa: E402
from jfusedq.testing import (DECODE_TOKENS, EDGE_PROJECTIONS, EXPERTS,  # noqa: E402
                             PREFILL_TOKENS, PROJECTIONS, rel_rms)
from models import cost  # noqa: E402
from models import run as runner  # noqa: E402

MS = DECODE_TOKENS + PREFILL_TOKENS
SWEEP_MS = (1, 64, 256, 4096)  # M = 16 tiles like M = 1 (block_m 16): ask for it with --ms
NKS = tuple(PROJECTIONS.values())
# --prefill: a short prompt's tokens to a long one's, the dense projections and the experts'.
# Run in this order (M outermost), so that a run cut short by --budget-s keeps M = 4096 and 256.
PREFILL_MS = (4096, 256, 1024, 16384)
PREFILL_NKS = NKS + tuple(EXPERTS.values())
CUBLAS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_cublas.py")
# The GEMMs' gate against the reference (bf16 outputs), and the cross-check of two float32
# outputs of the same block-scaled product (cuBLAS's and the default's).
TOL, TOL_F32 = 2.0**-8, 1e-4
# Two bf16 outputs of one product: each rounding is within 2^-8 of its float32 value.
TOL_BF16_PAIR = 2.0**-7


def roofline(m: int, n: int, k: int, fp8_peak: float, bw: float) -> tuple[int, int, float]:
  """(FLOPs, bytes, roofline seconds) of one call (module docstring); peak in TFLOP/s, bw in
  TB/s."""
  flops = 2 * m * n * k
  kb = -(-k // 128)
  nbytes = n * k + (-(-n // 128)) * kb * 4 + m * k + m * kb * 4 + m * n * 2
  return flops, nbytes, max(flops / (fp8_peak * 1e12), nbytes / (bw * 1e12))


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
      # Inputs from XLA's quantiser (each new shape costs an XLA compile, not a Triton
      # kernel's), their scales in the layout the fused norm hands this M.
      qa = group_quant(x, fmt=_fmt(), layout=scale_layout(m), implementation="xla")
      sets.append((x, qa, qw, sw, w.astype(jnp.bfloat16)))
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
  """The heuristic's pick and its neighbours: tile width, K split, warps, stages; for Mosaic GPU
  also the schedule and the wgmma chunks."""
  h = HEURISTICS[impl](m, n, k)
  if impl == "mosaic_gpu":
    # Tile widths dividing N, 2 to 6 TMA stages (as many as fit beside the output staging),
    # both schedules at every width (a persistent 64-wide grid of 2 tiles an SM against a
    # 128-wide one just over a wave); the wgmma in column chunks (192: 96 or 64 a chunk, 128:
    # 64); 256 columns; K in 2 or 4 parts at the heuristic's width; the persistent bands; the
    # warpgroups taking turns.
    fits = lambda c: mm_mosaic.smem_bytes(c, jnp.bfloat16) <= _target.HOPPER_SMEM_BYTES
    cands = [mm_mosaic.Config(bn, st) for bn in (64, 128, 192) if n % bn == 0
             for st in range(2, 7)]
    cands += [mm_mosaic.Config(h.block_n, st, persistent=True) for st in range(3, 7)]
    cands += [mm_mosaic.Config(bn, 4, persistent=True) for bn in (64, 128, 192) if n % bn == 0]
    cands += [mm_mosaic.Config(bn, 4, persistent=p, chunks=c) for bn, c in
              ((128, 2), (192, 2), (192, 3)) if n % bn == 0 for p in (False, True)]
    # 256 columns (the chunks one after another): 2 or 3 stages, both schedules.
    cands += [mm_mosaic.Config(256, st, persistent=p, chunks=c) for st in (2, 3)
              for p in (False, True) for c in (2, 4) if n % 256 == 0]
    # The persistent schedule's bands of row tiles: narrower, wider, and all the rows in one
    # (the order before the bands); a band of all mt rows or more is one order.
    mt = -(-m // mm_mosaic.BLOCK_M)
    if h.persistent:
      cands += [dataclasses.replace(h, band=b) for b in sorted({4, 8, 32, mt})
                if b < mt or b == mt > h.band]
    # The compute warpgroups taking turns at the tensor cores: at the pick and at the
    # persistent widths in one or two chunks.
    cands += [dataclasses.replace(c, pingpong=True) for c in
              [h, *(mm_mosaic.Config(bn, 4, persistent=True, chunks=ch)
                    for bn, ch in ((128, 1), (192, 1), (192, 2)) if n % bn == 0)]]
    for sp in (2, 4):  # float32 partials staged: the most stages that fit
      c = mm_mosaic.Config(h.block_n, 4, chunks=3 if h.block_n == 192 else 1, splits=sp)
      while not fits(c) and c.stages > 2:
        c = dataclasses.replace(c, stages=c.stages - 1)
      cands += [c] if (k // mm_mosaic.BLOCK_K) % sp == 0 else []
    return [h] + [c for c in dict.fromkeys(cands) if c != h and fits(c)]
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


def varying(impl: str, m: int, n: int, k: int, fields) -> list:
  """The heuristic's pick and the sweep's configs that differ from it only in `fields`."""
  h = HEURISTICS[impl](m, n, k)
  same = lambda c: all(getattr(c, f.name) == getattr(h, f.name)
                       for f in dataclasses.fields(h) if f.name not in fields)
  return [c for c in sweep_configs(impl, m, n, k) if same(c)]


def run_sweep(impl, ms, nks, fp8_peak, bw, commit, out, tag="", vary=None, merge=None):
  """The --sweep rows: every config of `sweep_configs` (only those varying `vary` from the
  heuristic's pick, where given), written after every case."""
  rows = []
  print(f"\nsweep ({impl}, quantised input): {'M':>5} {'N':>6} {'K':>6} {'us':>9} config")
  for seed, ((n, k), m) in enumerate((nk, m) for nk in nks for m in ms):
    make = make_problem(m, n, k, seed)
    x, qa, qw, sw, wb = make(1)[0]
    want = fp8_matmul(qa, qw, sw, implementation="xla")
    flops = 2 * m * n * k
    for cfg in varying(impl, m, n, k, vary) if vary else sweep_configs(impl, m, n, k):
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
                           + (f"_{tag}" if tag else ""), merged(rows, merge, ("impl", "config")),
                           {"copy_tbps": round(bw, 3), "fp8_peak_tflops": round(fp8_peak, 1)},
                           commit, out)


def cublas_unavailable() -> str | None:
  """Why the cuBLAS column cannot run here, or None."""
  if importlib.util.find_spec("torch") is None:
    return "torch is not installed"
  if jax.devices()[0].platform != "gpu":
    return f"cuBLAS needs a CUDA GPU; JAX runs on {jax.devices()[0].platform}"
  if jnp.dtype(_fmt().dtype) != jnp.float8_e4m3fn:
    return "cuBLAS's blockwise FP8 GEMM takes e4m3fn codes"
  return None


def sample_step(m: int) -> int:
  """Every `step`-th output row is compared: 256 rows spread over every 128-row tile."""
  return max(1, m // 256)


def cublas_peer(cases, first_set, timeout: float) -> tuple[dict, str | None]:
  """cuBLAS's blockwise GEMM on each case's first input set, in `_cublas.py`'s own process.

  cases: [(M, N, K, torch calls)]; first_set(i) -> the (x, qa, qw, sw, wb) set of case i.
  Returns ({case index: result (time_us, spread, out: the float32 rows of sample_step)}, why
  the column is missing or None); a case cuBLAS declined has an `error`.
  """
  why = cublas_unavailable()
  if why:
    return {}, why
  with tempfile.TemporaryDirectory() as d:
    spec = []
    for i, (m, n, k, calls) in enumerate(cases):
      _, qa, qw, sw, _ = first_set(i)
      for part, arr in (("a", qa.q), ("a_scale", qa.row_scale()), ("w", qw), ("w_scale", sw)):
        arr = np.asarray(arr)
        np.save(os.path.join(d, f"{i}_{part}.npy"), arr.view(np.uint8) if arr.itemsize == 1
                else arr)
      spec.append(dict(id=i, M=m, N=n, K=k, calls=calls, step=sample_step(m)))
    with open(os.path.join(d, "cases.json"), "w") as f:
      json.dump({"cases": spec}, f)
    print(f"cuBLAS: {len(spec)} cases in {CUBLAS} (at most {timeout:.0f} s)", flush=True)
    try:
      proc = subprocess.run([sys.executable, CUBLAS, d], capture_output=True, text=True,
                            timeout=timeout)
      print(proc.stdout[-4000:] + proc.stderr[-2000:], flush=True)
    except subprocess.TimeoutExpired as e:
      tail = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
      print(f"{tail[-4000:]}\ncuBLAS: stopped after {timeout:.0f} s; the cases it finished are "
            "kept", flush=True)
    path = os.path.join(d, "results.json")
    if not os.path.exists(path):
      return {}, "the torch side wrote no results (its output is above)"
    with open(path) as f:
      res = json.load(f)
    if res.get("skipped"):
      return {}, res["skipped"]
    out = {}
    for key, r in res["cases"].items():
      if "error" not in r:
        r["out"] = np.load(os.path.join(d, f"{key}_out.npy"))
      out[int(key)] = dict(r, peer=res.get("peer"))
  return out, None


def torch_calls(m: int, n: int, k: int) -> int:
  """cuBLAS's calls per case: no compile to pay, so 8-32 distinct copies, about 1 GB of them."""
  return int(max(8, min(32, -(-1e9 // (m * k + n * k + 2 * m * n)))))


def prefill_calls(m: int, n: int, k: int) -> int:
  """Our calls per timed jit: 2-4 input sets, about 160 MB of them (3x the H200's 50 MB L2),
  few enough that the compiles of every implementation fit the run."""
  return int(max(2, min(4, -(-160e6 // (m * k + n * k + 2 * m * n)))))


def prefill_problem(m, n, k, seed):
  """make_problem's sets with `x` and `wb` replaced by the dequantised operands in bf16: the
  product a user without FP8 would run (xla_bf16), on the same values."""
  make = make_problem(m, n, k, seed)

  def make_dequant(count):
    return [(qa.dequantize(jnp.bfloat16), qa, qw, sw,
             dequantize_weight(qw, sw).astype(jnp.bfloat16))
            for _, qa, qw, sw, _ in make(count)]
  return make_dequant


def kernel_family(row: dict) -> str | None:
  """The row's longest kernel, numbering dropped (XLA numbers its fusions per module)."""
  top = row.get("top_kernels")
  return re.sub(r"[_.]?\d+", "", max(top, key=top.get)) if top else None


KERNELS = ("mosaic_gpu", "triton", "pallas", "xla")
# The default last: its kernels name the implementation it picked (`pick`), whose check it shares.
PREFILL_IMPLS = {
    "xla_bf16": IMPLS["xla_bf16"],
    **{impl: (lambda x, qa, qw, sw, wb, impl=impl: fp8_matmul(qa, qw, sw, implementation=impl))
       for impl in KERNELS},
    "default": lambda x, qa, qw, sw, wb: fp8_matmul(qa, qw, sw),
}


def checked(got, want, theirs) -> dict:
  """A row's checks on the sampled rows: against the reference, and against cuBLAS's float32
  output (bf16 rounding alone, within 2^-8)."""
  row = dict(err_vs_reference=rel_rms(got, want))
  row["correct"] = row["err_vs_reference"] <= TOL
  if theirs:
    row["err_vs_cublas"] = rel_rms(got, theirs["out"])
    row["correct"] &= row["err_vs_cublas"] <= TOL
  return row


def cross_check(qa, qw, sw, step, theirs) -> dict:
  """The default's float32 output against cuBLAS's: the same product twice, within 1e-4
  (within two bf16 roundings where cuBLAS gave bf16)."""
  f32 = theirs["out_dtype"] == "float32"
  try:
    mine = fp8_matmul(qa, qw, sw, out_dtype=jnp.float32 if f32 else jnp.bfloat16)[::step]
  except Exception as e:  # noqa: BLE001  (a kernel without that output dtype: say so, go on)
    print(f"default with a {theirs['out_dtype']} output: {type(e).__name__}: {str(e)[:300]}")
    return dict(err_vs_cublas_f32=None)
  err = rel_rms(np.asarray(mine, np.float32), theirs["out"])
  return dict(err_vs_cublas_f32=err, correct=err <= (TOL_F32 if f32 else TOL_BF16_PAIR))


def prefill_case(m, n, k, seed, impls, theirs) -> dict[str, dict]:
  """{impl: row fields} of one case: each implementation checked and timed."""
  gpu = jax.devices()[0].platform == "gpu"
  calls = prefill_calls(m, n, k)
  # The slope (a second compile) only where no profiler trace gives kernel time: on CPU.
  sets = prefill_problem(m, n, k, seed)(calls if gpu else 2 * calls)
  x, qa, qw, sw, wb = sets[0]
  step = sample_step(m)
  want = fp8_matmul(qa.map_leading(lambda t: t[::step]), qw, sw, out_dtype=jnp.float32,
                    implementation="xla")
  rows, outs = {}, {}
  for impl in impls:
    if impl == "cublas_blockwise":
      if theirs:
        rows[impl] = dict(
            time_us=theirs["time_us"], median_us=theirs["median_us"], p10_us=theirs["p10_us"],
            p90_us=theirs["p90_us"], calls=theirs["calls"], out_dtype=theirs["out_dtype"],
            peer=theirs["peer"], kernels_per_call=theirs["kernels_per_call"],
            top_kernels=theirs["top_kernels"], **checked(theirs["out"], want, None))
      continue
    op = PREFILL_IMPLS[impl]
    try:
      # The default's check on a GPU is its pick's (the same kernels): one compile fewer.
      if impl != "default" or not gpu:
        outs[impl] = np.asarray(op(x, qa, qw, sw, wb)[::step], np.float32)
      t = _harness.measure(op, lambda count: sets[:count], calls, chain=not gpu)
    except Unsupported as e:
      print(f"{m:>5} {n:>6} {k:>6} {impl:>16} declines: {str(e)[:200]}")
      continue
    except Exception as e:  # noqa: BLE001  (a kernel that fails to build is a row that failed)
      print(f"{m:>5} {n:>6} {k:>6} {impl:>16} FAILED: {type(e).__name__}: {str(e)[:300]}")
      rows[impl] = dict(time_us=None, correct=False, error=f"{type(e).__name__}: {str(e)[:300]}")
      continue
    row = rows[impl] = dict(time_us=(t["kernel_s"] or t["chain_s"]) * 1e6, calls=calls,
                            config=str(HEURISTICS[impl](m, n, k)) if impl in HEURISTICS else None,
                            kernels_per_call=t["kernels_per_call"],
                            top_kernels=t.get("top_kernels"))
    if impl != "default":
      row.update(checked(outs[impl], want, theirs if impl != "xla_bf16" else None))
      continue
    # Its kernels name the pick on a GPU (no trace elsewhere: there, its output bits).
    fam = kernel_family(row)
    row["pick"] = next((i for i in KERNELS if i in rows and rows[i]["time_us"] is not None and (
        kernel_family(rows[i]) == fam if gpu else np.array_equal(outs[i], outs[impl]))), None)
    row["config"] = rows[row["pick"]]["config"] if row["pick"] else None
    if impl not in outs and row["pick"] is None:
      outs[impl] = np.asarray(op(x, qa, qw, sw, wb)[::step], np.float32)
    row.update(checked(outs.get(impl, outs.get(row["pick"])), want, theirs))
    if theirs:
      check = cross_check(qa, qw, sw, step, theirs)
      row["correct"] &= check.pop("correct", True)
      row.update(check)
  return rows


def merged(rows: list[dict], path: str | None, fields=("impl",)) -> list[dict]:
  """`rows`, then those of the results file at `path` for every (case, *fields) they lack (a
  sweep's: implementation and config), each keeping its own run's commit, date and ceilings
  (--merge: a comparison run in parts). A row that replaces one of the file's takes its
  `default` mark where it has none."""
  if not path:
    return rows
  with open(path) as f:
    doc = json.load(f)
  key = lambda r: (json.dumps(r["case"], sort_keys=True), *(r.get(f) for f in fields))
  old = {key(r): r for r in doc["rows"]}
  new = [r if "default" not in old.get(key(r), {}) else {"default": old[key(r)]["default"], **r}
         for r in rows]
  have = {key(r) for r in rows}
  return new + [{"commit": doc["commit"], "date": doc["date"], "ceilings": doc["ceilings"], **r}
                for r in doc["rows"] if key(r) not in have]


def run_prefill(ms, nks, impls, fp8_peak, bw, bf16, commit, out, tag, budget_s, peer_timeout,
                merge=None):
  """The --prefill rows (module docstring), written after every case."""
  # M outermost: a run cut short by the budget loses the last M, not a shape.
  cases = [(m, n, k) for m in ms for n, k in nks]
  peer, why = ({}, "not asked for") if "cublas_blockwise" not in impls else cublas_peer(
      [(*c, torch_calls(*c)) for c in cases], lambda i: prefill_problem(*cases[i], i)(1)[0],
      peer_timeout)
  if why:
    print(f"cuBLAS column skipped: {why}")
  name = "fp8_matmul_prefill" + (f"_{tag}" if tag else "")
  ceilings = {"copy_tbps": round(bw, 3), "bf16_tflops": round(bf16, 1)}
  rows, start = [], time.perf_counter()
  fmt = lambda v, spec: "-".rjust(int(spec.split(".")[0])) if v is None else format(v, spec)
  print(f"{'M':>5} {'N':>6} {'K':>6} {'impl':>16} {'us':>9} {'TFLOP/s':>8} {'vs_bf16':>7} "
        f"{'vs_cuBLAS':>9} {'err_ref':>8} {'err_cuBLAS':>10} pick")
  for i, (m, n, k) in enumerate(cases):
    if time.perf_counter() - start > budget_s:
      print(f"budget of {budget_s:.0f} s spent: cases (M, N, K) {cases[i:]} not run")
      break
    theirs = peer.get(i)
    if theirs and "error" in theirs:
      print(f"cuBLAS declined M={m} N={n} K={k}: {theirs['error']}")
      theirs = None
    t0 = time.perf_counter()
    case_rows = prefill_case(m, n, k, i, impls, theirs)
    flops, _, floor = roofline(m, n, k, fp8_peak, bw)
    base = case_rows.get("xla_bf16", {}).get("time_us")
    peer_us = case_rows.get("cublas_blockwise", {}).get("time_us")
    for impl, r in case_rows.items():
      us = r.pop("time_us")
      speed = lambda ref: round(ref / us, 3) if ref and us else None
      rows.append(dict(
          case=dict(M=m, N=n, K=k), impl=impl, time_us=us and round(us, 3),
          tflops=us and round(flops / us / 1e6, 1), roofline_frac=us and round(floor * 1e6 / us, 3),
          vs_xla=speed(base), vs_cublas=speed(peer_us),
          **{key: (float(f"{v:.3g}") if key.startswith("err") and isinstance(v, float) else
                   bool(v) if key == "correct" else v) for key, v in r.items()}))
      row = rows[-1]
      print(f"{m:>5} {n:>6} {k:>6} {impl:>16} {fmt(row['time_us'], '9.2f')} "
            f"{fmt(row['tflops'], '8.1f')} {fmt(row['vs_xla'], '7.3f')} "
            f"{fmt(row['vs_cublas'], '9.3f')} {fmt(row.get('err_vs_reference'), '8.2e')} "
            f"{fmt(row.get('err_vs_cublas_f32', row.get('err_vs_cublas')), '10.2e')} "
            f"{row.get('pick') or ''} {'' if row['correct'] else 'CHECK FAILED'}", flush=True)
    print(f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
    rows.sort(key=lambda r: r["case"]["M"])  # stable: the shapes' order within an M
    _harness.write_results(name, merged(rows, merge), ceilings, commit, out)
  return rows


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  ap.add_argument("--commit", default="unknown")
  ap.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script on CPU")
  ap.add_argument("--sweep", action="store_true", help="only the tiling sweep (see docstring)")
  ap.add_argument("--sweep-impl", default="pallas", choices=sorted(HEURISTICS))
  ap.add_argument("--sweep-vary", nargs="+", default=None, metavar="FIELD",
                  help="--sweep: only the configs that differ from the heuristic's pick in "
                       "these Config fields (e.g. band)")
  ap.add_argument("--ms", nargs="+", type=int, default=None,
                  help=f"default {MS}; with --sweep {SWEEP_MS}")
  ap.add_argument("--nks", nargs="+", default=None, help="N x K shapes, e.g. 12288x4096")
  ap.add_argument("--tag", default="", help="results file fp8_matmul_<tag>.json")
  ap.add_argument("--extra", nargs="*", default=[], choices=sorted(EXTRA_IMPLS),
                  help="also time these implementations")
  ap.add_argument("--impls", nargs="+", default=None,
                  choices=sorted({**IMPLS, **EXTRA_IMPLS, **PREFILL_IMPLS, "cublas_blockwise": 0}),
                  help="time only these (xla_bf16, the ratios' base, is always timed)")
  ap.add_argument("--cublas", action="store_true",
                  help="also cuBLAS's blockwise FP8 GEMM (torch, in its own process)")
  ap.add_argument("--prefill", action="store_true",
                  help=f"the prefill comparison (docstring): M {PREFILL_MS}, every projection "
                       "and expert shape, fp8_matmul_prefill.json")
  ap.add_argument("--budget-s", type=float, default=150.0,
                  help="--prefill: start no case after this many seconds of the timing loop")
  ap.add_argument("--peer-timeout", type=float, default=90.0,
                  help="seconds the torch process may take over all cases")
  ap.add_argument("--merge", default=None, metavar="JSON",
                  help="also write this results file's rows for the (case, impl) pairs not "
                       "measured now, each with its own commit, date and ceilings")
  args = ap.parse_args()
  nks = tuple(tuple(int(d) for d in nk.split("x")) for nk in args.nks) if args.nks else None
  if args.prefill:
    impls = args.impls and ["xla_bf16", *args.impls]
    ms, nks, impls = (((16, 128), (EDGE_PROJECTIONS["small"],),
                       impls or ["cublas_blockwise", "xla_bf16", "default", "xla"])
                      if args.smoke else (args.ms or PREFILL_MS, nks or PREFILL_NKS,
                                          impls or ["cublas_blockwise", *PREFILL_IMPLS]))
  else:
    ms, nks = ((1, 16), (EDGE_PROJECTIONS["small"],)) if args.smoke else (args.ms or MS,
                                                                          nks or NKS)
  name = "fp8_matmul" + (f"_{args.tag}" if args.tag else "")
  if not args.prefill:
    impls = dict(IMPLS, **{extra: EXTRA_IMPLS[extra] for extra in args.extra})
    if args.impls:
      every = {**IMPLS, **EXTRA_IMPLS}
      impls = {i: every[i] for i in dict.fromkeys(["xla_bf16", *args.impls]) if i in every}

  bw = runner.copy_tbps(0.05 if args.smoke else 2.0)
  bf16 = runner.bf16_tflops(256 if args.smoke else 8192)
  fp8_peak = cost.FP8_PER_BF16 * bf16
  print(f"device {jax.devices()[0].device_kind}: copy {bw:.2f} TB/s, bf16 dot {bf16:.0f} TFLOP/s,"
        f" FP8 peak taken as {fp8_peak:.0f} TFLOP/s")
  if args.sweep:
    return run_sweep(args.sweep_impl, (1,) if args.smoke else args.ms or SWEEP_MS, nks,
                     fp8_peak, bw, args.commit, args.out, args.tag, args.sweep_vary,
                     args.merge)
  if args.prefill:
    order = [i for i in ["cublas_blockwise", *PREFILL_IMPLS] if i in impls]
    return run_prefill(ms, nks, order, fp8_peak, bw, bf16, args.commit, args.out, args.tag,
                       args.budget_s, args.peer_timeout, args.merge)
  print(__doc__.split("\n\n")[1])
  rows = []
  cases = [(m, n, k) for (n, k) in nks for m in ms]
  peer, why = ({}, "not asked for (--cublas)") if not args.cublas else cublas_peer(
      [(*c, torch_calls(*c)) for c in cases], lambda i: make_problem(*cases[i], i)(1)[0],
      args.peer_timeout)
  if why:
    print(f"cuBLAS column skipped: {why}")
  print(f"{'M':>5} {'N':>6} {'K':>6} {'impl':>16} {'us':>9} {'TFLOP/s':>8} {'wTB/s':>6} "
        f"{'roof':>5} {'vs_bf16':>7} config / ok")
  for seed, (m, n, k) in enumerate(cases):
    make = make_problem(m, n, k, seed)
    x, qa, qw, sw, wb = make(1)[0]
    want = fp8_matmul(qa, qw, sw, implementation="xla")
    ok = {impl: rel_rms(fp8_matmul(qa, qw, sw, implementation=impl), want) <= 2.0**-8
          for impl in {i.split("+")[0] for i in impls} - {"xla_bf16", "xla_dequant"}}
    flops, nbytes, floor = roofline(m, n, k, fp8_peak, bw)
    # The same bytes copied: the ceiling of a kernel this size (launch and tail included).
    same = runner.copy_seconds(nbytes) if m <= 64 else None
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
    theirs = peer.get(seed)
    if theirs and "error" in theirs:
      print(f"cuBLAS declined M={m} N={n} K={k}: {theirs['error']}")
    elif theirs:
      sec = theirs["time_us"] * 1e-6
      secs.append(sec)
      err = rel_rms(theirs["out"], np.asarray(want[::sample_step(m)], np.float32))
      rows.append(dict(case=dict(M=m, N=n, K=k), impl="cublas_blockwise",
                       time_us=theirs["time_us"], tbps=round(n * k / sec / 1e12, 3),
                       tflops=round(flops / sec / 1e12, 1), roofline_frac=round(floor / sec, 3),
                       vs_xla=None, same_size_frac=same and round(same / sec, 3),
                       correct=bool(err <= TOL), config=None, chain_us=None,
                       kernels_per_call=theirs["kernels_per_call"],
                       top_kernels=theirs["top_kernels"], median_us=theirs["median_us"],
                       p10_us=theirs["p10_us"], p90_us=theirs["p90_us"],
                       err_vs_reference=float(f"{err:.3g}"), peer=theirs["peer"]))
    # From the unrounded times: on a loaded CPU (--smoke) a slope can round to 0 us.
    for row, sec in zip(rows[-len(secs):], secs, strict=True):
      row["vs_xla"] = round(base / sec, 3)
      print(f"{m:>5} {n:>6} {k:>6} {row['impl']:>16} {row['time_us']:9.2f} {row['tflops']:8.1f} "
            f"{row['tbps']:6.2f} {row['roofline_frac']:5.2f} {row['vs_xla']:7.2f} "
            f"{row['config'] or ''} {'' if row['correct'] else 'CHECK FAILED'}", flush=True)
    _harness.write_results(name, merged(rows, args.merge),
                           {"copy_tbps": round(bw, 3), "bf16_tflops": round(bf16, 1)},
                           args.commit, args.out)


if __name__ == "__main__":
  main()
