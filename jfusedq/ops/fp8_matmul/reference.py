"""Block-scaled W8A8 GEMM in plain jnp, float32.

out[m, n] = sum_kb (q_a[m, kb] . q_w[n, kb]) * a_scale[m, kb] * w_scale[n // 128, kb]. Each
scale is constant over its block, so this equals the dot of the dequantised operands, which
is how it is computed here (in f32 at the highest precision, never TF32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jfusedq.fp8 import BLOCK, QuantizedActivation


def dequantize_weight(qw: jax.Array, w_scale: jax.Array, block: int = BLOCK) -> jax.Array:
  """`qw [N, K]` fp8 and `w_scale [ceil(N/b), ceil(K/b)]` -> f32 `[N, K]`."""
  n, k = qw.shape
  s = jnp.repeat(jnp.repeat(w_scale, block, axis=0), block, axis=1)[:n, :k]
  return qw.astype(jnp.float32) * s


def fp8_matmul(a: QuantizedActivation, qw: jax.Array, w_scale: jax.Array,
               out_dtype=jnp.bfloat16) -> jax.Array:
  """`a.q [..., K]` x `qw [N, K]` -> `[..., N]` in out_dtype."""
  out = jnp.einsum("...k,nk->...n", a.dequantize(jnp.float32), dequantize_weight(qw, w_scale),
                   precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
  return out.astype(out_dtype)
