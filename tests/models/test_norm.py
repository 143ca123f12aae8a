"""jfusedq.nn.RMSNorm (jfusedq/nn/norm.py, tested here with the models that use it): plain,
with a residual, returning the quantised tuple through the fused kernel, all-reducing its
input under tensor parallelism, and the dual-input (MLA) form."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import activations, assert_outputs_close, assert_quant_close, rng, weights
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


def test_all_reduce_path():
  """With `axis_name` the norm all-reduces its input first: psum + add + norm (+ quant, through
  allreduce_rmsnorm_quant) inside shard_map equals the single-device norm of the sum."""
  n = 2
  mesh = jax.make_mesh((n,), ("tp",), devices=jax.devices()[:n])
  r = rng("norm-ar")
  parts = jnp.stack([activations(r, (3, 576)) for _ in range(n)])  # device i's partial sum
  res = activations(r, (3, 576))
  norm = _norm(axis_name="tp")
  plain = _norm()
  want_y, want_h = plain(jnp.sum(parts.astype(jnp.float32), 0).astype(jnp.bfloat16), res,
                         quant=True)
  for quant in (True, False):
    f = jax.shard_map(lambda p, r: norm(p[0], r, quant=quant), mesh=mesh,
                      in_specs=(P("tp"), P()), out_specs=P(), check_vma=False)
    y, h = jax.jit(f)(jax.device_put(parts, NamedSharding(mesh, P("tp"))),
                      jax.device_put(res, NamedSharding(mesh, P())))
    np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(want_h, np.float32))
    if quant:
      assert_quant_close(y, want_y)
    else:
      np.testing.assert_array_equal(np.asarray(y, np.float32),
                                    np.asarray(plain(want_h), np.float32))


def test_dual():
  """`dual`: this norm quantised and a second norm in bf16, one rmsnorm_quant launch."""
  a, b = _norm(), RMSNorm(128, eps=1e-6, rngs=nnx.Rngs(1))
  b.weight[...] = weights(rng("norm-w2"), 128)
  r = rng("norm-dual")
  x, x2 = activations(r, (4, 576)), activations(r, (4, 128))
  q, y2 = a.dual(x, b, x2)
  want = rmsnorm_quant(x, a.weight[...], x2=x2, weight2=b.weight[...], eps=1e-5, eps2=1e-6,
                       fmt="e4m3fn")
  assert_outputs_close(want._replace(quant=q), want)
  np.testing.assert_array_equal(np.asarray(y2, np.float32), np.asarray(b(x2), np.float32))
  np.testing.assert_array_equal(np.asarray(want.norm2, np.float32),
                                np.asarray(b(x2), np.float32))


@pytest.mark.parametrize("t", [255, 256])
def test_scales_in_the_projections_layout(t):
  """The tuple's scales come in the layout the FP8 projection reads without a transpose
  (`fp8_matmul.scale_layout`: column from 256 rows), from the fused, the all-reduce and the
  dual path; the codes and scales are the row-layout op's."""
  r = rng("norm-layout", t)
  x, res, x2 = activations(r, (t, 576)), activations(r, (t, 576)), activations(r, (t, 128))
  layout = "col" if t >= 256 else "row"
  norm = _norm(quant=True)
  w = norm.weight[...]
  want = rmsnorm_quant(x, w, residual=res, eps=1e-5, fmt="e4m3fn").quant
  n = 2
  mesh = jax.make_mesh((n,), ("tp",), devices=jax.devices()[:n])
  reduced = jax.shard_map(lambda p, r: _norm(quant=True, axis_name="tp")(p[0], r)[0],
                          mesh=mesh, in_specs=(P("tp"), P()), out_specs=P(), check_vma=False)
  second = RMSNorm(128, eps=1e-6, rngs=nnx.Rngs(1))
  outs = {"fused": norm(x, res)[0],
          "all-reduce": jax.jit(reduced)(
              jax.device_put(jnp.stack([x, jnp.zeros_like(x)]), NamedSharding(mesh, P("tp"))),
              jax.device_put(res, NamedSharding(mesh, P()))),
          "dual": norm.dual(x, second, x2)[0]}
  for path, q in outs.items():
    assert q.layout == layout, path
  fused = outs["fused"]
  np.testing.assert_array_equal(np.asarray(fused.row_scale()), np.asarray(want.scale))
  np.testing.assert_array_equal(np.asarray(fused.q, np.float32), np.asarray(want.q, np.float32))
  # Compiled as one program the XLA path may round a scale differently (test_all_reduce_path).
  assert_quant_close(outs["all-reduce"].with_layout("row"), want)
