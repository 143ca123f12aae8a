"""Triton kernel: (residual add) + RMSNorm + 1 x G FP8 quant (+ a second, norm-only input).

A program walks `block_rows` whole rows one after another, each held in registers as one masked
power-of-two 1-D block (padding and masks as in `group_quant.triton`) or, at many rows of a width
one block would pad by a quarter or more, as up to three (`pieces`), so the row statistic, the
group amax and the quantisation need no second read: bytes moved = x (+ residual in, residual
out) + fp8 codes + scales (+ bf16 copy) (+ x2 in and out). Absent inputs are bound to x (never
read) and absent outputs to one-element buffers (never written): a Triton signature is fixed,
and optional pointers would need a kernel each.

Why a 1-D row: XLA's Triton, which keeps the kernel in the CUDA graph, built the same kernel
over a [1, W] block slower, where Triton 3.6's own builds of the two ran level. The streaming
inputs are read with `.cg` (cached in L2 only), measured faster. The figures behind each choice
here: benchmarks/README.md, "RMSNorm + quant".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jfusedq import _target, _triton
from jfusedq._triton import tl
from jfusedq.fp8 import Fp8Format
from jfusedq.ops import _common
from jfusedq.ops.group_quant import triton as gq
from jfusedq.ops.group_quant.pallas import Config, to_fp8
from jfusedq.ops.rmsnorm_quant import reference

VECTOR = 8  # bf16 values in one 16-byte access
MAX_THREADS = 1024


def heuristics(rows: int, width: int, warp_size: int = 32, per_thread: int = VECTOR) -> Config:
  """One row a program, `per_thread` values a thread of its widest row as held in registers
  (`width`: the padded block, or the sum of the pieces).

  8 (one 16-byte vector for every access) where the row is also stored in bf16 (the residual,
  `hp`): with 16, Triton holds the row 16 to a thread for the loads and the fp8 store but 8
  for the bf16 stores, and converts between the two through shared memory. Otherwise 16 (two
  16-byte loads, one 16-byte fp8 store), where fewer warps ran faster on the MLA pair. One row
  a program: four rows a program ran slower.
  """
  del rows
  threads = min(max(width // per_thread, warp_size), MAX_THREADS)
  return Config(1, _common.pow2_floor(threads // warp_size))


MAX_PIECES = 3
# Rows split into pieces from this many, where one block would be this much padding or more:
# the pieces ran faster at 37.5% and 25% padding over 16384 rows, no faster at 12.5% (7168), and
# slower at one row (three reductions, narrower loads), so a decode row stays one block.
SPLIT_MIN_ROWS, SPLIT_MIN_PADDING = 4096, 0.25


def pieces(rows: int, k: int, group_size: int = 1) -> tuple[int, int, int]:
  """The power-of-two blocks a row of k values is held in, largest first, 0 for none.

  One block of `gq.block_width` (7168 -> 8192) unless the split applies (above): then the
  binary digits of k (5120 -> 4096 + 1024, 1536 -> 1024 + 512), the last of MAX_PIECES padded
  to cover the rest and every block a multiple of `group_size`, so no group straddles two
  (576 -> 512 + 128 in groups of 128)."""
  width = gq.block_width(k, group_size)
  if rows < SPLIT_MIN_ROWS or 1 - k / width < SPLIT_MIN_PADDING:
    return (width, 0, 0)
  widths, rest = [], k
  while rest and len(widths) < MAX_PIECES - 1 and _common.pow2_floor(rest) >= group_size:
    widths.append(_common.pow2_floor(rest))
    rest -= widths[-1]
  if rest:
    widths.append(max(_common.pow2_ceil(rest), group_size))
  return (*widths, *(0,) * (MAX_PIECES - len(widths)))


@_triton.jit
def _load(ptr, offs, mask):
  return tl.load(ptr + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)


@_triton.jit
def _add(x, r, res_out_ptr, offs, mask):
  """x + residual rounded to the residual dtype and stored: the norm reads what the stream
  carries."""
  h = (x + r).to(res_out_ptr.dtype.element_ty)
  tl.store(res_out_ptr + offs, h, mask=mask)
  return h.to(tl.float32)


@_triton.jit
def _sumsq(h, s):
  hs = h * s
  return tl.sum(hs * hs, axis=0)


@_triton.jit
def _inv_rms(ss, s, K: tl.constexpr, EPS: tl.constexpr):
  """rsqrt(mean(h^2) + eps) of the row whose (h * s)^2 sum to `ss`; NaN where that mean is
  not finite (a NaN or inf in the row): inf - inf, NaN - NaN. 3.4028234663852886e38 is the
  f32 maximum."""
  ms = ss * (1.0 / K)
  inv = tl.math.rsqrt(ms + EPS * s * s)
  return tl.where(ms <= 3.4028234663852886e38, inv, ms - ms)


@_triton.jit
def _scaled(h, s, inv, w_ptr, c, K: tl.constexpr, OFFSET: tl.constexpr):
  """h * s * inv * (w + offset) for the columns `c` of the row (zero past K)."""
  w = tl.load(w_ptr + c, mask=c < K, other=0.0).to(tl.float32)
  if OFFSET != 0.0:  # a constant: no add per value for y * w
    w = w + OFFSET
  # h * s first, as the reference: s * inv can be subnormal where h * s is not.
  return h * s * inv * w


@_triton.jit
def _emit(y, row, rows, offs, mask, hp_ptr, q_ptr, s_ptr, K: tl.constexpr, KEEP_HP: tl.constexpr,
          QUANT: tl.constexpr, G0: tl.constexpr, G: tl.constexpr, FP8_MAX: tl.constexpr,
          INV_MAX: tl.constexpr, UE8M0: tl.constexpr, COL: tl.constexpr,
          FNUZ_BITS: tl.constexpr):
  """The outputs of one block of the normalised row (its first group G0)."""
  if KEEP_HP:
    tl.store(hp_ptr + offs, y.to(hp_ptr.dtype.element_ty), mask=mask)
  if QUANT:
    gq.store_quant(y, row, rows, offs, mask, q_ptr, s_ptr, K, G0, G, FP8_MAX, INV_MAX, UE8M0,
                   COL, FNUZ_BITS)


@_triton.jit
def rmsnorm_quant_kernel(x_ptr, res_ptr, w_ptr, x2_ptr, w2_ptr, rows, q_ptr, s_ptr, res_out_ptr,
                         hp_ptr, y2_ptr, K: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr,
                         P2: tl.constexpr, K2: tl.constexpr, BLOCK_K2: tl.constexpr,
                         BLOCK_ROWS: tl.constexpr, EPS: tl.constexpr, EPS2: tl.constexpr,
                         OFFSET: tl.constexpr, HAS_RES: tl.constexpr, KEEP_HP: tl.constexpr,
                         HAS_X2: tl.constexpr, QUANT: tl.constexpr, G: tl.constexpr,
                         FP8_MAX: tl.constexpr, INV_MAX: tl.constexpr, UE8M0: tl.constexpr,
                         COL: tl.constexpr, FNUZ_BITS: tl.constexpr, RESCALE: tl.constexpr):
  # The row's blocks (`pieces`): P0 at column 0, P1 after it, P2 after both; 0 = absent.
  # Every load is issued before the first value is used, so all of a row's reads are in flight
  # together; `if P1 > 0` and the like are resolved at compile time.
  c0 = tl.arange(0, P0)
  if P1 > 0:
    c1 = P0 + tl.arange(0, P1)
  if P2 > 0:
    c2 = P0 + P1 + tl.arange(0, P2)
  # A row whose mean square is not finite (h * h overflowing f32, or a NaN or inf in the row)
  # has its sum taken again of h * RESCALE (`reference.safe_rsqrt`), a branch uniform over the
  # program: a second reduction of every row was measured 10% slower.
  for i in tl.static_range(BLOCK_ROWS):
    row = tl.program_id(0) * BLOCK_ROWS + i
    ok_row = row < rows
    base = row.to(tl.int64) * K
    if HAS_X2:
      cx = tl.arange(0, BLOCK_K2)
      mx = (cx < K2) & ok_row
      ox = row.to(tl.int64) * K2 + cx
      hx = _load(x2_ptr, ox, mx)
    m0 = (c0 < K) & ok_row
    h0 = _load(x_ptr, base + c0, m0)
    if HAS_RES:
      r0 = _load(res_ptr, base + c0, m0)
    if P1 > 0:
      m1 = (c1 < K) & ok_row
      h1 = _load(x_ptr, base + c1, m1)
      if HAS_RES:
        r1 = _load(res_ptr, base + c1, m1)
    if P2 > 0:
      m2 = (c2 < K) & ok_row
      h2 = _load(x_ptr, base + c2, m2)
      if HAS_RES:
        r2 = _load(res_ptr, base + c2, m2)
    if HAS_RES:
      h0 = _add(h0, r0, res_out_ptr, base + c0, m0)
      if P1 > 0:
        h1 = _add(h1, r1, res_out_ptr, base + c1, m1)
      if P2 > 0:
        h2 = _add(h2, r2, res_out_ptr, base + c2, m2)
    ss = _sumsq(h0, 1.0)
    if P1 > 0:
      ss += _sumsq(h1, 1.0)
    if P2 > 0:
      ss += _sumsq(h2, 1.0)
    ok = ss * (1.0 / K) <= 3.4028234663852886e38
    if not ok:
      ss = _sumsq(h0, RESCALE)
      if P1 > 0:
        ss += _sumsq(h1, RESCALE)
      if P2 > 0:
        ss += _sumsq(h2, RESCALE)
    s = tl.where(ok, 1.0, RESCALE)
    inv = _inv_rms(ss, s, K, EPS)
    y = _scaled(h0, s, inv, w_ptr, c0, K, OFFSET)
    _emit(y, row, rows, base + c0, m0, hp_ptr, q_ptr, s_ptr, K, KEEP_HP, QUANT, 0, G, FP8_MAX,
          INV_MAX, UE8M0, COL, FNUZ_BITS)
    if P1 > 0:
      y = _scaled(h1, s, inv, w_ptr, c1, K, OFFSET)
      _emit(y, row, rows, base + c1, m1, hp_ptr, q_ptr, s_ptr, K, KEEP_HP, QUANT, P0 // G, G,
            FP8_MAX, INV_MAX, UE8M0, COL, FNUZ_BITS)
    if P2 > 0:
      y = _scaled(h2, s, inv, w_ptr, c2, K, OFFSET)
      _emit(y, row, rows, base + c2, m2, hp_ptr, q_ptr, s_ptr, K, KEEP_HP, QUANT,
            (P0 + P1) // G, G, FP8_MAX, INV_MAX, UE8M0, COL, FNUZ_BITS)
    if HAS_X2:
      ssx = _sumsq(hx, 1.0)
      okx = ssx * (1.0 / K2) <= 3.4028234663852886e38
      if not okx:
        ssx = _sumsq(hx, RESCALE)
      sx = tl.where(okx, 1.0, RESCALE)
      y2 = _scaled(hx, sx, _inv_rms(ssx, sx, K2, EPS2), w2_ptr, cx, K2, OFFSET)
      tl.store(y2_ptr + ox, y2.to(y2_ptr.dtype.element_ty), mask=mx)


def rmsnorm_quant(x, weight, *, residual, eps, weight_offset, fmt: Fp8Format | None, group_size,
                  layout, ue8m0, keep_hp, x2, weight2, eps2, config: Config | None = None):
  """2-D `x [T, H]` (`x2 [T, H2]`) -> (q?, scale?, residual_out?, hp?, norm2?).

  `fmt=None` builds the norm alone (no q, scale): the add + RMSNorm kernel of the unfused
  chain, which then returns hp as its output.
  """
  target = _target.current()
  _triton.require(target)
  rows, k = x.shape
  has_res, has_x2 = residual is not None, x2 is not None
  k2 = x2.shape[1] if has_x2 else 1
  blocks = pieces(rows, k, group_size if fmt else 1)
  width2 = gq.block_width(k2)
  config = config or heuristics(rows, max(sum(blocks), width2 if has_x2 else 1),
                                64 if target.platform == "rocm" else 32,
                                VECTOR if has_res or keep_hp else 2 * VECTOR)
  bt = config.block_rows

  unused = jax.ShapeDtypeStruct((1,), jnp.uint8)
  quant = (gq.quant_out_shapes(rows, k, fmt, group_size, layout, target) if fmt
           else [unused, unused])
  like = lambda present, shape, dtype: (jax.ShapeDtypeStruct(shape, dtype) if present
                                        else unused)
  out_shape = [*quant, like(has_res, (rows, k), x.dtype), like(keep_hp, (rows, k), x.dtype),
               like(has_x2, (rows, k2), x2.dtype if has_x2 else None)]
  params = (gq.quant_params(fmt, group_size, layout, ue8m0, target) if fmt
            else dict(G=group_size, FP8_MAX=1.0, INV_MAX=1.0, UE8M0=False, COL=False,
                 FNUZ_BITS=False))
  q, scale, res_out, hp, norm2 = _triton.call(
      rmsnorm_quant_kernel, x, residual if has_res else x, weight, x2 if has_x2 else x,
      weight2 if has_x2 else weight, rows, out_shape=out_shape, grid=(-(-rows // bt),),
      num_warps=config.num_warps, num_stages=1, K=k, P0=blocks[0], P1=blocks[1], P2=blocks[2],
      K2=k2, BLOCK_K2=width2, BLOCK_ROWS=bt, EPS=eps, EPS2=eps2 if has_x2 else eps,
      OFFSET=weight_offset, HAS_RES=has_res, KEEP_HP=keep_hp, HAS_X2=has_x2, QUANT=fmt is not None,
      RESCALE=reference.RESCALE, **params)
  return (to_fp8(q, fmt) if fmt else None, scale if fmt else None, res_out if has_res else None,
          hp if keep_hp else None, norm2 if has_x2 else None)
