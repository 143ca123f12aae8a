"""DeepSeek-V3's decoder layer (MLA attention + DeepSeekMoE) on jfusedq's fused norm + FP8 path.

Shapes: B batch, T new tokens, S cache slots, H hidden_size, V vocab, NH attention heads (per
tensor-parallel device inside shard_map), Lq q_lora_rank, Lkv kv_lora_rank, R qk_rope_head_dim,
Dn qk_nope_head_dim, Dv v_head_dim, Dqk = Dn + R, E routed experts, I intermediate sizes.

A decode step's data path through one layer (`DecoderLayer`), SGLang LayerCommunicator style:
the layer receives the previous layer's output `h` (a partial sum under tensor parallelism)
and the residual stream `r`:

  prepare_attn:  r = psum(h) + r;  x = quant(rmsnorm(r) * w_in)    one kernel (`RMSNorm`, via
                                                                   `models.common.prepare`):
                                                                   x a QuantizedActivation
  attention:     h = o_proj(MLA(x))                                FP8 GEMMs read x's codes
  prepare_mlp:   r = psum(h) + r;  x = quant(rmsnorm(r) * w_post)  + its bf16 copy x.hp for
                                                                   the MoE router
  mlp:           h = MoE(x) or SwiGLU(x)                           FP8 experts

With `fused=False` the same weights run the unfused composition: rmsnorm to bf16, then each
FP8 projection quantises its input itself. Without FP8 every projection is a bf16 (or f32)
`jfusedq.nn.Linear` and the norms are plain: the unquantised path that matches Hugging Face.

MLA (q_lora_rank set, as in DeepSeek-V3):
  [q_a | kv_a | k_pe] = fused_qkv_a_proj_with_mqa(x)        [B, T, Lq + Lkv + R], one GEMM
  q_in, kv = q_a_layernorm.dual(q_a, kv_a_layernorm, kv_a)  one dual-input kernel: q_in
                                                            quantised, kv bf16
  q = q_b_proj(q_in) -> [B, T, NH, Dn + R];  [k_nope | v] = kv_b_proj(kv) -> [B, T, NH, Dn + Dv]
  q_pe, k_pe = rope(q_pe), rope(k_pe)  (DeepSeek's interleaved pairs, YaRN frequencies; k_pe is
                                        one head shared by all)
  o = softmax(q k^T * scale + causal) v, scale = Dqk^-0.5 * yarn_mscale(factor, mscale_all_dim)^2
  out = o_proj(o)                                           [B, T, H]
With a cache the layer keeps MLA's latent, kv and k_pe (`KVCache`). A decode step (T = 1)
attends with kv_b_proj absorbed into q and o (`MLA._absorbed`): it reads Lkv + R values a cached
token. Any longer call (prefill, with or without a cache) runs the per-head formula above, as
Hugging Face does, over the new tokens and the cached prefix, which kv_b_proj expands to per-head
keys and values one segment at a time (`jfusedq.ops.attention`: cuDNN's flash attention on an
NVIDIA GPU, an online softmax over key blocks elsewhere; never the T x S scores). Per (query,
key) pair the per-head form costs NH (Dqk + Dv) multiply-adds (40960 in DeepSeek-V3) against the
absorbed form's NH (2 Lkv + R) (139264), plus kv_b_proj once a key and call.

MoE: s = sigmoid(hp W_gate^T) [T, E] (f32); groups scored by the sum of their top-2 of
s + e_score_correction_bias; experts chosen (top_k) from the best topk_group of n_group groups;
weights = s at the chosen experts, normalised (norm_topk_prob), times routed_scaling_factor;
out = sum_k weight_k expert_k(x) + shared_experts(x), the routed experts computed only for the
tokens that picked them (`models.common.moe.Experts`).

Tensor parallel (`models.deepseek_v3.sharding`): heads split over the axis (q_b_proj, kv_b_proj
column-parallel; o_proj row-parallel), MLP / expert intermediate dims split (gate/up column,
down row); the partial sums of o_proj and down_proj are all-reduced inside the next prepare
step (`RMSNorm` with the TP axis: `jfusedq.parallel.allreduce_rmsnorm_quant`). fused_qkv_a,
router, norms, embeddings and lm_head are replicated.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jfusedq.fp8 import BLOCK, QuantizedActivation
from jfusedq.ops.attention import Prefix, attention
from jfusedq.ops.fp8_matmul import activation_format
from jfusedq.ops.fp8_matmul.reference import dequantize_weight
from jfusedq.ops import _dispatch
from jfusedq.ops.group_quant import group_quant
from jfusedq.ops.mla_decode import mla_decode
from models.common import Options, is_fp8, prepare, write_cache
from models.common.moe import Experts
from models.deepseek_v3.config import DeepseekV3Config
from models.deepseek_v3.rope import apply_rope, softmax_scale

# DeepseekV3RMSNorm(q_lora_rank) / (kv_lora_rank) in HF and DeepSeek's own code take the
# default eps, not config.rms_norm_eps.
LORA_NORM_EPS = 1e-6
_normal = nnx.initializers.normal(1.0)


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


class MLP(nnx.Module):
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


class Router(nnx.Module):
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


class MoE(nnx.Module):
  """`experts(x, gate(x_hp)) + shared_experts(x)`, x `[..., H]` -> `[..., H]`.

  The router needs the high-precision activation: on the fused path x is a QuantizedActivation
  carrying `hp` (the (bf16, fp8, scale) tuple), experts and shared experts use its codes.
  """

  def __init__(self, cfg: DeepseekV3Config, name: str, opts: Options, *, rngs: nnx.Rngs):
    self.gate = Router(cfg, rngs=rngs)
    fmt = opts.quant.fmt if opts.quantizes(f"{name}.experts") else None
    self.experts = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                           fmt=fmt, ue8m0=opts.ue8m0, dtype=opts.dtype,
                           param_dtype=opts.param_dtype, act="silu_mul",
                           implementation=opts.implementation, rngs=rngs)
    self.shared_experts = (
        MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
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


class MLA(nnx.Module):
  """Multi-head latent attention with a latent KV cache (equations in the module docstring).

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
    self.implementation, self.dtype = opts.implementation, opts.dtype

  @property
  def takes_fp8(self) -> bool:
    return is_fp8(self.fused_qkv_a_proj_with_mqa)

  def norm_q_kv(self, q_a: jax.Array, kv_a: jax.Array, fused: bool):
    """q_a_layernorm and kv_a_layernorm: one dual-input fused kernel when q_b_proj is FP8."""
    if fused and is_fp8(self.q_b_proj):
      return self.q_a_layernorm.dual(q_a, self.kv_a_layernorm, kv_a)
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
    k_pe = apply_rope(k_pe[:, :, None], cs, sn, cfg.rope_interleave)[:, :, 0]  # one head, shared
    kv = self._latent(kv)
    if cache is not None:
      codes, scales = (kv.q, kv.row_scale()) if isinstance(kv, QuantizedActivation) else (kv, None)
      cache = KVCache(write_cache(cache.kv, codes, pos), write_cache(cache.kv_scale, scales, pos),
                      write_cache(cache.k_pe, k_pe, pos))
      if t == 1:
        return self._absorbed(q, pos, cache), cache
    k, v = self._heads(kv, k_pe)
    prefix = None if cache is None else Prefix(
        lambda start, size: self._heads(*_slots(cache, start, size)), pos, cache.kv.shape[1])
    o = attention(q, k, v, scale=self.scale, prefix=prefix)  # [B, T, NH, Dv] f32
    return self.o_proj(o.reshape(b, t, -1).astype(self.dtype)), cache

  def _latent(self, kv: jax.Array) -> jax.Array | QuantizedActivation:
    """The normalised latent `[B, T, Lkv]` as kv_b_proj consumes it and the cache holds it: its
    1 x 128 fp8 codes and scales for an FP8 kv_b_proj (quantised once, for both), else kv."""
    if not is_fp8(self.kv_b_proj):
      return kv
    return group_quant(kv, group_size=BLOCK, fmt=activation_format(self.kv_b_proj.weight.dtype),
                       ue8m0=self.kv_b_proj.ue8m0, implementation=self.implementation)

  def _heads(self, kv, k_pe: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-head keys and values of latent tokens: kv `[B, S, Lkv]` (`_latent`'s form), k_pe
    `[B, S, R]` -> k `[B, S, NH, Dqk]` = [k_nope | k_pe], v `[B, S, NH, Dv]`, in dtype."""
    cfg = self.cfg
    dn = cfg.qk_nope_head_dim
    b, s = k_pe.shape[:2]
    kvb = self.kv_b_proj(kv).reshape(b, s, -1, dn + cfg.v_head_dim)  # [B, S, NH, Dn + Dv]
    k_pe = jnp.broadcast_to(k_pe[:, :, None].astype(kvb.dtype), (*kvb.shape[:3], k_pe.shape[-1]))
    return jnp.concatenate([kvb[..., :dn], k_pe], -1), kvb[..., dn:]

  def _absorbed(self, q, pos, cache: KVCache):
    """Attention over the latent cache, kv_b_proj folded into the query and the output
    (DeepSeek-V2's absorption): with W = kv_b_proj's weight `[NH, Dn + Dv, Lkv]` split into
    W_uk `[NH, Dn, Lkv]` and W_uv `[NH, Dv, Lkv]`,
      q_nope . k_nope = (q_nope W_uk) . kv        o = (softmax(...) kv) W_uv^T
    so a step reads Lkv + R values per cached token instead of NH (Dqk + Dv)
    (`jfusedq.mla_decode`, on the cache as stored: its fp8 codes and scales when kv_b_proj is
    FP8). The absorbed products read W's FP8 codes in place, their 128 x 128 block scales
    moved onto the small operand (`_absorb`). This equals the per-head formula up to where the
    roundings fall.
    q `[B, T, NH, Dqk]` (rope part rotated), cache written through position pos + T - 1 ->
    o_proj's output `[B, T, H]`."""
    cfg = self.cfg
    b, t, nh, _ = q.shape
    dn = cfg.qk_nope_head_dim
    codes, scales = self._absorb()
    g = codes.shape[2]
    # Operands in the model's dtype (the codes exact in it), sums in f32: a bf16 model's
    # products run on bf16 tensor cores, not as f32 GEMMs; mla_decode's kernel rounds q_lat to
    # bf16 in any case.
    cast = lambda a: a.astype(self.dtype)
    dot = lambda eq, x, y: jnp.einsum(eq, cast(x), cast(y), preferred_element_type=jnp.float32,
                                      precision=lax.Precision.HIGHEST)
    # q_lat[c in group j] = sum_d (q[d] s[d, j]) codes[d, c]: the scale varies along d only.
    qs = q[..., :dn].astype(jnp.float32)[..., None] * scales[:, :dn]  # [B, T, NH, Dn, G]
    q_lat = dot("bthdg,hdgc->bthgc", qs, codes[:, :dn]).reshape(b, t, nh, -1)
    o_lat = mla_decode(q_lat, q[..., dn:], cache.kv, cache.kv_scale, cache.k_pe, pos=pos,
                       scale=self.scale,
                       implementation=_dispatch.among("mla_decode", self.implementation))
    # o[e] = sum_j s[e, j] (o_lat[group j] . codes[e, group j]): one scale per (row, group).
    part = dot("bthgc,hegc->btheg", o_lat.reshape(b, t, nh, g, -1), codes[:, dn:])
    o = jnp.sum(part * scales[:, dn:], axis=-1)  # [B, T, NH, Dv]
    return self.o_proj(o.reshape(b, t, -1).astype(self.dtype))

  def _absorb(self) -> tuple[jax.Array, jax.Array]:
    """kv_b_proj's weight as (codes `[NH, Dn + Dv, G, Lkv / G]`, scales `[NH, Dn + Dv, G]`
    f32): W[h, d, c] = codes[h, d, j, c'] scales[h, d, j] for c = j Lkv / G + c'. An FP8 weight
    gives its codes with each row's 128 x 128 block scales (G = Lkv / 128); a high-precision one,
    or an FP8 one whose Lkv is not a multiple of 128 (dequantised), one group of scale 1."""
    cfg = self.cfg
    w, lkv = self.kv_b_proj, cfg.kv_lora_rank
    rows = cfg.qk_nope_head_dim + cfg.v_head_dim
    if is_fp8(w) and lkv % BLOCK == 0:
      codes = w.weight[...]
      scales = jnp.repeat(w.weight_scale_inv[...], BLOCK, axis=0)[:codes.shape[0]]
      return (codes.reshape(-1, rows, lkv // BLOCK, BLOCK),
              scales.reshape(-1, rows, lkv // BLOCK))
    full = (dequantize_weight(w.weight[...], w.weight_scale_inv[...]) if is_fp8(w)
            else w.weight[...].astype(jnp.float32))
    return full.reshape(-1, rows, 1, lkv), jnp.ones((full.shape[0] // rows, rows, 1),
                                                    jnp.float32)


def _slots(cache: KVCache, start: jax.Array, size: int):
  """Slots [start, start + size) of a layer's cache: (kv in `MLA._latent`'s form, k_pe)."""
  cut = lambda a: lax.dynamic_slice_in_dim(a, start, size, axis=1)
  kv = cut(cache.kv) if cache.kv_scale is None else QuantizedActivation(cut(cache.kv),
                                                                       cut(cache.kv_scale))
  return kv, cut(cache.k_pe)


class DecoderLayer(nnx.Module):
  """One decoder layer: (h, r) -> (h', r'), with the LayerCommunicator-style prepare steps.

  h `[B, T, H]` is the previous layer's output (a partial sum under tensor parallelism; the
  embedding for layer 0, where r is None); r `[B, T, H]` the residual stream, replicated.
  `fused` (mutable attribute) switches this layer between the fused and unfused paths.
  """

  def __init__(self, cfg: DeepseekV3Config, idx: int, opts: Options, *, fused: bool = True,
               rngs: nnx.Rngs):
    name = f"model.layers.{idx}"
    h, eps = cfg.hidden_size, cfg.rms_norm_eps
    # Layer 0's input is the replicated embedding: nothing to all-reduce.
    self.input_layernorm = opts.norm(h, eps, reduce=idx > 0, rngs=rngs)
    self.self_attn = MLA(cfg, f"{name}.self_attn", opts, rngs=rngs)
    self.post_attention_layernorm = opts.norm(h, eps, reduce=True, rngs=rngs)
    self.is_moe = idx >= cfg.first_k_dense_replace
    if self.is_moe:
      self.mlp = MoE(cfg, f"{name}.mlp", opts, rngs=rngs)
    else:
      self.mlp = MLP(h, cfg.intermediate_size, f"{name}.mlp", opts, rngs=rngs)
    self.fused = fused

  def prepare_attn(self, h, residual):
    """(All-reduce +) residual add + input_layernorm (+ quant for fused_qkv_a_proj)."""
    return prepare(self.input_layernorm, h, residual,
                   quant=self.fused and self.self_attn.takes_fp8, keep_hp=False)

  def prepare_mlp(self, h, residual):
    """(All-reduce +) residual add + post_attention_layernorm (+ quant, + bf16 copy for the
    MoE router)."""
    return prepare(self.post_attention_layernorm, h, residual,
                   quant=self.fused and self.mlp.takes_fp8, keep_hp=self.is_moe)

  def __call__(self, h, residual, cos, sin, *, cache: KVCache | None = None,
               pos: jax.Array | int = 0):
    x, residual = self.prepare_attn(h, residual)
    h, cache = self.self_attn(x, cos, sin, fused=self.fused, cache=cache, pos=pos)
    x, residual = self.prepare_mlp(h, residual)
    return self.mlp(x), residual, cache
