"""The Llama decoder layer on jfusedq's fused norm + FP8 path: a decode step's data path.

Shapes: B batch, T new tokens, S cached positions, H hidden size, Hq query heads and Hkv
key/value heads of D dims (local counts under tensor parallelism).

One layer (`DecoderLayer`), SGLang LayerCommunicator style: `prepare_attn` / `prepare_mlp` run
(all-reduce +) residual add + RMSNorm `y = h / rms(h) * w` + per-group FP8 quantisation as one
kernel (`jfusedq.nn.RMSNorm` via `models.common.prepare`), so the FP8 q/k/v and gate/up
projections receive a ready `QuantizedActivation` (fp8 codes, 1 x 128 group scales). With
`fused=False` the same weights run the unfused composition: add + RMSNorm to bf16, then each FP8
projection quantises its input itself. Without FP8 every projection is a plain
`jfusedq.nn.Linear` in `dtype`: the unquantised path, Hugging Face's `LlamaForCausalLM`.

Under tensor parallelism (inside `jax.shard_map` over `tp_axis`) q/k/v and gate/up are
column-parallel (whole heads, whole intermediate rows per device), o_proj and down_proj
row-parallel: the attention and MLP outputs are partial sums, and the next `prepare_*` runs
all-reduce + add + RMSNorm + quant as one step (`jfusedq.parallel.allreduce_rmsnorm_quant`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jfusedq.nn import Linear
from models.common import MLP, Options, prepare, rotate_half_rope, write_cache
from models.llama.config import LlamaConfig


class Attention(nnx.Module):
  """Grouped-query attention with RoPE and a KV cache (`self_attn`).

  x `[B, T, H]` (array, or QuantizedActivation from a fused norm) -> `[B, T, H]`:
    q = rope(q_proj(x)) [B, T, Hq, D],  k = rope(k_proj(x)), v = v_proj(x)  [B, T, Hkv, D]
    o = softmax(q k^T / sqrt(D) + causal mask) v    (f32 scores; query head j reads kv head
                                                     j // (Hq / Hkv))
    out = o_proj(o)                                 [B, T, H] (a partial sum under TP)
  The cache holds k, v `[B, S, Hkv, D]`; a call writes positions [pos, pos + T).
  """

  def __init__(self, cfg: LlamaConfig, layer: int, opts: Options, *, rngs: nnx.Rngs):
    h, d = cfg.hidden_size, cfg.head_dim
    self.d, self.theta, self.dtype = d, cfg.rope_theta, opts.dtype
    name = f"model.layers.{layer}.self_attn."
    self.q_proj = opts.proj(h, cfg.num_heads * d, name + "q_proj", rngs=rngs)
    self.k_proj = opts.proj(h, cfg.num_kv_heads * d, name + "k_proj", rngs=rngs)
    self.v_proj = opts.proj(h, cfg.num_kv_heads * d, name + "v_proj", rngs=rngs)
    self.o_proj = opts.proj(cfg.num_heads * d, h, name + "o_proj", rngs=rngs)

  @property
  def needs_hp(self) -> bool:
    return any(isinstance(p, Linear) for p in (self.q_proj, self.k_proj, self.v_proj))

  def __call__(self, x, cache: dict | None = None, *, pos=0):
    q = self.q_proj(x)
    b, t, _ = q.shape
    d = self.d
    q = rotate_half_rope(q.reshape(b, t, -1, d), pos, self.theta)
    k = rotate_half_rope(self.k_proj(x).reshape(b, t, -1, d), pos, self.theta)
    v = self.v_proj(x).reshape(b, t, -1, d)
    new = None
    if cache is not None:
      k, v = write_cache(cache["k"], k, pos), write_cache(cache["v"], v, pos)
      new = {"k": k, "v": v}
    s, hkv = k.shape[1], k.shape[2]
    q = q.reshape(b, t, hkv, -1, d)  # [B, T, Hkv, Hq / Hkv, D]
    scores = jnp.einsum("btgrd,bsgd->bgrts", q, k.astype(q.dtype),
                        preferred_element_type=jnp.float32) * d**-0.5
    qpos = jnp.asarray(pos, jnp.int32) + jnp.arange(t)
    mask = jnp.arange(s)[None, :] <= qpos[:, None]  # [T, S]: causal, and nothing past the cache
    p = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1).astype(self.dtype)
    o = jnp.einsum("bgrts,bsgd->btgrd", p, v.astype(self.dtype),
                   preferred_element_type=jnp.float32).reshape(b, t, -1)
    return self.o_proj(o.astype(self.dtype)), new

  def init_cache(self, batch: int, length: int, dtype) -> dict:
    hkv = self.k_proj.weight.shape[0] // self.d
    z = jnp.zeros((batch, length, hkv, self.d), dtype)
    return {"k": z, "v": z}


class DecoderLayer(nnx.Module):
  """One Llama decoder layer with `prepare_attn` / `prepare_mlp`:

    x, r = prepare_attn(h, r)    (all-reduce +) add + input_layernorm (+ quant): one kernel
    h = self_attn(x)             [B, T, H]
    x, r = prepare_mlp(h, r)     (all-reduce +) add + post_attention_layernorm (+ quant)
    h = mlp(x)                   [B, T, H]
  `h` leaves the layer un-added (a partial sum under TP); the next layer's `prepare_attn` (or
  the final norm) adds it to the residual.
  """

  def __init__(self, cfg: LlamaConfig, layer: int, opts: Options, *, fused: bool,
               rngs: nnx.Rngs):
    h, eps = cfg.hidden_size, cfg.rms_norm_eps
    self.self_attn = Attention(cfg, layer, opts, rngs=rngs)
    self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, f"model.layers.{layer}.mlp.", opts,
                   rngs=rngs)
    # The first layer's input is the (replicated) embedding: nothing to all-reduce.
    self.input_layernorm = opts.norm(h, eps, reduce=layer > 0, rngs=rngs)
    self.post_attention_layernorm = opts.norm(h, eps, reduce=True, rngs=rngs)
    self.fused = fused

  def __call__(self, h, residual, cache=None, *, pos=0):
    x, residual = prepare(self.input_layernorm, h, residual, quant=self.fused,
                          keep_hp=self.self_attn.needs_hp)
    h, cache = self.self_attn(x, cache, pos=pos)
    x, residual = prepare(self.post_attention_layernorm, h, residual, quant=self.fused,
                          keep_hp=self.mlp.needs_hp)
    return self.mlp(x), residual, cache
