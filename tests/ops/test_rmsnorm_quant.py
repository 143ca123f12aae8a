"""rmsnorm_quant: every implementation against the f32 reference, which is checked against a
float64 oracle; options, odd shapes, edge values, determinism, transforms and errors."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from helpers import (FORMATS, TRITON, activations, assert_outputs_close, assert_quant_close,
                     implementations, named, oracle_quant, oracle_rmsnorm, rng, weights)
from jfusedq import (Fp8Format, QuantizedActivation, Unsupported, _target, group_quant,
                     rmsnorm_quant)
from jfusedq.ops import _dispatch
from jfusedq.ops.rmsnorm_quant import triton as rq_triton
from jfusedq.ops.group_quant import Config
from jfusedq.ops.group_quant import pallas as gq_pallas
from jfusedq.testing import EDGE_WIDTHS, WIDTHS

W = WIDTHS
NORM_WIDTHS = named(W, "deepseek_v3.hidden", "deepseek_v3.q_lora", "deepseek_v3.kv_lora",
                    "deepseek_v3.kv_a", "deepseek_v3.q_a_kv_a", "qwen3_5.hidden",
                    "qwen3_5.linear_value")
# T = 1 alone and in batch dims, a tile's row count plus one.
ODD_SHAPES = [(1, W["deepseek_v3.hidden"]), (2, 3, W["deepseek_v3.kv_a"]),
              (1, 1, W["deepseek_v3.q_lora"]), (33, W["deepseek_v3.kv_lora"])]


def inputs(key, shape, *, residual=True, x2=None, dtype=jnp.bfloat16):
  r = rng(*key)
  x = activations(r, shape, dtype)
  res = activations(r, shape, dtype) if residual else None
  w = weights(r, shape[-1])
  if x2 is None:
    return x, res, w, None, None
  return x, res, w, activations(r, shape[:-1] + (x2,), dtype), weights(r, x2)


def run_both(impl, x, w, **kw):
  return (rmsnorm_quant(x, w, implementation=impl, **kw),
          rmsnorm_quant(x, w, implementation="xla", **kw))


OPTIONS = {
    "plain": dict(),
    "residual": dict(residual=True),
    "offset1": dict(weight_offset=1.0),
    "keep_hp": dict(keep_hp=True),
    "x2": dict(x2=W["deepseek_v3.kv_lora"]),
    "col": dict(layout="col"),
    "ue8m0": dict(ue8m0=True),
    "g64": dict(group_size=64),
    "e4m3fnuz": dict(fmt="e4m3fnuz"),
    "e4m3fnuz_224": dict(fmt="e4m3fnuz_224"),
    "eps": dict(eps=1e-2),
    "all": dict(residual=True, weight_offset=1.0, keep_hp=True, x2=W["deepseek_v3.kv_a"],
                layout="col", ue8m0=True, group_size=64, fmt="e4m3fnuz"),
}


def options_call(name, shape, impl, dtype=jnp.bfloat16):
  opt = dict(OPTIONS[name])
  x, res, w, x2, w2 = inputs(("opt", name, shape, str(dtype)), shape,
                             residual=opt.pop("residual", False), x2=opt.pop("x2", None),
                             dtype=dtype)
  if "fmt" in opt:
    opt["fmt"] = FORMATS[opt["fmt"]]
  return run_both(impl, x, w, residual=res, x2=x2, weight2=w2, **opt)


@pytest.mark.parametrize("impl", implementations("rmsnorm_quant"))
class TestEveryImplementation:
  """The contract each implementation meets, checked against the reference."""

  @pytest.mark.parametrize("hidden", NORM_WIDTHS)
  def test_model_hidden_sizes(self, impl, hidden):
    x, res, w, _, _ = inputs(("hidden", hidden), (3, hidden))
    got, want = run_both(impl, x, w, residual=res)
    assert_outputs_close(got, want)

  @pytest.mark.parametrize("name", OPTIONS)
  def test_options(self, impl, name):
    # 2112 = 16.5 groups of 128: the last group is partial.
    got, want = options_call(name, (5, W["deepseek_v3.q_a_kv_a"]), impl)
    assert_outputs_close(got, want)

  @pytest.mark.parametrize("shape", ODD_SHAPES)
  def test_odd_shapes_all_options(self, impl, shape):
    got, want = options_call("all", shape, impl)
    assert got.quant.q.shape == shape
    assert got.quant.scale.shape == (-(-shape[-1] // 64), *shape[:-1])
    assert_outputs_close(got, want)

  @pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
  def test_input_dtypes(self, impl, dtype):
    got, want = options_call("residual", (4, W["deepseek_v3.kv_a"]), impl, dtype)
    assert got.residual.dtype == dtype
    assert_outputs_close(got, want)

  def test_zero_rows_and_large_values(self, impl):
    x, res, w, _, _ = inputs(("extreme",), (6, W["deepseek_v3.q_lora"]))
    x = x.at[1].set(0).at[3].set(jnp.bfloat16(1e4)).at[4, ::7].set(jnp.bfloat16(-1e4))
    res = res.at[1].set(0)
    got, want = run_both(impl, x, w, residual=res, keep_hp=True)
    assert_outputs_close(got, want)
    q = np.asarray(got.quant.q.astype(jnp.float32))
    assert np.all(q[1] == 0) and np.all(np.isfinite(np.asarray(got.quant.scale)))
    # Row 3 is constant: after the norm every group's amax is |w| * const, so codes hit the max.
    assert np.abs(q[3]).max() == 448.0

  def test_deterministic(self, impl):
    x, res, w, x2, w2 = inputs(("det",), (8, W["deepseek_v3.hidden"]),
                               x2=W["deepseek_v3.kv_lora"])
    f = jax.jit(lambda *a: rmsnorm_quant(a[0], a[2], residual=a[1], x2=a[3], weight2=a[4],
                                         keep_hp=True, implementation=impl))
    a, b = f(x, res, w, x2, w2), f(x, res, w, x2, w2)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      assert np.asarray(u).tobytes() == np.asarray(v).tobytes()

  def test_jit_and_vmap(self, impl):
    x, res, w, _, _ = inputs(("vmap",), (3, 4, W["deepseek_v3.q_lora"]))
    want = rmsnorm_quant(x, w, residual=res, implementation="xla")
    jitted = jax.jit(lambda x, r, w: rmsnorm_quant(x, w, residual=r, implementation=impl))
    assert_outputs_close(jitted(x, res, w), want)
    mapped = jax.vmap(lambda x, r: rmsnorm_quant(x, w, residual=r, implementation=impl))(x, res)
    assert_outputs_close(mapped, want)

  @pytest.mark.parametrize("fmt", FORMATS)
  def test_fused_equals_unfused(self, impl, fmt):
    """The fused op against `r = x + residual; rmsnorm(r)` (f32) then the standalone quant."""
    fmt = FORMATS[fmt]
    x, res, w, _, _ = inputs(("unfused", fmt.name, fmt.max), (16, W["deepseek_v3.hidden"]))
    fused = rmsnorm_quant(x, w, residual=res, fmt=fmt, implementation=impl)
    r = (x.astype(jnp.float32) + res.astype(jnp.float32)).astype(x.dtype)
    rf = r.astype(jnp.float32)
    y = rf * jax.lax.rsqrt(jnp.mean(rf * rf, axis=-1, keepdims=True) + 1e-6) * w.astype(
        jnp.float32)
    unfused = group_quant(y, fmt=fmt, implementation=impl)
    np.testing.assert_array_equal(np.asarray(fused.residual, np.float32),
                                  np.asarray(r, np.float32))
    assert_quant_close(fused.quant, unfused)


@pytest.mark.parametrize("case", ["plain", "residual_offset", "ue8m0_fnuz", "g64_224"])
def test_reference_matches_float64_oracle(case):
  opt = {"plain": dict(), "residual_offset": dict(residual=True, weight_offset=1.0),
         "ue8m0_fnuz": dict(ue8m0=True, fmt="e4m3fnuz"),
         "g64_224": dict(group_size=64, fmt="e4m3fnuz_224")}[case]
  fmt = FORMATS[opt.pop("fmt", "e4m3fn")]
  group_size, offset = opt.get("group_size", 128), opt.get("weight_offset", 0.0)
  x, res, w, x2, w2 = inputs(("oracle", case), (7, W["deepseek_v3.q_a_kv_a"]),
                             residual=opt.pop("residual", False), x2=W["deepseek_v3.kv_a"])
  out = rmsnorm_quant(x, w, residual=res, x2=x2, weight2=w2, fmt=fmt, implementation="xla",
                      keep_hp=True, **opt)
  h = np.asarray(x, np.float64) if res is None else np.asarray(out.residual, np.float64)
  if res is not None:
    want_res = (np.asarray(x, np.float64) + np.asarray(res, np.float64)).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(out.residual), want_res)
  y = oracle_rmsnorm(h, w, 1e-6, offset)
  q, scale = oracle_quant(y, fmt, group_size, opt.get("ue8m0", False))
  want = QuantizedActivation(jnp.asarray(q), jnp.asarray(scale, jnp.float32), group_size=group_size)
  # f32 against f64 through a 2112-long mean and a product: ~1e-6 relative on y, hence on scales.
  assert_quant_close(out.quant, want, scale_rtol=1e-5)
  np.testing.assert_allclose(np.asarray(out.quant.hp, np.float64), y, rtol=2.0**-8, atol=1e-6)
  np.testing.assert_allclose(np.asarray(out.norm2, np.float64),
                             oracle_rmsnorm(x2, w2, 1e-6, offset), rtol=2.0**-8, atol=1e-6)


@pytest.mark.parametrize("impl", implementations("rmsnorm_quant", kernels=True))
@pytest.mark.parametrize("block_rows,num_warps", [(1, 4), (2, 8), (4, 16), (8, 4)])
def test_explicit_configs(impl, block_rows, num_warps):
  x, res, w, x2, w2 = inputs(("config",), (8, W["deepseek_v3.q_a_kv_a"]),
                             x2=W["deepseek_v3.kv_lora"])
  kw = dict(residual=res, x2=x2, weight2=w2, keep_hp=True)
  got = rmsnorm_quant(x, w, implementation=impl, config=Config(block_rows, num_warps), **kw)
  assert_outputs_close(got, rmsnorm_quant(x, w, implementation="xla", **kw))


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 16, 64, 96, 4096, 16383, 16384])
@pytest.mark.parametrize("width", named(W))
def test_heuristics_valid(rows, width):
  c = gq_pallas.heuristics(rows, width)
  assert rows % c.block_rows == 0
  assert c.block_rows * width <= max(gq_pallas.TILE, width)
  assert 4 <= c.num_warps <= 16


def test_default_implementation_on_cpu_is_xla():
  x, res, w, _, _ = inputs(("default",), (2, W["deepseek_v3.kv_a"]))
  if jax.default_backend() == "cpu":
    got = rmsnorm_quant(x, w, residual=res)
    want = rmsnorm_quant(x, w, residual=res, implementation="xla")
    for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert np.asarray(u).tobytes() == np.asarray(v).tobytes()


@pytest.mark.parametrize("hidden", named(EDGE_WIDTHS, "odd", "over_wide"))
def test_untileable_rows_fall_back(hidden):
  """Odd or over-wide rows: Pallas declines, an explicit request says so, a chain falls back."""
  x, _, w, _, _ = inputs(("fallback", hidden), (2, hidden))
  with pytest.raises(Unsupported, match="pallas"):
    rmsnorm_quant(x, w, implementation="pallas")
  got = rmsnorm_quant(x, w, implementation=("pallas", "xla"))
  assert_outputs_close(got, rmsnorm_quant(x, w, implementation="xla"))


def test_errors():
  x, res, w, x2, w2 = inputs(("errors",), (4, W["deepseek_v3.kv_a"]),
                             x2=W["deepseek_v3.kv_lora"])
  with pytest.raises(TypeError, match="x must be"):
    rmsnorm_quant(x.astype(jnp.int8), w)
  with pytest.raises(ValueError, match="weight shape"):
    rmsnorm_quant(x, w[:-1])
  with pytest.raises(ValueError, match="residual shape"):
    rmsnorm_quant(x, w, residual=res[:2])
  with pytest.raises(TypeError, match="residual dtype"):
    rmsnorm_quant(x, w, residual=res.astype(jnp.float32))
  with pytest.raises(ValueError, match="group_size"):
    rmsnorm_quant(x, w, group_size=100)
  with pytest.raises(ValueError, match="unknown implementation"):
    rmsnorm_quant(x, w, implementation="cuda")
  with pytest.raises(ValueError, match="together"):
    rmsnorm_quant(x, w, x2=x2)
  with pytest.raises(ValueError, match="x2 leading shape"):
    rmsnorm_quant(x, w, x2=x2[:3], weight2=w2)
  with pytest.raises(ValueError, match="layout"):
    rmsnorm_quant(x, w, layout="colmajor")
  with pytest.raises(ValueError, match="fmt"):
    rmsnorm_quant(x, w, fmt="e5m2")
  with pytest.raises(ValueError, match="must divide"):
    rmsnorm_quant(x, w, implementation="pallas", config=Config(8, 4))
  with pytest.raises(ValueError, match="fp8_max"):
    Fp8Format.e4m3fnuz(fp8_max=448.0)


def test_default_order_is_triton_first():
  # Triton ran 1.10-1.18x Pallas's speed on the H200 at T >= 4096 where its row block is at
  # most a quarter padding; Pallas where `triton` is missing; XLA alone on CPU.
  assert _dispatch.default_order(_target.Target("rocm", "gfx942")) == ("triton", "pallas", "xla")
  assert _dispatch.default_order(_target.Target("cpu", "cpu")) == ("xla",)


@pytest.mark.parametrize("rows,k,g,want", [
    (16384, 5120, 128, (4096, 1024, 0)), (4096, 1536, 128, (1024, 512, 0)),
    (16384, 7168, 128, (8192, 0, 0)),  # 12.5% padding: one block
    (4095, 5120, 128, (8192, 0, 0)),  # below SPLIT_MIN_ROWS: one block
    (4096, 5000, 128, (4096, 512, 512)),  # three pieces, the last padded
    (4096, 576, 128, (512, 128, 0)),  # the tail group its own piece
    (4096, 100, 128, (128, 0, 0)), (4096, 3, 1, (2, 1, 0))])
def test_triton_row_pieces(rows, k, g, want):
  assert rq_triton.pieces(rows, k, g) == want


@pytest.mark.parametrize("g", [1, 64, 128])
def test_triton_row_pieces_cover_the_row(g):
  for k in range(1, 9000, 37):
    p = [w for w in rq_triton.pieces(4096, k, g) if w]
    assert sum(p) >= k and sum(p) - k < p[-1], (k, p)
    assert p == sorted(p, reverse=True) and all(w % g == 0 and w & (w - 1) == 0 for w in p)


@pytest.mark.parametrize("impl", [TRITON])
@pytest.mark.parametrize("hidden", [5120, 5000, W["deepseek_v3.kv_a"]])
def test_split_rows_every_output(monkeypatch, impl, hidden):
  """The row in pieces at a few rows (SPLIT_MIN_ROWS lowered): every output against XLA, with
  a row holding an inf, one whose h * h overflows f32, and a zero row."""
  monkeypatch.setattr(rq_triton, "SPLIT_MIN_ROWS", 1)
  x, res, w, x2, w2 = inputs(("split", hidden), (6, hidden), x2=W["deepseek_v3.kv_lora"])
  x = x.at[1, hidden - 1].set(jnp.inf).at[2].set(3e38 / 2).at[3].set(0.0)
  res = res.at[2].set(0.0).at[3].set(0.0)
  kw = dict(residual=res, x2=x2, weight2=w2, keep_hp=True)
  got, want = run_both(impl, x, w, **kw)
  assert np.isnan(np.asarray(got.quant.scale[1])).all()
  clean = np.array([0, 2, 3, 4, 5])
  pick = lambda out: jax.tree.map(lambda a: a[clean], out)
  assert_outputs_close(pick(got), pick(want))
