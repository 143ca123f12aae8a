"""group_quant: every implementation against the f32 reference, and the reference against a
float64 oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (FORMATS, activations, assert_quant_close, implementations, named,
                     oracle_quant, rng)
from jfusedq import QuantizedActivation, Unsupported, group_quant
from jfusedq.testing import EDGE_WIDTHS, WIDTHS

WIDTH_CASES = named(EDGE_WIDTHS, "one_group", "partial_group") + named(
    WIDTHS, "deepseek_v3.kv_a", "deepseek_v3.q_a_kv_a", "deepseek_v3.hidden",
    "deepseek_v3.attn_out")
# T = 1, batch dims, a partial last group.
SHAPES = [(1, WIDTHS["deepseek_v3.q_a_kv_a"]), (2, 3, WIDTHS["deepseek_v3.kv_a"]),
          (5, WIDTHS["deepseek_v3.hidden"])]


def quant_both(impl, x, **kw):
  return group_quant(x, implementation=impl, **kw), group_quant(x, implementation="xla", **kw)


@pytest.mark.parametrize("impl", implementations("group_quant"))
class TestEveryImplementation:
  """The contract each implementation meets, checked against the reference."""

  @pytest.mark.parametrize("k", WIDTH_CASES)
  @pytest.mark.parametrize("fmt", FORMATS)
  def test_widths_and_formats(self, impl, k, fmt):
    x = activations(rng("width", k, fmt), (3, k))
    got, want = quant_both(impl, x, fmt=FORMATS[fmt])
    assert got.q.dtype == FORMATS[fmt].dtype and got.scale.shape == (3, -(-k // 128))
    assert_quant_close(got, want)

  @pytest.mark.parametrize("opt", [dict(layout="col"), dict(ue8m0=True), dict(group_size=64),
                                   dict(layout="col", ue8m0=True, group_size=64,
                                        fmt="e4m3fnuz")])
  @pytest.mark.parametrize("shape", SHAPES)
  def test_options_and_batch_dims(self, impl, opt, shape):
    opt = dict(opt)
    if "fmt" in opt:
      opt["fmt"] = FORMATS[opt["fmt"]]
    x = activations(rng("opt", shape, str(opt)), shape, jnp.float32)
    got, want = quant_both(impl, x, **opt)
    assert (got.group_size, got.layout) == (opt.get("group_size", 128), opt.get("layout", "row"))
    got.validate()
    assert_quant_close(got, want)
    if opt.get("ue8m0"):
      m, _ = np.frexp(np.asarray(got.scale))
      assert np.all(m == 0.5), "UE8M0 scales must be powers of two"

  @pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3fnuz"])
  def test_ue8m0_exact_powers_of_two(self, impl, fmt):
    """Groups whose amax / fp8_max is exactly a power of two keep that scale, not the next one
    (amax = 1.75 * 2**j, common in bf16, makes amax / 448 exact; 240 = 1.875 * 2**7 likewise)."""
    fmt = FORMATS[fmt]
    peaks = fmt.max * 2.0 ** np.arange(-12, -4)  # one exact peak per group, the rest below it
    x = rng("ue8m0-exact", fmt.name).uniform(-0.9, 0.9, (6, 1024)) * np.repeat(peaks, 128)
    x = jnp.asarray(x, jnp.bfloat16).at[:, ::128].set(jnp.asarray(peaks, jnp.bfloat16))
    got = group_quant(x, fmt=fmt, ue8m0=True, implementation=impl)
    np.testing.assert_array_equal(np.asarray(got.scale), np.broadcast_to(peaks / fmt.max, (6, 8)))
    assert_quant_close(got, group_quant(x, fmt=fmt, ue8m0=True, implementation="xla"))

  def test_zeros_large_values_and_dequantisation(self, impl):
    x = activations(rng("extreme"), (4, WIDTHS["deepseek_v3.q_lora"]))
    x = x.at[0].set(0).at[2, :128].set(jnp.bfloat16(1e4))
    got, want = quant_both(impl, x)
    assert_quant_close(got, want)
    assert np.all(np.asarray(got.q[0].astype(jnp.float32)) == 0)
    np.testing.assert_allclose(np.asarray(got.scale[2, 0]), float(jnp.bfloat16(1e4)) / 448,
                               rtol=1e-6)
    # e4m3 keeps 3 mantissa bits: round-to-nearest error <= 2**-4 of the value's binade.
    err = np.abs(np.asarray(got.dequantize()) - np.asarray(x, np.float32))
    assert np.all(err <= np.abs(np.asarray(x, np.float32)) * 2.0**-4 + 2.0**-9 * np.repeat(
        np.asarray(got.scale), 128, axis=-1))

  def test_deterministic_jit_vmap(self, impl):
    x = activations(rng("det"), (2, 6, WIDTHS["deepseek_v3.q_a_kv_a"]))
    f = jax.jit(lambda x: group_quant(x, implementation=impl, layout="col"))
    a, b = f(x), f(x)
    assert np.asarray(a.q).tobytes() == np.asarray(b.q).tobytes()
    assert np.asarray(a.scale).tobytes() == np.asarray(b.scale).tobytes()
    mapped = jax.vmap(lambda x: group_quant(x, implementation=impl))(x)
    assert_quant_close(mapped, group_quant(x, implementation="xla"))


@pytest.mark.parametrize("case", ["fn", "fnuz_ue8m0", "fnuz224_g64"])
def test_reference_matches_float64_oracle(case):
  fmt, ue8m0, g = {"fn": ("e4m3fn", False, 128), "fnuz_ue8m0": ("e4m3fnuz", True, 128),
                   "fnuz224_g64": ("e4m3fnuz_224", False, 64)}[case]
  fmt = FORMATS[fmt]
  x = activations(rng("oracle", case), (9, WIDTHS["deepseek_v3.q_a_kv_a"]), jnp.float32)
  got = group_quant(x, fmt=fmt, ue8m0=ue8m0, group_size=g, implementation="xla")
  q, scale = oracle_quant(x, fmt, g, ue8m0)
  # Input is exact in both; f32 division vs f64 moves scales by ~1 ulp.
  assert_quant_close(got, QuantizedActivation(jnp.asarray(q), jnp.asarray(scale, jnp.float32),
                                              group_size=g), scale_rtol=3e-7)


def test_errors():
  x = activations(rng("errors"), (2, 256))
  with pytest.raises(TypeError, match="x must be"):
    group_quant(x.astype(jnp.int32))
  with pytest.raises(ValueError, match="group_size"):
    group_quant(x, group_size=96)
  with pytest.raises(ValueError, match="layout"):
    group_quant(x, layout="column")
  with pytest.raises(ValueError, match="unknown implementation"):
    group_quant(x, implementation=("cutlass",))
  with pytest.raises(ValueError, match="at least one dimension"):
    group_quant(x[0, 0])
  with pytest.raises(Unsupported):
    group_quant(activations(rng("wide"), (1, 32768)), implementation="pallas")


@pytest.mark.parametrize("ue8m0", [False, True])
def test_quantize_rows_equals_the_reference(ue8m0):
  """The Mosaic GPU epilogue's quantisation (one 128-group a row, no clamp or select) gives the
  reference's codes and scales bit for bit: random rows over 2^-40 .. 2^40, rows of one value
  repeated (every code at +-fp8_max), zeros, and rows holding a NaN or an inf."""
  from jfusedq.fp8 import Fp8Format
  from jfusedq.ops.group_quant import pallas, reference
  fmt = Fp8Format.e4m3fn()
  r = rng("rows", ue8m0)
  y = r.standard_normal((64, 128)) * np.exp2(r.integers(-40, 41, (64, 1)))
  y[1] = 3.0
  y[2] = -1e30
  y[3] = 0.0
  y[4, 7] = np.nan
  y[5, 0] = np.inf
  y = jnp.asarray(y, jnp.float32)
  q, s = pallas.quantize_rows(y, fmt, ue8m0)
  want = reference.group_quant(y, fmt, ue8m0=ue8m0)
  np.testing.assert_array_equal(np.asarray(s), np.asarray(want.scale[:, 0]))
  np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(want.q, np.float32))
  assert np.isnan(np.asarray(q[4], np.float32)).all() and np.isnan(s[5])
