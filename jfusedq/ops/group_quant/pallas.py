"""Pallas kernel for 1 x G FP8 quantisation, and the chunk routines the fused kernels share.

Layout: each program owns `block_rows` whole rows. Pallas-Triton builds only power-of-two
arrays and does not mask blocks that overhang the array (an overhanging store lands in the
next row), so a row of width K is handled as K / C chunks of C columns, C the largest power of
two dividing K (7168 = 7 x 1024, 2112 = 33 x 64), each chunk loaded, kept in registers and
stored exactly; and `block_rows` always divides the number of rows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jfusedq import _target
from jfusedq.fp8 import AMAX_MIN, E4M3FNUZ, F32_MAX, Fp8Format, encode_e4m3fnuz
from jfusedq.ops import _common
from jfusedq.ops._dispatch import Unsupported

MAX_CHUNKS = 64  # unrolled chunks per row; more means an odd width, left to XLA
MAX_WIDTH = 16384  # f32 values per row kept in registers without spilling
TILE = 8192  # target elements per program (rows x width)


@dataclasses.dataclass(frozen=True)
class Config:
  """Tiling of a row-parallel kernel: rows per program and warps per program."""

  block_rows: int
  num_warps: int

  def __post_init__(self):
    for name in ("block_rows", "num_warps"):
      v = getattr(self, name)
      if not _common.is_pow2(v):
        raise ValueError(f"Config.{name} must be a positive power of two, got {v!r}")


def chunk_width(k: int) -> int:
  """Columns per chunk for a row of width k; raises Unsupported if the row cannot be tiled."""
  if k > MAX_WIDTH:
    raise Unsupported(f"row width {k} > {MAX_WIDTH}")
  c = _common.pow2_divisor(k)
  if k // c > MAX_CHUNKS:
    raise Unsupported(f"row width {k} splits into {k // c} power-of-two chunks (> {MAX_CHUNKS})")
  return c


def heuristics(rows: int, width: int) -> Config:
  """~TILE elements per program, rows dividing `rows`, ~16 elements per thread."""
  block_rows = min(_common.pow2_floor(TILE // max(width, 1)), _common.pow2_divisor(rows))
  num_warps = min(16, max(4, _common.pow2_floor(block_rows * width // 512)))
  return Config(block_rows, num_warps)


def check_config(config: Config, rows: int) -> None:
  if rows % config.block_rows:
    raise ValueError(f"Config.block_rows={config.block_rows} must divide the {rows} rows "
                     "(Pallas-Triton does not mask a partial block)")


def compiler_params(config: Config):
  return plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1)


def storage_dtype(fmt: Fp8Format):
  # Pallas-Triton cannot cast to fnuz: the kernel writes its bits and the caller bitcasts.
  return jnp.uint8 if fmt.dtype == E4M3FNUZ else fmt.dtype


def to_fp8(q: jax.Array, fmt: Fp8Format) -> jax.Array:
  return lax.bitcast_convert_type(q, fmt.dtype) if q.dtype != fmt.dtype else q


def load_chunks(ref, k: int) -> list[jax.Array]:
  """A `[rows, k]` (or `[k]`) block as f32 chunks of `chunk_width(k)` columns."""
  c = chunk_width(k)
  if len(ref.shape) == 1:
    return [ref[pl.ds(j * c, c)].astype(jnp.float32) for j in range(k // c)]
  return [ref[:, pl.ds(j * c, c)].astype(jnp.float32) for j in range(k // c)]


def store_chunks(ref, chunks: list[jax.Array]) -> None:
  c = chunks[0].shape[-1]
  for j, v in enumerate(chunks):
    ref[:, pl.ds(j * c, c)] = v.astype(ref.dtype)


def pow2_ceil_bits(s: jax.Array) -> jax.Array:
  """Smallest power of two >= s for positive normal f32, by clearing the mantissa."""
  bits = lax.bitcast_convert_type(s, jnp.int32)
  up = jnp.where((bits & 0x7FFFFF) != 0, (bits & 0x7F800000) + (1 << 23), bits)
  return lax.bitcast_convert_type(up, jnp.float32)


def _amax(y, axis: int, keepdims: bool = False):
  """max |y| over `axis`, inf when y holds a NaN or inf: a GPU max may drop NaN, so NaN is
  mapped to inf before reducing."""
  a = jnp.abs(y)
  return jnp.max(jnp.where(a <= F32_MAX, a, jnp.inf), axis=axis, keepdims=keepdims)


def _scale(amax, fmt: Fp8Format, ue8m0: bool):
  """The group scale; NaN for a group that held a NaN or inf (amax inf)."""
  return jnp.where(amax <= F32_MAX, _finite_scale(jnp.maximum(amax, AMAX_MIN), fmt, ue8m0),
                   jnp.nan)


def _finite_scale(amax, fmt: Fp8Format, ue8m0: bool):
  scale = amax * fmt.inv_max
  return pow2_ceil_bits(scale) if ue8m0 else scale


def _encode(y, scale, fmt: Fp8Format):
  # A GPU clamp may turn NaN into a bound: a NaN scale's codes are set NaN after it.
  q = jnp.where(scale == scale, jnp.clip(y * (1.0 / scale), -fmt.max, fmt.max), jnp.nan)
  return encode_e4m3fnuz(q) if fmt.dtype == E4M3FNUZ else q.astype(fmt.dtype)


def quantize_rows(y: jax.Array, fmt: Fp8Format, ue8m0: bool) -> tuple[jax.Array, jax.Array]:
  """One group a row: f32 `y [R, G]` -> (codes `[R, G]`, scales `[R]`), for a kernel tile
  that holds each row's whole group (the Mosaic GPU paired product's epilogue; not fnuz).

  `_encode`'s codes without its clamp and select, which change nothing here: a finite
  group's y / scale stays within half a code of fp8_max (the scale is amax / fp8_max to f32
  rounding, or above it), and a NaN scale makes its group's codes NaN by itself."""
  s = _scale(_amax(y, 1), fmt, ue8m0)
  return (y * (1.0 / s)[:, None]).astype(fmt.dtype), s


