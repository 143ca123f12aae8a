"""Prefill through the flash attention (`jfusedq.ops.attention`, its blocked backend here) and in
chunks, held to the XLA path (every score materialised, the prompt at once), for DeepSeek-V3
and Qwen3.5 (tiny random models): unquantised f32, unquantised bf16, and FP8 fused (bf16
activations); the attention layer alone, and the model. Odd lengths throughout: blocks of 4 keys
against 13 new tokens over 6 cached, chunks of 5 with a last chunk of 3, or of 1 (a decode
step). T = 1 through the flash op itself: tests/ops/test_attention.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jfusedq
from jfusedq.errors import InputError
from jfusedq.ops.attention import api as attention_api
from jfusedq.testing import rel_rms
from models import registry
from models.deepseek_v3.rope import rope_tables
from models.presets import PRESETS
from models.qwen3_5.config import GDN

MODELS = {"deepseek_v3": "deepseek-v3-tiny", "qwen3_5": "qwen3.5-tiny"}
PATHS = {"f32": dict(fp8=False, fused=False, dtype=jnp.float32, param_dtype=jnp.float32),
         "bf16": dict(fp8=False, fused=False), "fused": dict(fp8=True, fused=True)}
# The attention layer's output (`MLA`, `Attention`: o_proj included) from the XLA path's, per
# path, the same input and cache:
# f32: the same sums in another order (key blocks, segments merged by their log-sum-exp):
#   measured up to 1e-6; a missed or doubled key moves it by percent.
# bf16: the probabilities are rounded to bf16 against each block's running maximum instead of
#   the row's, and the output to bf16: measured 3.5e-3 (2**-8 is one bf16 ulp).
# fused: o_proj quantises the attention output to FP8, and where the two paths' outputs straddle
#   a rounding midpoint the code moves a step (6% of that value): measured 1.3e-2.
LAYER_TOL = {"f32": 1e-5, "bf16": 1e-2, "fused": 4e-2}
# The model's logits from the XLA path's: f32 as above; bf16 and fused carry the layer's
# difference through the random-weight stack, whose top-k expert choices flip on it: measured
# up to 0.12 (bf16) and 0.2 (fused), as `benchmarks/decode.py`'s gate for kernel differences
# (0.3 at 4 layers or fewer). Unrelated logits are sqrt(2) apart; a broken mask or merge O(1).
TOL = {"f32": 1e-5, "bf16": 0.3, "fused": 0.3}


@functools.cache
def model(name: str, path: str):
  return registry.build(PRESETS[MODELS[name]], seed=0, **PATHS[path])


def prefill(m, toks, cache, pos, *, chunk=None, attention=None, logits="all"):
  """One jitted model call; `attention` the attention backend (None: the default order)."""
  graphdef, state = nnx.split(m)

  @functools.partial(jax.jit, static_argnames=("chunk", "attention", "logits"))
  def run(state, toks, cache, pos, chunk, attention, logits):
    with jfusedq.implementations(attention=attention):
      return nnx.merge(graphdef, state)(toks, cache=cache, pos=pos, chunk=chunk, logits=logits)

  return run(state, toks, cache, pos, chunk, attention, logits)


def tokens(m, t: int) -> jax.Array:
  return jax.random.randint(jax.random.key(t), (2, t), 0, m.cfg.vocab_size, jnp.int32)


def assert_caches_close(got, want, tol):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert rel_rms(np.asarray(g, np.float32), np.asarray(w, np.float32)) <= tol


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_attention_layer_flash_equals_xla(name, path, monkeypatch):
  """The first full-attention layer alone: 13 new tokens over 6 cached, in blocks of 4 keys,
  the flash path against the XLA path on the same input and cache."""
  monkeypatch.setattr(attention_api, "BLOCK", 4)
  m = model(name, path)
  i = next(i for i, l in enumerate(m.layers) if name == "deepseek_v3" or l.kind != GDN)
  layer = m.layers[i].self_attn if name == "deepseek_v3" else m.layers[i].mixer
  x = jax.random.normal(jax.random.key(0), (2, 19, m.cfg.hidden_size), m.opts.dtype)
  graphdef, state = nnx.split(layer)

  @functools.partial(jax.jit, static_argnames="attention")
  def call(state, x, cache, pos, attention):
    a = nnx.merge(graphdef, state)
    with jfusedq.implementations(attention=attention):
      if name == "qwen3_5":
        return a(x, cache, pos=pos)
      positions = jnp.broadcast_to(pos + jnp.arange(x.shape[1]), x.shape[:2])
      return a(x, *rope_tables(m.cfg, positions), fused=path == "fused", cache=cache, pos=pos)

  _, cache = call(state, x[:, :6], m.init_cache(2, 24)[i], jnp.int32(0), "xla")
  want, want_cache = call(state, x[:, 6:], cache, jnp.int32(6), "xla")
  got, got_cache = call(state, x[:, 6:], cache, jnp.int32(6), None)
  assert rel_rms(got, want) <= LAYER_TOL[path]
  # The cache is written before attending: the same values.
  assert_caches_close(got_cache, want_cache, 0.0)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_flash_equals_xla_with_prefix(name, path, monkeypatch):
  """The whole model: 13 new tokens over 6 cached, in blocks of 4 keys, the flash path against
  the XLA path."""
  monkeypatch.setattr(attention_api, "BLOCK", 4)
  m = model(name, path)
  toks = tokens(m, 19)
  _, cache = prefill(m, toks[:, :6], m.init_cache(2, 24), jnp.int32(0), attention="xla")
  want, want_cache = prefill(m, toks[:, 6:], cache, jnp.int32(6), attention="xla")
  got, got_cache = prefill(m, toks[:, 6:], cache, jnp.int32(6))
  assert rel_rms(got, want) <= TOL[path]
  # The cache holds what the layers wrote: equal where the layers' inputs are.
  assert_caches_close(got_cache, want_cache, TOL[path])


@pytest.mark.parametrize("t", [11, 23])
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_chunked_equals_whole(name, path, t, monkeypatch):
  """Chunks of 5 (11 = 5 + 5 + 1: the last a decode step; 23 = 4 x 5 + 3) in blocks of 4 keys
  against the whole prompt at once on the XLA path: logits and cache."""
  monkeypatch.setattr(attention_api, "BLOCK", 4)
  m = model(name, path)
  toks = tokens(m, t)
  cache = m.init_cache(2, t + 2)
  want, want_cache = prefill(m, toks, cache, jnp.int32(0), attention="xla")
  got, got_cache = prefill(m, toks, cache, jnp.int32(0), chunk=5)
  assert got.shape == want.shape == (2, t, m.cfg.vocab_size)
  assert rel_rms(got, want) <= TOL[path]
  assert_caches_close(got_cache, want_cache, TOL[path])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_last_logits(name):
  """logits="last": the last position's row of the full logits, chunked or not."""
  m = model(name, "f32")
  toks = tokens(m, 12)
  full, _ = prefill(m, toks, m.init_cache(2, 12), jnp.int32(0))
  for chunk in (None, 5):
    last, _ = prefill(m, toks, m.init_cache(2, 12), jnp.int32(0), chunk=chunk, logits="last")
    assert last.shape == (2, 1, m.cfg.vocab_size)
    assert rel_rms(last, full[:, -1:]) <= TOL["f32"]


def test_chunk_and_logits_checked():
  m = model("qwen3_5", "f32")
  toks = tokens(m, 4)
  with pytest.raises(InputError, match="chunk"):
    m(toks, cache=m.init_cache(2, 4), chunk=0)
  with pytest.raises(InputError, match="logits"):
    m(toks, logits="first")
