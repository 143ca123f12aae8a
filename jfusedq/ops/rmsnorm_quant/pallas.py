"""Pallas kernel: (residual add) + RMSNorm + 1 x G FP8 quant (+ a second, norm-only input).

One program owns `block_rows` whole rows (padded to a power of two and masked, see
`group_quant.pallas`), so the row statistic, the group amax and the quantisation all happen
in registers and each input is read once: bytes moved = x (+ residual in, residual out) + fp8
codes + scales (+ bf16 copy) (+ x2 in and out).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jfusedq.fp8 import Fp8Format
from jfusedq.ops.group_quant import pallas as gq


def _normalise(h, w_ref, k: int, eps: float, weight_offset: float):
  """h f32 `[rows, width]` with zero padding -> RMSNorm(h) * (w + offset)."""
  w = gq.load_row(w_ref, k)[None, :] + weight_offset
  ms = jnp.sum(h * h, axis=-1, keepdims=True) * (1.0 / k)
  return h * lax.rsqrt(ms + eps) * w


def rmsnorm_quant(x, weight, *, residual, eps, weight_offset, fmt: Fp8Format, group_size, layout,
                  ue8m0, keep_hp, x2, weight2, eps2, config: gq.Config | None = None):
  """2-D `x [T, H]` (`x2 [T, H2]`) -> (q, scale, residual_out?, hp?, norm2?)."""
  rows, k = x.shape
  width = gq.padded_width(k, group_size)
  width2 = pl.next_power_of_2(x2.shape[1]) if x2 is not None else 0
  config = config or gq.heuristics(rows, width + width2)
  bt = config.block_rows
  has_res, has_x2 = residual is not None, x2 is not None

  def kernel(*refs):
    refs = list(refs)
    x_ref = refs.pop(0)
    r_ref = refs.pop(0) if has_res else None
    w_ref = refs.pop(0)
    x2_ref, w2_ref = (refs.pop(0), refs.pop(0)) if has_x2 else (None, None)
    q_ref, s_ref = refs.pop(0), refs.pop(0)
    r_out_ref = refs.pop(0) if has_res else None
    hp_ref = refs.pop(0) if keep_hp else None
    y2_ref = refs.pop(0) if has_x2 else None

    h = gq.load_row(x_ref, k)
    if has_res:
      h = (h + gq.load_row(r_ref, k)).astype(r_out_ref.dtype)
      r_out_ref[...] = h
      h = h.astype(jnp.float32)
    y = _normalise(h, w_ref, k, eps, weight_offset)
    if keep_hp:
      hp_ref[...] = y.astype(hp_ref.dtype)
    q, scale = gq.quantize_tile(y, fmt, group_size, ue8m0)
    q_ref[...] = q
    gq.store_scale(s_ref, scale, layout)
    if has_x2:
      y2 = _normalise(gq.load_row(x2_ref, x2.shape[1]), w2_ref, x2.shape[1], eps2, weight_offset)
      y2_ref[...] = y2.astype(y2_ref.dtype)

  row_spec = pl.BlockSpec((bt, width), lambda i: (i, 0))
  vec_spec = pl.BlockSpec((width,), lambda i: (0,))
  inputs, in_specs = [x], [row_spec]
  if has_res:
    inputs.append(residual), in_specs.append(row_spec)
  inputs.append(weight), in_specs.append(vec_spec)
  if has_x2:
    inputs += [x2, weight2]
    in_specs += [pl.BlockSpec((bt, width2), lambda i: (i, 0)),
                 pl.BlockSpec((width2,), lambda i: (0,))]
  out_shape, out_specs = gq.quant_out_specs(rows, k, fmt, group_size, layout, config)
  row2_spec = pl.BlockSpec((bt, width2), lambda i: (i, 0))
  extra = [(has_res, jax.ShapeDtypeStruct((rows, k), x.dtype), row_spec),
           (keep_hp, jax.ShapeDtypeStruct((rows, k), x.dtype), row_spec),
           (has_x2, has_x2 and jax.ShapeDtypeStruct(x2.shape, x2.dtype), row2_spec)]
  for present, shape, spec in extra:
    if present:
      out_shape.append(shape)
      out_specs.append(spec)
  outs = pl.pallas_call(
      kernel,
      grid=(pl.cdiv(rows, bt),),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=gq.compiler_params(config),
      interpret=gq.interpret(),
      name="rmsnorm_quant",
  )(*inputs)
  q, scale, *rest = outs
  residual_out = rest.pop(0) if has_res else None
  hp = rest.pop(0) if keep_hp else None
  norm2 = rest.pop(0) if has_x2 else None
  return gq.to_fp8(q, fmt), scale, residual_out, hp, norm2
