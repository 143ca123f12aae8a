"""Llama (models/llama/): the equations against a pure-jnp f32 reference, the fused and unfused
FP8 paths, the KV cache, tensor parallelism, and loading (safetensors and GGUF, whose q/k row
permutation must be undone for rotate-half RoPE).

Hugging Face `LlamaForCausalLM` parity is not run: the reference below writes its equations
out (rotate-half RoPE, GQA, SwiGLU), and the trained model's perplexity
(tests/test_accuracy.py) would expose any convention error.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
if ROOT not in sys.path:  # `models` is a top-level directory of the repository
  sys.path.insert(0, ROOT)

from jfusedq.checkpoint import MissingTensorError, save_file  # noqa: E402
from jfusedq.testing import rel_rms  # noqa: E402
from models import llama, registry  # noqa: E402
from models.common import rotate_half_rope, tp_apply  # noqa: E402
from models.llama import gguf  # noqa: E402
from tests.models.llama_files import tensors, write_gguf  # noqa: E402

TINY = llama.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=64, rope_theta=10000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=False)
# Every device's share of an FP8 projection holds whole 128 x 128 blocks over 8 devices.
TP = llama.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=1024, num_layers=2,
                       num_heads=8, num_kv_heads=8, head_dim=128, tie_word_embeddings=True)
F32 = dict(fp8=False, dtype=jnp.float32, param_dtype=jnp.float32)
# Two f32 computations of one function in different summation orders: measured <= 1e-6.
F32_RTOL = 1e-5


def build(cfg=TINY, seed=0, **kw) -> llama.LlamaForCausalLM:
  return llama.LlamaForCausalLM(cfg, rngs=nnx.Rngs(seed), **kw)


def ids(cfg=TINY, b=2, t=12, seed=1):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, cfg.vocab_size, jnp.int32)


@nnx.jit
def forward(m, x):
  return m(x).logits


def reference(cfg: llama.LlamaConfig, w: dict, tokens) -> np.ndarray:
  """Llama in pure jnp f32, from the Hugging Face tensors `w`."""
  t = tokens.shape[1]
  d = cfg.head_dim
  rms = lambda x, g: x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + cfg.rms_norm_eps) * g
  inv = 1.0 / cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
  ang = jnp.arange(t, dtype=jnp.float32)[:, None] * inv[None]
  cos, sin = jnp.cos(ang)[:, None], jnp.sin(ang)[:, None]  # [T, 1, D/2]

  def rope(x):
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

  h = jnp.asarray(w["model.embed_tokens.weight"])[tokens]
  mask = jnp.tril(jnp.ones((t, t), bool))
  rep = cfg.num_heads // cfg.num_kv_heads
  for i in range(cfg.num_layers):
    p = lambda n: jnp.asarray(w[f"model.layers.{i}.{n}.weight"])
    x = rms(h, p("input_layernorm"))
    q = rope((x @ p("self_attn.q_proj").T).reshape(*x.shape[:2], -1, d))
    k = rope((x @ p("self_attn.k_proj").T).reshape(*x.shape[:2], -1, d))
    v = (x @ p("self_attn.v_proj").T).reshape(*x.shape[:2], -1, d)
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
    a = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), -1)
    o = jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(*x.shape[:2], -1)
    h = h + o @ p("self_attn.o_proj").T
    x = rms(h, p("post_attention_layernorm"))
    h = h + (jax.nn.silu(x @ p("mlp.gate_proj").T) * (x @ p("mlp.up_proj").T)) @ \
        p("mlp.down_proj").T
  y = rms(h, jnp.asarray(w["model.norm.weight"]))
  head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
  return np.asarray(y @ jnp.asarray(head).T)


@functools.cache
def f32_model(cfg=TINY):
  return build(cfg, **F32)


def test_f32_matches_reference():
  m = f32_model()
  x = ids()
  got = np.asarray(forward(m, x))
  want = reference(TINY, tensors(m), x)
  np.testing.assert_allclose(got, want, rtol=F32_RTOL, atol=F32_RTOL * np.abs(want).max())


@pytest.mark.parametrize("tied", [False, True])
def test_fp8_paths_near_reference(tied):
  """bf16 and both FP8 paths from the same bf16 masters (FP8 = those masters quantised), each
  near the f32 reference; fused and unfused near each other."""
  cfg = llama.LlamaConfig(**{**TINY.__dict__, "tie_word_embeddings": tied})
  w = tensors(build(cfg, param_dtype=jnp.float32, fp8=False))
  x = ids(cfg)
  want = reference(cfg, w, x)
  got = {name: np.asarray(forward(llama.from_tensors(cfg, w, **kw), x)) for name, kw in (
      ("bf16", dict(fp8=False)), ("unfused", dict(fp8=True, fused=False)),
      ("fused", dict(fp8=True, fused=True)))}
  # bf16 rounding alone: ~0.5%; FP8 (3 mantissa bits) weights and activations: ~5%.
  assert rel_rms(got["bf16"], want) < 0.02
  for name in ("unfused", "fused"):
    assert rel_rms(got[name], want) < 0.1, name
  assert rel_rms(got["fused"], got["unfused"]) < 0.1
  assert not np.array_equal(got["fused"], got["unfused"])  # two different compositions


def test_fused_norm_hands_over_quantised_activation():
  """fused=True: the norm's output is the QuantizedActivation the q/k/v and gate/up GEMMs take."""
  m = build(fp8=True, fused=True)
  jaxpr = str(jax.make_jaxpr(lambda x: nnx.merge(*nnx.split(m))(x).logits)(ids()))
  unfused = str(jax.make_jaxpr(lambda x: nnx.merge(*nnx.split(build(fp8=True, fused=False)))(
      x).logits)(ids()))
  # Unfused: every FP8 projection quantises its own input (7 per layer); fused: only o_proj
  # and down_proj do (2 per layer), the norms quantise for the other five.
  assert jaxpr.count("float8_e4m3fn") < unfused.count("float8_e4m3fn")


