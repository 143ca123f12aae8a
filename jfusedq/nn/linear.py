"""Projections that accept the quantised handoff: FP8 block-scaled and plain bf16."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jfusedq.errors import DTypeError, InputError
from jfusedq.fp8 import Fp8Format, QuantizedActivation, resolve_format
from jfusedq.nn.weights import quantize_weight
from jfusedq.ops import _common, _dispatch
from jfusedq.ops.fp8_matmul import fp8_matmul, grouped_fp8_matmul
from jfusedq.ops.ragged_fp8_matmul import ragged_fp8_matmul, ragged_matmul

# Fan-in from the in axis of the `[out, in]` weight: lecun_normal's defaults (in_axis=-2) read
# out_features, which gave a wide-out layer such as an LM head outputs of std sqrt(in / out).
_default_init = nnx.initializers.lecun_normal(in_axis=-1, out_axis=-2)


def check_sizes(layer: str, **sizes) -> None:
  """A layer's constructor sizes: ints >= 1."""
  for name, v in sizes.items():
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
      raise InputError(f"{layer}: {name} must be an int >= 1, got {v!r}")


def check_input(layer: str, x, features: int) -> None:
  """A layer's input: a float array (or a QuantizedActivation) whose last axis is `features`."""
  if not isinstance(x, QuantizedActivation):
    _common.check_array(f"{layer}: x", x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise DTypeError(f"{layer}: x must be floating point, got {x.dtype}")
  if len(x.shape) < 1 or x.shape[-1] != features:
    raise InputError(f"{layer}: x must be [..., {features}], got shape {tuple(x.shape)}")


def _scaled_normal(key, shape, dtype):
  """N(0, 1 / K) for a weight `[..., N, K]`."""
  return nnx.initializers.normal(1.0)(key, shape, dtype) / shape[-1]**0.5


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _init_stack(key, shape, init, fmt, param_dtype):
  """A stack of weights drawn in f32: (fp8 codes, block scales) with `fmt`, else (weights in
  param_dtype, None). One jit from the draw to the result, so its f32 temporaries are XLA's
  (the draw alone is 15 GB for a DeepSeek-V3 expert stack, and each eager step of the
  quantisation would hold another of that size)."""
  w = init(key, shape, jnp.float32)
  if fmt is None:
    return w.astype(param_dtype), None
  return jax.vmap(lambda a: quantize_weight(a, fmt))(w)


def high_precision(x: jax.Array | QuantizedActivation) -> jax.Array:
  """The input a high-precision consumer reads: the array, or a quantised activation's `hp`."""
  if isinstance(x, QuantizedActivation):
    if x.hp is None:
      raise InputError("x: a high-precision projection got a QuantizedActivation without its "
                       "high-precision copy (hp); produce it with keep_hp=True / keep_bf16=True")
    return x.hp
  return x


class Fp8Linear(nnx.Module):
  """W8A8 projection with DeepSeek block scales: `y [..., N] = x [..., K] W^T`.

  W is stored as `weight [N, K]` fp8 and `weight_scale_inv [ceil(N/128), ceil(K/128)]` f32
  (the Hugging Face names). x may be bf16 (quantised per 1 x 128 group on the fly), or a
  `QuantizedActivation` from a fused norm (its fp8 part is used; `hp` is ignored):
    y[m, n] = sum_kb (q_x[m, kb] . q_w[n, kb]) * s_x[m, kb] * s_w[n // 128, kb].
  `ue8m0`: a bf16 x is quantised with power-of-two scales s_x (UE8M0, DESIGN.md 3.1).
  """

  def __init__(self, in_features: int, out_features: int, *, fmt: Fp8Format | str | None = None,
               ue8m0: bool = False, dtype=jnp.bfloat16, param_dtype=jnp.float32,
               kernel_init=_default_init, implementation: str | Sequence[str] | None = None,
               rngs: nnx.Rngs):
    check_sizes("Fp8Linear", in_features=in_features, out_features=out_features)
    # Initialised in param_dtype, then quantised: the fp8 weight is what the layer holds.
    w = kernel_init(rngs.params(), (out_features, in_features), param_dtype)
    q, s = quantize_weight(w, resolve_format(fmt))
    self.weight = nnx.Param(q)
    self.weight_scale_inv = nnx.Param(s)
    self.in_features, self.out_features = in_features, out_features
    self.ue8m0, self.dtype = ue8m0, dtype
    self.implementation = implementation

  def __call__(self, x: jax.Array | QuantizedActivation) -> jax.Array:
    check_input("Fp8Linear", x, self.weight.shape[-1])
    return fp8_matmul(x, self.weight[...], self.weight_scale_inv[...], out_dtype=self.dtype,
                      ue8m0=self.ue8m0, implementation=self.implementation)


class Linear(nnx.Module):
  """Plain projection `y [..., N] = x [..., K] W^T + b`, weight `[N, K]` (Hugging Face layout).

  Accepts a `QuantizedActivation` only if it carries the high-precision copy `hp` (Qwen3.5's
  bf16 `in_proj_ba` after a fused norm): that copy is used, never the fp8 codes.
  """

  def __init__(self, in_features: int, out_features: int, *, use_bias: bool = False,
               dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, kernel_init=_default_init,
               rngs: nnx.Rngs):
    check_sizes("Linear", in_features=in_features, out_features=out_features)
    self.weight = nnx.Param(kernel_init(rngs.params(), (out_features, in_features), param_dtype))
    self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else None
    self.dtype = dtype

  def __call__(self, x: jax.Array | QuantizedActivation) -> jax.Array:
    check_input("Linear", x, self.weight.shape[-1])
    y = jnp.einsum("...k,nk->...n", high_precision(x).astype(self.dtype),
                   self.weight[...].astype(self.dtype), preferred_element_type=jnp.float32)
    if self.bias is not None:
      y = y + self.bias[...].astype(jnp.float32)
    return y.astype(self.dtype)


class StackedLinear(nnx.Module):
  """E projections with stacked weights: `y[e] = x W[e]^T`, W `[E, N, K]` (HF layout): MoE experts.

  FP8 (`fmt` given): `weight [E, N, K]` fp8 and `weight_scale_inv [E, ceil(N/128),
  ceil(K/128)]` f32, the block-scaled GEMM of every expert in one `grouped_fp8_matmul` (which
  reads the weights in place: mapping `fp8_matmul` over experts sliced a copy of each); else
  `weight` in param_dtype, read with the input's high-precision copy. `__call__`: every expert
  on every row; `gathered`: only the experts `idx` picks per row; `ragged`: rows sorted by
  expert, each through its own (`ragged_fp8_matmul` / `ragged_matmul`: the weights read in
  place in either precision). `ue8m0`: as for Fp8Linear.
  """

  def __init__(self, num: int, in_features: int, out_features: int, *,
               fmt: Fp8Format | None, ue8m0: bool = False, dtype=jnp.bfloat16,
               param_dtype=jnp.bfloat16, kernel_init=_scaled_normal,
               implementation: str | Sequence[str] | None = None, rngs: nnx.Rngs):
    check_sizes("StackedLinear", num=num, in_features=in_features, out_features=out_features)
    w, s = _init_stack(rngs.params(), (num, out_features, in_features), kernel_init, fmt,
                       jnp.dtype(param_dtype))
    self.weight = nnx.Param(w)
    self.weight_scale_inv = None if s is None else nnx.Param(s)
    self.fmt, self.ue8m0, self.dtype, self.implementation = fmt, ue8m0, dtype, implementation

  def _grouped(self, a, ids=None):
    return grouped_fp8_matmul(a, self.weight[...], self.weight_scale_inv[...], ids,
                              out_dtype=self.dtype, ue8m0=self.ue8m0,
                              implementation=self.implementation)

  def _dense(self, x, w, spec: str) -> jax.Array:
    y = jnp.einsum(spec, high_precision(x).astype(self.dtype), w.astype(self.dtype),
                   preferred_element_type=jnp.float32)
    return y.astype(self.dtype)

  def __call__(self, x, *, batched: bool = False) -> jax.Array:
    """x `[..., K]` (array or QuantizedActivation), or `[E, ..., K]` with `batched` ->
    `[E, ..., N]`."""
    if self.fmt is not None:
      return self._grouped(x if batched else _leading(x, lambda t: t[None]))
    return self._dense(x, self.weight[...], "e...k,enk->e...n" if batched else "...k,enk->e...n")

  def gathered(self, x, idx: jax.Array, *, batched: bool = False) -> jax.Array:
    """Row m through experts idx[m]: x `[M, K]` (or `[M, k, K]` with `batched`), idx `[M, k]`
    -> `[M, k, N]`. Reads M * k weight matrices, not E: the decode path."""
    if self.fmt is None:
      # As grouped_fp8_matmul: an id outside [0, E) reads a clamped expert, its product zeroed.
      ids, valid = _common.expert_ids(idx, self.weight.shape[0])
      w = self.weight[...][ids]  # [M, k, N, K]
      y = self._dense(x, w, "mjk,mjnk->mjn" if batched else "mk,mjnk->mjn")
      return jnp.where(valid[..., None], y, jnp.zeros((), y.dtype))
    m, k = idx.shape
    # One product per (row, expert): row m's k products share its activation (group m).
    rows = (lambda t: t.reshape(m * k, 1, t.shape[-1])) if batched else (lambda t: t[:, None])
    return self._grouped(_leading(x, rows), idx.reshape(m * k)).reshape(m, k, -1)


  def ragged(self, x, group_sizes: jax.Array, rows: jax.Array | None = None) -> jax.Array:
    """Rows sorted by expert through their experts: x `[T, K]` (array or QuantizedActivation),
    `group_sizes [E]` rows of each expert in order, `rows [M]` the row of x each sorted row
    reads (None: x's own) -> `[M, N]`. The work grows with the rows, not E."""
    if self.fmt is not None:
      return ragged_fp8_matmul(x, self.weight[...], self.weight_scale_inv[...], group_sizes,
                               rows=rows, out_dtype=self.dtype, ue8m0=self.ue8m0,
                               implementation=_dispatch.among("ragged_fp8_matmul",
                                                              self.implementation))
    return ragged_matmul(high_precision(x).astype(self.dtype), self.weight[...], group_sizes,
                         rows=rows, out_dtype=self.dtype,
                         implementation=_dispatch.among("ragged_matmul", self.implementation))


def _leading(x: jax.Array | QuantizedActivation, fn) -> jax.Array | QuantizedActivation:
  """`fn` applied to the leading dims of an array or a QuantizedActivation."""
  return x.map_leading(fn) if isinstance(x, QuantizedActivation) else fn(x)
