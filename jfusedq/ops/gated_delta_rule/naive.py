"""Gated delta rule, token by token (the definition; also the decode path).

Per head, with state S [K, V] and for each token t (q_t scaled by `scale`):
  S   <- S * exp(g_t)                          (gated decay, g_t <= 0)
  d_t  = beta_t * (v_t - S^T k_t)              (delta rule: correct the memory at k_t)
  S   <- S + k_t d_t^T
  o_t  = S^T q_t
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

HIGHEST = lax.Precision.HIGHEST


def recurrent_gated_delta_rule(q, k, v, g, beta, *, scale: float, initial_state=None):
  """q, k `[B, T, H, K]`, v `[B, T, H, V]`, g, beta `[B, T, H]` -> (o `[B, T, H, V]` f32,
  final state `[B, H, K, V]` f32). All arithmetic in f32."""
  b, _, h, dk = k.shape
  dv = v.shape[-1]
  f32 = lambda a: jnp.moveaxis(a.astype(jnp.float32), 1, 0)  # time first for the scan
  state = (jnp.zeros((b, h, dk, dv), jnp.float32) if initial_state is None
           else initial_state.astype(jnp.float32))

  def step(s, xs):
    q_t, k_t, v_t, g_t, b_t = xs
    s = s * jnp.exp(g_t)[..., None, None]
    mem = jnp.einsum("bhkv,bhk->bhv", s, k_t, precision=HIGHEST)
    s = s + jnp.einsum("bhk,bhv->bhkv", k_t, (v_t - mem) * b_t[..., None], precision=HIGHEST)
    return s, jnp.einsum("bhkv,bhk->bhv", s, q_t * scale, precision=HIGHEST)

  state, o = lax.scan(step, state, (f32(q), f32(k), f32(v), f32(g), f32(beta)))
  return jnp.moveaxis(o, 0, 1), state
