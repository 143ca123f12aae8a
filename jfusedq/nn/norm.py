"""RMSNorm layer that can hand the next FP8 projection an already-quantised activation."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jfusedq.errors import InputError
from jfusedq.fp8 import BLOCK, Fp8Format, QuantizedActivation
from jfusedq.nn.linear import check_input, check_sizes
from jfusedq.ops import _common
from jfusedq.ops.fp8_matmul import scale_layout
from jfusedq.ops.rmsnorm import rmsnorm
from jfusedq.ops.rmsnorm_quant import rmsnorm_quant
from jfusedq.parallel import allreduce_rmsnorm_quant


class RMSNorm(nnx.Module):
  """(All-reduce +) (residual add +) RMSNorm, optionally fused with per-group FP8 quantisation.

    x = psum(x) over `axis_name` (when given: x is this device's partial sum)
    h = x + residual (rounded to `dtype`; h = x without a residual)
    y = h * rsqrt(mean(h^2) + eps) * (w + weight_offset)      (in f32)

  Shapes: x, residual `[..., H]`; weight `[H]`. With `quant=False` y is returned in `dtype`;
  with `quant=True` it is a `QuantizedActivation` (q `[..., H]` fp8, scales in the layout
  `fp8_matmul.scale_layout` asks for at that many rows, plus `hp` = y in `dtype` when
  `keep_hp`) made by the fused `rmsnorm_quant` kernel, or with
  `axis_name` by `jfusedq.parallel.allreduce_rmsnorm_quant` (psum + add + norm + quant as one
  step, its strategy chosen by `ar_strategy`); `ue8m0` rounds its scales up to powers of two
  (UE8M0, DESIGN.md 3.1). Returns y alone without a residual, `(y, h)`
  with one, like SGLang's RMSNorm (h is the new residual). Call it inside `jax.shard_map` over
  `axis_name` when that is set.
  """

  def __init__(self, num_features: int, *, eps: float = 1e-6, weight_offset: float = 0.0,
               quant: bool = False, keep_hp: bool = False, fmt: Fp8Format | str | None = None,
               group_size: int = BLOCK, ue8m0: bool = False, axis_name: str | None = None,
               ar_strategy: str | Sequence[str] | None = None, dtype=jnp.bfloat16,
               param_dtype=jnp.bfloat16, scale_init=nnx.initializers.ones,
               implementation: str | Sequence[str] | None = None, rngs: nnx.Rngs):
    check_sizes("RMSNorm", num_features=num_features)
    if not float(eps) >= 0.0:
      raise InputError(f"RMSNorm: eps must be >= 0, got {eps!r}")
    self.weight = nnx.Param(scale_init(rngs.params(), (num_features,), param_dtype))
    self.eps, self.weight_offset = float(eps), float(weight_offset)
    self.quant, self.keep_hp, self.fmt, self.group_size = quant, keep_hp, fmt, group_size
    self.ue8m0 = ue8m0
    self.axis_name = axis_name
    self.ar_strategy = tuple(ar_strategy) if isinstance(ar_strategy, list) else ar_strategy
    self.dtype = dtype
    self.implementation = implementation

  def __call__(self, x: jax.Array, residual: jax.Array | None = None, *,
               quant: bool | None = None, keep_hp: bool | None = None
               ) -> jax.Array | QuantizedActivation | tuple:
    quant = self.quant if quant is None else quant
    keep_hp = self.keep_hp if keep_hp is None else keep_hp
    check_input("RMSNorm", x, self.weight.shape[0])
    if residual is not None and tuple(residual.shape) != tuple(x.shape):
      raise InputError(f"RMSNorm: residual shape {tuple(residual.shape)} differs from x shape "
                       f"{tuple(x.shape)}")
    x = x.astype(self.dtype)
    residual = None if residual is None else residual.astype(self.dtype)
    w = self.weight[...]
    # The projection's layout: writing column-layout scales cost the norm kernel 1.00-1.04x
    # the time at T = 256-16384 (H200), less than the transpose it saves the GEMM.
    layout = scale_layout(_common.rows(x))
    if quant and self.axis_name is not None:
      y, h = allreduce_rmsnorm_quant(x, residual, w, axis_name=self.axis_name, eps=self.eps,
                                     weight_offset=self.weight_offset,
                                     group_size=self.group_size, fmt=self.fmt, layout=layout,
                                     ue8m0=self.ue8m0, keep_bf16=keep_hp, strategy=self.ar_strategy,
                                     implementation=self.implementation)
      return y if residual is None else (y, h)
    if self.axis_name is not None:
      x = lax.psum(x, self.axis_name)
    if quant:
      out = rmsnorm_quant(x, w, residual=residual, eps=self.eps, weight_offset=self.weight_offset,
                          group_size=self.group_size, fmt=self.fmt, layout=layout,
                          ue8m0=self.ue8m0, keep_hp=keep_hp, implementation=self.implementation)
      y = out.quant
    else:
      out = rmsnorm(x, w, residual=residual, eps=self.eps, weight_offset=self.weight_offset,
                    implementation=self.implementation)
      y = out.y
    return y if residual is None else (y, out.residual)

  def dual(self, x: jax.Array, second: RMSNorm, x2: jax.Array
           ) -> tuple[QuantizedActivation, jax.Array]:
    """This norm of x quantised, and `second`'s norm of x2 in its dtype, in one kernel launch
    (DeepSeek MLA: q_a_layernorm feeds the FP8 q_b_proj, kv_a_layernorm the latent cache).

    x `[..., H]`, x2 `[..., H2]`; no residual, no all-reduce. Returns (QuantizedActivation of
    `[..., H]`, `[..., H2]`)."""
    if second.weight_offset != self.weight_offset:
      raise InputError("second: the dual-input kernel applies one weight_offset to both norms; got "
                       f"{self.weight_offset} and {second.weight_offset}")
    out = rmsnorm_quant(x.astype(self.dtype), self.weight[...], x2=x2.astype(second.dtype),
                        weight2=second.weight[...], eps=self.eps, eps2=second.eps,
                        weight_offset=self.weight_offset, group_size=self.group_size,
                        fmt=self.fmt, layout=scale_layout(_common.rows(x)),
                        ue8m0=self.ue8m0, implementation=self.implementation)
    return out.quant, out.norm2
