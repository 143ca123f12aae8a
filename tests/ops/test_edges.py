"""Numerics at the edges, the same in every implementation: all-zero rows, values near the
bf16 maximum, NaN / inf inputs (a group or row holding one gets NaN scales and NaN codes, so
corruption stays visible)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jfusedq as jf
from jfusedq.nn import quantize_weight
from tests import helpers

BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)
H = 256  # two groups of 128


def _codes(q):
  return np.asarray(q.astype(jnp.float32))


def _corrupt(value, rows=3, h=H):
  """Row 0: `value` at column 3 (group 0); row 2: `value` at column 200 (group 1); the other
  rows clean."""
  x = jax.random.normal(jax.random.key(0), (rows, h), jnp.float32).astype(jnp.bfloat16)
  return x.at[0, 3].set(value).at[2, 200].set(value)


def _rmsnorm_quant(x, impl, **kw):
  return jf.rmsnorm_quant(x, jnp.ones((x.shape[-1],), jnp.bfloat16), implementation=impl, **kw)


@pytest.mark.parametrize("impl", helpers.implementations("group_quant"))
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("ue8m0", [False, True])
# XLA:CPU's vectorised max reduction dropped NaN at [16, 256] and [64, 7168] (not at [3, 256]).
@pytest.mark.parametrize("rows,h", [(3, H), (16, H), (64, 7168)])
def test_group_quant_non_finite_group_is_nan(impl, value, ue8m0, rows, h):
  qa = jf.group_quant(_corrupt(value, rows, h), ue8m0=ue8m0, implementation=impl)
  scale, codes = np.asarray(qa.scale), _codes(qa.q).reshape(rows, -1, 128)
  # Only the group holding the value is poisoned, all of its codes NaN.
  poisoned = np.zeros(scale.shape, bool)
  poisoned[0, 0] = poisoned[2, 1] = True
  assert np.isnan(scale[poisoned]).all() and np.isnan(codes[poisoned]).all()
  assert np.isfinite(scale[~poisoned]).all() and (scale[~poisoned] > 0).all()
  assert np.isfinite(codes[~poisoned]).all()


@pytest.mark.parametrize("impl", helpers.implementations("rmsnorm_quant"))
@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
def test_rmsnorm_quant_non_finite_row_is_nan(impl, value):
  out = _rmsnorm_quant(_corrupt(value), impl, keep_hp=True)
  scale, codes, hp = np.asarray(out.quant.scale), _codes(out.quant.q), np.asarray(
      out.quant.hp.astype(jnp.float32))
  # The row statistic is corrupt, so the whole row is: every scale, code and hp value NaN.
  for r in (0, 2):
    assert np.isnan(scale[r]).all() and np.isnan(codes[r]).all() and np.isnan(hp[r]).all()
  assert np.isfinite(scale[1]).all() and np.isfinite(codes[1]).all()


@pytest.mark.parametrize("impl", helpers.implementations("rmsnorm"))
def test_rmsnorm_non_finite_row_is_nan(impl):
  y = np.asarray(jf.rmsnorm(_corrupt(np.inf), jnp.ones((H,), jnp.bfloat16),
                            implementation=impl).y.astype(jnp.float32))
  assert np.isnan(y[0]).all() and np.isnan(y[2]).all() and np.isfinite(y[1]).all()


@pytest.mark.parametrize("impl", helpers.implementations("rmsnorm_quant"))
def test_rmsnorm_quant_residual_overflow_is_nan(impl):
  # bf16 max + bf16 max rounds to inf: the stream carries inf, and the row is treated as corrupt.
  x = jnp.full((2, H), BF16_MAX, jnp.bfloat16).at[1].set(1.0)
  out = _rmsnorm_quant(x, impl, residual=x)
  assert np.isinf(np.asarray(out.residual[0].astype(jnp.float32))).all()
  assert np.isnan(np.asarray(out.quant.scale[0])).all()
  assert np.isfinite(np.asarray(out.quant.scale[1])).all()


@pytest.mark.parametrize("impl", helpers.implementations("group_quant"))
def test_group_quant_zero_and_bf16_max_rows(impl):
  x = jnp.zeros((2, H), jnp.bfloat16).at[1].set(-BF16_MAX).at[1, 7].set(BF16_MAX)
  qa = jf.group_quant(x, implementation=impl)
  scale, codes = np.asarray(qa.scale), _codes(qa.q)
  assert (scale[0] > 0).all() and (codes[0] == 0).all()
  np.testing.assert_allclose(scale[1], BF16_MAX / 448.0, rtol=1e-6)
  assert (np.abs(codes[1]) == 448.0).all()


@pytest.mark.parametrize("impl", helpers.implementations("rmsnorm_quant"))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_rmsnorm_quant_zero_and_huge_rows(impl, dtype):
  # |h| near the dtype maximum overflows h * h in f32: the norm must still give h / rms(h).
  big = float(jnp.finfo(dtype).max) / 2
  x = jnp.zeros((3, H), dtype).at[1].set(big).at[1, :8].set(-big).at[2].set(1.0)
  out = _rmsnorm_quant(x.astype(dtype), impl, keep_hp=True)
  scale, codes = np.asarray(out.quant.scale), _codes(out.quant.q)
  assert (scale[0] > 0).all() and (codes[0] == 0).all()
  # Rows 1 and 2 normalise to +-1 everywhere (row 2 to 1 - eps / 2): the same scales, codes.
  np.testing.assert_allclose(scale[1], scale[2], rtol=helpers.SCALE_RTOL)
  np.testing.assert_array_equal(np.abs(codes[1]), codes[2])
  np.testing.assert_allclose(np.asarray(out.quant.hp[1].astype(jnp.float32))[8:], 1.0)


@pytest.mark.parametrize("impl", helpers.implementations("fp8_matmul"))
def test_fp8_matmul_non_finite_row_is_nan(impl):
  """A NaN or inf in an activation row reaches its outputs as NaN (through the NaN scale of its
  group), and no other row."""
  w, s = quantize_weight(jax.random.normal(jax.random.key(3), (128, H)), jf.Fp8Format.e4m3fn())
  x = _corrupt(np.nan).at[2, 200].set(np.inf)
  y = np.asarray(jf.fp8_matmul(x, w, s, implementation=impl).astype(jnp.float32))
  assert np.isnan(y[0]).all() and np.isnan(y[2]).all() and np.isfinite(y[1]).all()
