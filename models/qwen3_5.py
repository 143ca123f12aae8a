"""Qwen3.5 MoE / Qwen3-Next hybrid decoder (Gated DeltaNet + gated full attention, MoE) in NNX.

Layers follow `layer_types`: by default three Gated DeltaNet ("linear_attention") layers, then one
gated full-attention layer, repeated. Every layer ends in a sparse MoE block (Qwen3-Next may use a
dense MLP on `mlp_only_layers`). Shapes: B batch, T new tokens, S cached positions, H hidden
size, V vocabulary.

The FP8 fused path (DESIGN.md 3.5). Each decoder layer has a LayerCommunicator-style
`prepare_attn` / `prepare_mlp`: residual add + zero-centred RMSNorm `y = h / rms(h) * (1 + w)`
+ per-group FP8 quantisation in one kernel (`jfusedq.rmsnorm_quant`), so the next FP8 projection
receives a ready `QuantizedActivation`:

  * full attention: `(fp8, scale)` for its FP8 q/k/v projections;
  * Gated DeltaNet: `(bf16, fp8, scale)` (`keep_hp`): FP8 `in_proj_qkvz` uses the fp8 codes,
    the bf16 `in_proj_ba` (`jfusedq.nn.Linear`) the bf16 copy;
  * MoE: `(bf16, fp8, scale)`: FP8 experts / shared expert, bf16 router and shared-expert gate.

Under tensor parallelism (inside `jax.shard_map` over `tp_axis`: q/k/v, in_proj_qkvz/ba, conv,
expert gate/up projections column-parallel; o_proj, out_proj, down projections row-parallel)
each layer's mixer and MLP return partial sums, and the next `prepare_*` runs all-reduce + add +
RMSNorm + quant as one step (`jfusedq.allreduce_rmsnorm_quant`; `JFUSEDQ_DISABLE_FUSED_AR_QUANT=1`
makes it fall back to an unfused strategy). The fused path is opt-in per layer (`fused`); off,
the same weights run the unfused composition: (psum,) add + RMSNorm to bf16, then each FP8
projection quantises its input itself.

With `quant=None` every projection is a plain `jfusedq.nn.Linear` in `dtype` and every norm a
plain RMSNorm: the unquantised path, which equals Hugging Face's model in f32.

Internal Gated DeltaNet layout. `in_proj_qkvz` rows, `in_proj_ba` rows and conv channels are
grouped by key head g (Qwen3-Next's checkpoint layout), with r = num_v_heads / num_k_heads:
  in_proj_qkvz: per g [q_g (dk) | k_g (dk) | v_g (r dv) | z_g (r dv)]
  in_proj_ba:   per g [b_g (r) | a_g (r)]
  conv1d:       per g [q_g | k_g | v_g]
so a contiguous column-parallel shard holds whole key-head groups. Qwen3.5's separate
`in_proj_qkv` ([q_all | k_all | v_all]) + `in_proj_z`, `in_proj_b` + `in_proj_a` are permuted into
it on load (FP8 codes and scales move as whole 128-row blocks when head sizes allow).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jfusedq.checkpoint import (Checkpoint, CheckpointError, MissingTensorError, QuantConfig,
                                TensorMismatchError, load_array, load_linear)
from jfusedq.fp8 import Fp8Format
from jfusedq.nn import Fp8Linear, Linear, StackedLinear, high_precision, quantize_weight
from jfusedq.ops.fp8_matmul.reference import dequantize_weight
from jfusedq.ops.gated_delta_rule import gated_delta_rule
from jfusedq.ops.rmsnorm import rmsnorm
from jfusedq.ops.rmsnorm_quant import rmsnorm_quant
from jfusedq.ops.rmsnorm_quant.reference import rmsnorm as rmsnorm_f32
from jfusedq.parallel import allreduce_rmsnorm_quant

BLOCK = 128
CHUNK = 64  # chunk length of the prefill gated delta rule (HF and fla use 64)
GDN, ATTN = "linear_attention", "full_attention"
Impl = str | Sequence[str] | None

# --- config ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Qwen35Config:
  """Architecture of a Qwen3.5 MoE (`qwen3_5_moe[_text]`) or Qwen3-Next (`qwen3_next`) model."""

  model_type: str
  vocab_size: int
  hidden_size: int
  num_layers: int
  layer_types: tuple[str, ...]
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rotary_dim: int  # head_dim * partial_rotary_factor: rotated leading dims of each head
  rope_theta: float
  conv_kernel: int
  linear_key_head_dim: int
  linear_value_head_dim: int
  linear_num_key_heads: int
  linear_num_value_heads: int
  num_experts: int
  num_experts_per_tok: int
  moe_intermediate_size: int
  shared_expert_intermediate_size: int
  norm_topk_prob: bool = True
  intermediate_size: int = 0  # dense MLP (Qwen3-Next mlp_only_layers)
  mlp_only_layers: tuple[int, ...] = ()
  decoder_sparse_step: int = 1
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False

  def __post_init__(self):
    if len(self.layer_types) != self.num_layers:
      raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} "
                       f"layers")
    bad = sorted(set(self.layer_types) - {GDN, ATTN})
    if bad:
      raise ValueError(f"unknown layer types {bad}; expected {GDN!r} or {ATTN!r}")
    if self.linear_num_value_heads % self.linear_num_key_heads:
      raise ValueError(f"linear_num_value_heads={self.linear_num_value_heads} must be a multiple "
                       f"of linear_num_key_heads={self.linear_num_key_heads}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_attention_heads={self.num_heads} must be a multiple of "
                       f"num_key_value_heads={self.num_kv_heads}")
    if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
      raise ValueError(f"rotary dims {self.rotary_dim} must be even and in (0, {self.head_dim}]")

  @classmethod
  def from_hf(cls, cfg: dict) -> Qwen35Config:
    """From a Hugging Face config.json dict (the VLM `qwen3_5_moe` nests it in `text_config`)."""
    mt = cfg.get("model_type")
    if mt == "qwen3_5_moe":
      if "text_config" not in cfg:
        raise ValueError("config.json of model_type 'qwen3_5_moe' has no text_config")
      text = dict(cfg["text_config"])
      text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
      return cls.from_hf(dict(text, model_type=text.get("model_type", "qwen3_5_moe_text")))
    if mt not in ("qwen3_5_moe_text", "qwen3_next"):
      raise ValueError(f"model_type {mt!r} is not a Qwen3.5 MoE / Qwen3-Next model (expected "
                       f"'qwen3_5_moe', 'qwen3_5_moe_text' or 'qwen3_next')")
    if cfg.get("attention_bias"):
      raise ValueError("attention_bias=True is not supported (no released Qwen3.5 uses it)")
    if cfg.get("hidden_act", "silu") != "silu":
      raise ValueError(f"hidden_act={cfg['hidden_act']!r}: only silu is supported")
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
      raise ValueError(f"rope_type={rope_type!r} is not supported (only 'default' RoPE)")
    layers = cfg["num_hidden_layers"]
    interval = cfg.get("full_attention_interval", 4)
    types = cfg.get("layer_types") or [GDN if (i + 1) % interval else ATTN for i in range(layers)]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    return cls(
        model_type=mt, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        num_layers=layers, layer_types=tuple(types), num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"], head_dim=head_dim,
        rotary_dim=int(head_dim * partial),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        conv_kernel=cfg.get("linear_conv_kernel_dim", 4),
        linear_key_head_dim=cfg["linear_key_head_dim"],
        linear_value_head_dim=cfg["linear_value_head_dim"],
        linear_num_key_heads=cfg["linear_num_key_heads"],
        linear_num_value_heads=cfg["linear_num_value_heads"],
        num_experts=cfg["num_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
        moe_intermediate_size=cfg["moe_intermediate_size"],
        shared_expert_intermediate_size=cfg["shared_expert_intermediate_size"],
        # Qwen3.5's router always renormalises the top-k weights; Qwen3-Next reads the flag.
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)) if mt == "qwen3_next" else True,
        intermediate_size=cfg.get("intermediate_size") or 0,
        mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))

  def is_moe(self, i: int) -> bool:
    """Layer i ends in the sparse MoE block (else the dense MLP), as HF decides it."""
    return (i not in self.mlp_only_layers and self.num_experts > 0
            and (i + 1) % self.decoder_sparse_step == 0)


# --- small pieces ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Ctx:
  """Build options shared by every module (static)."""

  quant: QuantConfig | None
  dtype: Any
  param_dtype: Any
  tp_axis: str | None
  ar_strategy: str | tuple[str, ...] | None
  impl: Impl

  def fp8(self, name: str) -> bool:
    return self.quant is not None and self.quant.quantizes(name)


def _proj(name: str, k: int, n: int, ctx: _Ctx, *, rngs: nnx.Rngs):
  """FP8 block-scaled projection when `ctx.quant` quantises module `name`, else plain."""
  if ctx.fp8(name):
    return Fp8Linear(k, n, fmt=ctx.quant.fmt, dtype=ctx.dtype, param_dtype=jnp.float32,
                     implementation=ctx.impl, rngs=rngs)
  return Linear(k, n, dtype=ctx.dtype, param_dtype=ctx.param_dtype, rngs=rngs)


def _apply_rope(x, pos, rotary_dim: int, theta: float):
  """Rotate-half RoPE on the first `rotary_dim` dims of each head (HF `apply_rotary_pos_emb`).

  x `[B, T, N, D]`; positions `pos + t`. With d = rotary_dim / 2, inv_freq_i = theta^(-2i /
  rotary_dim), angle = p * inv_freq (f32), x1 = x[..., :d], x2 = x[..., d:rotary_dim]:
    out = [x1 cos - x2 sin, x2 cos + x1 sin, x[..., rotary_dim:]].
  """
  t = x.shape[1]
  inv = 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / rotary_dim))
  p = (jnp.asarray(pos, jnp.int32) + jnp.arange(t, dtype=jnp.int32)).astype(jnp.float32)
  ang = p[:, None] * jnp.asarray(inv, jnp.float32)[None, :]  # [T, d]
  cos = jnp.cos(ang)[None, :, None, :].astype(x.dtype)
  sin = jnp.sin(ang)[None, :, None, :].astype(x.dtype)
  d = rotary_dim // 2
  x1, x2, rest = x[..., :d], x[..., d:rotary_dim], x[..., rotary_dim:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


# --- mixers ---------------------------------------------------------------------------------


class GatedDeltaNet(nnx.Module):
  """Gated DeltaNet token mixer (Qwen3-Next / Qwen3.5 `linear_attn`).

  x `[B, T, H]` (array, or QuantizedActivation with hp) -> `[B, T, H]`. Hk key heads of dk, Hv
  value heads of dv, r = Hv / Hk, C = Hk (2 dk + r dv) conv channels (local counts under TP):
    qkvz = in_proj_qkvz(x)                      [B, T, Hk (2dk + 2 r dv)]   (FP8)
    ba   = in_proj_ba(x.hp)                     [B, T, Hk 2r]               (bf16)
    qkv  = silu(causal_conv1d(qkv))             depthwise, kernel K, state = last K-1 inputs
    q, k [B, T, Hk, dk] repeated r times per key head -> [B, T, Hv, dk] (HF repeat_interleave)
    v    [B, T, Hv, dv], z [B, T, Hv, dv]
    beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)             [B, T, Hv] f32
    o, S = gated_delta_rule(l2norm(q), l2norm(k), v, g, beta)  (scale dk^-1/2; chunk of 64 for
           prefill, token by token for decode; S [B, Hv, dk, dv] f32)
    o    = rmsnorm(o) * w * silu(z)             per head over dv (HF RMSNormGated, plain w)
    out  = out_proj(o)                          [B, T, H]  (FP8; a partial sum under TP)
  """

  def __init__(self, cfg: Qwen35Config, layer: int, ctx: _Ctx, *, rngs: nnx.Rngs):
    h, dk, dv = cfg.hidden_size, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    self.dk, self.dv, self.r, self.kernel = dk, dv, hv // hk, cfg.conv_kernel
    self.eps, self.dtype, self.impl = cfg.rms_norm_eps, ctx.dtype, ctx.impl
    name = f"model.layers.{layer}.linear_attn."
    qkvz_fp8 = ctx.fp8(name + "in_proj_qkv") and ctx.fp8(name + "in_proj_z") and ctx.fp8(
        name + "in_proj_qkvz")
    self.in_proj_qkvz = _proj(name + "in_proj_qkvz", h, hk * (2 * dk + 2 * self.r * dv),
                              dataclasses.replace(ctx, quant=ctx.quant if qkvz_fp8 else None),
                              rngs=rngs)
    self.in_proj_ba = Linear(h, 2 * hv, dtype=ctx.dtype, param_dtype=ctx.param_dtype, rngs=rngs)
    c = hk * (2 * dk + self.r * dv)
    self.conv_weight = nnx.Param(
        jax.random.normal(rngs.params(), (c, self.kernel), ctx.param_dtype) * 0.5)
    self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (hv,), jnp.float32, 1, 16)))
    self.dt_bias = nnx.Param(jnp.ones((hv,), jnp.float32))
    self.norm_weight = nnx.Param(jnp.ones((dv,), ctx.param_dtype))
    self.out_proj = _proj(name + "out_proj", hv * dv, h, ctx, rngs=rngs)

  def conv(self, x, state):
    """Causal depthwise conv + silu. x `[B, T, C]`, state `[B, K-1, C]` (the previous inputs,
    zeros at the start) -> (y `[B, T, C]`, new state `[B, K-1, C]`).
      y[t, c] = silu(sum_j w[c, j] * xp[t + j, c]),  xp = concat(state, x) along T.
    """
    b, t, c = x.shape
    if state is None:
      state = jnp.zeros((b, self.kernel - 1, c), x.dtype)
    xp = jnp.concatenate([state.astype(x.dtype), x], axis=1)
    w = self.conv_weight[...].astype(jnp.float32)
    y = sum(xp[:, j:j + t].astype(jnp.float32) * w[:, j] for j in range(self.kernel))
    return jax.nn.silu(y).astype(x.dtype), xp[:, t:]

  def __call__(self, x, cache: dict | None = None, *, mode: str | None = None):
    qkvz = self.in_proj_qkvz(x)
    ba = self.in_proj_ba(high_precision(x))
    b, t, _ = qkvz.shape
    dk, dv, r = self.dk, self.dv, self.r
    qkvz = qkvz.reshape(b, t, -1, 2 * dk + 2 * r * dv)  # [B, T, Hk, per-group rows]
    hk = qkvz.shape[2]
    qkv, z = qkvz[..., :2 * dk + r * dv], qkvz[..., 2 * dk + r * dv:]
    qkv, conv_state = self.conv(qkv.reshape(b, t, -1), None if cache is None else cache["conv"])
    qkv = qkv.reshape(b, t, hk, -1)
    q = jnp.repeat(qkv[..., :dk], r, axis=2)  # key head g serves value heads g r .. g r + r - 1
    k = jnp.repeat(qkv[..., dk:2 * dk], r, axis=2)
    v = qkv[..., 2 * dk:].reshape(b, t, hk * r, dv)
    z = z.reshape(b, t, hk * r, dv)
    ba = ba.reshape(b, t, hk, 2 * r).astype(jnp.float32)
    beta = jax.nn.sigmoid(ba[..., :r].reshape(b, t, -1))
    a = ba[..., r:].reshape(b, t, -1)
    g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
        a + self.dt_bias[...].astype(jnp.float32))
    mode = mode or ("recurrent" if t == 1 else "chunk")
    o, state = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True, mode=mode,
                                chunk_size=CHUNK,
                                initial_state=None if cache is None else cache["state"])
    # HF RMSNormGated: the normalised value is rounded to the activation dtype before the weight.
    o = rmsnorm_f32(o, jnp.ones(()), self.eps, 0.0).astype(self.dtype)
    o = (self.norm_weight[...].astype(self.dtype) * o).astype(jnp.float32) * jax.nn.silu(
        z.astype(jnp.float32))
    out = self.out_proj(o.astype(self.dtype).reshape(b, t, -1))
    new = None if cache is None else {"conv": conv_state.astype(cache["conv"].dtype),
                                      "state": state}
    return out, new

  def init_cache(self, batch: int, dtype) -> dict:
    c = self.conv_weight.shape[0]
    hv = self.A_log.shape[0]
    return {"conv": jnp.zeros((batch, self.kernel - 1, c), dtype),
            "state": jnp.zeros((batch, hv, self.dk, self.dv), jnp.float32)}


class Attention(nnx.Module):
  """Gated full attention (Qwen3-Next / Qwen3.5 `self_attn`), GQA, partial RoPE, KV cache.

  x `[B, T, H]` -> `[B, T, H]`. Hq query heads, Hkv key/value heads of D dims (local under TP):
    q_proj(x) -> [B, T, Hq, 2D]: per head [query (D) | gate (D)]
    q = rope(q_norm(query)), k = rope(k_norm(k_proj(x))) [B, T, Hkv, D], v = v_proj(x)
        (q_norm, k_norm zero-centred over D; rotate-half RoPE on the first rotary_dim dims)
    o = softmax(q k^T / sqrt(D) + causal mask) v       query head j reads kv head j // (Hq/Hkv)
    out = o_proj(o * sigmoid(gate))                     [B, T, H] (a partial sum under TP)
  The cache holds k, v `[B, S, Hkv, D]`; this call writes positions [pos, pos + T).
  """

  def __init__(self, cfg: Qwen35Config, layer: int, ctx: _Ctx, *, rngs: nnx.Rngs):
    h, d = cfg.hidden_size, cfg.head_dim
    self.d, self.rotary_dim, self.theta = d, cfg.rotary_dim, cfg.rope_theta
    self.eps, self.dtype = cfg.rms_norm_eps, ctx.dtype
    name = f"model.layers.{layer}.self_attn."
    self.q_proj = _proj(name + "q_proj", h, cfg.num_heads * d * 2, ctx, rngs=rngs)
    self.k_proj = _proj(name + "k_proj", h, cfg.num_kv_heads * d, ctx, rngs=rngs)
    self.v_proj = _proj(name + "v_proj", h, cfg.num_kv_heads * d, ctx, rngs=rngs)
    self.o_proj = _proj(name + "o_proj", cfg.num_heads * d, h, ctx, rngs=rngs)
    self.q_norm = nnx.Param(jnp.zeros((d,), ctx.param_dtype))
    self.k_norm = nnx.Param(jnp.zeros((d,), ctx.param_dtype))

  @property
  def needs_hp(self) -> bool:
    return any(isinstance(p, Linear) for p in (self.q_proj, self.k_proj, self.v_proj))

  def __call__(self, x, cache: dict | None = None, *, pos=0, mode=None):
    del mode
    qg = self.q_proj(x)
    b, t, _ = qg.shape
    d = self.d
    qg = qg.reshape(b, t, -1, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(b, t, -1)
    k = self.k_proj(x).reshape(b, t, -1, d)
    v = self.v_proj(x).reshape(b, t, -1, d)
    q = rmsnorm_f32(q, self.q_norm[...], self.eps, 1.0).astype(self.dtype)
    k = rmsnorm_f32(k, self.k_norm[...], self.eps, 1.0).astype(self.dtype)
    q = _apply_rope(q, pos, self.rotary_dim, self.theta)
    k = _apply_rope(k, pos, self.rotary_dim, self.theta)
    new = None
    if cache is not None:
      idx = (0, jnp.asarray(pos, jnp.int32), 0, 0)
      k = lax.dynamic_update_slice(cache["k"], k.astype(cache["k"].dtype), idx)
      v = lax.dynamic_update_slice(cache["v"], v.astype(cache["v"].dtype), idx)
      new = {"k": k, "v": v}
    s, hkv = k.shape[1], k.shape[2]
    q = q.reshape(b, t, hkv, -1, d)  # [B, T, Hkv, rep, D]
    scores = jnp.einsum("btgrd,bsgd->bgrts", q, k.astype(q.dtype),
                        preferred_element_type=jnp.float32) * d**-0.5
    qpos = jnp.asarray(pos, jnp.int32) + jnp.arange(t)
    mask = jnp.arange(s)[None, :] <= qpos[:, None]  # [T, S]: causal, and nothing past the cache
    scores = jnp.where(mask, scores, -jnp.inf)
    p = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
    o = jnp.einsum("bgrts,bsgd->btgrd", p, v.astype(self.dtype),
                   preferred_element_type=jnp.float32).reshape(b, t, -1)
    o = (o * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(self.dtype)
    return self.o_proj(o), new

  def init_cache(self, batch: int, length: int, dtype) -> dict:
    hkv = self.k_proj.weight.shape[0] // self.d
    z = jnp.zeros((batch, length, hkv, self.d), dtype)
    return {"k": z, "v": z}


# --- MLPs -----------------------------------------------------------------------------------


class MLP(nnx.Module):
  """SwiGLU `down(silu(gate(x)) * up(x))`: x `[B, T, H]` -> `[B, T, H]` (gate/up column-,
  down row-parallel under TP: a partial sum)."""

  def __init__(self, h: int, inter: int, name: str, ctx: _Ctx, *, rngs: nnx.Rngs):
    self.gate_proj = _proj(name + "gate_proj", h, inter, ctx, rngs=rngs)
    self.up_proj = _proj(name + "up_proj", h, inter, ctx, rngs=rngs)
    self.down_proj = _proj(name + "down_proj", inter, h, ctx, rngs=rngs)
    self.dtype = ctx.dtype

  @property
  def needs_hp(self) -> bool:
    return isinstance(self.gate_proj, Linear) or isinstance(self.up_proj, Linear)

  def __call__(self, x):
    a = jax.nn.silu(self.gate_proj(x).astype(jnp.float32)).astype(self.dtype)
    return self.down_proj((a * self.up_proj(x)).astype(self.dtype))


class SparseMoe(nnx.Module):
  """Softmax top-k MoE with a sigmoid-gated shared expert (Qwen3.5 / Qwen3-Next `mlp`).

  x `[B, T, H]` (QuantizedActivation with hp, or array) -> `[B, T, H]`:
    p = softmax(router(x.hp))                 [B, T, E] f32 (router in f32 from the bf16 copy)
    w = top-k of p (renormalised when norm_topk_prob), zero elsewhere
    out = sum_e w_e down_e(silu(gate_e(x)) * up_e(x)) + sigmoid(shared_gate(x.hp)) shared(x)
  Dense formulation: every expert runs on every token (fine for small E; a grouped GEMM over
  routed tokens is the production form). Under TP the experts' intermediate dimension is
  sharded (gate/up column-, down row-parallel): the output is a partial sum.
  """

  def __init__(self, cfg: Qwen35Config, layer: int, ctx: _Ctx, *, rngs: nnx.Rngs):
    h, e, inter = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    name = f"model.layers.{layer}.mlp."
    self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
    self.dtype = ctx.dtype
    # The router and shared-expert gate stay in high precision (HF FP8 checkpoints keep them).
    self.gate = Linear(h, e, dtype=jnp.float32, param_dtype=ctx.param_dtype, rngs=rngs)
    fp8 = any(ctx.fp8(f"{name}experts.{i}.{p}") for i in range(e)
              for p in ("gate_proj", "up_proj", "down_proj"))
    fmt = ctx.quant.fmt if fp8 else None
    init = nnx.initializers.lecun_normal(in_axis=-1, out_axis=-2, batch_axis=(0,))
    kw = dict(fmt=fmt, dtype=ctx.dtype, param_dtype=ctx.param_dtype, kernel_init=init,
              implementation=ctx.impl, rngs=rngs)
    self.experts_gate = StackedLinear(e, h, inter, **kw)
    self.experts_up = StackedLinear(e, h, inter, **kw)
    self.experts_down = StackedLinear(e, inter, h, **kw)
    self.shared_expert = MLP(h, cfg.shared_expert_intermediate_size, name + "shared_expert.",
                             ctx, rngs=rngs)
    self.shared_expert_gate = Linear(h, 1, dtype=jnp.float32, param_dtype=ctx.param_dtype,
                                     rngs=rngs)

  needs_hp = True  # the router reads the bf16 copy

  def __call__(self, x):
    hp = high_precision(x)
    probs = jax.nn.softmax(self.gate(hp).astype(jnp.float32), axis=-1)  # [B, T, E]
    top, idx = lax.top_k(probs, self.top_k)
    if self.norm_topk:
      top = top / jnp.sum(top, axis=-1, keepdims=True)
    # HF casts the routing weights to the activation dtype before weighting the experts.
    top = top.astype(self.dtype).astype(jnp.float32)
    w = jnp.sum(jax.nn.one_hot(idx, probs.shape[-1], dtype=jnp.float32) * top[..., None], -2)
    g = self.experts_gate(x).astype(jnp.float32)
    a = (jax.nn.silu(g).astype(self.dtype) * self.experts_up(x)).astype(self.dtype)
    y = self.experts_down(a, batched=True)  # [E, B, T, H]
    routed = jnp.einsum("e...h,...e->...h", y.astype(jnp.float32), w)
    shared = self.shared_expert(x).astype(jnp.float32) * jax.nn.sigmoid(
        self.shared_expert_gate(hp).astype(jnp.float32))
    return (routed.astype(self.dtype) + shared.astype(self.dtype)).astype(self.dtype)


# --- decoder --------------------------------------------------------------------------------


class DecoderLayer(nnx.Module):
  """One hybrid decoder layer with LayerCommunicator-style `prepare_attn` / `prepare_mlp`.

    x, residual = prepare_attn(h, residual)    (all-reduce +) add + norm (+ quant)
    h = mixer(x)                               GatedDeltaNet or Attention: [B, T, H]
    x, residual = prepare_mlp(h, residual)
    h = mlp(x)                                 SparseMoe or MLP: [B, T, H]
  `h` leaves the layer un-added (a partial sum under TP); the next layer's `prepare_attn` (or
  the final norm) adds it to the residual. Norm weights are zero-centred: y = h/rms(h) (1 + w).
  """

  def __init__(self, cfg: Qwen35Config, layer: int, ctx: _Ctx, *, fused: bool,
               rngs: nnx.Rngs):
    self.kind = cfg.layer_types[layer]
    self.first = layer == 0
    self.mixer = (GatedDeltaNet(cfg, layer, ctx, rngs=rngs) if self.kind == GDN
                  else Attention(cfg, layer, ctx, rngs=rngs))
    self.mlp = (SparseMoe(cfg, layer, ctx, rngs=rngs) if cfg.is_moe(layer)
                else MLP(cfg.hidden_size, cfg.intermediate_size, f"model.layers.{layer}.mlp.",
                         ctx, rngs=rngs))
    h = cfg.hidden_size
    self.input_layernorm = nnx.Param(jnp.zeros((h,), ctx.param_dtype))
    self.post_attention_layernorm = nnx.Param(jnp.zeros((h,), ctx.param_dtype))
    self.eps = cfg.rms_norm_eps
    self.fused = bool(fused) and ctx.quant is not None
    self.ctx = ctx
    # GDN's bf16 in_proj_ba reads the bf16 copy; attention only if a q/k/v stays unquantised.
    self.attn_hp = self.kind == GDN or self.mixer.needs_hp
    self.mlp_hp = self.mlp.needs_hp

  def _prepare(self, h, residual, weight, keep_hp: bool, reduce: bool):
    """(psum over tp_axis when `reduce` +) residual add + zero-centred RMSNorm (+ quant).

    h, residual `[B, T, H]` (residual None for the first layer: h is the embedding). Returns
    (x, new residual): x a QuantizedActivation (fused path; with hp when `keep_hp`) or an
    array in `dtype` (unfused / unquantised path, the projections quantise it themselves).
    """
    ctx, w = self.ctx, weight[...]
    h = h.astype(ctx.dtype)
    reduce = reduce and ctx.tp_axis is not None
    if self.fused:
      fmt = ctx.quant.fmt
      if reduce:
        return allreduce_rmsnorm_quant(h, residual, w, axis_name=ctx.tp_axis, eps=self.eps,
                                       weight_offset=1.0, fmt=fmt, keep_bf16=keep_hp,
                                       strategy=ctx.ar_strategy, implementation=ctx.impl)
      out = rmsnorm_quant(h, w, residual=residual, eps=self.eps, weight_offset=1.0, fmt=fmt,
                          keep_hp=keep_hp, implementation=ctx.impl)
      return out.quant, h if residual is None else out.residual
    if reduce:
      h = lax.psum(h, ctx.tp_axis)
    out = rmsnorm(h, w, residual=residual, eps=self.eps, weight_offset=1.0,
                  implementation=ctx.impl)
    return out.y, h if residual is None else out.residual

  def prepare_attn(self, h, residual):
    # The first layer's input is the (replicated) embedding: nothing to reduce.
    return self._prepare(h, residual, self.input_layernorm, self.attn_hp, not self.first)

  def prepare_mlp(self, h, residual):
    return self._prepare(h, residual, self.post_attention_layernorm, self.mlp_hp, True)

  def __call__(self, h, residual, cache=None, *, pos=0, mode=None):
    x, residual = self.prepare_attn(h, residual)
    if self.kind == GDN:
      h, cache = self.mixer(x, cache, mode=mode)
    else:
      h, cache = self.mixer(x, cache, pos=pos)
    x, residual = self.prepare_mlp(h, residual)
    return self.mlp(x), residual, cache


class Qwen35ForCausalLM(nnx.Module):
  """Qwen3.5 MoE / Qwen3-Next causal LM: ids `[B, T]` -> logits `[B, T, V]` (f32).

  Args:
    cfg: the architecture.
    quant: FP8 projections (`QuantConfig`: format, and the Hugging Face `modules_to_not_convert`
      that stay in high precision), or None for the unquantised path (plain Linear + RMSNorm).
    fused: the fused norm (+ all-reduce) + quant handoff, for all layers (bool) or per layer.
    tp_axis: mesh axis of tensor parallelism; the model must then run inside `jax.shard_map`
      over it with `partition_specs` (see `tp_apply`).
    ar_strategy: `allreduce_rmsnorm_quant`'s strategy (None: best available; a name: exactly
      that one or an error).
    dtype: activations and residual stream; param_dtype: high-precision parameters.
    implementation: kernel backend for the fused ops and FP8 GEMMs (None: platform best).

  Limits: every sequence of a batch sits at the same position (no padding masks); under TP the
  key heads of GDN, the attention heads and KV heads must divide by the device count (KV heads
  are not replicated across devices); the MoE is the dense all-experts formulation.
  """

  def __init__(self, cfg: Qwen35Config, *, quant: QuantConfig | None = None,
               fused: bool | Sequence[bool] = True, tp_axis: str | None = None,
               ar_strategy: str | Sequence[str] | None = None, dtype=jnp.bfloat16,
               param_dtype=jnp.bfloat16, implementation: Impl = None, rngs: nnx.Rngs):
    # Static (hashable) options: a list of strategies or backends becomes a tuple.
    tup = lambda v: tuple(v) if isinstance(v, list) else v
    ar_strategy, implementation = tup(ar_strategy), tup(implementation)
    ctx = _Ctx(quant, dtype, param_dtype, tp_axis, ar_strategy, implementation)
    flags = [fused] * cfg.num_layers if isinstance(fused, bool) else list(fused)
    if len(flags) != cfg.num_layers:
      raise ValueError(f"fused has {len(flags)} flags for {cfg.num_layers} layers")
    self.cfg, self.ctx = cfg, ctx
    self.embed_tokens = nnx.Param(
        jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), param_dtype))
    self.layers = nnx.List([DecoderLayer(cfg, i, ctx, fused=flags[i], rngs=rngs)
                            for i in range(cfg.num_layers)])
    self.norm = nnx.Param(jnp.zeros((cfg.hidden_size,), param_dtype))
    self.lm_head = None if cfg.tie_word_embeddings else Linear(
        cfg.hidden_size, cfg.vocab_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def init_cache(self, batch: int, length: int) -> tuple[dict, ...]:
    """Empty per-layer caches for `length` positions: attention k, v `[B, S, Hkv, D]`; GDN conv
    `[B, K-1, C]` and recurrent state `[B, Hv, dk, dv]` f32 (global shapes)."""
    dt = self.ctx.dtype
    return tuple(l.mixer.init_cache(batch, dt) if l.kind == GDN
                 else l.mixer.init_cache(batch, length, dt) for l in self.layers)

  def __call__(self, ids: jax.Array, *, cache: Sequence[dict] | None = None, pos=0,
               gdn_mode: str | None = None):
    """ids `[B, T]` int at positions pos .. pos + T - 1 -> (logits `[B, T, V]` f32, new cache).

    With `cache` (from `init_cache`) the call appends to it: attention writes k, v at
    [pos, pos + T), GDN continues from the conv and recurrent states. Every sequence of the
    batch is at the same position (no padding). gdn_mode: "chunk" / "recurrent" (default:
    recurrent for T == 1, chunked otherwise).
    """
    h = jnp.take(self.embed_tokens[...], ids, axis=0).astype(self.ctx.dtype)
    residual, new = None, []
    for i, layer in enumerate(self.layers):
      h, residual, c = layer(h, residual, None if cache is None else cache[i], pos=pos,
                             mode=gdn_mode)
      new.append(c)
    if self.ctx.tp_axis is not None:
      h = lax.psum(h.astype(self.ctx.dtype), self.ctx.tp_axis)
    y = rmsnorm(h.astype(self.ctx.dtype), self.norm[...], residual=residual,
                eps=self.cfg.rms_norm_eps, weight_offset=1.0, implementation=self.ctx.impl).y
    if self.lm_head is None:
      logits = jnp.einsum("...h,vh->...v", y, self.embed_tokens[...].astype(y.dtype),
                          preferred_element_type=jnp.float32)
    else:
      logits = self.lm_head(y)
    return logits.astype(jnp.float32), None if cache is None else tuple(new)


# --- tensor parallelism ---------------------------------------------------------------------

_COLUMN = {"in_proj_qkvz", "in_proj_ba", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj",
           "experts_gate", "experts_up"}
_ROW = {"o_proj", "out_proj", "down_proj", "experts_down"}
_HEADS = {"conv_weight", "A_log", "dt_bias"}


def _spec(names: Sequence[str], ndim: int, axis: str) -> P:
  owner, leaf = (names[-2] if len(names) > 1 else ""), names[-1]
  if leaf in _HEADS:
    return P(axis, *([None] * (ndim - 1)))
  if leaf in ("weight", "weight_scale_inv") and owner in _COLUMN | _ROW:
    dim = ndim - (2 if owner in _COLUMN else 1)  # N (column) or K (row) of [.., N, K]
    return P(*[axis if i == dim else None for i in range(ndim)])
  return P()


def partition_specs(state, axis: str):
  """PartitionSpecs of an `nnx.split` state for tensor parallelism over `axis`.

  Column-parallel (output rows sharded): in_proj_qkvz, in_proj_ba, q/k/v_proj, gate/up
  projections (experts: their intermediate rows), with their block scales; the GDN conv
  channels and per-head A_log / dt_bias follow. Row-parallel (input columns sharded): o_proj,
  out_proj, down projections. Everything else (norms, router, shared-expert gate, embedding,
  lm_head) is replicated. FP8 shards must hold whole 128 x 128 blocks.
  """
  def spec(path, x):
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    names = [n for n in names if n != "value"]
    return _spec(names, len(x.shape), axis)
  return jax.tree_util.tree_map_with_path(spec, state)


def cache_specs(model: Qwen35ForCausalLM, axis: str):
  """Cache sharding: attention k, v over kv heads, GDN conv over channels, state over heads."""
  return tuple({"conv": P(None, None, axis), "state": P(None, axis)} if l.kind == GDN
               else {"k": P(None, None, axis), "v": P(None, None, axis)} for l in model.layers)


def check_tp(model: Qwen35ForCausalLM, n: int) -> None:
  """Raises unless every sharded dimension splits over n devices (FP8: in whole blocks)."""
  cfg = model.cfg
  need = {"linear_num_key_heads": cfg.linear_num_key_heads, "num_key_value_heads":
          cfg.num_kv_heads, "num_attention_heads": cfg.num_heads}
  for what, v in need.items():
    if v % n:
      raise ValueError(f"tensor parallelism over {n} devices needs {what}={v} divisible by {n}")
  _, state = nnx.split(model)
  flat = jax.tree_util.tree_flatten_with_path(partition_specs(state, "tp"))[0]
  shapes = dict(jax.tree_util.tree_flatten_with_path(state)[0])
  for path, spec in flat:
    shape = shapes[path].shape
    for d, a in enumerate(spec):
      if a is None:
        continue
      fp8 = jnp.dtype(shapes[path].dtype).itemsize == 1
      unit = n * (BLOCK if fp8 else 1)
      if "weight_scale_inv" in jax.tree_util.keystr(path):
        unit = n
      if shape[d] % unit:
        raise ValueError(f"{jax.tree_util.keystr(path)} {shape}: dimension {d} does not split "
                         f"into {n} shards" + (" of whole 128-row FP8 blocks" if fp8 else ""))


def tp_apply(model: Qwen35ForCausalLM, mesh: jax.sharding.Mesh, *, with_cache: bool = False,
             gdn_mode: str | None = None, explicit_params: bool = False):
  """A jitted `f(ids, cache, pos) -> (logits, cache)` running `model` (built with
  `tp_axis`) inside `jax.shard_map` over that mesh axis, parameters sharded per
  `partition_specs`; ids, logits replicated; the cache (when `with_cache`) sharded per
  `cache_specs`. With `explicit_params`, returns `(f(params, ids, cache, pos), params)`: an
  outer jit then takes the weights as arguments rather than as captured constants."""
  axis = model.ctx.tp_axis
  if axis is None or axis not in mesh.axis_names:
    raise ValueError(f"the model's tp_axis {axis!r} is not an axis of the mesh "
                     f"{mesh.axis_names}; build it with tp_axis=...")
  check_tp(model, mesh.shape[axis])
  graphdef, state = nnx.split(model)
  pspecs = partition_specs(state, axis)
  cspecs = cache_specs(model, axis) if with_cache else P()

  def body(state, ids, cache, pos):
    m = nnx.merge(graphdef, state)
    logits, new = m(ids, cache=cache if with_cache else None, pos=pos, gdn_mode=gdn_mode)
    return logits, new if with_cache else jnp.zeros(())

  # check_vma=False: Pallas kernels inside shard_map need it (DESIGN.md 4).
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(pspecs, P(), cspecs, P()),
                             out_specs=(P(), cspecs if with_cache else P()),
                             check_vma=False))

  # Parameters placed once, sharded as the specs say (each device holds only its shard).
  put = lambda tree, specs: jax.tree.map(
      lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), tree, specs)
  state = put(state, pspecs)
  rep = NamedSharding(mesh, P())

  def pure(params, ids, cache=None, pos=0):
    cache = put(cache, cspecs) if with_cache else None
    logits, new = fn(params, jax.device_put(ids, rep), cache,
                     jax.device_put(jnp.asarray(pos, jnp.int32), rep))
    return logits, new if with_cache else None

  if explicit_params:
    return pure, state
  return lambda ids, cache=None, pos=0: pure(state, ids, cache, pos)


# --- loading --------------------------------------------------------------------------------


def _normalised(qc: QuantConfig) -> QuantConfig:
  """`modules_to_not_convert` entries in text-model names: the VLM checkpoints name modules
  `model.language_model.layers...`; this model's names are `model.layers...`."""
  out = []
  for e in qc.not_converted:
    if e.startswith("model.language_model."):
      e = "model." + e[len("model.language_model."):]
    elif e.startswith("language_model."):
      e = "model." + e[len("language_model."):]
    out.append(e)
  return dataclasses.replace(qc, not_converted=tuple(out))


