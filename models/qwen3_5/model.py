"""Qwen3.5 MoE / Qwen3-Next causal LM: embedding, hybrid decoder layers (`layers.py`), final
norm and LM head (or the tied embedding)."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from models.common import PREFILL_CHUNK, CausalLM, CausalLMOutput
from models.common.layers import check_cache_args
from models.qwen3_5 import sharding
from models.qwen3_5.config import GDN
from models.qwen3_5.layers import DecoderLayer


class Qwen35ForCausalLM(CausalLM):
  """Qwen3.5 MoE / Qwen3-Next causal LM: tokens `[B, T]` -> logits `[B, T, V]` f32.

    h = embed_tokens(tokens);  r = None
    h, r = layer(h, r)              for each decoder layer (`layers.DecoderLayer`)
    logits = lm_head(norm(psum(h) + r))   (the embedding matrix when tied; norm: y * (1 + w))

  Built as `models.common.CausalLM` (cfg: a `Qwen35Config`). Limits: every sequence of a
  batch sits at the same position (no padding masks); under TP the key heads of GDN, the
  attention heads and KV heads must divide by the device count (KV heads are not replicated
  across devices); the MoE is the dense all-experts formulation.
  """

  decoder_layer = DecoderLayer
  sharding = sharding
  norm_offset = 1.0

  def init_cache(self, batch: int, max_len: int) -> tuple[dict, ...]:
    """Empty per-layer caches for `max_len` positions: attention k, v `[B, S, Hkv, D]`; GDN
    conv `[B, K-1, C]` and recurrent state `[B, Hv, dk, dv]` f32 (global shapes)."""
    check_cache_args(batch, max_len)
    dt = self.opts.dtype
    return tuple(l.mixer.init_cache(batch, dt) if l.kind == GDN
                 else l.mixer.init_cache(batch, max_len, dt) for l in self.layers)

  def __call__(self, tokens: jax.Array, *, cache: Sequence[dict] | None = None, pos=0,
               chunk: int | None = PREFILL_CHUNK, logits: str = "all",
               gdn_mode: str | None = None) -> CausalLMOutput:
    """tokens `[B, T]` int at positions pos .. pos + T - 1 -> (logits `[B, T, V]` f32, cache).

    With `cache` (from `init_cache`) the call appends to it: attention writes k, v at
    [pos, pos + T), GDN continues from the conv and recurrent states. Every sequence of the
    batch is at the same position (no padding). chunk, logits: as `CausalLM.__call__` (a chunk
    hands GDN's states to the next through the cache). gdn_mode: "chunk" / "recurrent"
    (default: recurrent for T == 1, chunked otherwise).
    """
    return self._forward(tokens, cache, pos, chunk=chunk, logits=logits, gdn_mode=gdn_mode)

  def _cache_len(self, cache: Sequence[dict]) -> int | None:
    # GDN states hold no positions: the first attention layer's k gives the cache length.
    return next((c["k"].shape[1] for c in cache if "k" in c), None)
