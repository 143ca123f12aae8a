"""Llama causal LM: embedding, decoder layers (`layers.py`), final norm and LM head (or the
tied embedding)."""

from __future__ import annotations

from collections.abc import Sequence

from models.common import CausalLM
from models.common.layers import check_cache_args
from models.llama import sharding
from models.llama.layers import DecoderLayer


class LlamaForCausalLM(CausalLM):
  """Llama-family causal LM: tokens `[B, T]` -> logits `[B, T, V]` f32.

    h = embed_tokens(tokens);  r = None
    h, r = layer(h, r)                        for each decoder layer (`layers.DecoderLayer`)
    logits = lm_head(norm(psum(h) + r))       (the embedding matrix when tied), high precision

  Built as `models.common.CausalLM` (cfg: a `LlamaConfig`). Limits: every sequence of a
  batch sits at the same position (no padding masks); under TP the attention and KV heads must
  divide by the device count.
  """

  decoder_layer = DecoderLayer
  sharding = sharding

  def init_cache(self, batch: int, max_len: int) -> tuple[dict, ...]:
    """Empty per-layer caches for `max_len` positions: k, v `[B, S, Hkv, D]` (global shapes)."""
    check_cache_args(batch, max_len)
    return tuple(l.self_attn.init_cache(batch, max_len, self.opts.dtype) for l in self.layers)

  def _cache_len(self, cache: Sequence[dict]) -> int:
    return cache[0]["k"].shape[1]
