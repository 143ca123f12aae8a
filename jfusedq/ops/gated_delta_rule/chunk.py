"""Gated delta rule in chunks (prefill): WY form inside a chunk, a scan across chunks.

Within a chunk of C tokens, with G the cumulative log decay (G_i = sum_{j<=i} g_j) and
Gamma_ij = exp(G_i - G_j) for j <= i:
  A    = strict_lower((beta k) k^T * Gamma)
  T    = (I + A)^-1                                    (unit lower triangular solve)
  U    = T (beta v)                                    (pseudo-values)
  W    = T (beta k * exp(G))                           (decayed keys seen by the state)
Across chunks, with S the state entering the chunk:
  V'   = U - W S
  o    = (q * exp(G)) S + (lower(q k^T * Gamma)) V'
  S   <- exp(G_C) S + (k * exp(G_C - G))^T V'
All matmuls in f32 at the highest precision (never TF32 or bf16 passes).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.scipy.linalg import solve_triangular

HIGHEST = lax.Precision.HIGHEST


def _mm(eq, *xs):
  return jnp.einsum(eq, *xs, precision=HIGHEST)


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale: float, initial_state=None,
                           chunk_size: int = 64):
  """Same contract as `naive.recurrent_gated_delta_rule`; T need not divide by chunk_size."""
  b, t, h, dk = k.shape
  dv = v.shape[-1]
  c = chunk_size
  n = -(-t // c)
  pad = n * c - t

  def chunks(a):  # [B, T, H, ...] -> [N, B, H, C, ...] in f32, zero-padded (g = 0: no decay)
    a = jnp.pad(a.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
    a = a.reshape(b, n, c, h, *a.shape[3:])
    return jnp.moveaxis(jnp.moveaxis(a, 1, 0), 3, 2)

  q, k, v, g, beta = chunks(q * scale), chunks(k), chunks(v), chunks(g), chunks(beta)
  # Padded tokens carry k = v = 0 and beta = 0: they change neither the outputs kept nor S.
  cum = jnp.cumsum(g, axis=-1)  # [N, B, H, C]
  lower = jnp.tril(jnp.ones((c, c), bool))
  gamma = jnp.where(lower, jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], 0.0)),
                    0.0)
  kb = k * beta[..., None]
  a = jnp.where(jnp.tril(lower, -1), _mm("...ik,...jk->...ij", kb, k) * gamma, 0.0)
  eye = jnp.eye(c, dtype=jnp.float32)
  tinv = solve_triangular(eye + a, jnp.broadcast_to(eye, a.shape), lower=True,
                          unit_diagonal=True)
  u = _mm("...ij,...jv->...iv", tinv, v * beta[..., None])
  w = _mm("...ij,...jk->...ik", tinv, kb * jnp.exp(cum)[..., None])
  qk = _mm("...ik,...jk->...ij", q, k) * gamma
  last = cum[..., -1:]  # G_C

  def step(s, xs):
    q_i, k_i, u_i, w_i, qk_i, cum_i, last_i = xs
    v_new = u_i - _mm("bhck,bhkv->bhcv", w_i, s)
    o = _mm("bhck,bhkv->bhcv", q_i * jnp.exp(cum_i)[..., None], s) + _mm(
        "bhij,bhjv->bhiv", qk_i, v_new)
    s = s * jnp.exp(last_i)[..., None] + _mm(
        "bhck,bhcv->bhkv", k_i * jnp.exp(last_i - cum_i)[..., None], v_new)
    return s, o

  state = (jnp.zeros((b, h, dk, dv), jnp.float32) if initial_state is None
           else initial_state.astype(jnp.float32))
  state, o = lax.scan(step, state, (q, k, u, w, qk, cum, last))
  o = jnp.moveaxis(o, 0, 1).swapaxes(2, 3).reshape(b, n * c, h, dv)[:, :t]
  return o, state
