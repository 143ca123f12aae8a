"""DeepSeek-V3 causal LM: embedding, decoder layers (`layers.py`), final norm and LM head."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jfusedq.fp8 import BLOCK
from models.common import CausalLM, is_fp8
from models.common.layers import check_cache_args
from models.deepseek_v3 import sharding
from models.deepseek_v3.layers import DecoderLayer, KVCache
from models.deepseek_v3.rope import rope_tables


class DeepseekV3ForCausalLM(CausalLM):
  """DeepSeek-V3: tokens `[B, T]` -> logits `[B, T, V]` f32 (HF names: `model.*`, `lm_head`).

    cos, sin = rope_tables(pos .. pos + T - 1)     (default or YaRN, `rope.py`)
    h = embed_tokens(tokens);  r = None
    h, r = layer(h, r, cos, sin)    for each decoder layer (`layers.DecoderLayer`)
    logits = lm_head(norm(psum(h) + r))

  lm_head is kept when the config ties it (the loader copies the embedding into it). Built as
  `models.common.model.CausalLM` (cfg: a `DeepseekV3Config`).
  """

  decoder_layer = DecoderLayer
  sharding = sharding
  ties_head = False

  @staticmethod
  def _num_layers(cfg) -> int:
    return cfg.num_hidden_layers

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
        scale = jnp.zeros((batch, max_len, -(-cfg.kv_lora_rank // BLOCK)), jnp.float32)
      else:
        kv, scale = jnp.zeros(shape, dtype), None
      caches.append(KVCache(kv, scale, jnp.zeros((batch, max_len, cfg.qk_rope_head_dim), dtype)))
    return tuple(caches)

  def _cache_len(self, cache: Sequence[KVCache]) -> int:
    return cache[0].kv.shape[1]

  def _layer_args(self, tokens: jax.Array, pos) -> tuple:
    b, t = tokens.shape
    return rope_tables(self.cfg, jnp.broadcast_to(pos + jnp.arange(t), (b, t)))