def quantize_chunks(ys: list[jax.Array], fmt: Fp8Format, group_size: int, ue8m0: bool):
  """f32 chunks `[rows, C]` of one row block -> (code chunks, [(first group, scales [rows, n])]).

  A chunk wider than a group holds C/G whole groups; a narrower one is part of a group whose
  amax is taken over all its chunks (the last group may be short: its real columns only).
  """
  rows, c = ys[0].shape
  codes, scales = [], []
  if c >= group_size:
    per = c // group_size
    for j, y in enumerate(ys):
      g = y.reshape(rows, per, group_size)
      s = _scale(_amax(g, -1), fmt, ue8m0)
      codes.append(_encode(g, s[:, :, None], fmt).reshape(rows, c))
      scales.append((j * per, s))
  else:
    span = group_size // c
    for first in range(0, len(ys), span):
      members = ys[first:first + span]
      amax = functools.reduce(jnp.maximum, [_amax(y, 1, keepdims=True) for y in members])
      s = _scale(amax, fmt, ue8m0)
      codes += [_encode(y, s, fmt) for y in members]
      scales.append((first // span, s))
  return codes, scales


def store_scales(s_ref, scales, layout: str) -> None:
  for first, s in scales:
    n = s.shape[1]
    if layout == "row":
      s_ref[:, pl.ds(first, n)] = s
    else:
      s_ref[pl.ds(first, n), :] = s.T


def quant_out_specs(rows: int, k: int, fmt: Fp8Format, group_size: int, layout: str,
                    block_rows: int):
  """Output shapes and block specs of the (q, scale) pair."""
  groups = -(-k // group_size)
  shapes = [jax.ShapeDtypeStruct((rows, k), storage_dtype(fmt))]
  specs = [pl.BlockSpec((block_rows, k), lambda i: (i, 0))]
  if layout == "row":
    shapes.append(jax.ShapeDtypeStruct((rows, groups), jnp.float32))
    specs.append(pl.BlockSpec((block_rows, groups), lambda i: (i, 0)))
  else:
    shapes.append(jax.ShapeDtypeStruct((groups, rows), jnp.float32))
    specs.append(pl.BlockSpec((groups, block_rows), lambda i: (0, i)))
  return shapes, specs


def group_quant(x: jax.Array, fmt: Fp8Format, *, group_size: int, layout: str, ue8m0: bool,
                config: Config | None = None):
  """`x [T, K]` -> (q [T, K], scale); see `reference.group_quant` for the semantics."""
  rows, k = x.shape
  chunk_width(k)
  config = config or heuristics(rows, k)
  check_config(config, rows)
  bt = config.block_rows

  def kernel(x_ref, q_ref, s_ref):
    codes, scales = quantize_chunks(load_chunks(x_ref, k), fmt, group_size, ue8m0)
    store_chunks(q_ref, codes)
    store_scales(s_ref, scales, layout)

  out_shape, out_specs = quant_out_specs(rows, k, fmt, group_size, layout, bt)
  q, scale = pl.pallas_call(
      kernel,
      grid=(rows // bt,),
      in_specs=[pl.BlockSpec((bt, k), lambda i: (i, 0))],
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=compiler_params(config),
      interpret=_target.interpret(),
      name="group_quant",
  )(x)
  return to_fp8(q, fmt), scale
