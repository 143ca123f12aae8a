"""Projections that accept the quantised handoff: FP8 block-scaled and plain bf16."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jfusedq.fp8 import Fp8Format, QuantizedActivation, resolve_format
from jfusedq.nn.weights import quantize_weight
from jfusedq.ops.fp8_matmul import fp8_matmul

_default_init = nnx.initializers.lecun_normal()


class Fp8Linear(nnx.Module):
  """W8A8 projection with DeepSeek block scales: `y [..., N] = x [..., K] W^T`.

  W is stored as `weight [N, K]` fp8 and `weight_scale_inv [ceil(N/128), ceil(K/128)]` f32
  (the Hugging Face names). x may be bf16 (quantised per 1 x 128 group on the fly), or a
  `QuantizedActivation` from a fused norm (its fp8 part is used; `hp` is ignored):
    y[m, n] = sum_kb (q_x[m, kb] . q_w[n, kb]) * s_x[m, kb] * s_w[n // 128, kb].
  """

  def __init__(self, in_features: int, out_features: int, *, fmt: Fp8Format | str | None = None,
               dtype=jnp.bfloat16, param_dtype=jnp.float32, kernel_init=_default_init,
               implementation: str | Sequence[str] | None = None, rngs: nnx.Rngs):
    # Initialised in param_dtype, then quantised: the fp8 weight is what the layer holds.
    w = kernel_init(rngs.params(), (out_features, in_features), param_dtype)
    q, s = quantize_weight(w, resolve_format(fmt))
    self.weight = nnx.Param(q)
    self.weight_scale_inv = nnx.Param(s)
    self.in_features, self.out_features = in_features, out_features
    self.dtype = dtype
    self.implementation = implementation

  def __call__(self, x: jax.Array | QuantizedActivation) -> jax.Array:
    return fp8_matmul(x, self.weight[...], self.weight_scale_inv[...], out_dtype=self.dtype,
                      implementation=self.implementation)


class Linear(nnx.Module):
  """Plain projection `y [..., N] = x [..., K] W^T + b`, weight `[N, K]` (Hugging Face layout).

  Accepts a `QuantizedActivation` only if it carries the high-precision copy `hp` (Qwen3.5's
  bf16 `in_proj_ba` after a fused norm): that copy is used, never the fp8 codes.
  """

  def __init__(self, in_features: int, out_features: int, *, use_bias: bool = False,
               dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, kernel_init=_default_init,
               rngs: nnx.Rngs):
    self.weight = nnx.Param(kernel_init(rngs.params(), (out_features, in_features), param_dtype))
    self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else None
    self.dtype = dtype

  def __call__(self, x: jax.Array | QuantizedActivation) -> jax.Array:
    if isinstance(x, QuantizedActivation):
      if x.hp is None:
        raise ValueError("Linear got a QuantizedActivation without its high-precision copy "
                         "(hp); produce it with keep_hp=True / keep_bf16=True")
      x = x.hp
    y = jnp.einsum("...k,nk->...n", x.astype(self.dtype), self.weight[...].astype(self.dtype),
                   preferred_element_type=jnp.float32)
    if self.bias is not None:
      y = y + self.bias[...].astype(jnp.float32)
    return y.astype(self.dtype)
