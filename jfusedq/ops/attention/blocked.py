"""Attention as an online softmax over blocks of keys in XLA: scores `[B, Hq, T, block]` at a
time, never `[T, S]`."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def attend(scale: float, block: int):
  """`attend(q, k, v, n, causal) -> (o, lse)` for `api.flash`: q `[B, T, Hq, D]` over k `[B, S,
  Hkv, D]`, v `[B, S, Hkv, Dv]`, keys [0, n) valid (n None: all S), key j visible to query t
  only where j <= t when `causal` (S = T). o `[B, T, Hq, Dv]` f32, lse `[B, T, Hq]` f32.

  Per block of keys, with m the running row max, l the running denominator, acc the running
  numerator (FlashAttention's recurrence):
    s = scale q k_blk^T (f32, masked -inf);  m' = max(m, max s);  p = e^(s - m')
    l' = l e^(m - m') + sum p;  acc' = acc e^(m - m') + p v_blk  (p rounded to v's dtype)
  then o = acc / l, lse = m + log l.
  """

  def run(q, k, v, n, causal):
    b, t, hq, d = q.shape
    s, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    r = hq // hkv
    qg = q.reshape(b, t, hkv, r, d)
    size = min(block, s)
    blocks = -(-s // size)
    if blocks * size != s:  # padded keys lie past n (or past S) and stay masked
      pad = ((0, 0), (0, blocks * size - s), (0, 0), (0, 0))
      k, v = jnp.pad(k, pad), jnp.pad(v, pad)
    limit = s if n is None else n
    rows = jnp.arange(t)

    def step(j, carry):
      m, l, acc = carry
      kb = lax.dynamic_slice_in_dim(k, j * size, size, axis=1)
      vb = lax.dynamic_slice_in_dim(v, j * size, size, axis=1)
      # f32 operands as f32, as the reference (XLA on a GPU would round them to TF32).
      sc = jnp.einsum("btgrd,bsgd->bgrts", qg, kb, preferred_element_type=jnp.float32,
                      precision=lax.Precision.HIGHEST) * scale
      cols = j * size + jnp.arange(size)
      mask = cols[None, :] < limit
      if causal:
        mask = mask & (cols[None, :] <= rows[:, None])
      sc = jnp.where(mask, sc, -jnp.inf)
      m_new = jnp.maximum(m, sc.max(-1))
      # A row with no visible key yet keeps m = -inf; 0 in its place keeps e^(...) at 0.
      m_use = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
      p = jnp.exp(sc - m_use[..., None])
      corr = jnp.exp(m - m_use)
      pv = jnp.einsum("bgrts,bsgd->bgrtd", p.astype(v.dtype), vb,
                      preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
      return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

    init = (jnp.full((b, hkv, r, t), -jnp.inf, jnp.float32), jnp.zeros((b, hkv, r, t),
            jnp.float32), jnp.zeros((b, hkv, r, t, dv), jnp.float32))
    m, l, acc = (step(0, init) if blocks == 1
                 else lax.fori_loop(0, blocks, step, init))
    o = acc / jnp.where(l > 0, l, 1.0)[..., None]
    lse = m + jnp.log(l)
    o = jnp.moveaxis(o, 3, 1).reshape(b, t, hq, dv)
    return o, jnp.moveaxis(lse, 3, 1).reshape(b, t, hq)

  return run

