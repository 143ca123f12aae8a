"""rmsnorm (no quant): the unfused chain's norm kernel, against the reference and against the
fused op that shares its kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (TARGETS, TRITON, TRITON_CALL, activations, assert_rounded_close, lower, rng,
                     weights)
from jfusedq import rmsnorm, rmsnorm_quant

IMPLS = ("xla", "pallas", TRITON)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape,residual,offset", [((3, 7168), True, 0.0), ((1, 2112), False, 1.0),
                                                   ((2, 2, 576), True, 1.0)])
def test_matches_reference_and_fused(impl, shape, residual, offset):
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


@pytest.mark.lowering
@pytest.mark.parametrize("target", TARGETS)
def test_lowers(target):
  S = jax.ShapeDtypeStruct
  text = lower(target, lambda x, r, w: rmsnorm(x, w, residual=r, implementation="pallas"),
               S((4, 7168), jnp.bfloat16), S((4, 7168), jnp.bfloat16), S((7168,), jnp.bfloat16))
  assert text.count(TRITON_CALL) == 1


def test_errors():
  x = activations(rng("e"), (2, 256))
  with pytest.raises(ValueError, match="weight shape"):
    rmsnorm(x, x[0, :128])
  with pytest.raises(TypeError, match="x must be"):
    rmsnorm(x.astype(jnp.int32), x[0])
