"""DeepSeek-V3 (MLA attention + DeepSeekMoE) in Flax NNX on jfusedq's fused norm + FP8 path.

Shapes: B batch, T new tokens, S cache slots, H hidden_size, V vocab, NH attention heads (per
tensor-parallel device inside shard_map), Lq q_lora_rank, Lkv kv_lora_rank, R qk_rope_head_dim,
Dn qk_nope_head_dim, Dv v_head_dim, Dqk = Dn + R, E routed experts, I intermediate sizes.

Decoder layer l, SGLang LayerCommunicator style: the layer receives the previous layer's
output `h` (a partial sum under tensor parallelism) and the residual stream `r`:

  prepare_attn:  r = h + r;  x = quant(rmsnorm(r) * w_in)          one fused kernel, with the
                                                                   TP all-reduce folded in
  attention:     h = o_proj(MLA(x))                                FP8 projections
  prepare_mlp:   r = h + r;  x = quant(rmsnorm(r) * w_post) (+ bf16 copy for the MoE router)
  mlp:           h = MoE(x) or SwiGLU(x)                           FP8 experts

and after the last layer logits = lm_head(rmsnorm(h + r) * w_final) in bf16. With `fused=False`
the same weights run the unfused composition: rmsnorm to bf16, then each FP8 projection
quantises its input itself. Without a quantisation config every projection is a bf16 (or f32)
`jfusedq.nn.Linear` and the norms are plain: the unquantised path that matches Hugging Face.

MLA (q_lora_rank set, as in DeepSeek-V3):
  [q_a | kv_a | k_pe] = fused_qkv_a_proj_with_mqa(x)        [B, T, Lq + Lkv + R], one GEMM
  q_in, kv = rmsnorm_quant(q_a, w_qa, x2=kv_a, weight2=w_kva)  one dual-input kernel: q_in
                                                               quantised, kv bf16
  q = q_b_proj(q_in) -> [B, T, NH, Dn + R];  [k_nope | v] = kv_b_proj(kv) -> [B, T, NH, Dn + Dv]
  q_pe, k_pe = rope(q_pe), rope(k_pe)  (DeepSeek's interleaved pairs, YaRN frequencies; k_pe is
                                        one head shared by all)
  o = softmax(q k^T * scale + causal) v, scale = Dqk^-0.5 * yarn_mscale(factor, mscale_all_dim)^2
  out = o_proj(o)                                           [B, T, H]
With a cache (prefill and decode) the layer keeps MLA's latent, kv and k_pe (`KVCache`), and
attends with kv_b_proj absorbed into q and o (`DeepseekV3Attention._absorbed`); without one
it runs the per-head formula above, as Hugging Face does.

MoE: s = sigmoid(hp W_gate^T) [T, E] (f32); groups scored by the sum of their top-2 of
s + e_score_correction_bias; experts chosen (top_k) from the best topk_group of n_group groups;
weights = s at the chosen experts, normalised (norm_topk_prob), times routed_scaling_factor;
out = sum_k weight_k expert_k(x) + shared_experts(x).

Tensor parallel (`shard_forward`): heads split over the axis (q_b_proj, kv_b_proj column-
parallel; o_proj row-parallel), MLP / expert intermediate dims split (gate/up column, down row);
the partial sums of o_proj and down_proj are all-reduced inside the next prepare step by
`jfusedq.parallel.allreduce_rmsnorm_quant`. fused_qkv_a, router, norms, embeddings and lm_head
are replicated.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jfusedq.checkpoint import (Checkpoint, CheckpointError, QuantConfig, TensorMismatchError,
                                load_array, load_linear)
from jfusedq.fp8 import Fp8Format, QuantizedActivation
from jfusedq.nn import Fp8Linear, Linear, StackedLinear
from jfusedq.nn.norm import RMSNorm
from jfusedq.ops.fp8_matmul import activation_format
from jfusedq.ops.fp8_matmul.reference import dequantize_weight
from jfusedq.ops.group_quant import group_quant
from jfusedq.ops.rmsnorm_quant import rmsnorm_quant
from jfusedq.parallel import allreduce_rmsnorm_quant

# DeepseekV3RMSNorm(q_lora_rank) / (kv_lora_rank) in HF and DeepSeek's own code take the
# default eps, not config.rms_norm_eps.
LORA_NORM_EPS = 1e-6
_normal = nnx.initializers.normal(1.0)


# --- config --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class YarnScaling:
  """YaRN RoPE scaling (HF `rope_scaling` / `rope_parameters` with type "yarn")."""

  factor: float
  original_max_position_embeddings: int
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float = 1.0
  mscale_all_dim: float = 0.0
  attention_factor: float | None = None
  truncate: bool = True


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config:
  """The fields of a Hugging Face DeepseekV3Config this model uses (defaults: DeepSeek-V3)."""

  vocab_size: int = 129280
  hidden_size: int = 7168
  intermediate_size: int = 18432
  moe_intermediate_size: int = 2048
  num_hidden_layers: int = 61
  num_attention_heads: int = 128
  num_key_value_heads: int = 128
  n_shared_experts: int = 1
  n_routed_experts: int = 256
  routed_scaling_factor: float = 2.5
  kv_lora_rank: int = 512
  q_lora_rank: int = 1536
  qk_rope_head_dim: int = 64
  v_head_dim: int = 128
  qk_nope_head_dim: int = 128
  n_group: int = 8
  topk_group: int = 4
  num_experts_per_tok: int = 8
  first_k_dense_replace: int = 3
  norm_topk_prob: bool = True
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: YarnScaling | None = None
  rope_interleave: bool = True
  max_position_embeddings: int = 4096
  tie_word_embeddings: bool = False
  hidden_act: str = "silu"
  # config.json's quantization_config, as read (compare=False keeps the config hashable).
  quantization_config: dict | None = dataclasses.field(default=None, compare=False)

  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @classmethod
  def from_hf(cls, d: dict) -> DeepseekV3Config:
    """From a Hugging Face config.json dict (transformers 4.x `rope_scaling` + `rope_theta`, or
    5.x `rope_parameters`)."""
    names = {f.name for f in dataclasses.fields(cls)} - {"rope_scaling", "rope_theta"}
    kw = {k: d[k] for k in names if d.get(k) is not None}
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    kw["rope_theta"] = float(rope.get("rope_theta") or d.get("rope_theta") or 10000.0)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "yarn":
      factor = rope.get("factor")
      orig = rope.get("original_max_position_embeddings") or d.get("max_position_embeddings")
      if factor is None:  # HF: the ratio of the context lengths when no factor is given
        factor = d["max_position_embeddings"] / orig
      fields = {f.name for f in dataclasses.fields(YarnScaling)}
      extra = {k: v for k, v in rope.items() if k in fields and v is not None}
      kw["rope_scaling"] = YarnScaling(**{**extra, "factor": float(factor),
                                          "original_max_position_embeddings": int(orig)})
    elif kind not in ("default", None):
      raise NotImplementedError(f"rope type {kind!r}: only 'default' and 'yarn' are supported")
    cfg = cls(**kw)
    if cfg.q_lora_rank is None:
      raise NotImplementedError("q_lora_rank=None (DeepSeek-V2-Lite's direct q_proj) is not "
                                "supported")
    if cfg.hidden_act != "silu":
      raise NotImplementedError(f"hidden_act={cfg.hidden_act!r}: only 'silu' is supported")
    if cfg.num_key_value_heads != cfg.num_attention_heads:
      raise NotImplementedError("MLA expands keys per head: num_key_value_heads must equal "
                                "num_attention_heads")
    if cfg.n_routed_experts % cfg.n_group:
      raise ValueError(f"n_routed_experts={cfg.n_routed_experts} is not divisible by "
                       f"n_group={cfg.n_group}")
    return cfg

  @classmethod
  def from_json(cls, path: str | os.PathLike) -> DeepseekV3Config:
    if os.path.isdir(path):
      path = os.path.join(path, "config.json")
    with open(path) as f:
      return cls.from_hf(json.load(f))


# --- rotary embedding ----------------------------------------------------------------------


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


# --- building blocks -----------------------------------------------------------------------


class Options(NamedTuple):
  """Construction options shared by every layer (static)."""

  quant: QuantConfig | None
  dtype: Any
  param_dtype: Any
  implementation: str | Sequence[str] | None

  def quantizes(self, *modules: str) -> bool:
    return self.quant is not None and all(self.quant.quantizes(m) for m in modules)

  def proj(self, in_features: int, out_features: int, *modules: str, rngs: nnx.Rngs):
    """Fp8Linear when every one of `modules` (HF names) is quantised, else Linear."""
    if self.quantizes(*modules):
      return Fp8Linear(in_features, out_features, fmt=self.quant.fmt, dtype=self.dtype,
                       implementation=self.implementation, rngs=rngs)
    return Linear(in_features, out_features, dtype=self.dtype, param_dtype=self.param_dtype,
                  rngs=rngs)

  def norm(self, features: int, eps: float, *, rngs: nnx.Rngs) -> RMSNorm:
    fmt = None if self.quant is None else self.quant.fmt
    return RMSNorm(features, eps=eps, fmt=fmt, dtype=self.dtype, param_dtype=self.param_dtype,
                   implementation=self.implementation, rngs=rngs)


def is_fp8(layer) -> bool:
  """Whether a projection consumes FP8 activations (so a fused norm should quantise for it)."""
  return isinstance(layer, Fp8Linear) or (isinstance(layer, StackedLinear)
                                          and layer.fmt is not None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
  """One layer's MLA latent cache; slot s holds position s.

  kv `[B, S, Lkv]` the normalised latent exactly as kv_b_proj consumes it: with an FP8
  kv_b_proj its 1 x 128 fp8 codes, and kv_scale `[B, S, ceil(Lkv/128)]` f32 their scales (None
  for a bf16 / f32 kv_b_proj); k_pe `[B, S, R]` the rotated rope key (rope part de-interleaved),
  one head shared by all. Lkv + R values a token (576 in DeepSeek-V3) where a per-head cache
  holds NH (Dqk + Dv) (40960): the heads' keys and values are never materialised.
  """

  kv: jax.Array
  kv_scale: jax.Array | None
  k_pe: jax.Array


class Embedding(nnx.Module):
  """`embed_tokens`: ids `[B, T]` -> `weight[ids]` `[B, T, H]` in dtype."""

  def __init__(self, num: int, features: int, *, dtype, param_dtype, rngs: nnx.Rngs):
    self.weight = nnx.Param(_normal(rngs.params(), (num, features), param_dtype))
    self.dtype = dtype

  def __call__(self, ids: jax.Array) -> jax.Array:
    return jnp.take(self.weight[...], ids, axis=0).astype(self.dtype)


class DeepseekV3MLP(nnx.Module):
  """SwiGLU MLP: `down_proj(silu(gate_proj(x)) * up_proj(x))`, x `[..., H]` -> `[..., H]`.

  x may be a `QuantizedActivation` (fused path; FP8 projections use its codes) or an array.
  Under tensor parallelism gate/up hold I/tp rows and the result is a partial sum.
  """

  def __init__(self, hidden: int, intermediate: int, name: str, opts: Options, *,
               rngs: nnx.Rngs):
    self.gate_proj = opts.proj(hidden, intermediate, f"{name}.gate_proj", rngs=rngs)
    self.up_proj = opts.proj(hidden, intermediate, f"{name}.up_proj", rngs=rngs)
    self.down_proj = opts.proj(intermediate, hidden, f"{name}.down_proj", rngs=rngs)
    self.dtype = opts.dtype

  @property
  def takes_fp8(self) -> bool:
    return is_fp8(self.gate_proj) and is_fp8(self.up_proj)

  def __call__(self, x: jax.Array | QuantizedActivation) -> jax.Array:
    g, u = self.gate_proj(x), self.up_proj(x)
    h = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(self.dtype)
    return self.down_proj(h)


class DeepseekV3TopkRouter(nnx.Module):
  """Sigmoid router with group-limited top-k: hidden `[..., H]` -> (weights, idx) `[..., k]`.

    s = sigmoid(x W^T), c = s + e_score_correction_bias            [..., E]
    group score = sum of the top-2 c in each of n_group groups      [..., n_group]
    keep the topk_group best groups; idx = top_k experts by c among them
    weights = s[idx] (/ their sum if norm_topk_prob) * routed_scaling_factor   (f32)
  Router weights are kept in f32 (HF `_keep_in_fp32_modules_strict`).
  """

  def __init__(self, cfg: DeepseekV3Config, *, rngs: nnx.Rngs):
    e, h = cfg.n_routed_experts, cfg.hidden_size
    self.weight = nnx.Param(_normal(rngs.params(), (e, h), jnp.float32) / h**0.5)
    self.e_score_correction_bias = nnx.Param(jnp.zeros((e,), jnp.float32))
    self.cfg = cfg

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    cfg = self.cfg
    e, g = cfg.n_routed_experts, cfg.n_group
    logits = jnp.einsum("...h,eh->...e", x.astype(jnp.float32), self.weight[...],
                        precision=lax.Precision.HIGHEST)
    scores = jax.nn.sigmoid(logits)
    choice = scores + self.e_score_correction_bias[...]
    grouped = choice.reshape(*choice.shape[:-1], g, e // g)
    group_scores = lax.top_k(grouped, min(2, e // g))[0].sum(-1)  # [..., n_group]
    _, top_groups = lax.top_k(group_scores, cfg.topk_group)
    group_mask = jax.nn.one_hot(top_groups, g, dtype=jnp.bool_).any(-2)  # [..., n_group]
    expert_mask = jnp.repeat(group_mask, e // g, axis=-1)
    _, idx = lax.top_k(jnp.where(expert_mask, choice, -jnp.inf), cfg.num_experts_per_tok)
    w = jnp.take_along_axis(scores, idx, axis=-1)
    if cfg.norm_topk_prob:
      w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return w * cfg.routed_scaling_factor, idx


class DeepseekV3Experts(nnx.Module):
  """Routed SwiGLU experts: y = sum_j w[..., j] * expert_idx[..., j](x), x `[..., H]`,
  expert_e(x) = down_e(silu(gate_e(x)) * up_e(x)); weights stacked `[E, I, H]` / `[E, H, I]`.

  Two formulations, chosen by shape at trace time:
    gathered (decode: M * top_k < E for M tokens): each token reads only its top_k experts'
      weights, which is what bounds a decode step (weight bytes).
    dense (prefill): every expert on every token, mixed by the router weights (zero off the
      chosen experts); costs E/top_k times the routed FLOPs, fine for small models and checks.
      A grouped GEMM (tokens sorted by expert) would replace it at scale.
  """

  def __init__(self, cfg: DeepseekV3Config, name: str, opts: Options, *, rngs: nnx.Rngs):
    e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    fmt = opts.quant.fmt if opts.quantizes(f"{name}.experts") else None
    kw = dict(fmt=fmt, dtype=opts.dtype, param_dtype=opts.param_dtype,
              implementation=opts.implementation, rngs=rngs)
    self.gate_proj = StackedLinear(e, h, i, **kw)
    self.up_proj = StackedLinear(e, h, i, **kw)
    self.down_proj = StackedLinear(e, i, h, **kw)
    self.num_experts, self.dtype = e, opts.dtype

  @property
  def takes_fp8(self) -> bool:
    return is_fp8(self.gate_proj)

  def _act(self, g, u):
    return (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(self.dtype)

  def __call__(self, x: jax.Array | QuantizedActivation, weights: jax.Array, idx: jax.Array,
               *, gathered: bool | None = None) -> jax.Array:
    """x `[..., H]`; weights, idx `[..., top_k]` from the router -> `[..., H]`.
    `gathered`: force a formulation (None: by shape)."""
    lead, k = weights.shape[:-1], weights.shape[-1]
    m = math.prod(lead)
    if gathered if gathered is not None else m * k < self.num_experts:
      if isinstance(x, QuantizedActivation) and x.layout != "row":
        x = dataclasses.replace(x, scale=x.row_scale(), layout="row")
      flat = jax.tree.map(lambda a: a.reshape(m, a.shape[-1]), x)  # [M, H] (q, scale, hp)
      ids = idx.reshape(m, k)
      h = self._act(self.gate_proj.gathered(flat, ids), self.up_proj.gathered(flat, ids))
      y = self.down_proj.gathered(h, ids, batched=True)  # [M, k, H]
      y = jnp.einsum("mjh,mj->mh", y.astype(jnp.float32), weights.reshape(m, k))
      return y.reshape(*lead, -1).astype(self.dtype)
    dense = jnp.einsum("...k,...ke->...e", weights,
                       jax.nn.one_hot(idx, self.num_experts, dtype=jnp.float32))
    h = self._act(self.gate_proj(x), self.up_proj(x))  # [E, ..., I]
    y = self.down_proj(h, batched=True)  # [E, ..., H]
    return jnp.einsum("e...h,...e->...h", y.astype(jnp.float32), dense).astype(self.dtype)


class DeepseekV3MoE(nnx.Module):
  """`experts(x, gate(x_hp)) + shared_experts(x)`, x `[..., H]` -> `[..., H]`.

  The router needs the high-precision activation: on the fused path x is a QuantizedActivation
  carrying `hp` (the (bf16, fp8, scale) tuple), experts and shared experts use its codes.
  """

  def __init__(self, cfg: DeepseekV3Config, name: str, opts: Options, *, rngs: nnx.Rngs):
    self.gate = DeepseekV3TopkRouter(cfg, rngs=rngs)
    self.experts = DeepseekV3Experts(cfg, name, opts, rngs=rngs)
    self.shared_experts = (
        DeepseekV3MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                      f"{name}.shared_experts", opts, rngs=rngs)
        if cfg.n_shared_experts else None)
    self.dtype = opts.dtype

  @property
  def takes_fp8(self) -> bool:
    return self.experts.takes_fp8 and (self.shared_experts is None
                                       or self.shared_experts.takes_fp8)

  def __call__(self, x: jax.Array | QuantizedActivation) -> jax.Array:
    hp = x.hp if isinstance(x, QuantizedActivation) else x
    if hp is None:
      raise ValueError("the MoE router needs the high-precision activation: quantise with "
                       "keep_hp=True")
    y = self.experts(x, *self.gate(hp))
    if self.shared_experts is not None:
      y = (y.astype(jnp.float32) + self.shared_experts(x).astype(jnp.float32)).astype(self.dtype)
    return y


class DeepseekV3Attention(nnx.Module):
  """Multi-head latent attention with a per-head KV cache (equations in the module docstring).

  x `[B, T, H]` (array, or QuantizedActivation on the fused path) -> `[B, T, H]` (a partial
  sum under tensor parallelism, where this device holds NH = heads/tp heads).
  """

  def __init__(self, cfg: DeepseekV3Config, name: str, opts: Options, *, rngs: nnx.Rngs):
    h, nh = cfg.hidden_size, cfg.num_attention_heads
    lq, lkv, r = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    # HF's q_a_proj and kv_a_proj_with_mqa share their input: one GEMM with N = Lq + Lkv + R.
    self.fused_qkv_a_proj_with_mqa = opts.proj(h, lq + lkv + r, f"{name}.q_a_proj",
                                               f"{name}.kv_a_proj_with_mqa", rngs=rngs)
    self.q_a_layernorm = opts.norm(lq, LORA_NORM_EPS, rngs=rngs)
    self.q_b_proj = opts.proj(lq, nh * cfg.qk_head_dim, f"{name}.q_b_proj", rngs=rngs)
    self.kv_a_layernorm = opts.norm(lkv, LORA_NORM_EPS, rngs=rngs)
    self.kv_b_proj = opts.proj(lkv, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                               f"{name}.kv_b_proj", rngs=rngs)
    self.o_proj = opts.proj(nh * cfg.v_head_dim, h, f"{name}.o_proj", rngs=rngs)
    self.cfg, self.scale = cfg, softmax_scale(cfg)
    self.quant, self.implementation, self.dtype = opts.quant, opts.implementation, opts.dtype

  @property
  def takes_fp8(self) -> bool:
    return is_fp8(self.fused_qkv_a_proj_with_mqa)

  def norm_q_kv(self, q_a: jax.Array, kv_a: jax.Array, fused: bool):
    """q_a_layernorm and kv_a_layernorm: one dual-input fused kernel when q_b_proj is FP8."""
    if fused and is_fp8(self.q_b_proj):
      out = rmsnorm_quant(q_a, self.q_a_layernorm.weight[...], x2=kv_a,
                          weight2=self.kv_a_layernorm.weight[...], eps=LORA_NORM_EPS,
                          fmt=self.quant.fmt, implementation=self.implementation)
      return out.quant, out.norm2
    return self.q_a_layernorm(q_a), self.kv_a_layernorm(kv_a)

  def __call__(self, x, cos: jax.Array, sin: jax.Array, *, fused: bool = True,
               cache: KVCache | None = None, pos: jax.Array | int = 0):
    """cos, sin `[B, T, R/2]`; cache slots [pos, pos + T) are written. Returns (out, cache)."""
    cfg = self.cfg
    b, t = cos.shape[:2]
    lq, lkv, dn = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim
    qkv = self.fused_qkv_a_proj_with_mqa(x)  # [B, T, Lq + Lkv + R]
    q_a, kv_a, k_pe = qkv[..., :lq], qkv[..., lq:lq + lkv], qkv[..., lq + lkv:]
    q_in, kv = self.norm_q_kv(q_a, kv_a, fused)
    q = self.q_b_proj(q_in).reshape(b, t, -1, cfg.qk_head_dim)  # [B, T, NH, Dqk]
    cs, sn = cos[:, :, None], sin[:, :, None]
    q = jnp.concatenate([q[..., :dn], apply_rope(q[..., dn:], cs, sn, cfg.rope_interleave)], -1)
    k_pe = apply_rope(k_pe[:, :, None], cs, sn, cfg.rope_interleave)  # one head, shared
    qpos = pos + jnp.arange(t)
    if cache is not None:
      return self._absorbed(q, kv, k_pe[:, :, 0], qpos, cache, pos)
    # No cache (a whole sequence at once): per-head keys and values, Hugging Face's formula.
    kvb = self.kv_b_proj(kv).reshape(b, t, -1, dn + cfg.v_head_dim)  # [B, T, NH, Dn + Dv]
    k_nope, v = kvb[..., :dn], kvb[..., dn:]
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe, (*k_nope.shape[:-1], k_pe.shape[-1]))],
                        -1)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k.astype(q.dtype),
                        preferred_element_type=jnp.float32) * self.scale
    scores = jnp.where(qpos[None, :] <= qpos[:, None], scores, -jnp.inf)  # causal
    p = jax.nn.softmax(scores, axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return self.o_proj(o.reshape(b, t, -1).astype(self.dtype)), cache

  def _absorbed(self, q, kv, k_pe, qpos, cache: KVCache, pos):
    """Attention over the latent cache, kv_b_proj folded into the query and the output
    (DeepSeek-V2's absorption): with W = kv_b_proj's weight `[NH, Dn + Dv, Lkv]` split into
    W_uk `[NH, Dn, Lkv]` and W_uv `[NH, Dv, Lkv]`,
      q_nope . k_nope = (q_nope W_uk) . kv        o = (softmax(...) kv) W_uv^T
    so a step reads Lkv + R values per cached token instead of NH (Dqk + Dv). kv enters as
    kv_b_proj would see it (its fp8 codes and scales when kv_b_proj is FP8), so this equals the
    per-head formula up to where the roundings fall.
    q `[B, T, NH, Dqk]` (rope part rotated), kv `[B, T, Lkv]`, k_pe `[B, T, R]`."""
    cfg = self.cfg
    b, t, nh, _ = q.shape
    dn, lkv = cfg.qk_nope_head_dim, cfg.kv_lora_rank
    if is_fp8(self.kv_b_proj):
      kq = group_quant(kv, group_size=128, fmt=activation_format(self.kv_b_proj.weight.dtype),
                       implementation=self.implementation)
      new = (kq.q, kq.row_scale())
      w = dequantize_weight(self.kv_b_proj.weight[...], self.kv_b_proj.weight_scale_inv[...])
    else:
      new = (kv.astype(cache.kv.dtype), None)
      w = self.kv_b_proj.weight[...].astype(jnp.float32)
    at = (0, pos, 0)
    put = lambda c, x: None if c is None else lax.dynamic_update_slice(c, x.astype(c.dtype), at)
    cache = KVCache(put(cache.kv, new[0]), put(cache.kv_scale, new[1]), put(cache.k_pe, k_pe))
    # In f32 throughout: these einsums are small beside the projections (Lkv = 512 wide, one
    # query token at decode), the dequantised weight stays exact, and XLA:CPU has no batched
    # bf16 x bf16 -> f32 dot to fall back on.
    f32 = lambda a: a.astype(jnp.float32)
    lat = (f32(cache.kv) if cache.kv_scale is None  # [B, S, Lkv]
           else QuantizedActivation(cache.kv, cache.kv_scale).dequantize())
    w = w.reshape(nh, -1, lkv)  # this device's heads
    q_lat = jnp.einsum("bthd,hdc->bthc", f32(q[..., :dn]), w[:, :dn])
    scores = (jnp.einsum("bthc,bsc->bhts", q_lat, lat)
              + jnp.einsum("bthr,bsr->bhts", f32(q[..., dn:]), f32(cache.k_pe))) * self.scale
    # Causal: slot j is visible to query i iff j <= pos + i; unwritten slots lie beyond.
    kpos = jnp.arange(cache.kv.shape[1])
    scores = jnp.where(kpos[None, :] <= qpos[:, None], scores, -jnp.inf)
    p = jax.nn.softmax(scores, axis=-1)
    o = jnp.einsum("bthc,hdc->bthd", jnp.einsum("bhts,bsc->bthc", p, lat), w[:, dn:])
    return self.o_proj(o.reshape(b, t, -1).astype(self.dtype)), cache


class DeepseekV3DecoderLayer(nnx.Module):
  """One decoder layer: (h, r) -> (h', r'), with the LayerCommunicator-style prepare steps.

  h `[B, T, H]` is the previous layer's output (a partial sum under tensor parallelism; the
  embedding for layer 0, where r is None); r `[B, T, H]` the residual stream, replicated.
  `fused` (mutable attribute) switches this layer between the fused and unfused paths.
  """

  def __init__(self, cfg: DeepseekV3Config, idx: int, opts: Options, *, fused: bool = True,
               rngs: nnx.Rngs):
    name = f"model.layers.{idx}"
    self.input_layernorm = opts.norm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs)
    self.self_attn = DeepseekV3Attention(cfg, f"{name}.self_attn", opts, rngs=rngs)
    self.post_attention_layernorm = opts.norm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs)
    self.is_moe = idx >= cfg.first_k_dense_replace
    if self.is_moe:
      self.mlp = DeepseekV3MoE(cfg, f"{name}.mlp", opts, rngs=rngs)
    else:
      self.mlp = DeepseekV3MLP(cfg.hidden_size, cfg.intermediate_size, f"{name}.mlp", opts,
                               rngs=rngs)
    self.fused = fused
    self.implementation = opts.implementation

  def _prepare(self, norm: RMSNorm, h, residual, quant: bool, keep_hp: bool, axis_name):
    """r' = psum(h) + r; x = rmsnorm(r') -> quantised (fused path into an FP8 consumer) or not."""
    quant = quant and self.fused
    if residual is None:  # layer 0: h is the embedding, replicated, and becomes the residual
      return norm(h, quant=quant, keep_hp=keep_hp), h.astype(norm.dtype)
    if axis_name is not None:
      if quant:
        return allreduce_rmsnorm_quant(h, residual, norm.weight[...], axis_name=axis_name,
                                       eps=norm.eps, fmt=norm.fmt, keep_bf16=keep_hp,
                                       implementation=self.implementation)
      h = lax.psum(h, axis_name)
    return norm(h, residual, quant=quant, keep_hp=keep_hp)

  def prepare_attn(self, h, residual, axis_name=None):
    """Residual add (+ all-reduce) + input_layernorm (+ quant for fused_qkv_a_proj)."""
    return self._prepare(self.input_layernorm, h, residual, self.self_attn.takes_fp8, False,
                         axis_name)

  def prepare_mlp(self, h, residual, axis_name=None):
    """Residual add (+ all-reduce) + post_attention_layernorm (+ quant, + bf16 copy for MoE)."""
    return self._prepare(self.post_attention_layernorm, h, residual, self.mlp.takes_fp8,
                         self.is_moe, axis_name)

  def __call__(self, h, residual, cos, sin, *, cache: KVCache | None = None,
               pos: jax.Array | int = 0, axis_name: str | None = None):
    x, residual = self.prepare_attn(h, residual, axis_name)
    h, cache = self.self_attn(x, cos, sin, fused=self.fused, cache=cache, pos=pos)
    x, residual = self.prepare_mlp(h, residual, axis_name)
    return self.mlp(x), residual, cache


class CausalLMOutput(NamedTuple):
  logits: jax.Array  # [B, T, V] in dtype
  cache: tuple[KVCache, ...] | None  # updated cache, when one was given


class DeepseekV3ForCausalLM(nnx.Module):
  """DeepSeek-V3: tokens `[B, T]` -> logits `[B, T, V]` (HF names: `model.*`, `lm_head`).

  Args:
    cfg: the model config.
    quant: FP8 quantisation of the projections (None: the unquantised bf16/f32 path).
    fused: fused norm + quant everywhere (bool) or per layer (sequence of bools).
    dtype: activation / compute dtype (bf16; f32 for checks against Hugging Face).
    param_dtype: dtype of high-precision weights (norms, embeddings, lm_head, bf16 projections).
    implementation: backend for jfusedq ops ("pallas", "xla", None = best available).
  """

  def __init__(self, cfg: DeepseekV3Config, *, quant: QuantConfig | None = None,
               fused: bool | Sequence[bool] = True, dtype=jnp.bfloat16,
               param_dtype=jnp.bfloat16, implementation: str | Sequence[str] | None = None,
               rngs: nnx.Rngs):
    opts = Options(quant, dtype, param_dtype, implementation)
    fused = [fused] * cfg.num_hidden_layers if isinstance(fused, bool) else list(fused)
    if len(fused) != cfg.num_hidden_layers:
      raise ValueError(f"fused has {len(fused)} entries for {cfg.num_hidden_layers} layers")
    self.model = DeepseekV3Model(cfg, opts, fused, rngs=rngs)
    self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, param_dtype=param_dtype,
                          rngs=rngs)
    self.cfg, self.quant, self.dtype, self.param_dtype = cfg, quant, dtype, param_dtype

  def set_fused(self, fused: bool | Sequence[bool]) -> None:
    """Switches layers between the fused and unfused paths (same weights)."""
    layers = self.model.layers
    fused = [fused] * len(layers) if isinstance(fused, bool) else list(fused)
    for layer, f in zip(layers, fused, strict=True):
      layer.fused = bool(f)

  def init_cache(self, batch: int, max_len: int, dtype=None) -> tuple[KVCache, ...]:
    """Zeroed per-layer latent caches for `max_len` positions (`KVCache`; the same on every
    tensor-parallel device). dtype: of kv (unquantised kv_b_proj) and k_pe."""
    cfg, dtype = self.cfg, dtype or self.dtype
    caches = []
    for layer in self.model.layers:
      proj = layer.self_attn.kv_b_proj
      shape = (batch, max_len, cfg.kv_lora_rank)
      if is_fp8(proj):
        kv = jnp.zeros(shape, proj.weight.dtype)
        scale = jnp.zeros((batch, max_len, -(-cfg.kv_lora_rank // 128)), jnp.float32)
      else:
        kv, scale = jnp.zeros(shape, dtype), None
      caches.append(KVCache(kv, scale, jnp.zeros((batch, max_len, cfg.qk_rope_head_dim), dtype)))
    return tuple(caches)

  def __call__(self, tokens: jax.Array, *, cache: Sequence[KVCache] | None = None,
               pos: jax.Array | int = 0, axis_name: str | None = None) -> CausalLMOutput:
    """tokens `[B, T]` at positions pos .. pos + T - 1 (pos: tokens already in `cache`)."""
    h, cache = self.model(tokens, cache=cache, pos=pos, axis_name=axis_name)
    return CausalLMOutput(self.lm_head(h), cache)


class DeepseekV3Model(nnx.Module):
  """Embeddings, decoder layers and the final norm: tokens `[B, T]` -> hidden `[B, T, H]`."""

  def __init__(self, cfg: DeepseekV3Config, opts: Options, fused: Sequence[bool], *,
               rngs: nnx.Rngs):
    self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=opts.dtype,
                                  param_dtype=opts.param_dtype, rngs=rngs)
    self.layers = nnx.List([DeepseekV3DecoderLayer(cfg, i, opts, fused=f, rngs=rngs)
                            for i, f in enumerate(fused)])
    self.norm = opts.norm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs)
    self.cfg = cfg

  def __call__(self, tokens, *, cache=None, pos=0, axis_name=None):
    b, t = tokens.shape
    positions = jnp.broadcast_to(pos + jnp.arange(t), (b, t))
    cos, sin = rope_tables(self.cfg, positions)
    h, residual = self.embed_tokens(tokens), None
    new_cache = []
    for i, layer in enumerate(self.layers):
      h, residual, c = layer(h, residual, cos, sin, cache=None if cache is None else cache[i],
                             pos=pos, axis_name=axis_name)
      new_cache.append(c)
    if axis_name is not None:
      h = lax.psum(h, axis_name)
    h, _ = self.norm(h, residual)
    return h, None if cache is None else tuple(new_cache)


# --- tensor parallelism --------------------------------------------------------------------

_COLUMN = ("q_b_proj", "kv_b_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")


def _names(path) -> list:
  """Module / parameter names of a state path, without the Variable's trailing "value"."""
  out = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        out.append(getattr(k, attr))
        break
  return out[:-1] if out and out[-1] == "value" else out


