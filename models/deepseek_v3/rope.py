"""DeepSeek-V3's rotary embedding: HF's default / YaRN frequencies, interleaved pairs."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from models.deepseek_v3.config import DeepseekV3Config


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(cfg: DeepseekV3Config) -> float:
  """Dqk^-0.5, times yarn_mscale(factor, mscale_all_dim)^2 under YaRN (HF yarn_apply_mscale)."""
  scale = cfg.qk_head_dim ** -0.5
  y = cfg.rope_scaling
  if y is not None and y.mscale_all_dim:
    scale *= yarn_mscale(y.factor, y.mscale_all_dim) ** 2
  return scale


@functools.lru_cache(maxsize=None)
def rope_frequencies(cfg: DeepseekV3Config) -> tuple[np.ndarray, float]:
  """(inv_freq [R/2] f32, attention_factor): HF's default / YaRN RoPE parameters.

  Computed in float32 the way transformers computes them, so angles agree to the last bit.
  """
  dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
  pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
  y = cfg.rope_scaling
  if y is None:
    return (np.float32(1.0) / pos_freqs).astype(np.float32), 1.0
  if y.attention_factor is not None:
    attention_factor = float(y.attention_factor)
  elif y.mscale and y.mscale_all_dim:
    attention_factor = yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim)
  else:
    attention_factor = yarn_mscale(y.factor)

  def correction_dim(rotations):
    return (dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(base)))

  low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
  if y.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001  # HF: prevent a zero-width ramp
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low))
                 / np.float32(high - low), 0, 1).astype(np.float32)
  extrapolation = 1 - ramp  # the share of the unscaled frequency
  inv_freq = (np.float32(1.0) / (np.float32(y.factor) * pos_freqs) * (1 - extrapolation)
              + np.float32(1.0) / pos_freqs * extrapolation)
  return inv_freq.astype(np.float32), attention_factor


def rope_tables(cfg: DeepseekV3Config, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
  """cos, sin `[B, T, R/2]` f32 for integer `positions [B, T]`, times the YaRN attention factor."""
  inv_freq, factor = rope_frequencies(cfg)
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleave: bool) -> jax.Array:
  """Rotates `x [..., R]` by cos/sin `[..., R/2]` (broadcast), in f32, back to x.dtype.

  DeepSeek's weights hold each rotated pair interleaved, (x0, x1), (x2, x3), ...; HF's
  `apply_rotary_pos_emb_interleave` rotates the even/odd slices and writes the result
  de-interleaved, [even' | odd']. Queries and keys get the same permutation, so q.k is that of
  the interleaved rotation; the cache holds keys in the de-interleaved order. Without
  interleave, the pairs are (x_i, x_{i + R/2}) (rotate_half).
  """
  xf = x.astype(jnp.float32)
  if interleave:
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
  else:
    x1, x2 = jnp.split(xf, 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
