"""FP8 formats, per-device defaults, the fnuz bit encoder and the QuantizedActivation pytree."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from helpers import rng
from jfusedq import Fp8Format, QuantizedActivation, default_format
from jfusedq.fp8 import encode_e4m3fnuz


def test_formats():
  assert Fp8Format.e4m3fn().max == 448.0 and Fp8Format.e4m3fnuz().max == 240.0
  assert Fp8Format.e4m3fnuz(fp8_max=224).max == 224.0
  assert Fp8Format.e4m3fn().dtype == jnp.float8_e4m3fn
  with pytest.raises(ValueError, match="fp8_max"):
    Fp8Format.e4m3fn(fp8_max=500)
  with pytest.raises(ValueError, match="unsupported FP8 dtype"):
    Fp8Format(jnp.float8_e5m2, 57344.0)


@pytest.mark.parametrize("kind,platform,want", [
    ("NVIDIA H200", "cuda", "e4m3fn"), ("NVIDIA H100 80GB HBM3", "cuda", "e4m3fn"),
    ("gfx950", "rocm", "e4m3fn"), ("AMD Instinct MI355X", "rocm", "e4m3fn"),
    ("gfx942", "rocm", "e4m3fnuz"), ("AMD Instinct MI300X", "rocm", "e4m3fnuz"),
    ("AMD Instinct MI325X", "rocm", "e4m3fnuz"), ("cpu", "cpu", "e4m3fn")])
def test_default_format_per_device(kind, platform, want):
  assert default_format(kind, platform).name == want


@pytest.mark.parametrize("kind,platform,want", [("gfx942", "rocm", "e4m3fnuz"),
                                                ("gfx950", "rocm", "e4m3fn")])
def test_default_format_follows_abstract_device(kind, platform, want):
  mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(kind, None, platform))
  with jax.sharding.use_abstract_mesh(mesh):
    assert default_format().name == want
    assert default_format(fp8_max=224.0).max == 224.0


def test_encode_e4m3fnuz_bit_exact():
  """Every code, every midpoint (ties to even) and its neighbours, random values, +-0, NaN."""
  codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fnuz).astype(np.float32)
  vals = np.unique(codes[~np.isnan(codes)])
  mids = (vals[1:] + vals[:-1]) / 2
  r = rng("fnuz")
  x = np.concatenate([
      vals, mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf),
      r.uniform(-240, 240, 50_000), r.standard_normal(50_000) * 2.0**-8,
      [0.0, -0.0, np.nan, 2.0**-11, -2.0**-11, 2.0**-12]]).astype(np.float32)
  got = np.asarray(jax.jit(encode_e4m3fnuz)(x))
  want = x.astype(ml_dtypes.float8_e4m3fnuz).view(np.uint8)
  np.testing.assert_array_equal(got, want)
  assert got[np.flatnonzero(np.signbit(x) & (x == 0))[0]] == 0  # no negative zero
  assert got[np.flatnonzero(np.isnan(x))[0]] == 0x80


def test_quantized_activation_pytree():
  q = jnp.zeros((3, 256), jnp.float8_e4m3fn).at[:, 0].set(2.0)
  s = jnp.asarray(rng("qa").uniform(0.1, 1, (2, 3)), jnp.float32)
  qa = QuantizedActivation(q, s, None, group_size=128, layout="col")
  qa.validate()
  leaves, tree = jax.tree.flatten(qa)
  assert len(leaves) == 2
  back = jax.jit(lambda a: a)(qa)
  assert (back.group_size, back.layout) == (128, "col")
  np.testing.assert_array_equal(back.row_scale(), s.T)
  np.testing.assert_allclose(back.dequantize()[:, 0], 2.0 * s.T[:, 0])
  with pytest.raises(ValueError, match="scale shape"):
    QuantizedActivation(q, s, group_size=128, layout="row").validate()
  with pytest.raises(ValueError, match="hp shape"):
    QuantizedActivation(q, s, jnp.zeros((3, 2)), layout="col").validate()
  with pytest.raises(TypeError, match="q must be"):
    QuantizedActivation(q.astype(jnp.bfloat16), s, layout="col").validate()
  with pytest.raises(ValueError, match="layout"):
    QuantizedActivation(q, s, layout="transposed")


@pytest.mark.parametrize("layout", ["row", "col"])
def test_quantized_activation_layouts_and_views(layout):
  """flatten / unflatten / with_layout / map_leading keep every code with its own scale."""
  from jfusedq import group_quant
  x = jnp.asarray(rng("views", layout).standard_normal((2, 3, 320)), jnp.bfloat16)
  qa = group_quant(x, layout=layout, implementation="xla")
  qa = QuantizedActivation(qa.q, qa.scale, x, group_size=qa.group_size, layout=layout)
  want = np.asarray(qa.dequantize())
  flat = qa.flatten()
  flat.validate()
  assert flat.shape == (6, 320) and flat.layout == layout and flat.hp.shape == (6, 320)
  np.testing.assert_array_equal(flat.dequantize(), want.reshape(6, 320))
  back = flat.unflatten((2, 3))
  back.validate()
  np.testing.assert_array_equal(back.dequantize(), want)
  other = qa.with_layout("col" if layout == "row" else "row")
  other.validate()
  np.testing.assert_array_equal(other.dequantize(), want)
  assert qa.with_layout(layout) is qa
  mapped = qa.map_leading(lambda t: t[:, None])
  mapped.validate()
  assert mapped.layout == "row" and mapped.shape == (2, 1, 3, 320)
  np.testing.assert_array_equal(mapped.dequantize(), want[:, None])


@pytest.mark.parametrize("m", [1, 300])
def test_xla_path_quantises_inside_a_larger_jit(m):
  """The XLA fp8_matmul of a bf16 activation, and of rmsnorm_quant's output, inside one jit
  equal the product of the codes computed on their own, bit for bit (W8A8, not W8A16: GPU
  XLA's excess-precision simplification must not remove the fp8 rounding)."""
  from jfusedq import fp8_matmul, group_quant, rmsnorm_quant
  from jfusedq.nn.weights import quantize_weight
  r = rng("excess_precision", m)
  x = jnp.asarray(r.standard_normal((m, 1024)), jnp.bfloat16)
  nw = jnp.asarray(r.uniform(0.5, 1.5, (1024,)), jnp.bfloat16)
  w, s = quantize_weight(jnp.asarray(r.standard_normal((384, 1024)) * 0.02, jnp.float32),
                         "e4m3fn")
  mm = jax.jit(lambda a: fp8_matmul(a, w, s, implementation="xla"))
  fetch = lambda t: jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), t)  # materialised
  codes = fetch(jax.jit(lambda x: group_quant(x, fmt="e4m3fn", implementation="xla"))(x))
  np.testing.assert_array_equal(np.asarray(mm(x), np.float32), np.asarray(mm(codes), np.float32))
  norm = lambda x: rmsnorm_quant(x, nw, fmt="e4m3fn", implementation="xla").quant
  fused = jax.jit(lambda x: fp8_matmul(norm(x), w, s, implementation="xla"))(x)
  np.testing.assert_array_equal(np.asarray(fused, np.float32),
                                np.asarray(mm(fetch(jax.jit(norm)(x))), np.float32))


def test_xla_quantisation_keeps_its_codes():
  """The XLA paths put the fp8 codes behind an optimisation barrier, which XLA does not
  simplify through (on CPU the bit-for-bit test passes either way; this is what holds on GPU)."""
  from jfusedq import fp8_matmul, group_quant
  from jfusedq.nn.weights import quantize_weight
  w, s = quantize_weight(jnp.ones((128, 256)), "e4m3fn")
  for fmt in ("e4m3fn", "e4m3fnuz"):
    fn = lambda x: group_quant(x, fmt=fmt, implementation="xla").dequantize()
    text = jax.jit(fn).lower(jax.ShapeDtypeStruct((4, 256), jnp.bfloat16)).as_text()
    barriers = [ln for ln in text.splitlines() if "optimization_barrier" in ln]
    assert barriers and all(("f8E4M3FNUZ" if fmt == "e4m3fnuz" else "f8E4M3FN") in ln
                            for ln in barriers)
  text = jax.jit(lambda x: fp8_matmul(x, w, s, implementation="xla")).lower(
      jax.ShapeDtypeStruct((4, 256), jnp.bfloat16)).as_text()
  assert any("optimization_barrier" in ln and "f8E4M3FN" in ln for ln in text.splitlines())
