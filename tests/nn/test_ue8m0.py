"""UE8M0 (power-of-two) activation scales through the layers: RMSNorm's fused quantisation,
Fp8Linear's and StackedLinear's on-the-fly one, QuantConfig and a model built with them; each
against the ops' reference.py with the option on."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import activations, assert_outputs_close, implementations, rng, weights
from jfusedq.checkpoint import QuantConfig
from jfusedq.fp8 import Fp8Format
from jfusedq.nn import Fp8Linear, RMSNorm, StackedLinear
from jfusedq.ops.fp8_matmul import reference as matmul_ref
from jfusedq.ops.group_quant import reference as quant_ref
from jfusedq.ops.rmsnorm_quant import reference as norm_ref
from jfusedq.testing import rel_rms

FMT = Fp8Format.e4m3fn()


def assert_close(got, want):
  # As the fp8_matmul tests: the kernels accumulate the K blocks in another order than the
  # reference and both round to bf16, so near-zero outputs (cancellation) differ by more than
  # their own size; measured on the H200, 0.3-0.6% of elements beyond 2^-7 relative alone.
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert rel_rms(got, want) <= 2.0**-8, rel_rms(got, want)
  assert np.all(np.abs(got - want) <= 2.0**-7 * np.abs(want) + 1e-3 * np.abs(want).max())


def assert_pow2(scale):
  s = np.asarray(scale, np.float64)
  assert np.all(s > 0) and np.array_equal(s, 2.0 ** np.round(np.log2(s))), s


@pytest.mark.parametrize("impl", implementations("rmsnorm_quant"))
def test_rmsnorm_ue8m0(impl):
  norm = RMSNorm(576, eps=1e-5, fmt=FMT, quant=True, ue8m0=True, implementation=impl,
                 rngs=nnx.Rngs(0))
  norm.weight[...] = weights(rng("ue8m0-norm-w"), 576)
  r = rng("ue8m0-norm")
  x, res = activations(r, (2, 3, 576)), activations(r, (2, 3, 576))
  q, h = norm(x, res, keep_hp=True)
  assert_pow2(q.scale)
  want = norm_ref.rmsnorm_quant(x, norm.weight[...], residual=res, eps=1e-5, weight_offset=0.0,
                                fmt=FMT, group_size=128, layout="row", ue8m0=True, keep_hp=True)
  assert_outputs_close(want._replace(quant=q, residual=h), want)
  # The dual-input (MLA) form carries the option too.
  second = RMSNorm(512, eps=1e-6, rngs=nnx.Rngs(1))
  q2, _ = norm.dual(x, second, activations(r, (2, 3, 512)))
  assert_pow2(q2.scale)


@pytest.mark.parametrize("impl", implementations("fp8_matmul"))
def test_fp8_linear_ue8m0(impl):
  layer = Fp8Linear(384, 200, fmt=FMT, ue8m0=True, implementation=impl, rngs=nnx.Rngs(0))
  x = activations(rng("ue8m0-lin"), (2, 3, 384))
  qa = quant_ref.group_quant(x, FMT, ue8m0=True)
  assert_pow2(qa.scale)
  w, s = layer.weight[...], layer.weight_scale_inv[...]
  want = np.asarray(matmul_ref.fp8_matmul(qa, w, s, jnp.bfloat16), np.float32)
  got = np.asarray(layer(x), np.float32)
  assert_close(got, want)
  # Not the default rounding: some scales differ, so the products do.
  plain = Fp8Linear(384, 200, fmt=FMT, implementation=impl, rngs=nnx.Rngs(0))
  assert not np.array_equal(np.asarray(plain(x), np.float32), got)


def test_stacked_linear_ue8m0():
  layer = StackedLinear(4, 256, 128, fmt=FMT, ue8m0=True, rngs=nnx.Rngs(0))
  x = activations(rng("ue8m0-stacked"), (5, 256))
  qa = quant_ref.group_quant(x, FMT, ue8m0=True)
  w, s = layer.weight[...], layer.weight_scale_inv[...]
  want = np.stack([np.asarray(matmul_ref.fp8_matmul(qa, w[e], s[e], jnp.bfloat16), np.float32)
                   for e in range(4)])
  assert_close(np.asarray(layer(x), np.float32), want)


def test_quant_config_ue8m0():
  """`scale_fmt: "ue8m0"` in a checkpoint's quantization_config (DeepSeek-V3.1) turns it on."""
  assert QuantConfig.from_hf({"quant_method": "fp8", "scale_fmt": "ue8m0"}, FMT).ue8m0
  assert not QuantConfig.from_hf({"quant_method": "fp8"}, FMT).ue8m0
  assert not QuantConfig(FMT).ue8m0
