"""Pallas kernel for 1 x G FP8 quantisation, and the tile routine the fused kernels share.

Layout: each program owns `block_rows` rows and the whole row, padded to a power of two
(Pallas-Triton only builds power-of-two arrays); the pad is masked on load and store, so a
hidden size such as 7168 runs as an 8192-wide tile with the last 1024 columns inert.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jfusedq import _target
from jfusedq.fp8 import E4M3FNUZ, Fp8Format, encode_e4m3fnuz
from jfusedq.ops._dispatch import Unsupported

# Past this many f32 per row a program's tile no longer fits in registers without spilling;
# such rows are left to XLA (the models' widest norm is 8192).
MAX_WIDTH = 16384


@dataclasses.dataclass(frozen=True)
class Config:
  """Tiling of a row-parallel kernel: rows per program and warps per program."""

  block_rows: int
  num_warps: int

  def __post_init__(self):
    for name in ("block_rows", "num_warps"):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 1 or v & (v - 1):
        raise ValueError(f"Config.{name} must be a positive power of two, got {v!r}")


def padded_width(k: int, group_size: int) -> int:
  return max(pl.next_power_of_2(k), group_size)


def heuristics(rows: int, width: int) -> Config:
  """Rows per program so a tile holds ~16K elements; warps so each thread keeps <= 64."""
  if width > MAX_WIDTH:
    raise Unsupported(f"padded row width {width} > {MAX_WIDTH}")
  fit = 1 << max(0, (16384 // width).bit_length() - 1)  # largest power of two <= 16384/width
  block_rows = min(pl.next_power_of_2(max(rows, 1)), fit)
  tile = block_rows * width
  num_warps = 4 if tile <= 2048 else 8 if tile <= 8192 else 16
  return Config(block_rows, num_warps)


def interpret() -> bool:
  return _target.current().platform == "cpu"


def compiler_params(config: Config):
  return plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1)


def storage_dtype(fmt: Fp8Format):
  # Pallas-Triton cannot cast to fnuz: the kernel writes its bits and the caller bitcasts.
  return jnp.uint8 if fmt.dtype == E4M3FNUZ else fmt.dtype


def to_fp8(q: jax.Array, fmt: Fp8Format) -> jax.Array:
  return lax.bitcast_convert_type(q, fmt.dtype) if q.dtype != fmt.dtype else q


def pow2_ceil_bits(s: jax.Array) -> jax.Array:
  """Smallest power of two >= s for positive normal f32, by clearing the mantissa."""
  bits = lax.bitcast_convert_type(s, jnp.int32)
  up = jnp.where((bits & 0x7FFFFF) != 0, (bits & 0x7F800000) + (1 << 23), bits)
  return lax.bitcast_convert_type(up, jnp.float32)


def quantize_tile(y: jax.Array, fmt: Fp8Format, group_size: int, ue8m0: bool):
  """`y [rows, width]` f32 with zeroed padding -> (codes [rows, width], scale [rows, width/G])."""
  rows, width = y.shape
  g = y.reshape(rows, width // group_size, group_size)
  amax = jnp.maximum(jnp.max(jnp.abs(g), axis=-1), 1e-10)
  scale = amax / fmt.max
  if ue8m0:
    scale = pow2_ceil_bits(scale)
  q = jnp.clip(g * (1.0 / scale)[:, :, None], -fmt.max, fmt.max).reshape(rows, width)
  q = encode_e4m3fnuz(q) if fmt.dtype == E4M3FNUZ else q.astype(fmt.dtype)
  return q, scale


def store_scale(s_ref, scale: jax.Array, layout: str) -> None:
  s_ref[...] = scale if layout == "row" else scale.T


def quant_out_specs(rows: int, k: int, fmt: Fp8Format, group_size: int, layout: str,
                    config: Config):
  """Output shapes and block specs of the (q, scale) pair."""
  width = padded_width(k, group_size)
  groups, groups_p = -(-k // group_size), width // group_size
  bt = config.block_rows
  shapes = [jax.ShapeDtypeStruct((rows, k), storage_dtype(fmt))]
  specs = [pl.BlockSpec((bt, width), lambda i: (i, 0))]
  if layout == "row":
    shapes.append(jax.ShapeDtypeStruct((rows, groups), jnp.float32))
    specs.append(pl.BlockSpec((bt, groups_p), lambda i: (i, 0)))
  else:
    shapes.append(jax.ShapeDtypeStruct((groups, rows), jnp.float32))
    specs.append(pl.BlockSpec((groups_p, bt), lambda i: (0, i)))
  return shapes, specs


def load_row(ref, k: int) -> jax.Array:
  """The tile as f32 with the columns past `k` zeroed (the pad is not guaranteed to be)."""
  x = ref[...].astype(jnp.float32)
  if x.shape[-1] != k:
    col = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    x = jnp.where(col < k, x, 0.0)
  return x


def group_quant(x: jax.Array, fmt: Fp8Format, *, group_size: int, layout: str, ue8m0: bool,
                config: Config | None = None):
  """`x [T, K]` -> (q [T, K], scale); see `reference.group_quant` for the semantics."""
  rows, k = x.shape
  width = padded_width(k, group_size)
  config = config or heuristics(rows, width)

  def kernel(x_ref, q_ref, s_ref):
    q, scale = quantize_tile(load_row(x_ref, k), fmt, group_size, ue8m0)
    q_ref[...] = q
    store_scale(s_ref, scale, layout)

  out_shape, out_specs = quant_out_specs(rows, k, fmt, group_size, layout, config)
  q, scale = pl.pallas_call(
      kernel,
      grid=(pl.cdiv(rows, config.block_rows),),
      in_specs=[pl.BlockSpec((config.block_rows, width), lambda i: (i, 0))],
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=compiler_params(config),
      interpret=interpret(),
      name="group_quant",
  )(x)
  return to_fp8(q, fmt), scale