def test_cache_prefill_then_decode_equals_one_pass():
  m = f32_model()
  x = ids(t=10)
  full = np.asarray(forward(m, x))
  cache = m.init_cache(2, 16)
  out = m(x[:, :7], cache=cache, pos=0)
  steps = [out.logits]
  cache = out.cache
  for i in range(7, 10):
    out = m(x[:, i:i + 1], cache=cache, pos=i)
    steps.append(out.logits)
    cache = out.cache
  np.testing.assert_allclose(np.concatenate(steps, 1), full, rtol=F32_RTOL,
                             atol=F32_RTOL * np.abs(full).max())


@pytest.mark.parametrize("fp8", [False, True])
def test_tp8_equals_one_device(fp8):
  """TP over 8 devices vs one: f32 differs by summation order only (F32_RTOL); the FP8 fused
  path in bf16 also rounds its partial sums differently, which moves FP8 codes of the next
  projection's input by a step (measured rel rms 0.029-0.032 over seeds 0-2, fused and unfused
  alike; bound 5e-2)."""
  kw = F32 if not fp8 else dict(fp8=True, fused=True)
  one = build(TP, **kw)
  x = ids(TP, t=8)
  want = np.asarray(forward(one, x))
  mesh = jax.make_mesh((8,), ("tp",), devices=jax.devices()[:8])
  got = np.asarray(tp_apply(build(TP, tp_axis="tp", **kw), mesh)(x).logits)
  if fp8:
    assert rel_rms(got, want) < 5e-2
  else:
    np.testing.assert_allclose(got, want, rtol=F32_RTOL, atol=F32_RTOL * np.abs(want).max())


