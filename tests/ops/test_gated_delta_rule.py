"""Gated delta rule: recurrent against a float64 numpy loop, chunked against recurrent, state
continuation (prefill then decode), odd lengths, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import rng
from jfusedq.ops.gated_delta_rule import gated_delta_rule
from jfusedq.testing import rel_rms

# f32 throughout: the recurrence and the chunked form agree to ~1e-6 relative RMS (measured
# 4e-7 at T = 130); 1e-5 leaves room and still catches a wrong decay or mask term, which
# moves the output by percent.
RTOL = 1e-5


def inputs(key, b, t, h, dk, dv, dtype=jnp.float32, state=True):
  r = rng(*key)
  f = lambda *s: r.standard_normal(s)
  q, k = jnp.asarray(f(b, t, h, dk), dtype), jnp.asarray(f(b, t, h, dk), dtype)
  v = jnp.asarray(f(b, t, h, dv), dtype)
  g = jnp.asarray(-np.exp(r.uniform(-4, 0.5, (b, t, h))), jnp.float32)  # decays exp(g) in (0, 1)
  beta = jnp.asarray(r.uniform(0.02, 0.98, (b, t, h)), jnp.float32)
  s0 = jnp.asarray(f(b, h, dk, dv) * 0.3, jnp.float32) if state else None
  return q, k, v, g, beta, s0


def oracle(q, k, v, g, beta, s0, scale):
  """The recurrence in float64 numpy, one token and one head at a time."""
  q, k, v, g, beta = (np.asarray(a, np.float64) for a in (q, k, v, g, beta))
  b, t, h, dk = q.shape
  s = np.zeros((b, h, dk, v.shape[-1])) if s0 is None else np.asarray(s0, np.float64).copy()
  o = np.zeros((b, t, h, v.shape[-1]))
  for i in range(t):
    for bi in range(b):
      for hi in range(h):
        st = s[bi, hi] * np.exp(g[bi, i, hi])
        kt = k[bi, i, hi]
        st = st + np.outer(kt, beta[bi, i, hi] * (v[bi, i, hi] - kt @ st))
        s[bi, hi] = st
        o[bi, i, hi] = (q[bi, i, hi] * scale) @ st
  return o, s


@pytest.mark.parametrize("t", [1, 7, 33])
def test_recurrent_matches_float64_oracle(t):
  q, k, v, g, beta, s0 = inputs(("oracle", t), 2, t, 3, 8, 12)
  # Normalised keys keep the state bounded, as in the model.
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  o, s = gated_delta_rule(q, k, v, g, beta, initial_state=s0, mode="recurrent")
  want_o, want_s = oracle(q, k, v, g, beta, s0, 8**-0.5)
  assert rel_rms(o, want_o) < 1e-6 and rel_rms(s, want_s) < 1e-6


@pytest.mark.parametrize("t", [1, 63, 64, 65, 130])
@pytest.mark.parametrize("state", [False, True])
def test_chunk_matches_recurrent(t, state):
  q, k, v, g, beta, s0 = inputs(("chunk", t, state), 2, t, 3, 16, 24, state=state)
  kw = dict(initial_state=s0, use_qk_l2norm=True)
  o_c, s_c = gated_delta_rule(q, k, v, g, beta, mode="chunk", **kw)
  o_r, s_r = gated_delta_rule(q, k, v, g, beta, mode="recurrent", **kw)
  assert rel_rms(o_c, o_r) < RTOL and rel_rms(s_c, s_r) < RTOL


@pytest.mark.parametrize("chunk_size", [16, 32])
def test_chunk_sizes_and_bf16(chunk_size):
  q, k, v, g, beta, _ = inputs(("bf16", chunk_size), 1, 50, 2, 32, 32, dtype=jnp.bfloat16,
                               state=False)
  o_c, s_c = gated_delta_rule(q, k, v, g, beta, mode="chunk", chunk_size=chunk_size,
                              use_qk_l2norm=True)
  o_r, s_r = gated_delta_rule(q, k, v, g, beta, mode="recurrent", use_qk_l2norm=True)
  assert o_c.dtype == jnp.bfloat16 and s_c.dtype == jnp.float32
  # Both compute in f32 from the same bf16 inputs; the outputs differ by bf16 rounding only.
  assert rel_rms(o_c, o_r) < 2.0**-8 and rel_rms(s_c, s_r) < RTOL


def test_prefill_then_decode_equals_full():
  q, k, v, g, beta, _ = inputs(("continue",), 2, 70, 2, 16, 16, state=False)
  kw = dict(use_qk_l2norm=True)
  o_full, s_full = gated_delta_rule(q, k, v, g, beta, mode="chunk", **kw)
  o_pre, s = gated_delta_rule(q[:, :67], k[:, :67], v[:, :67], g[:, :67], beta[:, :67],
                              mode="chunk", **kw)
  outs = [o_pre]
  step = jax.jit(lambda *a, s: gated_delta_rule(*a, initial_state=s, mode="recurrent", **kw))
  for i in range(67, 70):
    o_i, s = step(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], g[:, i:i + 1], beta[:, i:i + 1],
                  s=s)
    outs.append(o_i)
  assert rel_rms(jnp.concatenate(outs, axis=1), o_full) < RTOL and rel_rms(s, s_full) < RTOL


def test_errors():
  q, k, v, g, beta, s0 = inputs(("errors",), 1, 4, 2, 8, 8)
  with pytest.raises(ValueError, match="q, k must be"):
    gated_delta_rule(q, k[..., :4], v, g, beta)
  with pytest.raises(ValueError, match="g and beta"):
    gated_delta_rule(q, k, v, g[:, :2], beta)
  with pytest.raises(ValueError, match="initial_state"):
    gated_delta_rule(q, k, v, g, beta, initial_state=s0[..., :4])
  with pytest.raises(ValueError, match="mode"):
    gated_delta_rule(q, k, v, g, beta, mode="parallel")
