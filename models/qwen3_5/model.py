"""Qwen3.5 MoE / Qwen3-Next causal LM: embedding, hybrid decoder layers (`layers.py`), final
norm and LM head (or the tied embedding)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jfusedq.checkpoint import QuantConfig
from jfusedq.nn import Linear
from models.common import CausalLMOutput, Embedding, Options, fused_flags
from models.common.layers import Impl, check_cache_args, check_call
from models.qwen3_5 import sharding
from models.qwen3_5.config import GDN, Qwen35Config
from models.qwen3_5.layers import DecoderLayer


class Qwen35ForCausalLM(nnx.Module):
  """Qwen3.5 MoE / Qwen3-Next causal LM: tokens `[B, T]` -> logits `[B, T, V]` f32.

    h = embed_tokens(tokens);  r = None
    h, r = layer(h, r)              for each decoder layer (`layers.DecoderLayer`)
    logits = lm_head(norm(psum(h) + r))   (the embedding matrix when tied)

  Args:
    cfg: the architecture.
    fp8: FP8 projections: True (the device's format), a `QuantConfig` (format, and the Hugging
      Face `modules_to_not_convert` that stay in high precision), or False (the unquantised
      path: plain Linear + RMSNorm).
    fused: the fused norm (+ all-reduce) + quant hand-off, for all layers (bool) or per layer.
    tp_axis: mesh axis of tensor parallelism; the model then runs inside `jax.shard_map` over
      it (`models.common.tp_apply`).
    ar_strategy: `allreduce_rmsnorm_quant`'s strategy (None: best available; a name: exactly
      that one or an error).
    dtype: activations and residual stream; param_dtype: high-precision parameters.
    implementation: kernel backend for the fused ops and FP8 GEMMs (None: platform best).

  Limits: every sequence of a batch sits at the same position (no padding masks); under TP the
  key heads of GDN, the attention heads and KV heads must divide by the device count (KV heads
  are not replicated across devices); the MoE is the dense all-experts formulation.
  """

  def __init__(self, cfg: Qwen35Config, *, fp8: bool | QuantConfig = True,
               fused: bool | Sequence[bool] = True, tp_axis: str | None = None,
               ar_strategy: str | Sequence[str] | None = None, dtype=jnp.bfloat16,
               param_dtype=jnp.bfloat16, implementation: Impl = None, rngs: nnx.Rngs):
    opts = Options.of(fp8, dtype=dtype, param_dtype=param_dtype, tp_axis=tp_axis,
                      ar_strategy=ar_strategy, implementation=implementation)
    flags = fused_flags(fused, cfg.num_layers, opts.quant)
    self.cfg, self.opts = cfg, opts
    self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                                  param_dtype=param_dtype, rngs=rngs)
    self.layers = nnx.List([DecoderLayer(cfg, i, opts, fused=flags[i], rngs=rngs)
                            for i in range(cfg.num_layers)])
    self.norm = opts.norm(cfg.hidden_size, cfg.rms_norm_eps, weight_offset=1.0, reduce=True,
                          rngs=rngs)
    self.lm_head = None if cfg.tie_word_embeddings else Linear(
        cfg.hidden_size, cfg.vocab_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def init_cache(self, batch: int, max_len: int) -> tuple[dict, ...]:
    """Empty per-layer caches for `max_len` positions: attention k, v `[B, S, Hkv, D]`; GDN
    conv `[B, K-1, C]` and recurrent state `[B, Hv, dk, dv]` f32 (global shapes)."""
    check_cache_args(batch, max_len)
    dt = self.opts.dtype
    return tuple(l.mixer.init_cache(batch, dt) if l.kind == GDN
                 else l.mixer.init_cache(batch, max_len, dt) for l in self.layers)

  def __call__(self, tokens: jax.Array, *, cache: Sequence[dict] | None = None, pos=0,
               gdn_mode: str | None = None) -> CausalLMOutput:
    """tokens `[B, T]` int at positions pos .. pos + T - 1 -> (logits `[B, T, V]` f32, cache).

    With `cache` (from `init_cache`) the call appends to it: attention writes k, v at
    [pos, pos + T), GDN continues from the conv and recurrent states. Every sequence of the
    batch is at the same position (no padding). gdn_mode: "chunk" / "recurrent" (default:
    recurrent for T == 1, chunked otherwise).
    """
    # GDN states hold no positions: the first attention layer's k gives the cache length.
    kv = [c["k"] for c in cache or () if "k" in c]
    check_call(tokens, vocab=self.cfg.vocab_size, pos=pos,
               cache_len=kv[0].shape[1] if kv else None)
    h = self.embed_tokens(tokens)
    residual, new = None, []
    for i, layer in enumerate(self.layers):
      h, residual, c = layer(h, residual, None if cache is None else cache[i], pos=pos,
                             gdn_mode=gdn_mode)
      new.append(c)
    y, _ = self.norm(h, residual)
    logits = self.embed_tokens.attend(y) if self.lm_head is None else self.lm_head(y)
    return CausalLMOutput(logits.astype(jnp.float32), None if cache is None else tuple(new))

  def partition_specs(self, state):
    return sharding.partition_specs(state, self.opts.tp_axis)

  def cache_specs(self):
    return sharding.cache_specs(self)

  def check_tp(self, n: int) -> None:
    sharding.check_tp(self, n)
