"""MLA decode in plain jnp, f32: the contract the kernels are tested against (and the XLA path)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jfusedq.fp8 import BLOCK


def latent(kv: jax.Array, kv_scale: jax.Array | None) -> jax.Array:
  """The cached latent `[B, S, L]` in f32: codes x their 1 x 128 group's scale, or kv."""
  x = kv.astype(jnp.float32)
  if kv_scale is None:
    return x
  s = jnp.repeat(kv_scale, BLOCK, axis=-1)[..., :kv.shape[-1]]
  return x * s


def mla_decode(q_lat, q_pe, kv, kv_scale, k_pe, pos, scale: float) -> jax.Array:
  """o `[B, T, NH, L]` f32 (module `api` for the shapes): every slot scored, slots past each
  query's position masked."""
  lat = latent(kv, kv_scale)
  f32 = lambda a: a.astype(jnp.float32)
  dot = lambda eq, a, b: jnp.einsum(eq, a, b, precision=lax.Precision.HIGHEST)  # no TF32
  s = (dot("bthc,bsc->bths", f32(q_lat), lat) + dot("bthr,bsr->bths", f32(q_pe), f32(k_pe))) * scale
  t, slots = q_lat.shape[1], kv.shape[1]
  qpos = jnp.asarray(pos, jnp.int32) + jnp.arange(t)
  visible = jnp.arange(slots)[None, :] <= qpos[:, None]  # [T, S]: causal, unwritten slots
  s = jnp.where(visible[None, :, None], s, -jnp.inf)
  return dot("bths,bsc->bthc", jax.nn.softmax(s, axis=-1), lat)
