"""FP8 weight preparation: 128 x 128 block quantisation and the e4m3fn -> e4m3fnuz conversion."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jfusedq.fp8 import (AMAX_MIN, BLOCK, E4M3FN, E4M3FNUZ, Fp8Format, keep_codes,
                         resolve_format)


def quantize_weight(w: jax.Array, fmt: Fp8Format | str | None = None, block: int = BLOCK):
  """`w [N, K]` float -> (q [N, K] fp8, scale [ceil(N/b), ceil(K/b)] f32), DeepSeek format.

  `fmt`: an Fp8Format, "e4m3fn" / "e4m3fnuz", or None for the device's native format (as the
  activation ops take it).

  Per block: scale = max(amax, 1e-10) / fp8_max, q = fp8(clamp(w / scale)); a partial block is
  zero-padded for its amax (padding never raises it). `scale` multiplies the dequantised
  block, like Hugging Face's `weight_scale_inv`.
  """
  if w.ndim != 2:
    raise ValueError(f"weight must be [N, K], got shape {w.shape}")
  if not jnp.issubdtype(w.dtype, jnp.floating):
    raise TypeError(f"weight must be floating point, got {w.dtype}")
  fmt = resolve_format(fmt)
  n, k = w.shape
  nb, kb = -(-n // block), -(-k // block)
  wp = jnp.pad(w.astype(jnp.float32), ((0, nb * block - n), (0, kb * block - k)))
  blocks = wp.reshape(nb, block, kb, block)
  scale = jnp.maximum(jnp.max(jnp.abs(blocks), axis=(1, 3)), AMAX_MIN) / fmt.max
  q = jnp.clip(blocks / scale[:, None, :, None], -fmt.max, fmt.max)
  q = keep_codes(q.reshape(nb * block, kb * block)[:n, :k].astype(fmt.dtype))
  return q, scale


def e4m3fn_to_e4m3fnuz(q: jax.Array, scale: jax.Array):
  """Reinterpret an e4m3fn checkpoint for MI300 (gfx942): same bits, scale doubled.

  The fnuz exponent bias is 8, not 7, so a bit pattern means half the value; doubling the
  scale restores it. 0x80 is -0 in e4m3fn but NaN in e4m3fnuz, so it becomes 0x00.
  """
  if jnp.dtype(q.dtype) != E4M3FN:
    raise TypeError(f"expected float8_e4m3fn weights, got {q.dtype}")
  bits = lax.bitcast_convert_type(q, jnp.uint8)
  bits = jnp.where(bits == 0x80, jnp.uint8(0), bits)
  return lax.bitcast_convert_type(bits, E4M3FNUZ), scale * 2.0
