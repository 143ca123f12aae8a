"""Triton kernel for 1 x G FP8 quantisation, and the quantise-and-store routine the fused
kernels share.

Layout: each program owns `block_rows` whole rows, each held in registers as one power-of-two
block of `width >= K` columns (7168 -> 8192); masked loads and stores keep the padding out of
memory, and the padding's zeros leave every group's amax as it is. Rows are masked too, so no
tiling constraint remains on T or K (unlike Pallas-Triton, which needs power-of-two chunks).
The fused norm holds its row as a 1-D block instead (`rmsnorm_quant.triton`); `store_quant`
takes either. For the quant alone the 1-D row, one row a program, ran slower than the
[rows, W] blocks at T >= 4096 (benchmarks/README.md, "RMSNorm + quant"), so this kernel keeps
them.

FP8 codes: a native cast (round to nearest even) for e4m3fn, and for e4m3fnuz on gfx942 whose
format it is; elsewhere (NVIDIA, gfx950) the kernel writes the fnuz bits computed with integer
ops (`fp8.encode_e4m3fnuz`) and the caller bitcasts them (`fnuz_bits`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jfusedq import _target, _triton
from jfusedq._triton import tl
from jfusedq.fp8 import E4M3FNUZ, Fp8Format, default_format
from jfusedq.ops import _common
from jfusedq.ops._dispatch import Unsupported
from jfusedq.ops.group_quant.pallas import Config, to_fp8

MAX_WIDTH = 32768  # padded f32 values per row in registers (64 per thread at 16 warps)
TILE = 8192  # target elements per program (rows x width)
PROGRAMS = 256  # keep about two programs per SM before packing rows together
# Many waves of programs: one row of 4 warps a program (16 to 64 values a thread) keeps more
# rows in flight per SM than 16 warps of 16 (0.90 against 0.74 of copy bandwidth at
# 16384 x 5120), the fastest or within 1% of it of the nine tilings tried from T = 4096.
BANDWIDTH_ROWS = 4096


def block_width(k: int, group_size: int = 1) -> int:
  """The power-of-two block a row of width k is held in; Unsupported beyond MAX_WIDTH."""
  width = max(_common.pow2_ceil(k), group_size)
  if width > MAX_WIDTH:
    raise Unsupported(f"row width {k} pads to {width} > {MAX_WIDTH} values in registers")
  return width


def heuristics(rows: int, width: int) -> Config:
  """From BANDWIDTH_ROWS rows, one row of 4 warps a program; below, ~TILE elements per program
  (fewer rows while that leaves < PROGRAMS programs), ~16 per thread. `width`: padded values
  per row, all inputs together."""
  if rows >= BANDWIDTH_ROWS:
    return Config(1, 4)
  block_rows = min(_common.pow2_floor(TILE // width), _common.pow2_floor(rows // PROGRAMS))
  num_warps = min(16, max(4, _common.pow2_floor(block_rows * width // 512)))
  return Config(block_rows, num_warps)


def fnuz_bits(fmt: Fp8Format, target: _target.Target) -> bool:
  """Whether the kernel writes fnuz codes as integer bits: wherever fnuz is not the device's
  own format. Triton's NVIDIA backend has no fnuz conversion, and its gfx950 one fails an
  assertion in Triton 3.6 (seen compiling for gfx950 on CPU); gfx942 converts natively."""
  return fmt.dtype == E4M3FNUZ and default_format(target.device_kind,
                                                  target.platform).dtype != E4M3FNUZ


def quant_out_shapes(rows: int, k: int, fmt: Fp8Format, group_size: int, layout: str,
                     target: _target.Target):
  groups = _common.num_groups(k, group_size)
  q = jax.ShapeDtypeStruct((rows, k), jnp.uint8 if fnuz_bits(fmt, target) else fmt.dtype)
  s = jax.ShapeDtypeStruct((rows, groups) if layout == "row" else (groups, rows), jnp.float32)
  return [q, s]


def quant_params(fmt: Fp8Format, group_size: int, layout: str, ue8m0: bool,
                 target: _target.Target) -> dict:
  """The constexprs of `store_quant`."""
  return dict(G=group_size, FP8_MAX=fmt.max, INV_MAX=fmt.inv_max, UE8M0=ue8m0, COL=layout == "col",
              FNUZ_BITS=fnuz_bits(fmt, target))


@_triton.jit
def encode_fnuz(y):
  """f32 `y` clamped to +-240 -> e4m3fnuz bits, nearest even (`fp8.encode_e4m3fnuz`)."""
  a = tl.abs(y)
  bits = a.to(tl.int32, bitcast=True)
  # Normal range (a >= 2**-7): rebias the exponent (127 -> 8), round the mantissa to 3 bits.
  normal = (bits - (119 << 23) + 0x7FFFF + ((bits >> 20) & 1)) >> 20
  # Subnormal range: at 2**13 the f32 ulp is 2**-10, the fnuz subnormal step, so the add
  # itself rounds to nearest even; 0x46000000 is the bits of 2**13.
  sub = (a + 8192.0).to(tl.int32, bitcast=True) - 0x46000000
  code = tl.where(a < 0.0078125, sub, normal)
  code = tl.where((y < 0) & (code != 0), code | 0x80, code)
  code = tl.where(y != y, 0x80, code)
  return code.to(tl.uint8)


@_triton.jit
def _max_nan(a, b):
  return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@_triton.jit
def store_quant(y, r, rows, offs, mask, q_ptr, s_ptr, K: tl.constexpr, G0: tl.constexpr,
                G: tl.constexpr,
                FP8_MAX: tl.constexpr, INV_MAX: tl.constexpr, UE8M0: tl.constexpr,
                COL: tl.constexpr, FNUZ_BITS: tl.constexpr):
  """Quantise f32 `y` in groups of G and store its codes at `q_ptr + offs` and its scales in
  row or col layout: `y [R, W]` for the rows `r [R]`, or `y [W]` for the one row `r` (W a
  power-of-two multiple of G, zero past K), its first group the row's G0-th."""
  ONE_ROW: tl.constexpr = len(y.shape) == 1
  W: tl.constexpr = y.shape[len(y.shape) - 1]
  if ONE_ROW:
    yg = tl.reshape(y, (W // G, G))
  else:
    yg = tl.reshape(y, (y.shape[0], W // G, G))
  # A group holding a NaN or inf gets scale NaN and NaN codes (as the reference): the max and
  # the clamp propagate NaN, so its codes y * NaN stay NaN with no compare or select per value.
  # 3.4028234663852886e38 is the f32 maximum.
  amax = tl.reduce(tl.abs(yg), len(yg.shape) - 1, _max_nan)
  finite = amax <= 3.4028234663852886e38
  scale = tl.maximum(amax, 1e-10) * INV_MAX
  if UE8M0:
    # Next power of two of a positive normal f32: clear the mantissa, bump the exponent.
    bits = scale.to(tl.int32, bitcast=True)
    bits = tl.where((bits & 0x7FFFFF) != 0, (bits & 0x7F800000) + (1 << 23), bits)
    scale = bits.to(tl.float32, bitcast=True)
  # IEEE division, as XLA's: Triton's `/` is approximate and would move codes at midpoints.
  scale = tl.where(finite, scale, amax - amax)  # inf - inf, NaN - NaN: NaN
  inv = tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
  q = tl.clamp(yg * tl.expand_dims(inv, len(yg.shape) - 1), -FP8_MAX, FP8_MAX,
               propagate_nan=tl.PropagateNan.ALL)
  q = tl.reshape(q, y.shape)
  if FNUZ_BITS:
    codes = encode_fnuz(q)
  else:
    codes = q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
  tl.store(q_ptr + offs, codes, mask=mask)
  NG: tl.constexpr = (K + G - 1) // G
  g = G0 + tl.arange(0, W // G)
  if ONE_ROW:
    s_mask = (g < NG) & (r < rows)
    s_offs = g * rows + r if COL else r.to(tl.int64) * NG + g
  else:
    s_mask = (r < rows)[:, None] & (g < NG)[None, :]
    s_offs = g[None, :] * rows + r[:, None] if COL else r[:, None] * NG + g[None, :]
  tl.store(s_ptr + s_offs, scale, mask=s_mask)


@_triton.jit
def group_quant_kernel(x_ptr, rows, q_ptr, s_ptr, K: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_ROWS: tl.constexpr, G: tl.constexpr, FP8_MAX: tl.constexpr,
                       INV_MAX: tl.constexpr, UE8M0: tl.constexpr, COL: tl.constexpr,
                       FNUZ_BITS: tl.constexpr):
  r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
  c = tl.arange(0, BLOCK_K)
  mask = (r < rows)[:, None] & (c < K)[None, :]
  offs = r.to(tl.int64)[:, None] * K + c[None, :]
  y = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
  store_quant(y, r, rows, offs, mask, q_ptr, s_ptr, K, 0, G, FP8_MAX, INV_MAX, UE8M0, COL,
              FNUZ_BITS)


def group_quant(x: jax.Array, fmt: Fp8Format, *, group_size: int, layout: str, ue8m0: bool,
                config: Config | None = None):
  """`x [T, K]` -> (q [T, K], scale); see `reference.group_quant` for the semantics."""
  target = _target.current()
  _triton.require(target)
  rows, k = x.shape
  width = block_width(k, group_size)
  config = config or heuristics(rows, width)
  bt = config.block_rows
  q, scale = _triton.call(
      group_quant_kernel, x, rows,
      out_shape=quant_out_shapes(rows, k, fmt, group_size, layout, target),
      grid=(-(-rows // bt),), num_warps=config.num_warps, num_stages=1,
      K=k, BLOCK_K=width, BLOCK_ROWS=bt, **quant_params(fmt, group_size, layout, ue8m0, target))
  return to_fp8(q, fmt), scale