def tp_spec(path, shape, axis: str) -> P:
  """PartitionSpec of one parameter (by its module path) for tensor parallelism over `axis`.

  Column-parallel projections split N (weight [N, K] rows, scale rows alike), row-parallel
  ones split K; stacked experts [E, N, K] likewise on their last two axes. Everything else
  (fused_qkv_a, router, norms, embeddings, lm_head) is replicated.
  """
  names = _names(path)
  if len(names) < 2 or names[-1] not in ("weight", "weight_scale_inv"):
    return P()
  lead = [None] * (len(shape) - 2)
  if names[-2] in _COLUMN:
    return P(*lead, axis, None)
  if names[-2] in _ROW:
    return P(*lead, None, axis)
  return P()


def _check_split(name: str, shape, spec: P, n: int, fp8: bool) -> None:
  for dim, s in zip(shape, spec):
    if s is None:
      continue
    if dim % n:
      raise ValueError(f"parameter {name} {list(shape)}: an axis of size {dim} does not split "
                       f"over {n} devices")
    if fp8 and (dim // n) % 128:
      raise ValueError(f"FP8 parameter {name} {list(shape)}: {dim // n} rows/columns per device "
                       f"is not a multiple of the 128 x 128 weight block, so one block (one "
                       f"scale) would straddle two devices")


def shard_forward(model: DeepseekV3ForCausalLM, mesh: jax.sharding.Mesh, axis: str = "tp",
                  *, with_cache: bool = False, explicit_params: bool = False):
  """`forward(tokens, cache=None, pos=0) -> (logits, cache)` running `model` tensor-parallel.

  The body runs under `jax.shard_map` over `axis` of `mesh`; parameters are split per
  `tp_spec` (heads and intermediate dims), the latent caches, tokens and logits replicated.
  Wrap it in `jax.jit`. Raises if a split dimension does not divide, or would cut an FP8
  128 x 128 weight block. With `explicit_params` (and `with_cache`), returns
  `(forward(params, tokens, cache, pos), params)` instead: a jit of it then takes the weights
  as arguments, where the closure would make them constants of the compiled program.
  """
  n = mesh.shape[axis]
  graphdef, state = nnx.split(model)
  flat, treedef = jax.tree_util.tree_flatten_with_path(state)
  specs = []
  for path, leaf in flat:
    spec = tp_spec(path, leaf.shape, axis)
    name = ".".join(str(x) for x in _names(path))
    _check_split(name, leaf.shape, spec, n, jnp.dtype(leaf.dtype).itemsize == 1)
    specs.append(spec)
  # Placed once, so each device holds only its shard from here on.
  leaves = [jax.device_put(leaf, NamedSharding(mesh, spec))
            for (_, leaf), spec in zip(flat, specs)]
  # The latent cache has no head axis: every device holds (and writes) the same one.
  cache_specs = tuple(KVCache(P(), P() if is_fp8(layer.self_attn.kv_b_proj) else None, P())
                      for layer in model.model.layers)

  def body(leaves, tokens, cache, pos):
    m = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))
    out = m(tokens, cache=cache, pos=pos, axis_name=axis)
    return out.logits, out.cache

  if with_cache:
    fn = jax.shard_map(body, mesh=mesh, in_specs=(specs, P(), cache_specs, P()),
                       out_specs=(P(), cache_specs), check_vma=False)

    def pure(params, tokens, cache, pos=0):
      explicit = jax.sharding.AxisType.Explicit in getattr(mesh, "axis_types", ())
      if explicit:  # shard_map wants inputs already split as in_specs say on Explicit axes
        cache = jax.tree.map(lambda c: jax.reshard(c, NamedSharding(mesh, P())), cache)
      return fn(params, tokens, cache, jnp.asarray(pos, jnp.int32))

    if explicit_params:
      return pure, leaves
    return lambda tokens, cache, pos=0: pure(leaves, tokens, cache, pos)
  fn = jax.shard_map(lambda l, t: body(l, t, None, 0)[0], mesh=mesh, in_specs=(specs, P()),
                     out_specs=P(), check_vma=False)
  return lambda tokens: fn(leaves, tokens)


