"""rmsnorm (no quant): the unfused chain's norm kernel, against the reference and against the
fused op that shares its kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (TARGETS, TRITON_CALL, activations, assert_rounded_close, implementations,
                     lower, rng, weights)
from jfusedq import rmsnorm, rmsnorm_quant
from jfusedq.testing import WIDTHS

W = WIDTHS


@pytest.mark.parametrize("impl", implementations("rmsnorm"))
class TestEveryImplementation:
  """The contract each implementation meets, checked against the reference and the fused op."""

  @pytest.mark.parametrize("shape,residual,offset", [
      ((3, W["deepseek_v3.hidden"]), True, 0.0), ((1, W["deepseek_v3.q_a_kv_a"]), False, 1.0),
      ((2, 2, W["deepseek_v3.kv_a"]), True, 1.0)])
  def test_matches_reference_and_fused(self, impl, shape, residual, offset):
    r = rng("rmsnorm", shape, residual, offset)
    x, w = activations(r, shape), weights(r, shape[-1])
    res = activations(r, shape) if residual else None
    got = rmsnorm(x, w, residual=res, weight_offset=offset, implementation=impl)
    want = rmsnorm(x, w, residual=res, weight_offset=offset, implementation="xla")
    assert_rounded_close(got.y, want.y)
    fused = rmsnorm_quant(x, w, residual=res, weight_offset=offset, keep_hp=True,
                          implementation=impl)
    # One kernel (or one reference) for both ops: identical bits.
    np.testing.assert_array_equal(np.asarray(got.y, np.float32),
                                  np.asarray(fused.quant.hp, np.float32))
    if residual:
      np.testing.assert_array_equal(np.asarray(got.residual, np.float32),
                                    np.asarray(want.residual, np.float32))
    else:
      assert got.residual is None

  def test_deterministic(self, impl):
    r = rng("rmsnorm-det")
    shape = (4, W["deepseek_v3.q_a_kv_a"])
    x, res, w = activations(r, shape), activations(r, shape), weights(r, shape[-1])
    f = jax.jit(lambda x, res: rmsnorm(x, w, residual=res, implementation=impl))
    a, b = f(x, res), f(x, res)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      assert np.asarray(u).tobytes() == np.asarray(v).tobytes()


@pytest.mark.lowering
@pytest.mark.parametrize("target", TARGETS)
def test_lowers(target):
  S, h = jax.ShapeDtypeStruct, W["deepseek_v3.hidden"]
  text = lower(target, lambda x, r, w: rmsnorm(x, w, residual=r, implementation="pallas"),
               S((4, h), jnp.bfloat16), S((4, h), jnp.bfloat16), S((h,), jnp.bfloat16))
  assert text.count(TRITON_CALL) == 1


def test_errors():
  x = activations(rng("e"), (2, 256))
  with pytest.raises(ValueError, match="weight shape"):
    rmsnorm(x, x[0, :128])
  with pytest.raises(TypeError, match="x must be"):
    rmsnorm(x.astype(jnp.int32), x[0])
