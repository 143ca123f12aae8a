"""Triton kernel: (residual add) + RMSNorm + 1 x G FP8 quant (+ a second, norm-only input).

A program walks `block_rows` whole rows one after another, each a masked power-of-two 1-D
block in registers (padding and masks as in `group_quant.triton`), so the row statistic, the group amax and the
quantisation need no second read: bytes moved = x (+ residual in, residual
out) + fp8 codes + scales (+ bf16 copy) (+ x2 in and out). Absent inputs are bound to x (never
read) and absent outputs to one-element buffers (never written): a Triton signature is fixed,
and optional pointers would need a kernel each.

Why a 1-D row: through XLA's Triton, the same kernel over a [1, W] block ran 1.06-1.14x the
time of the 1-D one on the H200 (129.7 against 122.0 us at 16384 x 4096, 66.0 against 59.6 at
4096 x 7168, 2.51 against 2.15 at 1 x 7168), where Triton 3.6's own build of the two ran within
1-4% of each other. The streaming inputs are read with `.cg` (cached in L2 only): 117.2
against 122.0 us at 16384 x 4096, 57.7 against 59.6 at 4096 x 7168.
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

VECTOR = 8  # bf16 values in one 16-byte access
MAX_THREADS = 1024


def heuristics(rows: int, width: int, warp_size: int = 32, per_thread: int = VECTOR) -> Config:
  """One row a program, `per_thread` values of its widest padded row (`width`) a thread.

  8 (one 16-byte vector for every access) where the row is also stored in bf16 (the residual,
  `hp`): with 16, Triton holds the row 16 to a thread for the loads and the fp8 store but 8
  for the bf16 stores, and converts between the two through shared memory; on the H200 16
  warps for 8192 values took 2.40 against 2.15 us at 1 x 7168 (59.9 against 59.6 at
  4096 x 7168). Otherwise 16 (two 16-byte loads, one 16-byte fp8 store): the MLA pair took
  40.6 against 48.0 us at 16384 x (1536 + 512) at 4 warps against 8. One row a program at
  16384 x 1536 (8 warps) took 47.8 against 49.7 us for four rows of 16 warps."""
  del rows
  threads = min(max(width // per_thread, warp_size), MAX_THREADS)
  return Config(1, _common.pow2_floor(threads // warp_size))


@_triton.jit
def _normalise(h, w_ptr, c, K: tl.constexpr, EPS: tl.constexpr, OFFSET: tl.constexpr):
  """h [W] f32 (zero past K) -> h * rsqrt(mean(h^2) + eps) * (w + offset), overflow-safe
  and NaN for a row holding a NaN or inf, as `reference.safe_rsqrt` (2**-80 its RESCALE,
  3.4028234663852886e38 the f32 maximum).

  The rescaled sum is taken only where the row's mean square is not finite (a branch uniform
  over the program): with a second reduction of every row and the group quant's selects per
  value the kernel took 70.4 against 63.9 us at 4096 x 7168 on the H200."""
  ms = tl.sum(h * h, axis=0) * (1.0 / K)
  ok = ms <= 3.4028234663852886e38
  if not ok:
    hs = h * 8.271806125530277e-25
    ms = tl.sum(hs * hs, axis=0) * (1.0 / K)
  s = tl.where(ok, 1.0, 8.271806125530277e-25)
  inv = tl.math.rsqrt(ms + EPS * s * s)
  inv = tl.where(ms <= 3.4028234663852886e38, inv, ms - ms)  # inf - inf, NaN - NaN: NaN
  w = tl.load(w_ptr + c, mask=c < K, other=0.0).to(tl.float32)
  if OFFSET != 0.0:  # a constant: no add per value for y * w
    w = w + OFFSET
  # h * s first, as the reference: s * inv can be subnormal where h * s is not.
  return h * s * inv * w


@_triton.jit
def rmsnorm_quant_kernel(x_ptr, res_ptr, w_ptr, x2_ptr, w2_ptr, rows, q_ptr, s_ptr, res_out_ptr,
                         hp_ptr, y2_ptr, K: tl.constexpr, BLOCK_K: tl.constexpr, K2: tl.constexpr,
                         BLOCK_K2: tl.constexpr, BLOCK_ROWS: tl.constexpr, EPS: tl.constexpr,
                         EPS2: tl.constexpr, OFFSET: tl.constexpr, HAS_RES: tl.constexpr,
                         KEEP_HP: tl.constexpr, HAS_X2: tl.constexpr, QUANT: tl.constexpr,
                         G: tl.constexpr, FP8_MAX: tl.constexpr, INV_MAX: tl.constexpr,
                         UE8M0: tl.constexpr, COL: tl.constexpr, FNUZ_BITS: tl.constexpr):
  c = tl.arange(0, BLOCK_K)
  for i in tl.static_range(BLOCK_ROWS):
    row = tl.program_id(0) * BLOCK_ROWS + i
    mask = (c < K) & (row < rows)
    offs = row.to(tl.int64) * K + c
    if HAS_X2:
      # Loaded first, so that both rows' reads are in flight together.
      c2 = tl.arange(0, BLOCK_K2)
      mask2 = (c2 < K2) & (row < rows)
      offs2 = row.to(tl.int64) * K2 + c2
      h2 = tl.load(x2_ptr + offs2, mask=mask2, other=0.0, cache_modifier=".cg").to(tl.float32)
    h = tl.load(x_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    if HAS_RES:
      # Round the sum to the residual dtype first: the norm reads what the stream carries.
      h = h + tl.load(res_ptr + offs, mask=mask, other=0.0,
                      cache_modifier=".cg").to(tl.float32)
      h = h.to(res_out_ptr.dtype.element_ty)
      tl.store(res_out_ptr + offs, h, mask=mask)
      h = h.to(tl.float32)
    y = _normalise(h, w_ptr, c, K, EPS, OFFSET)
    if KEEP_HP:
      tl.store(hp_ptr + offs, y.to(hp_ptr.dtype.element_ty), mask=mask)
    if QUANT:
      gq.store_quant(y, row, rows, offs, mask, q_ptr, s_ptr, K, G, FP8_MAX, INV_MAX, UE8M0, COL,
                     FNUZ_BITS)
    if HAS_X2:
      y2 = _normalise(h2, w2_ptr, c2, K2, EPS2, OFFSET)
      tl.store(y2_ptr + offs2, y2.to(y2_ptr.dtype.element_ty), mask=mask2)


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
  width = gq.block_width(k, group_size if fmt else 1)
  width2 = gq.block_width(k2)
  config = config or heuristics(rows, max(width, width2 if has_x2 else 1),
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
      num_warps=config.num_warps, num_stages=1, K=k, BLOCK_K=width,
      K2=k2, BLOCK_K2=width2, BLOCK_ROWS=bt, EPS=eps, EPS2=eps2 if has_x2 else eps,
      OFFSET=weight_offset, HAS_RES=has_res, KEEP_HP=keep_hp, HAS_X2=has_x2, QUANT=fmt is not None,
      **params)
  return (to_fp8(q, fmt) if fmt else None, scale if fmt else None, res_out if has_res else None,
          hp if keep_hp else None, norm2 if has_x2 else None)
