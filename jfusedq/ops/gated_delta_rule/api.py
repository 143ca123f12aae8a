"""Public entry point of the gated delta rule (Gated DeltaNet, Qwen3-Next / Qwen3.5)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jfusedq.ops.gated_delta_rule.chunk import chunk_gated_delta_rule
from jfusedq.ops.gated_delta_rule.naive import recurrent_gated_delta_rule


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """x / sqrt(sum(x^2) + eps) over the last axis, in f32 (the HF / fla convention)."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
                     scale: float | None = None, initial_state: jax.Array | None = None,
                     use_qk_l2norm: bool = False, mode: str = "chunk", chunk_size: int = 64):
  """Gated delta rule over a sequence (see `naive` for the recurrence).

  Args:
    q, k: `[B, T, H, K]`; v: `[B, T, H, V]` (equal head counts: repeat grouped heads first).
    g: `[B, T, H]` log decay (<= 0); beta: `[B, T, H]` write strength in (0, 1).
    scale: multiplies q; default K ** -0.5.
    initial_state: `[B, H, K, V]` (the decode cache), or None for zeros.
    use_qk_l2norm: l2-normalise q and k over K first.
    mode: "chunk" (prefill: matmuls over chunks of `chunk_size`) or "recurrent" (token by
      token: decode, and the reference).
  Returns:
    (o `[B, T, H, V]` in v's dtype, final state `[B, H, K, V]` float32).
  """
  if q.ndim != 4 or k.shape != q.shape or v.ndim != 4 or v.shape[:3] != q.shape[:3]:
    raise ValueError(f"q, k must be [B, T, H, K] and v [B, T, H, V] with equal B, T, H; got "
                     f"{q.shape}, {k.shape}, {v.shape}")
  if g.shape != q.shape[:3] or beta.shape != q.shape[:3]:
    raise ValueError(f"g and beta must be [B, T, H] = {q.shape[:3]}, got {g.shape}, {beta.shape}")
  b, _, h, dk = q.shape
  if initial_state is not None and initial_state.shape != (b, h, dk, v.shape[-1]):
    raise ValueError(f"initial_state must be [B, H, K, V] = {(b, h, dk, v.shape[-1])}, got "
                     f"{initial_state.shape}")
  if mode not in ("chunk", "recurrent"):
    raise ValueError(f"mode must be 'chunk' or 'recurrent', got {mode!r}")
  if use_qk_l2norm:
    q, k = l2norm(q), l2norm(k)
  scale = dk**-0.5 if scale is None else scale
  if mode == "chunk":
    o, state = chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                      chunk_size=chunk_size)
  else:
    o, state = recurrent_gated_delta_rule(q, k, v, g, beta, scale=scale,
                                          initial_state=initial_state)
  return o.astype(v.dtype), state