# --- loading -------------------------------------------------------------------------------


def _set(param: nnx.Param, value: jax.Array, name: str) -> None:
  want = param.get_value()
  if tuple(value.shape) != tuple(want.shape):
    raise TensorMismatchError(f"{name}: loaded shape {list(value.shape)}, model expects "
                              f"{list(want.shape)}")
  param.set_value(jnp.asarray(value).astype(want.dtype))


def _load_proj(layer, ckpt: Checkpoint, names: Sequence[str], fmt) -> None:
  """Fills a Linear / Fp8Linear from HF projection(s) `names` (concatenated along N)."""
  k = layer.weight.get_value().shape[1]
  where = "+".join(ckpt.prefix + n for n in names)
  if isinstance(layer, Fp8Linear):
    w, s = load_linear(ckpt, names, in_features=k, out_features=layer.out_features, fmt=fmt)
    _set(layer.weight, w, where + ".weight")
    _set(layer.weight_scale_inv, s, where + ".weight_scale_inv")
  else:
    n = layer.weight.get_value().shape[0]
    w, _ = load_linear(ckpt, names, in_features=k, out_features=n, dtype=jnp.float32)
    _set(layer.weight, w, where + ".weight")


def _load_norm(norm: RMSNorm, ckpt: Checkpoint, name: str) -> None:
  w = norm.weight.get_value()
  _set(norm.weight, load_array(ckpt, f"{name}.weight", w.shape, w.dtype), ckpt.prefix + name)


