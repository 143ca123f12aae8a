"""Attention through cuDNN's fused flash attention, by JAX's own binding of it.

`jax.nn.dot_product_attention(implementation="cudnn")` is that binding's public wrapper, but it
requires v's head dim to equal q's (DeepSeek-V3's per-head MLA has 192 and 128) and rounds the
returned log-sum-exp to the inputs' dtype, where merging partial attentions needs f32 (a bf16
lse of ~10 is off by up to 0.03, a 3% error in a segment's weight). The binding itself
(`jax._src.cudnn.fused_attention_stablehlo`) takes Dv != Dqk on Hopper with cuDNN >= 9.10 and
returns the statistics in f32. It is JAX internals: CI runs on CPU, where this backend declines
before reaching it, so only a GPU run (benchmarks/prefill.py) checks it against a JAX upgrade.
"""

from __future__ import annotations

import jax.numpy as jnp

from jfusedq.ops._dispatch import Unsupported


def attend(scale: float, target):
  """`attend(q, k, v, n, causal) -> (o, lse)` for `api.flash` (see `blocked.attend`) as one
  cuDNN call: causal (T = S, where its top-left causal mask is the right one), or keys [0, n)
  by its padding mask. Declines (`Unsupported`) off CUDA, for dtypes other than bf16 / f16,
  and for whatever cuDNN's own checks refuse at trace time."""

  def run(q, k, v, n, causal):
    if target.platform != "cuda":
      raise Unsupported(f"cuDNN attention needs an NVIDIA GPU, not {target.platform}")
    if q.dtype not in (jnp.bfloat16, jnp.float16):
      raise Unsupported(f"cuDNN attention takes bf16 / f16, got {q.dtype}")
    try:
      from jax._src.cudnn import fused_attention_stablehlo as fa
    except ImportError as e:
      raise Unsupported(f"JAX's cuDNN attention binding is missing: {e}") from e
    b, t = q.shape[:2]
    kw = dict(mask_type=fa.MaskType.CAUSAL)
    if not causal:
      kw = dict(mask_type=fa.MaskType.PADDING, q_seqlen=jnp.full((b,), t, jnp.int32),
                kv_seqlen=jnp.full((b,), n, jnp.int32))
    try:
      o, lse = fa.dot_product_attention(q, k, v, scale=scale, qkv_layout="BTNH",
                                        return_residual=True, **kw)
    except (NotImplementedError, RuntimeError) as e:  # no cuDNN, or a shape it does not run
      raise Unsupported(f"cuDNN attention: {e}") from e
    return o.astype(jnp.float32), jnp.moveaxis(lse, 1, 2).astype(jnp.float32)

  return run