def test_tp_needs_divisible_heads():
  mesh = jax.make_mesh((8,), ("tp",), devices=jax.devices()[:8])
  with pytest.raises(ValueError, match="num_attention_heads=4 divisible by 8"):
    tp_apply(build(tp_axis="tp", **F32), mesh)


def hf_config(cfg: llama.LlamaConfig) -> dict:
  return dict(model_type="llama", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
              intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
              num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
              head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
              tie_word_embeddings=cfg.tie_word_embeddings, hidden_act="silu")


def save_checkpoint(m, path) -> None:
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf_config(m.cfg), f)
  save_file(tensors(m), os.path.join(path, "model.safetensors"))


def test_safetensors_round_trip(tmp_path):
  m = f32_model()
  save_checkpoint(m, tmp_path)
  x = ids()
  for loaded in (llama.from_pretrained(tmp_path, **F32), registry.from_pretrained(tmp_path,
                                                                                  **F32)):
    np.testing.assert_array_equal(np.asarray(forward(loaded, x)), np.asarray(forward(m, x)))
  fp8 = llama.from_pretrained(tmp_path, fp8=True)  # quantised on load
  assert rel_rms(np.asarray(forward(fp8, x)), np.asarray(forward(m, x))) < 0.1
  os.remove(tmp_path / "model.safetensors")
  w = tensors(m)
  del w["model.layers.1.mlp.up_proj.weight"]
  save_file(w, os.path.join(tmp_path, "model.safetensors"))
  with pytest.raises(MissingTensorError, match="model.layers.1.mlp.up_proj"):
    llama.from_pretrained(tmp_path, **F32)


def test_rope_permutation_matches_interleaved_rope():
  """llama.cpp's converter permutes q/k rows so that its interleaved RoPE (pairs 2i, 2i + 1)
  computes what Hugging Face's rotate-half RoPE (pairs i, i + D/2) does on the original rows:
  check that on q rows, and that `unpermute_rope` inverts it."""
  heads, d, k = 3, 8, 5
  w = np.random.default_rng(0).normal(size=(heads * d, k)).astype(np.float32)
  x = np.random.default_rng(1).normal(size=(k,)).astype(np.float32)
  perm = gguf.permute_rope(w, heads)
  np.testing.assert_array_equal(gguf.unpermute_rope(perm, heads), w)
  pos, theta = 5, 10000.0
  half = rotate_half_rope(jnp.asarray((w @ x).reshape(1, 1, heads, d)), pos, theta)
  ang = pos / theta ** (np.arange(0, d, 2) / d)
  y = (perm @ x).reshape(heads, d // 2, 2)  # llama.cpp: adjacent pairs
  inter = np.stack([y[..., 0] * np.cos(ang) - y[..., 1] * np.sin(ang),
                    y[..., 0] * np.sin(ang) + y[..., 1] * np.cos(ang)], -1).reshape(heads, d)
  np.testing.assert_allclose(gguf.permute_rope(np.asarray(half).reshape(heads * d, 1), heads)
                             .reshape(heads, d), inter, rtol=1e-5, atol=1e-5)


def test_gguf_round_trip(tmp_path):
  """A tiny model written as llama.cpp's converter writes it (GGUF names, permuted q/k rows)
  loads to the same logits."""
  pytest.importorskip("gguf", reason="the gguf package reads GGUF files")
  m = f32_model()
  cfg = m.cfg
  write_gguf(tmp_path / "tiny.gguf", cfg, tensors(m))
  loaded = llama.from_pretrained(tmp_path / "tiny.gguf", **F32)
  # GGUF stores eps in f32 (the value the f32 norms compute with either way).
  assert dataclasses.replace(loaded.cfg, rms_norm_eps=cfg.rms_norm_eps) == cfg
  assert np.float32(loaded.cfg.rms_norm_eps) == np.float32(cfg.rms_norm_eps)
  x = ids()
  np.testing.assert_array_equal(np.asarray(forward(loaded, x)), np.asarray(forward(m, x)))