def _load_mlp(mlp: DeepseekV3MLP, ckpt: Checkpoint, fmt) -> None:
  for p in ("gate_proj", "up_proj", "down_proj"):
    _load_proj(getattr(mlp, p), ckpt, [p], fmt)


def _load_experts(experts: DeepseekV3Experts, ckpt: Checkpoint, num: int, fmt) -> None:
  for p in ("gate_proj", "up_proj", "down_proj"):
    layer: StackedLinear = getattr(experts, p)
    _, n, k = layer.weight.get_value().shape
    parts = [load_linear(ckpt, [f"{e}.{p}"], in_features=k, out_features=n,
                         fmt=None if layer.fmt is None else fmt, dtype=jnp.float32)
             for e in range(num)]
    where = f"{ckpt.prefix}{{0..{num - 1}}}.{p}"
    _set(layer.weight, jnp.stack([w for w, _ in parts]), where + ".weight")
    if layer.fmt is not None:
      _set(layer.weight_scale_inv, jnp.stack([s for _, s in parts]),
           where + ".weight_scale_inv")


def load_weights(model: DeepseekV3ForCausalLM, ckpt: Checkpoint) -> None:
  """Fills every parameter of `model` from a Hugging Face DeepSeek-V3 checkpoint.

  Projections are taken as stored (FP8 + weight_scale_inv) or quantised / cast to what the
  model holds; q_a_proj and kv_a_proj_with_mqa are concatenated into the fused projection;
  experts are stacked. Errors name the tensor. Tensors the model does not use (DeepSeek-V3's
  multi-token-prediction layer) are ignored.
  """
  cfg, fmt = model.cfg, None if model.quant is None else model.quant.fmt
  c = ckpt.scope("model.")
  emb = model.model.embed_tokens.weight
  _set(emb, load_array(c, "embed_tokens.weight", emb.get_value().shape, emb.get_value().dtype),
       "model.embed_tokens.weight")
  for i, layer in enumerate(model.model.layers):
    lc = c.scope(f"layers.{i}.")
    _load_norm(layer.input_layernorm, lc, "input_layernorm")
    _load_norm(layer.post_attention_layernorm, lc, "post_attention_layernorm")
    a, ac = layer.self_attn, lc.scope("self_attn.")
    _load_proj(a.fused_qkv_a_proj_with_mqa, ac, ["q_a_proj", "kv_a_proj_with_mqa"], fmt)
    for p in ("q_b_proj", "kv_b_proj", "o_proj"):
      _load_proj(getattr(a, p), ac, [p], fmt)
    _load_norm(a.q_a_layernorm, ac, "q_a_layernorm")
    _load_norm(a.kv_a_layernorm, ac, "kv_a_layernorm")
    mc = lc.scope("mlp.")
    if layer.is_moe:
      g = layer.mlp.gate
      e, h = cfg.n_routed_experts, cfg.hidden_size
      _set(g.weight, load_array(mc, "gate.weight", (e, h), jnp.float32), mc.prefix + "gate.weight")
      _set(g.e_score_correction_bias,
           load_array(mc, "gate.e_score_correction_bias", (e,), jnp.float32),
           mc.prefix + "gate.e_score_correction_bias")
      _load_experts(layer.mlp.experts, mc.scope("experts."), e, fmt)
      if layer.mlp.shared_experts is not None:
        _load_mlp(layer.mlp.shared_experts, mc.scope("shared_experts."), fmt)
    else:
      _load_mlp(layer.mlp, mc, fmt)
  _load_norm(model.model.norm, c, "norm")
  head = "lm_head" if "lm_head.weight" in ckpt or not cfg.tie_word_embeddings else None
  if head is None:  # tied: the output projection is the embedding matrix
    model.lm_head.weight.set_value(model.model.embed_tokens.weight.get_value()
                                   .astype(model.lm_head.weight.get_value().dtype))
  else:
    _load_proj(model.lm_head, ckpt, [head], None)
  missing = [".".join(str(x) for x in _names(p))
             for p, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]
             if isinstance(leaf, jax.ShapeDtypeStruct)]
  if missing:
    raise CheckpointError(f"parameters left unloaded (a loader bug): {missing}")


