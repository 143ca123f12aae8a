"""Fp8Linear / Linear with every input kind, the weight quantiser and the fnuz conversion."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import FORMATS, activations, implementations, named, rng
from jfusedq import Fp8Format, QuantizedActivation, default_format, rmsnorm_quant
from jfusedq.nn import Fp8Linear, Linear, e4m3fn_to_e4m3fnuz, quantize_weight
from jfusedq.ops.fp8_matmul.reference import dequantize_weight
from jfusedq.testing import EDGE_PROJECTIONS, rel_rms


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", named(EDGE_PROJECTIONS, "small", "partial_blocks"))
def test_quantize_weight(fmt, shape):
  (n, k), fmt = shape, FORMATS[fmt]
  w = rng("qw", n, k).standard_normal((n, k)).astype(np.float32)
  q, s = quantize_weight(jnp.asarray(w), fmt)
  assert q.dtype == fmt.dtype and s.shape == (-(-n // 128), -(-k // 128))
  blocks = np.pad(np.abs(w), ((0, s.shape[0] * 128 - n), (0, s.shape[1] * 128 - k)))
  amax = blocks.reshape(s.shape[0], 128, s.shape[1], 128).max(axis=(1, 3))
  # f32 division against f64: one rounding, <= 2**-23 relative.
  np.testing.assert_allclose(np.asarray(s), amax / fmt.max, rtol=2.0**-23)
  # Round to nearest with 3 mantissa bits: within 2**-4 of each value, or half the smallest
  # subnormal step of the block near zero.
  err = np.abs(np.asarray(dequantize_weight(q, s)) - w)
  floor = np.repeat(np.repeat(np.asarray(s), 128, 0), 128, 1)[:n, :k] * 2.0**-9
  assert np.all(err <= np.abs(w) * 2.0**-4 + floor)


def test_quantize_weight_format_names():
  """A format name or None (the device's native format) means the same as the Fp8Format."""
  w = jnp.asarray(rng("qw_names").standard_normal((130, 260)), jnp.float32)
  for name in ("e4m3fn", "e4m3fnuz"):
    want = quantize_weight(w, getattr(Fp8Format, name)())
    got = quantize_weight(w, name)
    assert got[0].dtype == want[0].dtype
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  assert quantize_weight(w)[0].dtype == default_format().dtype
  with pytest.raises(ValueError, match="fmt must be"):
    quantize_weight(w, "e5m2")


def test_e4m3fn_to_e4m3fnuz():
  w = rng("fnuz").standard_normal((256, 256)).astype(np.float32)
  q, s = quantize_weight(jnp.asarray(w), Fp8Format.e4m3fn())
  q = q.at[0, :4].set(jnp.asarray([-0.0, 0.0, -0.0, 1.0], jnp.float8_e4m3fn))
  qz, sz = e4m3fn_to_e4m3fnuz(q, s)
  assert qz.dtype == jnp.float8_e4m3fnuz
  np.testing.assert_array_equal(np.asarray(dequantize_weight(qz, sz)),
                                np.asarray(dequantize_weight(q, s)))
  bits = np.asarray(qz).view(np.uint8)
  assert not np.any(bits == 0x80), "-0 must not become the fnuz NaN"
  assert not np.any(np.isnan(np.asarray(qz).astype(np.float32)))
  with pytest.raises(TypeError):
    e4m3fn_to_e4m3fnuz(qz, sz)


@pytest.mark.parametrize("impl", implementations("fp8_matmul"))
def test_fp8_linear_input_kinds(impl):
  layer = Fp8Linear(384, 200, fmt="e4m3fn", implementation=impl, rngs=nnx.Rngs(0))
  assert layer.weight[...].dtype == jnp.float8_e4m3fn
  assert layer.weight_scale_inv[...].shape == (2, 3)
  x = activations(rng("lin"), (2, 3, 384))
  norm_w = jnp.asarray(rng("lin-w").standard_normal(384), jnp.bfloat16)
  quant = rmsnorm_quant(x, norm_w, keep_hp=True, fmt="e4m3fn").quant
  plain = QuantizedActivation(quant.q, quant.scale)
  y_tuple, y_hp = layer(plain), layer(quant)
  np.testing.assert_array_equal(np.asarray(y_tuple), np.asarray(y_hp))
  y_arr = jax.jit(lambda m, x: m(x))(layer, quant.hp)
  assert y_arr.shape == (2, 3, 200) and y_arr.dtype == jnp.bfloat16
  # Against f32 matmul of the unquantised norm output and the dequantised weight: the
  # activation's own fp8 rounding (~2**-5 RMS relative) dominates.
  exact = jnp.einsum("...k,nk->...n", quant.hp.astype(jnp.float32),
                     dequantize_weight(layer.weight[...], layer.weight_scale_inv[...]))
  assert rel_rms(y_arr, exact) < 0.05
  assert rel_rms(y_tuple, exact) < 0.05


def test_linear_uses_hp_and_requires_it():
  layer = Linear(384, 64, rngs=nnx.Rngs(1))
  x = activations(rng("bf16lin"), (4, 384))
  quant = rmsnorm_quant(x, jnp.ones(384, jnp.bfloat16) * 0.5, keep_hp=True).quant
  np.testing.assert_array_equal(np.asarray(layer(quant)), np.asarray(layer(quant.hp)))
  with pytest.raises(ValueError, match="high-precision copy"):
    layer(QuantizedActivation(quant.q, quant.scale))
  with_bias = Linear(384, 64, use_bias=True, rngs=nnx.Rngs(1))
  assert with_bias(x).shape == (4, 64)


@pytest.mark.parametrize("layer", [Linear, Fp8Linear])
@pytest.mark.parametrize("n, k", [(4096, 64), (64, 4096)], ids=["wide_out", "wide_in"])
def test_default_init_keeps_the_input_scale(layer, n, k):
  """The default initialiser takes the fan-in from the in axis of the `[out, in]` weight, so a
  unit-variance input gives outputs of std ~1 whatever the shape (an LM head's logits); fan-in
  from the out axis gave std sqrt(k / n): 0.125 and 8 here."""
  kw = dict(fmt="e4m3fn") if layer is Fp8Linear else {}
  lin = layer(k, n, rngs=nnx.Rngs(0), **kw)
  x = jnp.asarray(rng("init", n, k).standard_normal((64, k)), jnp.bfloat16)
  std = float(np.asarray(lin(x), np.float32).std())
  assert 0.8 < std < 1.2, std
