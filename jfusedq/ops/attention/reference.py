"""The attention's reference: every score at once in XLA, as the models computed it before the
flash backends (`[B, Hq, T, L + T]` f32 scores)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# f32 products as f32 (XLA's GPU default rounds f32 operands to TF32: 3e-4 apart from the
# f64 oracle on an H100); bf16 operands are exact either way.
HIGHEST = jax.lax.Precision.HIGHEST


def attention(q, k, v, prefix, scale: float) -> jax.Array:
  """`api.attention`'s result from the whole score matrix: keys = [the prefix's `slots` fetched
  whole, the new tokens']; slot j of the prefix visible where j < L, new key j where j <= t.
  -> o `[B, T, Hq, Dv]` f32."""
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  visible = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]  # [T, T]
  if prefix is not None:
    pk, pv = prefix.fetch(jnp.int32(0), prefix.slots)
    k = jnp.concatenate([pk.astype(q.dtype), k], axis=1)
    v = jnp.concatenate([pv.astype(q.dtype), v], axis=1)
    cached = jnp.arange(prefix.slots) < jnp.asarray(prefix.length, jnp.int32)
    visible = jnp.concatenate([jnp.broadcast_to(cached, (t, prefix.slots)), visible], axis=1)
  qg = q.reshape(b, t, hkv, hq // hkv, d)
  scores = jnp.einsum("btgrd,bsgd->bgrts", qg, k, preferred_element_type=jnp.float32,
                      precision=HIGHEST) * scale
  p = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
  o = jnp.einsum("bgrts,bsgd->btgrd", p.astype(v.dtype), v, preferred_element_type=jnp.float32,
                 precision=HIGHEST)
  return o.reshape(b, t, hq, v.shape[-1])
