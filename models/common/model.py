"""`CausalLM`, the base of every model package's class: the embedding, decoder layers, final
norm and LM head, and what the three answer alike (the input checks, the layer loop, the
tensor-parallel specs)."""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jfusedq.checkpoint import QuantConfig
from jfusedq.nn import Linear
from jfusedq.errors import InputError
from models.common.layers import (CausalLMOutput, Embedding, Impl, Options, check_call,
                                  check_chunk, fused_flags)

# Prompt tokens a prefill runs at once (`CausalLM.__call__`'s `chunk`). A placeholder until
# benchmarks/prefill.py --chunks measures the deep presets on the H200: the value that keeps
# prefill near its unchunked speed at the least peak memory becomes the default.
PREFILL_CHUNK = 8192


class CausalLM(nnx.Module):
  """A decoder-only causal LM: tokens `[B, T]` -> logits `[B, T, V]` f32, as embed_tokens,
  `layers`, the final `norm` and `lm_head` (the embedding matrix when tied). A model package's
  class names its decoder layer and sharding module (the class attributes below) and writes
  `init_cache` and `_cache_len`; its docstring gives the model's equations.

  Args:
    cfg: the architecture (the package's config class).
    fp8: FP8 projections: True (the device's format), a `QuantConfig` (format, and the Hugging
      Face `modules_to_not_convert` that stay in high precision), or False (the unquantised
      path: plain Linear + RMSNorm).
    fused: the fused norm (+ all-reduce) + quant hand-off, for all layers (bool) or per layer.
    tp_axis: mesh axis of tensor parallelism; the model then runs inside `jax.shard_map` over
      it (`models.common.tp_apply`).
    ar_strategy: `allreduce_rmsnorm_quant`'s strategy under TP (None: the best available; a
      name: exactly that one or an error).
    dtype: activations and the residual stream (bf16; f32 for checks against Hugging Face).
    param_dtype: high-precision parameters (norms, embedding, lm_head, unquantised projections).
    implementation: kernel backend of the fused ops and FP8 GEMMs ("pallas", "xla", ...; None:
      the platform's best).
    rngs: random initialisation (a loader builds the model abstractly, `nnx.eval_shape`).
  """

  # The package's decoder layer, built as decoder_layer(cfg, index, opts, fused=, rngs=) and
  # called as layer(h, residual, *_layer_args, cache=, pos=) -> (h, residual, cache).
  decoder_layer: ClassVar[type]
  # The package's sharding module: partition_specs(state, axis), cache_specs(model) and
  # check_tp(model, n), the last on a config alone (the CLI checks --tp before building).
  sharding: ClassVar[types.ModuleType]
  # The final norm's weight offset (1: y * (1 + w), zero-centred weights).
  norm_offset: ClassVar[float] = 0.0
  # Whether tie_word_embeddings drops lm_head for the embedding matrix (False: lm_head is kept,
  # and the loader fills it with the embedding).
  ties_head: ClassVar[bool] = True

  def __init__(self, cfg, *, fp8: bool | QuantConfig = True, fused: bool | Sequence[bool] = True,
               tp_axis: str | None = None, ar_strategy: str | Sequence[str] | None = None,
               dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, implementation: Impl = None,
               rngs: nnx.Rngs):
    opts = Options.of(fp8, dtype=dtype, param_dtype=param_dtype, tp_axis=tp_axis,
                      ar_strategy=ar_strategy, implementation=implementation)
    self.cfg, self.opts = cfg, opts
    self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                                  param_dtype=param_dtype, rngs=rngs)
    flags = fused_flags(fused, self._num_layers(cfg), opts.quant)
    self.layers = nnx.List([self.decoder_layer(cfg, i, opts, fused=f, rngs=rngs)
                            for i, f in enumerate(flags)])
    self.norm = opts.norm(cfg.hidden_size, cfg.rms_norm_eps, weight_offset=self.norm_offset,
                          reduce=True, rngs=rngs)
    tied = self.ties_head and cfg.tie_word_embeddings
    self.lm_head = None if tied else Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype,
                                            param_dtype=param_dtype, rngs=rngs)

  @staticmethod
  def _num_layers(cfg) -> int:
    return cfg.num_layers

  def _cache_len(self, cache: Sequence) -> int | None:
    """The positions `cache` holds (None: no layer's cache has a position axis)."""
    raise NotImplementedError

  def _layer_args(self, tokens: jax.Array, pos) -> tuple:
    """What every layer takes after (h, residual) for tokens at pos .. pos + T - 1."""
    del tokens, pos
    return ()

  def __call__(self, tokens: jax.Array, *, cache: Sequence | None = None,
               pos: jax.Array | int = 0, chunk: int | None = PREFILL_CHUNK,
               logits: str = "all") -> CausalLMOutput:
    """tokens `[B, T]` int at positions pos .. pos + T - 1 -> (logits `[B, T, V]` f32, cache).

    With `cache` (from `init_cache`) the call appends to it and attends to everything before.
    Every sequence of the batch is at the same position (no padding). `chunk` (with a cache): a
    prompt of more tokens runs `chunk` at a time into the cache (`_forward`); None: at once.
    `logits="last"`: only the last position's, `[B, 1, V]` (what a serving prefill samples
    from; the LM head then runs on one position). The inputs are checked by
    `models.common.layers.check_call`.
    """
    return self._forward(tokens, cache, pos, chunk=chunk, logits=logits)

  def _forward(self, tokens: jax.Array, cache: Sequence | None, pos, *, chunk: int | None,
               logits: str, **layer_kw) -> CausalLMOutput:
    """`__call__`, with `layer_kw` passed to every layer.

    Chunked prefill: with a cache and T > chunk, the first n = ceil(T / chunk) - 1 chunks of
    `chunk` tokens run one after another in a `lax.scan` (one trace of the layers; each chunk
    writes its keys into the cache and attends to every earlier one through it), then the last
    1 .. chunk tokens. Activations, the MoE's expert intermediates and the attention's blocks
    then scale with the chunk, not the prompt; the cache and (logits="all") the logits scale
    with the prompt.
    """
    check_call(tokens, vocab=self.cfg.vocab_size, pos=pos,
               cache_len=None if cache is None else self._cache_len(cache))
    check_chunk(chunk)
    if logits not in ("all", "last"):
      raise InputError(f"logits must be 'all' or 'last', got {logits!r}")
    b, t = tokens.shape
    if cache is None or chunk is None or t <= chunk:
      out, new = self._pass(tokens, cache, pos, logits, layer_kw)
      return CausalLMOutput(out, new)
    n = (t - 1) // chunk
    pos = jnp.asarray(pos, jnp.int32)

    def step(carry, toks):
      cache, p = carry
      out, cache = self._pass(toks, cache, p, None if logits == "last" else "all", layer_kw)
      return (cache, p + chunk), out

    head = tokens[:, :n * chunk].reshape(b, n, chunk).swapaxes(0, 1)  # [n, B, chunk]
    (cache, pos), outs = lax.scan(step, (tuple(cache), pos), head)
    out, cache = self._pass(tokens[:, n * chunk:], cache, pos, logits, layer_kw)
    if logits == "all":
      out = jnp.concatenate([outs.swapaxes(0, 1).reshape(b, n * chunk, -1), out], axis=1)
    return CausalLMOutput(out, cache)

  def _pass(self, tokens: jax.Array, cache: Sequence | None, pos, logits: str | None,
            layer_kw: dict) -> tuple[jax.Array | None, tuple | None]:
    """One pass of `tokens` through the layers: (logits of every position ("all"), of the last
    ("last") or None (None: no LM head), the updated cache)."""
    args = self._layer_args(tokens, pos)
    h, residual, new = self.embed_tokens(tokens), None, []
    for i, layer in enumerate(self.layers):
      h, residual, c = layer(h, residual, *args, cache=None if cache is None else cache[i],
                             pos=pos, **layer_kw)
      new.append(c)
    new = None if cache is None else tuple(new)
    if logits is None:
      return None, new
    if logits == "last":
      h, residual = h[:, -1:], residual[:, -1:]
    y, _ = self.norm(h, residual)
    out = self.embed_tokens.attend(y) if self.lm_head is None else self.lm_head(y)
    return out.astype(jnp.float32), new

  def partition_specs(self, state):
    return self.sharding.partition_specs(state, self.opts.tp_axis)

  def cache_specs(self):
    return self.sharding.cache_specs(self)

  def check_tp(self, n: int) -> None:
    self.sharding.check_tp(self, n)
