"""Qwen3.5 MoE / Qwen3-Next's hybrid decoder layer (Gated DeltaNet or gated full attention,
then MoE) on jfusedq's fused norm + FP8 path.

Layers follow `layer_types`: by default three Gated DeltaNet ("linear_attention") layers, then one
gated full-attention layer, repeated. Every layer ends in a sparse MoE block (Qwen3-Next may use a
dense MLP on `mlp_only_layers`). Shapes: B batch, T new tokens, S cached positions, H hidden
size, V vocabulary.

A decode step's data path through one layer (`DecoderLayer`), SGLang LayerCommunicator style:
`prepare_attn` / `prepare_mlp` run (all-reduce +) residual add + zero-centred RMSNorm
`y = h / rms(h) * (1 + w)` + per-group FP8 quantisation as one kernel (`jfusedq.nn.RMSNorm`, via
`models.common.prepare`), so the next FP8 projection receives a ready `QuantizedActivation`:

  * full attention: `(fp8, scale)` for its FP8 q/k/v projections;
  * Gated DeltaNet: `(bf16, fp8, scale)` (`keep_hp`): FP8 `in_proj_qkvz` uses the fp8 codes,
    the bf16 `in_proj_ba` (`jfusedq.nn.Linear`) the bf16 copy;
  * MoE: `(bf16, fp8, scale)`: FP8 experts / shared expert, bf16 router and shared-expert gate.

Under tensor parallelism (inside `jax.shard_map` over `tp_axis`: q/k/v, in_proj_qkvz/ba, conv,
expert gate/up projections column-parallel; o_proj, out_proj, down projections row-parallel)
each layer's mixer and MLP return partial sums, and the next `prepare_*` runs all-reduce + add +
RMSNorm + quant as one step (`jfusedq.parallel.allreduce_rmsnorm_quant`;
`JFUSEDQ_DISABLE_FUSED_AR_QUANT=1` makes it fall back to an unfused strategy). The fused path is
opt-in per layer (`fused`); off, the same weights run the unfused composition: (psum,) add +
RMSNorm to bf16, then each FP8 projection quantises its input itself. Without FP8 every
projection is a plain `jfusedq.nn.Linear` in `dtype` and every norm a plain RMSNorm: the
unquantised path, which equals Hugging Face's model in f32.

Internal Gated DeltaNet layout. `in_proj_qkvz` rows, `in_proj_ba` rows and conv channels are
grouped by key head g (Qwen3-Next's checkpoint layout), with r = num_v_heads / num_k_heads:
  in_proj_qkvz: per g [q_g (dk) | k_g (dk) | v_g (r dv) | z_g (r dv)]
  in_proj_ba:   per g [b_g (r) | a_g (r)]
  conv1d:       per g [q_g | k_g | v_g]
so a contiguous column-parallel shard holds whole key-head groups. Qwen3.5's separate
`in_proj_qkv` ([q_all | k_all | v_all]) + `in_proj_z`, `in_proj_b` + `in_proj_a` are permuted into
it on load (`loading.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jfusedq.nn import Linear, RMSNorm, high_precision
from jfusedq.ops.attention import Prefix, attention
from jfusedq.ops.gated_delta_rule import gated_delta_rule
from jfusedq.ops.rmsnorm_quant.reference import rmsnorm as rmsnorm_f32
from models.common import MLP, Options, prepare, rotate_half_rope, write_cache
from models.common.moe import Experts
from models.qwen3_5.config import GDN, Qwen35Config

CHUNK = 64  # chunk length of the prefill gated delta rule (HF and fla use 64)


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

  def __init__(self, cfg: Qwen35Config, layer: int, opts: Options, *, rngs: nnx.Rngs):
    h, dk, dv = cfg.hidden_size, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    self.dk, self.dv, self.r, self.kernel = dk, dv, hv // hk, cfg.conv_kernel
    self.eps, self.dtype = cfg.rms_norm_eps, opts.dtype
    name = f"model.layers.{layer}.linear_attn."
    # FP8 only if Qwen3.5's in_proj_qkv and in_proj_z (Qwen3-Next's in_proj_qkvz) all are.
    self.in_proj_qkvz = opts.proj(h, hk * (2 * dk + 2 * self.r * dv), name + "in_proj_qkv",
                                  name + "in_proj_z", name + "in_proj_qkvz", rngs=rngs)
    self.in_proj_ba = Linear(h, 2 * hv, dtype=opts.dtype, param_dtype=opts.param_dtype,
                             rngs=rngs)
    c = hk * (2 * dk + self.r * dv)
    self.conv_weight = nnx.Param(
        jax.random.normal(rngs.params(), (c, self.kernel), opts.param_dtype) * 0.5)
    self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (hv,), jnp.float32, 1, 16)))
    self.dt_bias = nnx.Param(jnp.ones((hv,), jnp.float32))
    self.norm_weight = nnx.Param(jnp.ones((dv,), opts.param_dtype))
    self.out_proj = opts.proj(hv * dv, h, name + "out_proj", rngs=rngs)

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
  The cache holds k, v `[B, S, Hkv, D]`; this call writes positions [pos, pos + T). A decode
  step (T = 1) scores the whole cache at once (`_decode`); a longer call (prefill) attends over
  the new tokens and the cached positions [0, pos) without the T x S scores
  (`jfusedq.ops.attention`: cuDNN's flash attention on an NVIDIA GPU, an online softmax over key
  blocks elsewhere).
  """

  def __init__(self, cfg: Qwen35Config, layer: int, opts: Options, *, rngs: nnx.Rngs):
    h, d = cfg.hidden_size, cfg.head_dim
    self.d, self.rotary_dim, self.theta = d, cfg.rotary_dim, cfg.rope_theta
    self.dtype = opts.dtype
    name = f"model.layers.{layer}.self_attn."
    self.q_proj = opts.proj(h, cfg.num_heads * d * 2, name + "q_proj", rngs=rngs)
    self.k_proj = opts.proj(h, cfg.num_kv_heads * d, name + "k_proj", rngs=rngs)
    self.v_proj = opts.proj(h, cfg.num_kv_heads * d, name + "v_proj", rngs=rngs)
    self.o_proj = opts.proj(cfg.num_heads * d, h, name + "o_proj", rngs=rngs)
    # Per-head norms over D values stay in XLA, which fuses them with the RoPE that follows.
    head_norm = lambda: RMSNorm(d, eps=cfg.rms_norm_eps, weight_offset=1.0, dtype=opts.dtype,
                                param_dtype=opts.param_dtype, scale_init=nnx.initializers.zeros,
                                implementation="xla", rngs=rngs)
    self.q_norm, self.k_norm = head_norm(), head_norm()

  @property
  def needs_hp(self) -> bool:
    return any(isinstance(p, Linear) for p in (self.q_proj, self.k_proj, self.v_proj))

  def __call__(self, x, cache: dict | None = None, *, pos=0):
    qg = self.q_proj(x)
    b, t, _ = qg.shape
    d = self.d
    qg = qg.reshape(b, t, -1, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(b, t, -1)
    k = self.k_proj(x).reshape(b, t, -1, d)
    v = self.v_proj(x).reshape(b, t, -1, d)
    q, k = self.q_norm(q), self.k_norm(k)
    q = rotate_half_rope(q, pos, self.theta, self.rotary_dim)
    k = rotate_half_rope(k, pos, self.theta, self.rotary_dim)
    if cache is None:
      o, new = attention(q, k, v, scale=d**-0.5), None  # [B, T, Hq, D] f32
    else:
      new = {"k": write_cache(cache["k"], k, pos), "v": write_cache(cache["v"], v, pos)}
      if t == 1:
        o = self._decode(q, new, pos)
      else:
        fetch = lambda start, size: tuple(lax.dynamic_slice_in_dim(new[n], start, size, axis=1)
                                          for n in ("k", "v"))
        o = attention(q, k, v, scale=d**-0.5, prefix=Prefix(fetch, pos, new["k"].shape[1]))
    o = (o.reshape(b, t, -1) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(self.dtype)
    return self.o_proj(o), new

  def _decode(self, q, cache: dict, pos) -> jax.Array:
    """One token's attention over the whole cache, every slot scored and the slots past pos
    masked: q `[B, 1, Hq, D]` -> o `[B, 1, Hq, D]` f32."""
    k, v = cache["k"], cache["v"]
    b, t, _, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    q = q.reshape(b, t, hkv, -1, d)  # [B, T, Hkv, rep, D]
    scores = jnp.einsum("btgrd,bsgd->bgrts", q, k.astype(q.dtype),
                        preferred_element_type=jnp.float32) * d**-0.5
    qpos = jnp.asarray(pos, jnp.int32) + jnp.arange(t)
    mask = jnp.arange(s)[None, :] <= qpos[:, None]  # [T, S]: causal, and nothing past the cache
    scores = jnp.where(mask, scores, -jnp.inf)
    p = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
    o = jnp.einsum("bgrts,bsgd->btgrd", p, v.astype(self.dtype),
                   preferred_element_type=jnp.float32)
    return o.reshape(b, t, -1, d)

  def init_cache(self, batch: int, length: int, dtype) -> dict:
    hkv = self.k_proj.weight.shape[0] // self.d
    z = jnp.zeros((batch, length, hkv, self.d), dtype)
    return {"k": z, "v": z}


# --- MLPs -----------------------------------------------------------------------------------


class SparseMoe(nnx.Module):
  """Softmax top-k MoE with a sigmoid-gated shared expert (Qwen3.5 / Qwen3-Next `mlp`).

  x `[B, T, H]` (QuantizedActivation with hp, or array) -> `[B, T, H]`:
    p = softmax(router(x.hp))                 [B, T, E] f32 (router in f32 from the bf16 copy)
    w = top-k of p (renormalised when norm_topk_prob), zero elsewhere
    out = sum_e w_e down_e(silu(gate_e(x)) * up_e(x)) + sigmoid(shared_gate(x.hp)) shared(x)
  The routed experts compute only the tokens that picked them (`models.common.moe.Experts`).
  Under TP the experts' intermediate dimension is sharded (gate/up column-, down row-parallel):
  the output is a partial sum.
  """

  def __init__(self, cfg: Qwen35Config, layer: int, opts: Options, *, rngs: nnx.Rngs):
    h, e, inter = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    name = f"model.layers.{layer}.mlp."
    self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
    self.dtype = opts.dtype
    # The router and shared-expert gate stay in high precision (HF FP8 checkpoints keep them).
    self.gate = Linear(h, e, dtype=jnp.float32, param_dtype=opts.param_dtype, rngs=rngs)
    fp8 = any(opts.quantizes(f"{name}experts.{i}.{p}") for i in range(e)
              for p in ("gate_proj", "up_proj", "down_proj"))
    self.experts = Experts(e, h, inter, fmt=opts.quant.fmt if fp8 else None, ue8m0=opts.ue8m0,
                           dtype=opts.dtype, param_dtype=opts.param_dtype,
                           act="silu_round_mul", implementation=opts.implementation,
                           kernel_init=nnx.initializers.lecun_normal(in_axis=-1, out_axis=-2,
                                                                     batch_axis=(0,)),
                           rngs=rngs)
    self.shared_expert = MLP(h, cfg.shared_expert_intermediate_size, name + "shared_expert.",
                             opts, rngs=rngs)
    self.shared_expert_gate = Linear(h, 1, dtype=jnp.float32, param_dtype=opts.param_dtype,
                                     rngs=rngs)

  needs_hp = True  # the router reads the bf16 copy

  def __call__(self, x):
    hp = high_precision(x)
    probs = jax.nn.softmax(self.gate(hp).astype(jnp.float32), axis=-1)  # [B, T, E]
    top, idx = lax.top_k(probs, self.top_k)
    if self.norm_topk:
      top = top / jnp.sum(top, axis=-1, keepdims=True)
    # HF casts the routing weights to the activation dtype before weighting the experts.
    routed = self.experts(x, top.astype(self.dtype).astype(jnp.float32), idx)
    shared = self.shared_expert(x).astype(jnp.float32) * jax.nn.sigmoid(
        self.shared_expert_gate(hp).astype(jnp.float32))
    return (routed.astype(self.dtype) + shared.astype(self.dtype)).astype(self.dtype)


# --- decoder --------------------------------------------------------------------------------


class DecoderLayer(nnx.Module):
  """One hybrid decoder layer with LayerCommunicator-style `prepare_attn` / `prepare_mlp`.

    x, r = prepare_attn(h, r)    (all-reduce +) add + norm (+ quant): one kernel
    h = mixer(x)                 GatedDeltaNet or Attention: [B, T, H]
    x, r = prepare_mlp(h, r)
    h = mlp(x)                   SparseMoe or MLP: [B, T, H]
  `h` leaves the layer un-added (a partial sum under TP); the next layer's `prepare_attn` (or
  the final norm) adds it to the residual. Norm weights are zero-centred: y = h/rms(h) (1 + w).
  """

  def __init__(self, cfg: Qwen35Config, layer: int, opts: Options, *, fused: bool,
               rngs: nnx.Rngs):
    self.kind = cfg.layer_types[layer]
    self.mixer = (GatedDeltaNet(cfg, layer, opts, rngs=rngs) if self.kind == GDN
                  else Attention(cfg, layer, opts, rngs=rngs))
    self.mlp = (SparseMoe(cfg, layer, opts, rngs=rngs) if cfg.is_moe(layer)
                else MLP(cfg.hidden_size, cfg.intermediate_size, f"model.layers.{layer}.mlp.",
                         opts, rngs=rngs))
    h, eps = cfg.hidden_size, cfg.rms_norm_eps
    # The first layer's input is the (replicated) embedding: nothing to all-reduce.
    self.input_layernorm = opts.norm(h, eps, weight_offset=1.0, reduce=layer > 0, rngs=rngs)
    self.post_attention_layernorm = opts.norm(h, eps, weight_offset=1.0, reduce=True,
                                              rngs=rngs)
    self.fused = fused
    # GDN's bf16 in_proj_ba reads the bf16 copy; attention only if a q/k/v stays unquantised.
    self.attn_hp = self.kind == GDN or self.mixer.needs_hp
    self.mlp_hp = self.mlp.needs_hp

  def prepare_attn(self, h, residual):
    """(All-reduce +) residual add + input_layernorm (+ quant, + bf16 copy for GDN)."""
    return prepare(self.input_layernorm, h, residual, quant=self.fused, keep_hp=self.attn_hp)

  def prepare_mlp(self, h, residual):
    """(All-reduce +) residual add + post_attention_layernorm (+ quant, + bf16 copy for the
    router)."""
    return prepare(self.post_attention_layernorm, h, residual, quant=self.fused,
                   keep_hp=self.mlp_hp)

  def __call__(self, h, residual, cache=None, *, pos=0, gdn_mode=None):
    x, residual = self.prepare_attn(h, residual)
    if self.kind == GDN:
      h, cache = self.mixer(x, cache, mode=gdn_mode)
    else:
      h, cache = self.mixer(x, cache, pos=pos)
    x, residual = self.prepare_mlp(h, residual)
    return self.mlp(x), residual, cache
