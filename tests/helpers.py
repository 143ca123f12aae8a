"""The op tests' implementations, inputs, a float64 numpy oracle and closeness checks."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from jfusedq import _target, _triton
from jfusedq.fp8 import Fp8Format, QuantizedActivation
from jfusedq.nn import quantize_weight
from jfusedq.testing import quant_mismatch, rel_rms

# Reductions in a different order and (on GPU) approximate rsqrt / division move a scale by a
# few f32 ulps (1 ulp = 6e-8 relative); 1e-6 leaves room for ~16 and still catches any real
# error. A code moves only when y / scale sits within that much of a rounding midpoint.
SCALE_RTOL = 1e-6
CODE_FRAC = 1e-3
# A bf16 output rounded from f32 values that differ by a few ulps may land one bf16 ulp
# (2**-8 relative to the leading bit, so at most 2**-7 of the value) apart.
BF16_RTOL = 2.0**-7

FORMATS = {
    "e4m3fn": Fp8Format.e4m3fn(),
    "e4m3fnuz": Fp8Format.e4m3fnuz(),
    "e4m3fnuz_224": Fp8Format.e4m3fnuz(fp8_max=224.0),
}


def _mosaic_gpu_missing() -> str | None:
  """Why the Mosaic GPU kernel cannot run here: it needs a Hopper GPU, or the CPU interpreter."""
  target = _target.current()
  if target.platform == "cpu" or target.is_hopper:
    return None
  return f"no Hopper GPU: the Mosaic GPU kernel is built for sm90, not {target.device_kind}"


def _impl(name: str, missing: str | None):
  return pytest.param(name, marks=() if missing is None else pytest.mark.skip(reason=missing))


# The implementations each op's shared suite runs over, as pytest params skipped where they
# cannot run: "xla" is the op's reference.py, which every other is checked against; Pallas runs
# interpreted on CPU. The Mosaic GPU GEMM builds only K % 128 == 0, N % 64 == 0 and e4m3fn, and
# its CPU interpreter takes ~3x Pallas's time, so its cases (test_fp8_matmul.py) are its own.
XLA, PALLAS = "xla", "pallas"
# Under tests/triton_interpret.py the target is an H200 and the launcher Triton's interpreter.
TRITON = _impl("triton", _triton.missing())
MOSAIC_GPU = _impl("mosaic_gpu", _mosaic_gpu_missing())
IMPLEMENTATIONS = {
    "group_quant": (XLA, PALLAS, TRITON),
    "rmsnorm": (XLA, PALLAS, TRITON),
    "rmsnorm_quant": (XLA, PALLAS, TRITON),
    "fp8_matmul": (XLA, PALLAS, TRITON),
}


def implementations(op: str, *, kernels: bool = False) -> tuple:
  """`op`'s implementations for `pytest.mark.parametrize`; `kernels`: the tiled ones alone (they
  take a `config`)."""
  return tuple(i for i in IMPLEMENTATIONS[op] if not (kernels and i == XLA))


def named(table: dict, *names: str) -> list:
  """Shapes of a `jfusedq.testing` table (the named ones, or all) as params whose ids are their
  names."""
  return [pytest.param(table[n], id=n) for n in names or table]


def rng(*key) -> np.random.Generator:
  return np.random.default_rng(zlib.crc32(repr(key).encode()))


def activations(r: np.random.Generator, shape, dtype=jnp.bfloat16) -> jax.Array:
  """Normal values with per-row magnitudes spread over two decades and a few outliers."""
  x = r.standard_normal(shape) * np.exp(r.uniform(-2.3, 2.3, shape[:-1] + (1,)))
  x = np.where(r.random(shape) < 0.002, x * 30.0, x)
  return jnp.asarray(x, dtype)


def weights(r: np.random.Generator, n: int, dtype=jnp.bfloat16) -> jax.Array:
  return jnp.asarray(r.standard_normal(n) * 0.5 + 0.2, dtype)


def assert_quant_close(got: QuantizedActivation, want: QuantizedActivation, *,
                       scale_rtol=SCALE_RTOL, code_frac=CODE_FRAC):
  why = quant_mismatch(got, want, max_code_frac=code_frac, scale_rtol=scale_rtol)
  assert why is None, why


def assert_rounded_close(got, want, rtol=BF16_RTOL):
  assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.shape)
  g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert np.all(np.isfinite(g))
  np.testing.assert_allclose(g, w, rtol=rtol, atol=1e-30)


def assert_outputs_close(got, want):
  """Every output of rmsnorm_quant: quant (+hp), residual (bit-exact), norm2."""
  assert_quant_close(got.quant, want.quant)
  assert (got.quant.hp is None) == (want.quant.hp is None)
  if want.quant.hp is not None:
    assert_rounded_close(got.quant.hp, want.quant.hp)
  assert (got.residual is None) == (want.residual is None)
  if want.residual is not None:
    # The same f32 add rounded once: no freedom at all.
    np.testing.assert_array_equal(np.asarray(got.residual, np.float32),
                                  np.asarray(want.residual, np.float32))
  assert (got.norm2 is None) == (want.norm2 is None)
  if want.norm2 is not None:
    assert_rounded_close(got.norm2, want.norm2)


def oracle_quant(y, fmt: Fp8Format, group_size: int, ue8m0: bool):
  """float64 numpy per-group quantisation: (q as fp8 numpy, row-major scale float64)."""
  y = np.asarray(y, np.float64)
  *lead, k = y.shape
  groups = -(-k // group_size)
  pad = np.zeros((*lead, groups * group_size - k))
  yg = np.concatenate([y, pad], axis=-1).reshape(*lead, groups, group_size)
  scale = np.maximum(np.abs(yg).max(-1), 1e-10) / fmt.max
  if ue8m0:
    scale = 2.0 ** np.ceil(np.log2(scale))
  q = np.clip(yg / scale[..., None], -fmt.max, fmt.max).reshape(*lead, -1)[..., :k]
  np_dtype = {"e4m3fn": ml_dtypes.float8_e4m3fn, "e4m3fnuz": ml_dtypes.float8_e4m3fnuz}
  return q.astype(np_dtype[fmt.name]), scale


def oracle_rmsnorm(h, w, eps, offset):
  h = np.asarray(h, np.float64)
  return h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps) * (
      np.asarray(w, np.float64) + offset)


# A GEMM's result and its reference are f32 sums rounded once to bf16 (2**-9 relative); summed
# in another order they may round to neighbouring bf16 values: 2**-8 relative RMS bounds that
# with room, and elementwise one bf16 ulp (2**-7 of the value) plus a floor for outputs that
# cancel to ~0.
GEMM_RMS_TOL = 2.0**-8


def assert_gemm_close(got, want):
  assert got.shape == want.shape and got.dtype == want.dtype
  g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert np.all(np.isfinite(g))
  assert rel_rms(g, w) <= GEMM_RMS_TOL, rel_rms(g, w)
  assert np.all(np.abs(g - w) <= 2.0**-7 * np.abs(w) + 1e-3 * np.abs(w).max())


def experts(key, e, n, k, fmt="e4m3fn"):
  """E random expert weights `[E, N, K]` quantised to 128 x 128 blocks, their scales then
  scaled at random, so a wrong expert or block index cannot hide behind uniform scales."""
  r = rng(*key)
  w = jnp.asarray(r.standard_normal((e, n, k)) * np.exp(r.uniform(-1, 1, (e, n, 1))),
                  jnp.float32)
  qw, sw = jax.vmap(lambda a: quantize_weight(a, FORMATS[fmt]))(w)
  return qw, sw * jnp.asarray(r.uniform(0.5, 2.0, sw.shape), jnp.float32)


# Abstract devices stand in for GPUs this machine does not have.
TARGETS = {"h200": ("NVIDIA H200", "cuda"), "gfx950": ("gfx950", "rocm"),
           "gfx942": ("gfx942", "rocm")}
TRITON_CALL = "__gpu$xla.gpu.triton"


def lower(target: str, fn, *avals) -> str:
  """StableHLO text of jit(fn) lowered for `target` through an abstract mesh."""
  kind, platform = TARGETS[target]
  mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(kind, None, platform))
  with jax.sharding.use_abstract_mesh(mesh):
    return jax.jit(fn).trace(*avals).lower().as_text()