def from_pretrained(path: str | os.PathLike, *, quantize: bool | None = None,
                    fmt: Fp8Format | str | None = None, fused: bool | Sequence[bool] = True,
                    dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                    implementation: str | Sequence[str] | None = None) -> DeepseekV3ForCausalLM:
  """Loads a Hugging Face DeepSeek-V3 checkpoint directory (config.json + safetensors).

  Args:
    quantize: None: FP8 iff config.json has a `quantization_config` (DeepSeek's FP8 release);
      True: FP8, quantising high-precision weights on load (128 x 128 blocks); False: the
      unquantised path (FP8 weights dequantised to param_dtype).
    fmt: FP8 format (default: the device's; e4m3fn checkpoints are converted for e4m3fnuz).
    fused, dtype, param_dtype, implementation: as for `DeepseekV3ForCausalLM`.
  """
  ckpt = Checkpoint(path)
  cfg = DeepseekV3Config.from_hf(ckpt.config)
  qc = ckpt.config.get("quantization_config")
  if quantize is None:
    quantize = qc is not None
  quant = QuantConfig.from_hf(qc, fmt) if quantize else None
  model = nnx.eval_shape(lambda: DeepseekV3ForCausalLM(
      cfg, quant=quant, fused=fused, dtype=dtype, param_dtype=param_dtype,
      implementation=implementation, rngs=nnx.Rngs(0)))
  load_weights(model, ckpt)
  return model
