"""Prefill attention (`jfusedq.ops.attention`): the XLA reference against a float64 numpy loop,
the blocked online softmax against the reference on odd lengths (T not a multiple of the block,
a cached prefix, T = 1, a prefix not a multiple of the block), a traced prefix length, and
errors. cuDNN's backend needs an NVIDIA GPU; here it must decline."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from helpers import rng
from jfusedq import Unsupported
from jfusedq.errors import DTypeError, InputError
from jfusedq.ops.attention import Prefix, attention
from jfusedq.testing import rel_rms

# f32: the same sums in another order (blocks, and segments merged through their log-sum-exp):
# measured 7e-8 to 2e-7; 1e-5 catches a wrong mask or merge, which moves the output by percent.
F32_RTOL = 1e-5
# bf16 inputs: both round the probabilities to bf16 before they weigh v, each block relative to
# its own running max instead of the row's, so a probability lands up to one bf16 ulp (2**-8
# relative) elsewhere: measured 1.5e-3 to 2.1e-3. A key seen twice or missed moves it by >= 5%.
BF16_RTOL = 8e-3

# (T, L cached, slots, block): T = 1; T and L below, at, and past odd multiples of the block;
# a prefix that is not a whole number of blocks; slots past what is cached stay unread.
CASES = [(1, 0, 8, 4), (1, 9, 10, 4), (7, 0, 8, 4), (7, 5, 20, 4), (13, 11, 30, 4),
         (5, 9, 14, 16), (8, 8, 16, 4)]
# (Hq, Hkv, Dqk, Dv): GQA as Qwen3.5's gated attention, per-head MLA as DeepSeek-V3's.
HEADS = {"gqa": (8, 2, 32, 32), "mla": (4, 4, 24, 16)}


def inputs(seed, t, slots, heads, dtype):
  hq, hkv, d, dv = heads
  r = rng(seed, t, slots)
  f = lambda *s: jnp.asarray(r.standard_normal(s), dtype)
  q, k, v = f(2, t, hq, d), f(2, t, hkv, d), f(2, t, hkv, dv)
  ck, cv = f(2, slots, hkv, d), f(2, slots, hkv, dv)
  fetch = lambda start, size: (lax.dynamic_slice_in_dim(ck, start, size, axis=1),
                               lax.dynamic_slice_in_dim(cv, start, size, axis=1))
  return q, k, v, (ck, cv), fetch


def oracle(q, k, v, cached, length, scale):
  """Causal attention in float64 numpy, one query and head at a time: keys = the first
  `length` cached slots, then the new tokens up to the query's own."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  ck, cv = (np.asarray(a, np.float64)[:, :length] for a in cached)
  b, t, hq, _ = q.shape
  r = hq // k.shape[2]
  o = np.zeros((b, t, hq, v.shape[-1]))
  for bi in range(b):
    for i in range(t):
      for h in range(hq):
        keys = np.concatenate([ck[bi, :, h // r], k[bi, :i + 1, h // r]])
        vals = np.concatenate([cv[bi, :, h // r], v[bi, :i + 1, h // r]])
        s = keys @ q[bi, i, h] * scale
        p = np.exp(s - s.max())
        o[bi, i, h] = p @ vals / p.sum()
  return o


@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("t,length,slots,block", CASES)
def test_reference_equals_oracle(t, length, slots, block, heads):
  q, k, v, cached, fetch = inputs(0, t, slots, HEADS[heads], jnp.float32)
  got = attention(q, k, v, scale=0.3, prefix=Prefix(fetch, length, slots), implementation="xla")
  assert got.dtype == jnp.float32 and got.shape == (*q.shape[:3], v.shape[-1])
  assert rel_rms(got, oracle(q, k, v, cached, length, 0.3)) <= F32_RTOL


@pytest.mark.parametrize("dtype,tol", [("float32", F32_RTOL), ("bfloat16", BF16_RTOL)])
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("t,length,slots,block", CASES)
def test_blocked_equals_reference(t, length, slots, block, heads, dtype, tol):
  q, k, v, _, fetch = inputs(1, t, slots, HEADS[heads], jnp.dtype(dtype))
  prefix = Prefix(fetch, length, slots)
  want = attention(q, k, v, scale=0.3, prefix=prefix, implementation="xla")
  got = attention(q, k, v, scale=0.3, prefix=prefix, block=block, implementation="blocked")
  assert rel_rms(got, want) <= tol
  if jax.default_backend() == "cpu":  # the default order there is the blocked backend
    assert rel_rms(attention(q, k, v, scale=0.3, prefix=prefix, block=block), got) == 0


def test_traced_length():
  """Under jit the cached length is a traced position: one compile serves every length, and
  each equals the reference at that length."""
  t, slots, heads = 5, 23, HEADS["gqa"]
  q, k, v, _, fetch = inputs(2, t, slots, heads, jnp.float32)
  traces = []

  @jax.jit
  def run(q, k, v, n):
    traces.append(n)
    return attention(q, k, v, scale=0.3, prefix=Prefix(fetch, n, slots), block=4)

  for n in (0, 3, 4, 17, slots - t):
    want = attention(q, k, v, scale=0.3, prefix=Prefix(fetch, n, slots), implementation="xla")
    assert rel_rms(run(q, k, v, jnp.int32(n)), want) <= F32_RTOL
  assert len(traces) == 1


def test_no_prefix_is_causal():
  """Without a prefix each token sees itself and those before: the first output is v[0]."""
  q, k, v, _, _ = inputs(3, 6, 8, HEADS["mla"], jnp.float32)
  o = attention(q, k, v, scale=0.3, block=4)
  np.testing.assert_allclose(o[:, 0], v[:, 0], rtol=1e-6)
  assert rel_rms(o, oracle(q, k, v, (k[:, :0], v[:, :0]), 0, 0.3)) <= F32_RTOL


def test_cudnn_declines_off_gpu():
  q, k, v, _, _ = inputs(4, 3, 8, HEADS["gqa"], jnp.bfloat16)
  with pytest.raises(Unsupported, match="NVIDIA GPU"):
    attention(q, k, v, scale=0.3, implementation="cudnn")


def test_errors():
  q, k, v, _, fetch = inputs(5, 3, 8, HEADS["gqa"], jnp.float32)
  with pytest.raises(InputError, match="not a multiple"):
    attention(q[:, :, :7], k[:, :, :2], v, scale=1.0)
  with pytest.raises(InputError, match="disagree"):
    attention(q, k[:, :2], v[:, :2], scale=1.0)
  with pytest.raises(DTypeError, match="share a dtype"):
    attention(q, k.astype(jnp.bfloat16), v, scale=1.0)
  with pytest.raises(InputError, match="slots"):
    attention(q, k, v, scale=1.0, prefix=Prefix(fetch, 2, 0))
  with pytest.raises(InputError, match="block"):
    attention(q, k, v, scale=1.0, block=0)
