"""DeepSeek-V3 causal LM: embedding, decoder layers (`layers.py`), final norm and LM head."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jfusedq.checkpoint import QuantConfig
from jfusedq.nn import Linear
from models.common import CausalLMOutput, Embedding, Options, fused_flags, is_fp8
from models.common.layers import Impl, check_cache_args, check_call
from models.deepseek_v3 import sharding
from models.deepseek_v3.config import DeepseekV3Config
from models.deepseek_v3.layers import DecoderLayer, KVCache
from models.deepseek_v3.rope import rope_tables


class DeepseekV3ForCausalLM(nnx.Module):
  """DeepSeek-V3: tokens `[B, T]` -> logits `[B, T, V]` f32 (HF names: `model.*`, `lm_head`).

    h = embed_tokens(tokens);  r = None
    h, r = layer(h, r)              for each decoder layer (`layers.DecoderLayer`)
    logits = lm_head(norm(psum(h) + r))

  Args:
    cfg: the model config.
    fp8: FP8 projections: True (the device's format), a `QuantConfig` (format and the Hugging
      Face `modules_to_not_convert`), or False (the unquantised bf16/f32 path).
    fused: the fused norm (+ all-reduce) + quant hand-off, for all layers (bool) or per layer.
    tp_axis: mesh axis of tensor parallelism; the model then runs inside `jax.shard_map` over
      it (`models.common.tp_apply`).
    ar_strategy: `allreduce_rmsnorm_quant`'s strategy under TP (None: the best available).
    dtype: activation / compute dtype (bf16; f32 for checks against Hugging Face).
    param_dtype: dtype of high-precision weights (norms, embeddings, lm_head, bf16 projections).
    implementation: backend for jfusedq ops ("pallas", "xla", None = best available).
  """

  def __init__(self, cfg: DeepseekV3Config, *, fp8: bool | QuantConfig = True,
               fused: bool | Sequence[bool] = True, tp_axis: str | None = None,
               ar_strategy: str | Sequence[str] | None = None, dtype=jnp.bfloat16,
               param_dtype=jnp.bfloat16, implementation: Impl = None, rngs: nnx.Rngs):
    opts = Options.of(fp8, dtype=dtype, param_dtype=param_dtype, tp_axis=tp_axis,
                      ar_strategy=ar_strategy, implementation=implementation)
    flags = fused_flags(fused, cfg.num_hidden_layers, opts.quant)
    self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                                  param_dtype=param_dtype, rngs=rngs)
    self.layers = nnx.List([DecoderLayer(cfg, i, opts, fused=f, rngs=rngs)
                            for i, f in enumerate(flags)])
    self.norm = opts.norm(cfg.hidden_size, cfg.rms_norm_eps, reduce=True, rngs=rngs)
    self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, param_dtype=param_dtype,
                          rngs=rngs)
    self.cfg, self.opts = cfg, opts

  def init_cache(self, batch: int, max_len: int) -> tuple[KVCache, ...]:
    """Zeroed per-layer latent caches for `max_len` positions (`KVCache`; the same on every
    tensor-parallel device): kv in kv_b_proj's input form (fp8 codes + scales for an FP8
    kv_b_proj, else dtype), k_pe in dtype."""
    check_cache_args(batch, max_len)
    cfg, dtype = self.cfg, self.opts.dtype
    caches = []
    for layer in self.layers:
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
               pos: jax.Array | int = 0) -> CausalLMOutput:
    """tokens `[B, T]` at positions pos .. pos + T - 1 (pos: tokens already in `cache`);
    checked by `models.common.layers.check_call`."""
    check_call(tokens, vocab=self.cfg.vocab_size, pos=pos,
               cache_len=None if cache is None else cache[0].kv.shape[1])
    b, t = tokens.shape
    positions = jnp.broadcast_to(pos + jnp.arange(t), (b, t))
    cos, sin = rope_tables(self.cfg, positions)
    h, residual = self.embed_tokens(tokens), None
    new_cache = []
    for i, layer in enumerate(self.layers):
      h, residual, c = layer(h, residual, cos, sin, cache=None if cache is None else cache[i],
                             pos=pos)
      new_cache.append(c)
    h, _ = self.norm(h, residual)
    logits = self.lm_head(h).astype(jnp.float32)
    return CausalLMOutput(logits, None if cache is None else tuple(new_cache))

  def partition_specs(self, state):
    return sharding.partition_specs(state, self.opts.tp_axis)

  def cache_specs(self):
    return sharding.cache_specs(self)

  def check_tp(self, n: int) -> None:
    sharding.check_tp(self, n)
