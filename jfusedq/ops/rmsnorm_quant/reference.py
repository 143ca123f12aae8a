"""Fused add + RMSNorm + per-group FP8 quant in plain jnp, float32 math."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jfusedq.fp8 import F32_MAX, Fp8Format, QuantizedActivation
from jfusedq.ops.group_quant import reference as group_quant_ref

# h * h overflows f32 from |h| ~ 1.8e19: a row whose mean square overflows is normalised from
# h * RESCALE instead (exact, a power of two), whose squares stay finite up to the f32 maximum.
RESCALE = 2.0**-80


class RmsNormQuantOutput(NamedTuple):
  quant: QuantizedActivation  # fp8 codes + scales of the normalised x (+ hp copy if asked)
  residual: jax.Array | None  # x + residual rounded to x.dtype, when a residual was given
  norm2: jax.Array | None  # rmsnorm(x2) in x2.dtype, when a second input was given


def add_residual(x: jax.Array, residual: jax.Array) -> jax.Array:
  """x + residual in f32, rounded to x.dtype: the new residual stream, which the norm reads
  (so the fused op equals the unfused `r = x + residual; rmsnorm(r)`)."""
  r = x.astype(jnp.float32) + residual.astype(jnp.float32)
  # Under jit, XLA on GPU may drop an f32 -> bf16 -> f32 round trip (excess precision allowed),
  # so the norm would read the unrounded sum: a 2**-8 scale error seen on the H200. An explicit
  # reduce_precision is never dropped.
  info = jnp.finfo(x.dtype)
  return jax.lax.reduce_precision(r, info.nexp, info.nmant).astype(x.dtype)


def rmsnorm(h: jax.Array, weight: jax.Array, eps: float, weight_offset: float) -> jax.Array:
  """`h * rsqrt(mean(h^2) + eps) * (weight + weight_offset)`, in f32; a row holding a NaN or
  +-inf is NaN throughout."""
  h = h.astype(jnp.float32)
  ms = jnp.mean(h * h, axis=-1, keepdims=True)
  c, inv = safe_rsqrt(ms, jnp.mean(jnp.square(h * RESCALE), axis=-1, keepdims=True), eps)
  return h * c * inv * (weight.astype(jnp.float32) + weight_offset)


def safe_rsqrt(ms, ms_rescaled, eps: float):
  """(c, inv) with `h * c * inv = h * rsqrt(mean(h^2) + eps)` without overflow: c = 1 while
  `ms` is finite, else RESCALE (then `ms_rescaled`, the mean square of h * RESCALE, is read);
  inv is NaN when that too is not finite (h held a NaN or inf)."""
  ok = ms <= F32_MAX
  c = jnp.where(ok, 1.0, RESCALE)
  ms = jnp.where(ok, ms, ms_rescaled)
  inv = jax.lax.rsqrt(ms + eps * c * c)
  return c, jnp.where(ms <= F32_MAX, inv, jnp.nan)


def rmsnorm_quant(x, weight, *, residual=None, eps: float, weight_offset: float, fmt: Fp8Format,
                  group_size: int, layout: str, ue8m0: bool, keep_hp: bool, x2=None,
                  weight2=None, eps2: float | None = None) -> RmsNormQuantOutput:
  residual_out = None
  h = x
  if residual is not None:
    residual_out = add_residual(x, residual)
    h = residual_out
  y = rmsnorm(h, weight, eps, weight_offset)
  hp = y.astype(x.dtype) if keep_hp else None
  quant = group_quant_ref.group_quant(y, fmt, group_size=group_size, layout=layout, ue8m0=ue8m0,
                                      hp=hp)
  norm2 = None
  if x2 is not None:
    norm2 = rmsnorm(x2, weight2, eps2, weight_offset).astype(x2.dtype)
  return RmsNormQuantOutput(quant, residual_out, norm2)
