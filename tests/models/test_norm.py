"""jfusedq.nn.RMSNorm (jfusedq/nn/norm.py, tested here with the models that use it): plain,
with a residual, and returning the quantised tuple through the fused kernel."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from helpers import activations, assert_outputs_close, rng, weights
from jfusedq import QuantizedActivation, rmsnorm, rmsnorm_quant
from jfusedq.nn.norm import RMSNorm


def _norm(**kw):
  norm = RMSNorm(576, eps=1e-5, fmt="e4m3fn", rngs=nnx.Rngs(0), **kw)
  norm.weight[...] = weights(rng("norm-w"), 576)
  return norm


def test_plain_and_residual():
  norm = _norm()
  r = rng("norm")
  x, res = activations(r, (3, 576)), activations(r, (3, 576))
  w = norm.weight[...]
  np.testing.assert_array_equal(np.asarray(norm(x), np.float32),
                                np.asarray(rmsnorm(x, w, eps=1e-5).y, np.float32))
  y, h = norm(x, res)
  want = rmsnorm(x, w, residual=res, eps=1e-5)
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want.y, np.float32))
  np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(want.residual, np.float32))


def test_quantised_tuple():
  norm = _norm(quant=True)
  r = rng("norm-q")
  x, res = activations(r, (2, 5, 576)), activations(r, (2, 5, 576))
  w = norm.weight[...]
  q, h = jax.jit(lambda m, x, r: m(x, r, keep_hp=True))(norm, x, res)
  assert isinstance(q, QuantizedActivation) and q.hp is not None and q.q.shape == (2, 5, 576)
  want = rmsnorm_quant(x, w, residual=res, eps=1e-5, fmt="e4m3fn", keep_hp=True)
  got = want._replace(quant=q, residual=h)
  assert_outputs_close(got, want)
  # Without a residual only the tuple comes back; quant=False per call gives the plain norm.
  assert isinstance(norm(x), QuantizedActivation)
  assert norm(x, quant=False).dtype == jnp.bfloat16