def quant_config(hf: dict, fmt: Fp8Format | str | None = None) -> QuantConfig:
  """The QuantConfig of a config.json (top level, or the text config's), names normalised."""
  qc = hf.get("quantization_config") or (hf.get("text_config") or {}).get("quantization_config")
  return _normalised(QuantConfig.from_hf(qc, fmt))


def _grouped_rows(cfg: Qwen35Config) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Row permutations from Qwen3.5's layouts to the key-head-grouped one.

  Returns (qkvz, conv, ba): indices into concat(in_proj_qkv, in_proj_z) rows, into the conv
  channels [q_all | k_all | v_all], and into concat(in_proj_b, in_proj_a) rows.
  """
  dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
  hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
  r, kd, vd = hv // hk, hk * dk, hv * dv
  qkvz, conv, ba = [], [], []
  for g in range(hk):
    q = np.arange(g * dk, (g + 1) * dk)
    k = kd + q
    v = 2 * kd + np.arange(g * r * dv, (g + 1) * r * dv)
    z = 2 * kd + vd + np.arange(g * r * dv, (g + 1) * r * dv)
    qkvz += [q, k, v, z]
    conv += [q, k, v]
    ba += [np.arange(g * r, (g + 1) * r), hv + np.arange(g * r, (g + 1) * r)]
  return np.concatenate(qkvz), np.concatenate(conv), np.concatenate(ba)


def _permute_rows(w, s, rows: np.ndarray, fmt: Fp8Format | None):
  """Rows `rows` of a projection (fp8 + block scale, or dense). FP8 blocks move whole when
  `rows` maps aligned 128-row blocks to aligned blocks; otherwise dequantise, permute, requantise
  (codes then change)."""
  if s is None:
    return w[rows], None
  blocks = rows.reshape(-1, BLOCK) if rows.size % BLOCK == 0 else None
  if blocks is not None and np.all(blocks[:, 0] % BLOCK == 0) and np.all(
      blocks == blocks[:, :1] + np.arange(BLOCK)):
    return w[rows], s[blocks[:, 0] // BLOCK]
  return quantize_weight(dequantize_weight(w, s)[rows], fmt)


class _Loader:
  """Fills an abstract model from a checkpoint, naming the tensor in every error."""

  def __init__(self, ckpt: Checkpoint, model: Qwen35ForCausalLM):
    self.ckpt, self.model, self.cfg = ckpt, model, model.cfg
    lm = "model.language_model."
    self.p = lm if f"{lm}embed_tokens.weight" in ckpt else "model."
    self.pdt = model.ctx.param_dtype

  def set(self, var: nnx.Variable, value, name: str) -> None:
    want = var.get_value()
    if tuple(value.shape) != tuple(want.shape):
      raise TensorMismatchError(f"tensor {name!r} gives shape {list(value.shape)} for a "
                                f"parameter of shape {list(want.shape)}")
    dt = want.dtype
    if jnp.dtype(dt).itemsize == 1 and jnp.dtype(value.dtype) != jnp.dtype(dt):
      raise TensorMismatchError(f"tensor {name!r} is {value.dtype}, expected {dt}")
    var.set_value(jnp.asarray(value).astype(dt))

  def array(self, var, name: str, shape):
    self.set(var, load_array(self.ckpt, name, shape, self.pdt), self.ckpt.prefix + name)

  def linear(self, mod, names, k: int, rows: np.ndarray | None = None) -> None:
    """A projection from one or more checkpoint modules (concatenated along N, then `rows`)."""
    fmt = self.model.ctx.quant.fmt if isinstance(mod, Fp8Linear) else None
    w, s = load_linear(self.ckpt, names, in_features=k, fmt=fmt, dtype=self.pdt)
    if rows is not None:
      w, s = _permute_rows(w, s, rows, fmt)
    label = "+".join(names) if isinstance(names, (list, tuple)) else names
    self.set(mod.weight, w, label)
    if s is not None:
      self.set(mod.weight_scale_inv, s, label + " (weight_scale_inv)")

  def experts(self, moe: SparseMoe, base: str) -> None:
    e, h = self.cfg.num_experts, self.cfg.hidden_size
    inter = self.cfg.moe_intermediate_size
    mods = {"gate_proj": moe.experts_gate, "up_proj": moe.experts_up,
            "down_proj": moe.experts_down}
    fused = f"{base}experts.gate_up_proj"
    if f"{base}experts.0.gate_proj.weight" in self.ckpt:
      for p, mod in mods.items():
        fmt = self.model.ctx.quant.fmt if mod.weight_scale_inv is not None else None
        parts = [load_linear(self.ckpt, f"{base}experts.{i}.{p}",
                             in_features=inter if p == "down_proj" else h, fmt=fmt,
                             dtype=self.pdt) for i in range(e)]
        self.set(mod.weight, jnp.stack([w for w, _ in parts]), f"{base}experts.*.{p}")
        if fmt is not None:
          self.set(mod.weight_scale_inv, jnp.stack([s for _, s in parts]),
                   f"{base}experts.*.{p} (weight_scale_inv)")
    elif fused in self.ckpt:
      # HF Qwen3_5MoeExperts: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].
      gu = load_array(self.ckpt, fused, (e, 2 * inter, h), jnp.float32)
      dn = load_array(self.ckpt, f"{base}experts.down_proj", (e, h, inter), jnp.float32)
      for mod, w, name in ((moe.experts_gate, gu[:, :inter], fused),
                           (moe.experts_up, gu[:, inter:], fused),
                           (moe.experts_down, dn, f"{base}experts.down_proj")):
        if mod.weight_scale_inv is None:
          self.set(mod.weight, w.astype(self.pdt), self.ckpt.prefix + name)
        else:
          q, s = jax.vmap(lambda a: quantize_weight(a, self.model.ctx.quant.fmt))(w)
          self.set(mod.weight, q, self.ckpt.prefix + name)
          self.set(mod.weight_scale_inv, s, self.ckpt.prefix + name + " (scales)")
    else:
      raise MissingTensorError(
          f"experts of {self.ckpt.prefix}{base[:-1]} are missing from {self.ckpt.path}: neither "
          f"per-expert '{self.ckpt.prefix}{base}experts.0.gate_proj.weight' nor fused "
          f"'{self.ckpt.prefix}{fused}'")

  def gdn(self, m: GatedDeltaNet, base: str) -> None:
    cfg, h = self.cfg, self.cfg.hidden_size
    hv, c = cfg.linear_num_value_heads, m.conv_weight.shape[0]
    qkvz_rows, conv_rows, ba_rows = _grouped_rows(cfg)
    if cfg.model_type == "qwen3_next":  # checkpoint already in the grouped layout
      self.linear(m.in_proj_qkvz, base + "in_proj_qkvz", h)
      self.linear(m.in_proj_ba, base + "in_proj_ba", h)
    else:
      self.linear(m.in_proj_qkvz, [base + "in_proj_qkv", base + "in_proj_z"], h, qkvz_rows)
      self.linear(m.in_proj_ba, [base + "in_proj_b", base + "in_proj_a"], h, ba_rows)
    conv = load_array(self.ckpt, base + "conv1d.weight", (c, 1, cfg.conv_kernel), self.pdt)
    self.set(m.conv_weight, conv[:, 0][conv_rows], self.ckpt.prefix + base + "conv1d.weight")
    # A_log and dt_bias keep f32 (released checkpoints store them so).
    for var, n in ((m.A_log, "A_log"), (m.dt_bias, "dt_bias")):
      self.set(var, load_array(self.ckpt, base + n, (hv,), jnp.float32),
               self.ckpt.prefix + base + n)
    self.array(m.norm_weight, base + "norm.weight", (cfg.linear_value_head_dim,))
    self.linear(m.out_proj, base + "out_proj", hv * cfg.linear_value_head_dim)

  def attention(self, m: Attention, base: str) -> None:
    cfg, h = self.cfg, self.cfg.hidden_size
    for p in ("q_proj", "k_proj", "v_proj"):
      self.linear(getattr(m, p), base + p, h)
    self.linear(m.o_proj, base + "o_proj", cfg.num_heads * cfg.head_dim)
    self.array(m.q_norm, base + "q_norm.weight", (cfg.head_dim,))
    self.array(m.k_norm, base + "k_norm.weight", (cfg.head_dim,))

  def mlp(self, m: MLP, base: str, inter: int) -> None:
    h = self.cfg.hidden_size
    self.linear(m.gate_proj, base + "gate_proj", h)
    self.linear(m.up_proj, base + "up_proj", h)
    self.linear(m.down_proj, base + "down_proj", inter)

  def load(self) -> None:
    cfg, model, h = self.cfg, self.model, self.cfg.hidden_size
    top, self.ckpt = self.ckpt, self.ckpt.scope(self.p)
    self.array(model.embed_tokens, "embed_tokens.weight", (cfg.vocab_size, h))
    self.array(model.norm, "norm.weight", (h,))
    for i, layer in enumerate(model.layers):
      base = f"layers.{i}."
      self.array(layer.input_layernorm, base + "input_layernorm.weight", (h,))
      self.array(layer.post_attention_layernorm, base + "post_attention_layernorm.weight", (h,))
      if layer.kind == GDN:
        self.gdn(layer.mixer, base + "linear_attn.")
      else:
        self.attention(layer.mixer, base + "self_attn.")
      if isinstance(layer.mlp, SparseMoe):
        moe = layer.mlp
        self.linear(moe.gate, base + "mlp.gate", h)
        self.experts(moe, base + "mlp.")
        self.mlp(moe.shared_expert, base + "mlp.shared_expert.",
                 cfg.shared_expert_intermediate_size)
        self.linear(moe.shared_expert_gate, base + "mlp.shared_expert_gate", h)
      else:
        self.mlp(layer.mlp, base + "mlp.", cfg.intermediate_size)
    self.ckpt = top
    if model.lm_head is not None:
      self.linear(model.lm_head, "lm_head", h)


def from_pretrained(path: str | os.PathLike, *, fp8: bool = True,
                    fmt: Fp8Format | str | None = None, fused: bool | Sequence[bool] = True,
                    tp_axis: str | None = None, ar_strategy: str | Sequence[str] | None = None,
                    dtype=None, param_dtype=None,
                    implementation: Impl = None) -> Qwen35ForCausalLM:
  """A model from a Hugging Face checkpoint directory (config.json + safetensors, with or
  without model.safetensors.index.json; text `model.*` or VLM `model.language_model.*` names).

  fp8=True: projections FP8 (`fmt`, default the device's): FP8 checkpoint weights with their
  `weight_scale_inv` (f32 or bf16) are kept, high-precision ones quantised on load; modules in
  `quantization_config.modules_to_not_convert` (with or without the VLM prefix) stay high
  precision. Activations bf16. fp8=False: the unquantised path, every weight dequantised to
  `param_dtype` (default f32, activations `dtype` f32: the exact comparison with HF).
  Experts may be stored per expert (`experts.{e}.{gate,up,down}_proj.weight`, as save_pretrained
  and the FP8 releases write) or fused (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`,
  high precision, as the bf16 releases store them).
  Raises CheckpointError subclasses naming the tensor at fault.
  """
  ckpt = Checkpoint(path)
  cfg = Qwen35Config.from_hf(ckpt.config)
  if fp8:
    quant = quant_config(ckpt.config, fmt)
    dtype, param_dtype = dtype or jnp.bfloat16, param_dtype or jnp.bfloat16
  else:
    quant = None
    dtype, param_dtype = dtype or jnp.float32, param_dtype or jnp.float32
  model = nnx.eval_shape(lambda: Qwen35ForCausalLM(
      cfg, quant=quant, fused=fused, tp_axis=tp_axis, ar_strategy=ar_strategy, dtype=dtype,
      param_dtype=param_dtype, implementation=implementation, rngs=nnx.Rngs(0)))
  _Loader(ckpt, model).load()
  _, state = nnx.split(model)
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    if isinstance(leaf, jax.ShapeDtypeStruct):
      raise CheckpointError(f"parameter {jax.tree_util.keystr(path)} was not loaded (a loader "
                            f"bug: every parameter should map to a checkpoint tensor)")
  return model


__all__ = [
    "Attention", "DecoderLayer", "GatedDeltaNet", "MLP", "Qwen35Config",
    "Qwen35ForCausalLM", "SparseMoe", "cache_specs", "check_tp", "from_pretrained",
    "partition_specs", "quant_config", "tp_apply",
]
