"""Pallas kernel: (residual add) + RMSNorm + 1 x G FP8 quant (+ a second, norm-only input).

One program owns `block_rows` whole rows, held in registers as power-of-two column chunks
(see `group_quant.pallas`), so the row statistic, the group amax and the quantisation need
no second read: bytes moved = x (+ residual in, residual out) + fp8 codes + scales
(+ bf16 copy) (+ x2 in and out).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jfusedq import _target
from jfusedq.fp8 import Fp8Format
from jfusedq.ops.group_quant import pallas as gq
from jfusedq.ops.rmsnorm_quant.reference import RESCALE, safe_rsqrt


def _normalise(hs: list, w_ref, k: int, eps: float, weight_offset: float) -> list:
  """Chunks of h (f32) -> chunks of h * rsqrt(mean(h^2) + eps) * (w + offset), overflow-safe
  and NaN for a row holding a NaN or inf (`reference.safe_rsqrt`)."""
  ss = sum(jnp.sum(h * h, axis=1, keepdims=True) for h in hs)
  ss_rescaled = sum(jnp.sum(jnp.square(h * RESCALE), axis=1, keepdims=True) for h in hs)
  c, inv = safe_rsqrt(ss * (1.0 / k), ss_rescaled * (1.0 / k), eps)
  return [h * c * inv * (w[None, :] + weight_offset)
          for h, w in zip(hs, gq.load_chunks(w_ref, k))]


def rmsnorm_quant(x, weight, *, residual, eps, weight_offset, fmt: Fp8Format | None, group_size,
                  layout, ue8m0, keep_hp, x2, weight2, eps2, config: gq.Config | None = None):
  """2-D `x [T, H]` (`x2 [T, H2]`) -> (q?, scale?, residual_out?, hp?, norm2?).

  `fmt=None` builds the norm alone (no q, scale): the add + RMSNorm kernel of the unfused
  chain, which then returns hp as its output.
  """
  rows, k = x.shape
  k2 = x2.shape[1] if x2 is not None else 0
  gq.chunk_width(k)
  if k2:
    gq.chunk_width(k2)
  config = config or gq.heuristics(rows, k + k2)
  gq.check_config(config, rows)
  bt = config.block_rows
  has_res, has_x2 = residual is not None, x2 is not None

  def kernel(*refs):
    refs = list(refs)
    x_ref = refs.pop(0)
    r_ref = refs.pop(0) if has_res else None
    w_ref = refs.pop(0)
    x2_ref, w2_ref = (refs.pop(0), refs.pop(0)) if has_x2 else (None, None)
    q_ref, s_ref = (refs.pop(0), refs.pop(0)) if fmt else (None, None)
    r_out_ref = refs.pop(0) if has_res else None
    hp_ref = refs.pop(0) if keep_hp else None
    y2_ref = refs.pop(0) if has_x2 else None

    hs = gq.load_chunks(x_ref, k)
    if has_res:
      # Round the sum to the residual dtype first: the norm reads what the stream carries.
      hs = [(h + r).astype(r_out_ref.dtype) for h, r in zip(hs, gq.load_chunks(r_ref, k))]
      gq.store_chunks(r_out_ref, hs)
      hs = [h.astype(jnp.float32) for h in hs]
    ys = _normalise(hs, w_ref, k, eps, weight_offset)
    if keep_hp:
      gq.store_chunks(hp_ref, ys)
    if fmt:
      codes, scales = gq.quantize_chunks(ys, fmt, group_size, ue8m0)
      gq.store_chunks(q_ref, codes)
      gq.store_scales(s_ref, scales, layout)
    if has_x2:
      gq.store_chunks(y2_ref, _normalise(gq.load_chunks(x2_ref, k2), w2_ref, k2, eps2,
                                         weight_offset))

  row_spec = pl.BlockSpec((bt, k), lambda i: (i, 0))
  inputs, in_specs = [x], [row_spec]
  if has_res:
    inputs.append(residual)
    in_specs.append(row_spec)
  inputs.append(weight)
  in_specs.append(pl.BlockSpec((k,), lambda i: (0,)))
  if has_x2:
    inputs += [x2, weight2]
    in_specs += [pl.BlockSpec((bt, k2), lambda i: (i, 0)), pl.BlockSpec((k2,), lambda i: (0,))]
  out_shape, out_specs = (gq.quant_out_specs(rows, k, fmt, group_size, layout, bt) if fmt
                          else ([], []))
  extra = [(has_res, (rows, k), x.dtype, row_spec),
           (keep_hp, (rows, k), x.dtype, row_spec),
           (has_x2, (rows, k2), x2.dtype if has_x2 else None,
            pl.BlockSpec((bt, k2), lambda i: (i, 0)))]
  for present, shape, dtype, spec in extra:
    if present:
      out_shape.append(jax.ShapeDtypeStruct(shape, dtype))
      out_specs.append(spec)
  outs = pl.pallas_call(
      kernel,
      grid=(rows // bt,),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=gq.compiler_params(config),
      interpret=_target.interpret(),
      name="rmsnorm_quant",
  )(*inputs)
  rest = list(outs)
  q, scale = (gq.to_fp8(rest.pop(0), fmt), rest.pop(0)) if fmt else (None, None)
  residual_out = rest.pop(0) if has_res else None
  hp = rest.pop(0) if keep_hp else None
  norm2 = rest.pop(0) if has_x2 else None
  return q, scale, residual_out, hp, norm2
