"""Per-group (1 x G) FP8 quantisation in plain jnp, float32 throughout."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jfusedq.fp8 import AMAX_MIN, BLOCK, F32_MAX, Fp8Format, QuantizedActivation, keep_codes


def pow2_ceil(s: jax.Array) -> jax.Array:
  """Smallest power of two >= s (UE8M0 scales); exact, unlike exp2(ceil(log2(s)))."""
  m, e = jnp.frexp(s)  # s = m * 2**e, m in [0.5, 1)
  return jnp.where(m == 0.5, s, jnp.ldexp(jnp.ones_like(s), e))


def group_quant(y: jax.Array, fmt: Fp8Format, *, group_size: int = BLOCK, layout: str = "row",
                ue8m0: bool = False, hp: jax.Array | None = None) -> QuantizedActivation:
  """Quantise `y [..., K]` in groups of `group_size` consecutive columns.

  For each group: `amax = max(max|y|, 1e-10)`, `scale = amax * f32(1 / fp8_max)` (rounded up
  to a power of two if `ue8m0`), `q = fp8(clamp(y * (1/scale), -fp8_max, fp8_max))`. A last
  partial group covers its real columns only. A group holding a NaN or +-inf gets scale NaN,
  hence NaN codes.
  """
  y = y.astype(jnp.float32)
  *lead, k = y.shape
  groups = -(-k // group_size)
  pad = groups * group_size - k
  yg = jnp.pad(y, [(0, 0)] * len(lead) + [(0, pad)]).reshape(*lead, groups, group_size)
  a = jnp.abs(yg)
  # XLA:CPU's vectorised max reduction drops NaN at some shapes ([16, 256] and [64, 7168] f32
  # did): a NaN counts as inf here, which every max keeps, and either makes the scale NaN.
  amax = jnp.max(jnp.where(jnp.isnan(a), jnp.inf, a), axis=-1)
  scale = jnp.maximum(amax, AMAX_MIN) * fmt.inv_max
  if ue8m0:
    scale = pow2_ceil(scale)
  scale = jnp.where(amax <= F32_MAX, scale, jnp.nan)
  q = jnp.clip(yg * (1.0 / scale)[..., None], -fmt.max, fmt.max)
  q = keep_codes(q.reshape(*lead, groups * group_size)[..., :k].astype(fmt.dtype))
  if layout == "col":
    scale = jnp.moveaxis(scale, -1, 0)
  return QuantizedActivation(q, scale, hp, group_size=group_size, layout=layout)
