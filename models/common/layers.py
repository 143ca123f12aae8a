"""Build options, the projection factory, the embedding and the prepare step."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jfusedq.checkpoint import QuantConfig
from jfusedq.errors import DTypeError, InputError, check_range
from jfusedq.fp8 import QuantizedActivation, default_format
from jfusedq.nn import Fp8Linear, Linear, RMSNorm, StackedLinear

Impl = str | Sequence[str] | None


@dataclasses.dataclass(frozen=True)
class Options:
  """Build options shared by every module of a model (static, hashable).

  quant: FP8 projections (format, power-of-two activation scales or not, and the Hugging Face
    `modules_to_not_convert` that stay in high precision), or None for the unquantised path.
  dtype: activations and the residual stream; param_dtype: high-precision parameters.
  tp_axis: the mesh axis of tensor parallelism (the model then runs inside `jax.shard_map`
    over it, see `tp_apply`), or None.
  ar_strategy: the all-reduce + norm + quant strategy under TP (None: the best available).
  implementation: kernel backend of every jfusedq op the model runs (None: each op's best; an
    op without the named backends runs its own default order), but the prefill attention's,
    whose backends are its own (`jfusedq.ops.attention`; chosen with
    `jfusedq.implementations(attention=...)`).
  """

  quant: QuantConfig | None
  dtype: Any
  param_dtype: Any
  tp_axis: str | None = None
  ar_strategy: str | tuple[str, ...] | None = None
  implementation: str | tuple[str, ...] | None = None

  @classmethod
  def of(cls, fp8: bool | QuantConfig | None, *, dtype, param_dtype, tp_axis=None,
         ar_strategy=None, implementation=None) -> Options:
    """`fp8`: True (every projection FP8 in the device's format), a QuantConfig, or False /
    None (unquantised). Lists become tuples, so the options stay hashable."""
    quant = QuantConfig(default_format()) if fp8 is True else (fp8 or None)
    tup = lambda v: tuple(v) if isinstance(v, list) else v
    return cls(quant, dtype, param_dtype, tp_axis, tup(ar_strategy), tup(implementation))

  @property
  def ue8m0(self) -> bool:
    """Whether activations are quantised with power-of-two (UE8M0) scales."""
    return self.quant is not None and self.quant.ue8m0

  def quantizes(self, *modules: str) -> bool:
    """Whether every one of `modules` (full Hugging Face names) is an FP8 projection."""
    return self.quant is not None and all(self.quant.quantizes(m) for m in modules)

  def proj(self, in_features: int, out_features: int, *modules: str, rngs: nnx.Rngs):
    """Fp8Linear when every one of `modules` (HF names of what it computes) is quantised, else
    a high-precision Linear."""
    if self.quantizes(*modules):
      return Fp8Linear(in_features, out_features, fmt=self.quant.fmt, ue8m0=self.ue8m0,
                       dtype=self.dtype, implementation=self.implementation, rngs=rngs)
    return Linear(in_features, out_features, dtype=self.dtype, param_dtype=self.param_dtype,
                  rngs=rngs)

  def norm(self, features: int, eps: float, *, weight_offset: float = 0.0,
           reduce: bool = False, rngs: nnx.Rngs) -> RMSNorm:
    """An RMSNorm in the model's dtypes and format. `reduce`: its input is a partial sum under
    tensor parallelism (the norm all-reduces it over `tp_axis` first). Zero-centred norms
    (`weight_offset=1`, y * (1 + w)) start at w = 0."""
    init = nnx.initializers.zeros if weight_offset else nnx.initializers.ones
    return RMSNorm(features, eps=eps, weight_offset=weight_offset,
                   fmt=None if self.quant is None else self.quant.fmt, ue8m0=self.ue8m0,
                   axis_name=self.tp_axis if reduce else None, ar_strategy=self.ar_strategy,
                   dtype=self.dtype, param_dtype=self.param_dtype, scale_init=init,
                   implementation=self.implementation, rngs=rngs)


def is_fp8(layer) -> bool:
  """Whether a projection consumes FP8 activations (so a fused norm should quantise for it)."""
  return isinstance(layer, Fp8Linear) or (isinstance(layer, StackedLinear)
                                          and layer.fmt is not None)


def fused_flags(fused: bool | Sequence[bool], layers: int, quant: QuantConfig | None) -> list:
  """Per-layer fused flags from one bool or a sequence; the unquantised path fuses nothing."""
  flags = [fused] * layers if isinstance(fused, bool) else list(fused)
  if len(flags) != layers:
    raise ValueError(f"fused has {len(flags)} flags for {layers} layers")
  return [bool(f) and quant is not None for f in flags]


class Embedding(nnx.Module):
  """`embed_tokens`: ids `[B, T]` -> `weight[ids]` `[B, T, H]` in dtype (weight `[V, H]`).

  Ids outside [0, V) are clamped into it (`jnp.take(mode="clip")`): a finite row of the table,
  where the default gather would fill NaN (id >= V) that attention spreads over the sequence,
  or wrap (a negative id read as V - 1). Concrete ids are checked before that and raise
  `InputError` (see `check_call`); traced ones under `jfusedq.errors.debug_checks()`.
  """

  def __init__(self, num: int, features: int, *, dtype, param_dtype, rngs: nnx.Rngs):
    self.weight = nnx.Param(nnx.initializers.normal(1.0)(rngs.params(), (num, features),
                                                         param_dtype))
    self.dtype = dtype

  def __call__(self, ids: jax.Array) -> jax.Array:
    return jnp.take(self.weight[...], ids, axis=0, mode="clip").astype(self.dtype)

  def attend(self, y: jax.Array) -> jax.Array:
    """Tied LM head: y `[..., H]` -> logits `y W^T` `[..., V]` in f32."""
    return jnp.einsum("...h,vh->...v", y, self.weight[...].astype(y.dtype),
                      preferred_element_type=jnp.float32)


def rotate_half_rope(x: jax.Array, pos, theta: float, rotary_dim: int | None = None) -> jax.Array:
  """Rotate-half RoPE (Hugging Face `apply_rotary_pos_emb`) on the first `rotary_dim` dims of
  each head (default: the whole head).

  x `[B, T, N, D]` at positions p = pos + t. With d = rotary_dim / 2, inv_freq_i =
  theta^(-2i / rotary_dim), angle = p * inv_freq (f32, cos and sin then rounded to x's dtype),
  x1 = x[..., :d], x2 = x[..., d:rotary_dim]:
    out = [x1 cos - x2 sin, x2 cos + x1 sin, x[..., rotary_dim:]].
  """
  t = x.shape[1]
  rotary_dim = x.shape[-1] if rotary_dim is None else rotary_dim
  inv = 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / rotary_dim))
  p = (jnp.asarray(pos, jnp.int32) + jnp.arange(t, dtype=jnp.int32)).astype(jnp.float32)
  ang = p[:, None] * jnp.asarray(inv, jnp.float32)[None, :]  # [T, d]
  cos = jnp.cos(ang)[None, :, None, :].astype(x.dtype)
  sin = jnp.sin(ang)[None, :, None, :].astype(x.dtype)
  d = rotary_dim // 2
  x1, x2, rest = x[..., :d], x[..., d:rotary_dim], x[..., rotary_dim:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


class MLP(nnx.Module):
  """SwiGLU `down_proj(silu(gate_proj(x)) * up_proj(x))`: x `[B, T, H]` -> `[B, T, H]`, silu
  rounded to `dtype` before the product, as Hugging Face's Llama and Qwen3.5 compute it
  (gate/up column-, down row-parallel under TP: a partial sum). `name`: the HF module prefix
  ("model.layers.{i}.mlp.")."""

  def __init__(self, h: int, inter: int, name: str, opts: Options, *, rngs: nnx.Rngs):
    self.gate_proj = opts.proj(h, inter, name + "gate_proj", rngs=rngs)
    self.up_proj = opts.proj(h, inter, name + "up_proj", rngs=rngs)
    self.down_proj = opts.proj(inter, h, name + "down_proj", rngs=rngs)
    self.dtype = opts.dtype

  @property
  def needs_hp(self) -> bool:
    return isinstance(self.gate_proj, Linear) or isinstance(self.up_proj, Linear)

  def __call__(self, x):
    a = jax.nn.silu(self.gate_proj(x).astype(jnp.float32)).astype(self.dtype)
    return self.down_proj((a * self.up_proj(x)).astype(self.dtype))


def prepare(norm: RMSNorm, h: jax.Array, residual: jax.Array | None, *, quant: bool,
            keep_hp: bool) -> tuple[jax.Array | QuantizedActivation, jax.Array]:
  """The prepare step before a mixer or MLP (SGLang's LayerCommunicator):

    r' = psum(h) + r          (psum only when `norm` has a TP axis: h is a partial sum)
    x  = rmsnorm(r') * w      quantised (a QuantizedActivation, + `hp` when `keep_hp`) when
                              `quant`, else in dtype; one kernel either way

  `residual` None: h is the embedding (replicated, layer 0) and becomes the residual.
  Returns (x, r')."""
  if residual is None:
    return norm(h, quant=quant, keep_hp=keep_hp), h.astype(norm.dtype)
  return norm(h, residual, quant=quant, keep_hp=keep_hp)


def write_cache(cache: jax.Array | None, x: jax.Array, pos: jax.Array | int) -> jax.Array | None:
  """`cache [B, S, ...]` with `x [B, T, ...]` (cast to the cache's dtype) in slots
  pos .. pos + T - 1 (slot s holds position s); None stays None. A traced pos outside
  [0, S - T] is clamped into it (XLA's dynamic_update_slice), so earlier slots are overwritten:
  concrete positions are checked by `check_call`, traced ones under `debug_checks()`."""
  if cache is None:
    return None
  at = (0, jnp.asarray(pos, jnp.int32)) + (0,) * (cache.ndim - 2)
  return lax.dynamic_update_slice(cache, x.astype(cache.dtype), at)


def check_call(tokens, *, vocab: int, cache_len: int | None, pos) -> None:
  """The inputs of a model's `__call__`, before tracing: tokens an integer `[B, T]` array with
  B, T >= 1 and (when concrete) ids in [0, vocab); pos >= 0 and, with a cache of `cache_len`
  slots, pos + T <= cache_len. Traced ids and positions are checked at run time only under
  `jfusedq.errors.debug_checks()`; otherwise the embedding and the cache write clamp them.

  Raises:
    InputError, DTypeError: naming the argument, its value and what it needs.
  """
  if not hasattr(tokens, "shape") or not hasattr(tokens, "dtype"):
    raise InputError(f"tokens must be an integer [B, T] array, got {type(tokens).__name__}")
  if tokens.ndim != 2:
    raise InputError(f"tokens must be [B, T] (batch, length), got shape {tuple(tokens.shape)}")
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise DTypeError(f"tokens must hold integer ids, got dtype {tokens.dtype}")
  b, t = tokens.shape
  if b < 1 or t < 1:
    raise InputError(f"tokens must have batch and length >= 1, got shape {(b, t)}")
  check_range("tokens", tokens, 0, vocab)
  if cache_len is None:
    if not isinstance(pos, jax.core.Tracer) and int(np.asarray(pos)) < 0:
      raise InputError(f"pos must be >= 0, got {int(np.asarray(pos))}")
    return
  if isinstance(pos, jax.core.Tracer):
    check_range("pos", pos, 0, cache_len - t + 1)
    return
  p = int(np.asarray(pos))
  if p < 0 or p + t > cache_len:
    raise InputError(f"pos = {p} with {t} tokens needs slots [{p}, {p + t}), outside the "
                     f"cache's [0, {cache_len}): pos must lie in [0, {cache_len - t}]")


def check_chunk(chunk) -> None:
  """A prefill chunk (`CausalLM.__call__`): an int >= 1, or None."""
  if chunk is not None and (not isinstance(chunk, (int, np.integer)) or isinstance(chunk, bool)
                            or chunk < 1):
    raise InputError(f"chunk must be an int >= 1 or None, got {chunk!r}")


def check_cache_args(batch, max_len) -> None:
  """`init_cache(batch, max_len)`: both ints >= 1."""
  for name, v in (("batch", batch), ("max_len", max_len)):
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
      raise InputError(f"{name} must be an int >= 1, got {v!r}")


def check_generate(*, batch: int, prompt_len: int, steps: int, max_len: int) -> None:
  """A generation run (prompt of `prompt_len`, then `steps` decode steps, in a cache of
  `max_len` slots): batch, prompt_len >= 1, steps >= 0, prompt_len + steps <= max_len."""
  check_cache_args(batch, max_len)
  if not isinstance(prompt_len, (int, np.integer)) or prompt_len < 1:
    raise InputError(f"prompt_len must be an int >= 1, got {prompt_len!r}")
  if not isinstance(steps, (int, np.integer)) or steps < 0:
    raise InputError(f"steps must be an int >= 0, got {steps!r}")
  if prompt_len + steps > max_len:
    raise InputError(f"prompt_len + steps = {prompt_len + steps} exceeds the cache's max_len = "
                     f"{max_len}")


class CausalLMOutput(NamedTuple):
  logits: jax.Array  # [B, T, V] f32
  cache: tuple | None  # the updated per-layer cache, when one was given
