"""ragged_fp8_matmul / ragged_matmul / ragged_swiglu: every implementation against the f32
reference over routings (uniform, skewed, empty experts, everything on one expert, rows past
the groups), gathered rows, odd shapes, both formats and scale layouts; the fused SwiGLU
against its unfused steps; the Mosaic GPU kernel against the dense one; the tile maps; errors;
the XLA path's cost against the expert count."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import FORMATS, MOSAIC_GPU, TARGETS, TRITON, activations, experts, lower, rng
from helpers import assert_gemm_close as assert_close
from jfusedq import (QuantizedActivation, default_format, fp8_matmul, group_quant,
                     ragged_fp8_matmul, ragged_matmul, ragged_swiglu)
from jfusedq.errors import DTypeError, InputError
from jfusedq.ops._dispatch import Unsupported
from jfusedq.ops.fp8_matmul.mosaic_gpu import Config as MosaicConfig
from jfusedq.ops.fp8_matmul.pallas import Config
from jfusedq.ops.ragged_fp8_matmul import api, reference, tiles, xla
from jfusedq.ops.ragged_fp8_matmul import mosaic_gpu as ragged_mosaic
from jfusedq.testing import rel_rms
from jfusedq.testing import EDGE_PROJECTIONS

IMPLS = ("xla", TRITON)
PARTIAL_N, PARTIAL_K = EDGE_PROJECTIONS["partial_blocks"]


def routing(key, name, m, e):
  """Group sizes summing to m (or less: rows past the groups), by name."""
  r = rng(*key)
  if name == "uniform":
    sizes = np.bincount(r.integers(0, e, m), minlength=e)
  elif name == "skewed":  # two experts take nearly everything, most are empty
    sizes = np.bincount(r.choice([1, e - 2, 0], m, p=[0.6, 0.35, 0.05]), minlength=e)
  elif name == "one_expert":
    sizes = np.eye(e, dtype=np.int64)[e // 2] * m
  else:  # "tail": a third of the rows past the last group, which must come out zero
    sizes = np.bincount(r.integers(0, e, m - m // 3), minlength=e)
  return jnp.asarray(sizes, jnp.int32)


def skip_fnuz(impl, fmt):
  if impl == "triton" and fmt == "e4m3fnuz" and default_format().name == "e4m3fn":
    pytest.skip("triton multiplies e4m3fnuz only where the GPU does (AMD MI300)")


@pytest.mark.parametrize("impl", IMPLS)
class TestEveryImplementation:

  @pytest.mark.parametrize("route", ["uniform", "skewed", "one_expert", "tail"])
  @pytest.mark.parametrize("m,e,n,k", [(1, 5, 256, 384), (37, 6, PARTIAL_N, PARTIAL_K),
                                       (200, 3, 384, 256)])
  def test_routings_and_shapes(self, impl, route, m, e, n, k):
    qw, sw = experts(("w", m, e, n, k), e, n, k)
    x = activations(rng("x", m, k), (m, k))
    sizes = routing(("r", route, m), route, m, e)
    got = ragged_fp8_matmul(x, qw, sw, sizes, implementation=impl)
    want = reference.ragged_fp8_matmul(group_quant(x, fmt="e4m3fn", implementation="xla"), qw,
                                       sw, sizes)
    assert_close(got, want)
    if route == "tail":
      assert not np.any(np.asarray(got)[int(sizes.sum()):])

  @pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3fnuz"])
  @pytest.mark.parametrize("layout", ["row", "col"])
  def test_gathered_rows_formats_and_layouts(self, impl, fmt, layout):
    """MoE's first projection: sorted (token, expert) pairs read their token's row in place."""
    skip_fnuz(impl, fmt)
    t, topk, e, n, k = 11, 3, 7, 384, 640
    qw, sw = experts(("g", fmt), e, n, k, fmt)
    x = activations(rng("gx", fmt), (t, k))
    idx = np.stack([rng("gi", i).permutation(e)[:topk] for i in range(t)])  # [T, topk]
    order = np.argsort(idx.reshape(-1), kind="stable")
    rows = jnp.asarray(order // topk, jnp.int32)
    sizes = jnp.asarray(np.bincount(idx.reshape(-1), minlength=e), jnp.int32)
    qa = group_quant(x, fmt=FORMATS[fmt], layout=layout, implementation="xla")
    got = ragged_fp8_matmul(qa, qw, sw, sizes, rows=rows, implementation=impl)
    # Each sorted row is its token through its expert: per-pair fp8_matmul.
    q = qa.with_layout("row")
    want = jnp.concatenate([
        fp8_matmul(type(qa)(q.q[r:r + 1], q.scale[r:r + 1]), qw[ex], sw[ex],
                   implementation="xla")
        for r, ex in zip(np.asarray(rows), idx.reshape(-1)[order])])
    assert_close(got, want)

  def test_ue8m0_and_determinism(self, impl):
    qw, sw = experts(("u",), 4, 256, 512)
    x = activations(rng("ux"), (50, 512))
    sizes = routing(("ur",), "uniform", 50, 4)
    f = jax.jit(lambda x: ragged_fp8_matmul(x, qw, sw, sizes, ue8m0=True, implementation=impl))
    a, b = f(x), f(x)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    want = reference.ragged_fp8_matmul(
        group_quant(x, fmt="e4m3fn", ue8m0=True, implementation="xla"), qw, sw, sizes)
    assert_close(a, want)

  @pytest.mark.parametrize("route", ["uniform", "skewed", "tail"])
  def test_bf16(self, impl, route):
    m, e, n, k = 45, 5, 192, 320
    r = rng("bf", route)
    w = jnp.asarray(r.standard_normal((e, n, k)) / k**0.5, jnp.bfloat16)
    x = activations(r, (m, k))
    sizes = routing(("bfr", route), route, m, e)
    rows = jnp.asarray(r.integers(0, m, m), jnp.int32)
    got = ragged_matmul(x, w, sizes, rows=rows, implementation=impl)
    assert_close(got, reference.ragged_matmul(x, w, sizes, rows))


def pairs(key, t, topk, e):
  """(rows, group_sizes) of t tokens routed to topk distinct experts each, sorted by expert."""
  idx = np.stack([rng(key, i).permutation(e)[:topk] for i in range(t)])
  order = np.argsort(idx.reshape(-1), kind="stable")
  sizes = np.bincount(idx.reshape(-1), minlength=e)
  return jnp.asarray(order // topk, jnp.int32), jnp.asarray(sizes, jnp.int32)


def assert_hidden_close(got, want, codes=0.02):
  """The hidden's codes and scales: the products' f32 sums in another order move a bf16
  rounding of g or u (2**-9) now and then, and with it a code by a step, rarely a group's
  amax; a wrong block, expert or row is O(1) off in the RMS."""
  assert got.q.shape == want.q.shape and got.q.dtype == want.q.dtype
  assert got.scale.shape == want.scale.shape and got.layout == want.layout == "row"
  g, w = np.asarray(got.dequantize(), np.float64), np.asarray(want.dequantize(), np.float64)
  assert np.all(np.isfinite(g))
  assert rel_rms(g, w) <= 2e-2, rel_rms(g, w)
  assert np.mean(np.asarray(got.q, np.float32) != np.asarray(want.q, np.float32)) <= codes


@pytest.mark.parametrize("impl", IMPLS)
class TestSwiglu:

  # T = 1; partial N and K blocks with decode tiles; 160 rows in 2 experts: prefill's 128-row
  # tiles (two warp groups). Not every product of routing and shape: the Triton interpreter
  # runs each case.
  @pytest.mark.parametrize("m,e,n,k,route,act", [
      (1, 5, 256, 384, "uniform", "silu_mul"), (1, 5, 256, 384, "one_expert", "silu_round_mul"),
      (37, 6, PARTIAL_N, PARTIAL_K, "uniform", "silu_mul"),
      (37, 6, PARTIAL_N, PARTIAL_K, "skewed", "silu_round_mul"),
      (37, 6, PARTIAL_N, PARTIAL_K, "tail", "silu_mul"),
      (160, 2, 128, 256, "uniform", "silu_mul"), (160, 2, 128, 256, "tail", "silu_round_mul")])
  def test_routings_and_shapes(self, impl, m, e, n, k, route, act):
    (wg, sg), (wu, su) = (experts((p, m, e, n, k), e, n, k) for p in "gu")
    x = activations(rng("sx", m, k), (m, k))
    sizes = routing(("sr", route, m), route, m, e)
    got = ragged_swiglu(x, wg, sg, wu, su, sizes, act=act, implementation=impl)
    qa = group_quant(x, fmt="e4m3fn", implementation="xla")
    want = reference.ragged_swiglu(qa, wg, sg, wu, su, sizes, None, act, jnp.bfloat16,
                                   FORMATS["e4m3fn"], False)
    assert_hidden_close(got, want)
    if route == "tail":  # rows past the groups: zero products, zero codes
      assert not np.any(np.asarray(got.q, np.float32)[int(sizes.sum()):])

  @pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3fnuz"])
  @pytest.mark.parametrize("layout", ["row", "col"])
  def test_gathered_rows_formats_layouts_ue8m0(self, impl, fmt, layout):
    skip_fnuz(impl, fmt)
    t, topk, e, n, k = 13, 3, 7, 384, 640
    (wg, sg), (wu, su) = (experts(("sg", p, fmt), e, n, k, fmt) for p in "gu")
    x = activations(rng("sgx", fmt), (t, k))
    rows, sizes = pairs("sgi", t, topk, e)
    for ue8m0 in (False, True):
      qa = group_quant(x, fmt=FORMATS[fmt], layout=layout, ue8m0=ue8m0, implementation="xla")
      got = ragged_swiglu(qa, wg, sg, wu, su, sizes, rows=rows, act="silu_round_mul",
                          ue8m0=ue8m0, implementation=impl)
      want = reference.ragged_swiglu(qa, wg, sg, wu, su, sizes, rows, "silu_round_mul",
                                     jnp.bfloat16, FORMATS[fmt], ue8m0)
      assert_hidden_close(got, want)
      if ue8m0:
        s = np.asarray(got.scale)
        np.testing.assert_array_equal(s, 2.0 ** np.round(np.log2(s)))

  def test_fused_equals_unfused(self, impl):
    """The fused op against its steps as the unfused layer runs them: both products through
    `ragged_fp8_matmul` at the same tiling, `swiglu`, then `group_quant`. Same products and
    roundings; what may differ is the sigmoid's last f32 bit (the kernel's exp against
    XLA's), which moves a bf16 rounding of the hidden now and then."""
    t, topk, e, n, k = 29, 4, 9, 256, 512
    (wg, sg), (wu, su) = (experts(("fu", p), e, n, k) for p in "gu")
    x = activations(rng("fux"), (t, k))
    rows, sizes = pairs("fui", t, topk, e)
    cfg = Config(16, 128, 1, num_warps=4, num_stages=3) if impl == "triton" else None
    kw = dict(rows=rows, implementation=impl)
    for act in ("silu_mul", "silu_round_mul"):
      got = ragged_swiglu(x, wg, sg, wu, su, sizes, act=act, config=cfg, **kw)
      g, u = (ragged_fp8_matmul(x, w, s, sizes, config=cfg, **kw) for w, s in ((wg, sg),
                                                                              (wu, su)))
      h = reference.swiglu(g, u, act, jnp.bfloat16)
      want = group_quant(h, fmt="e4m3fn", implementation="xla")
      np.testing.assert_array_equal(np.asarray(got.scale), np.asarray(want.scale))
      same = np.mean(np.asarray(got.q, np.float32) == np.asarray(want.q, np.float32))
      assert same >= 0.999, same

  def test_determinism_and_f32_hidden(self, impl):
    t, topk, e, n, k = 20, 2, 4, 128, 256
    (wg, sg), (wu, su) = (experts(("df", p), e, n, k) for p in "gu")
    x = activations(rng("dfx"), (t, k))
    rows, sizes = pairs("dfi", t, topk, e)
    f = jax.jit(lambda x: ragged_swiglu(x, wg, sg, wu, su, sizes, rows=rows, dtype=jnp.float32,
                                        implementation=impl))
    a, b = f(x), f(x)
    np.testing.assert_array_equal(np.asarray(a.q, np.float32), np.asarray(b.q, np.float32))
    np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(b.scale))
    want = reference.ragged_swiglu(group_quant(x, fmt="e4m3fn", implementation="xla"), wg, sg,
                                   wu, su, sizes, rows, "silu_mul", jnp.float32,
                                   FORMATS["e4m3fn"], False)
    assert_hidden_close(a, want)


  @pytest.mark.parametrize("act", ["silu_mul", "silu_round_mul"])
  def test_high_precision(self, impl, act):
    """Unquantised weights (scales None): the hidden itself, against `ragged_matmul`'s
    products and `swiglu`, both computed in f32 from the same operands."""
    t, topk, e, n, k = 23, 3, 5, 192, 320
    r = rng("hp", act)
    wg, wu = (jnp.asarray(r.standard_normal((e, n, k)) / k**0.5, jnp.bfloat16) for _ in "gu")
    x = activations(r, (t, k))
    rows, sizes = pairs("hpi", t, topk, e)
    sizes = sizes.at[1].add(-2)  # two rows past the groups: zero products, a zero hidden
    got = ragged_swiglu(x, wg, None, wu, None, sizes, rows=rows, act=act, implementation=impl)
    want = reference.ragged_swiglu(x, wg, None, wu, None, sizes, rows, act, jnp.bfloat16, None,
                                   False)
    assert got.dtype == jnp.bfloat16
    # bf16 roundings of g and u moved by a different f32 summation order: a bf16 ulp now
    # and then, which the activation keeps.
    assert rel_rms(np.asarray(got, np.float32), np.asarray(want, np.float32)) <= 2.0**-8
    assert not np.any(np.asarray(got, np.float32)[int(sizes.sum()):])


def test_swiglu_errors():
  (wg, sg), (wu, su) = (experts(("se", p), 3, 256, 256) for p in "gu")
  x = activations(rng("se_x"), (4, 256))
  sizes = jnp.asarray([1, 2, 1], jnp.int32)
  with pytest.raises(InputError, match="act must be"):
    ragged_swiglu(x, wg, sg, wu, su, sizes, act="gelu")
  with pytest.raises(InputError, match="gate and up must match"):
    ragged_swiglu(x, wg, sg, wu[:, :128], su[:, :1], sizes)
  with pytest.raises(InputError, match="block_n=128"):
    ragged_swiglu(x, wg, sg, wu, su, sizes, config=Config(16, 64, 1))
  with pytest.raises(InputError, match="k_splits=1"):
    ragged_swiglu(x, wg, sg, wu, su, sizes, config=Config(16, 128, 2))
  hp = jnp.zeros((3, 256, 256), jnp.bfloat16)
  with pytest.raises(InputError, match="k_splits=1"):
    ragged_swiglu(x, hp, None, hp, None, sizes, config=Config(16, 64, 2))
  with pytest.raises(DTypeError, match="dtype"):
    ragged_swiglu(x, wg, sg, wu, su, sizes, dtype=jnp.int32)
  with pytest.raises(InputError, match="group_sizes has 2 groups"):
    ragged_swiglu(x, wg, sg, wu, su, sizes[:2])
  with pytest.raises(InputError, match="both be arrays"):
    ragged_swiglu(x, wg, sg, wu, None, sizes)
  qa = group_quant(x, fmt="e4m3fn", implementation="xla")
  with pytest.raises(InputError, match="unquantised"):
    ragged_swiglu(qa, hp, None, hp, None, sizes)
  with pytest.raises(InputError, match="K = 128"):
    ragged_swiglu(x[:, :128], hp, None, hp, None, sizes)


@pytest.mark.parametrize("align", [1, 8])
def test_tile_map_covers_every_row_once(align):
  for seed in range(20):
    r = rng("tiles", align, seed)
    e, m = int(r.integers(1, 9)), int(r.integers(1, 300))
    bm = int(2 ** r.integers(0 if align == 1 else 3, 7))
    sizes = np.bincount(r.integers(0, e, int(r.integers(0, m + 1))), minlength=e)
    expert, start, first, end, count = map(
        np.asarray, tiles.tile_map(jnp.asarray(sizes), m, bm, align))
    assert len(expert) == tiles.max_tiles(m, e, bm, align)
    assert np.all(start % align == 0)
    owner = np.full(m, -1)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    for x, s, f, en in zip(expert, start, first, end):
      en = min(en, s + bm)  # a tile owns its rows up to its group's end
      assert s <= f and (align > 1 or f == s)
      assert np.all(owner[f:en] == -1)
      owner[f:en] = x
      if f < en and x < e:  # a tile lies inside its expert's run
        assert bounds[x] <= f and en <= bounds[x + 1]
    assert np.all(owner[:bounds[-1]] == np.repeat(np.arange(e), sizes))
    assert np.all(owner[bounds[-1]:] == e)  # the zero pseudo-group
    base = bounds[:-1] - bounds[:-1] % align
    assert int(count) == sum(-(-(b + s - o) // bm) for s, b, o in zip(sizes, bounds[:-1], base)
                             if s)


@pytest.mark.parametrize("align", [1, 8])
def test_row_slots_point_into_the_owning_tile(align):
  for seed in range(20):
    r = rng("slots", align, seed)
    e, m = int(r.integers(1, 9)), int(r.integers(1, 300))
    bm = int(2 ** r.integers(3, 7))
    sizes = jnp.asarray(np.bincount(r.integers(0, e, int(r.integers(0, m + 1))), minlength=e))
    expert, start, first, end, _ = map(np.asarray, tiles.tile_map(sizes, m, bm, align))
    slots = np.asarray(tiles.row_slots(sizes, m, bm, align))
    for t, (s, f, en) in enumerate(zip(start, first, end)):
      own = np.arange(f, min(en, s + bm))
      np.testing.assert_array_equal(slots[own], t * bm + own - s)


# The interpreter runs the kernel's schedule as the GPU does; four SMs make every persistent
# CTA walk a ragged count of tiles. Shapes the kernel builds (K % 128, N % block_n): T = 1;
# blocks shared by several experts with empty ones between; all rows on one expert; rows past
# the groups (zeros: expert E's weight rows lie past the array); 192-wide tiles in three chunks
# (the heuristic's, for the skewed case too).
@pytest.mark.parametrize("route,m,e,n,k,config", [
    ("uniform", 1, 5, 128, 256, None),
    ("skewed", 200, 3, 192, 384, None),
    ("one_expert", 130, 4, 256, 256, MosaicConfig(128, stages=2)),
    ("tail", 300, 6, 320, 256, MosaicConfig(64, stages=2, persistent=True)),
    ("uniform", 300, 5, 384, 384, MosaicConfig(192, stages=2, persistent=True, chunks=3)),
], ids=str)
@pytest.mark.parametrize("impl", [MOSAIC_GPU])
def test_mosaic_gpu(monkeypatch, impl, route, m, e, n, k, config):
  monkeypatch.setattr("jfusedq._target.sm_count", lambda device_kind=None: 4)
  qw, sw = experts(("mw", m, e, n, k), e, n, k)
  x = activations(rng("mx", m, k), (m, k))
  sizes = routing(("mr", route, m), route, m, e)
  qa = group_quant(x, fmt="e4m3fn", implementation="xla")
  got = ragged_fp8_matmul(qa, qw, sw, sizes, config=config, implementation=impl)
  assert_close(got, reference.ragged_fp8_matmul(qa, qw, sw, sizes))
  if route == "tail":
    assert not np.any(np.asarray(got)[int(sizes.sum()):])


# A ragged tile stores its rows from any row of its staging, and TMA reads shared memory only
# from 128-byte boundaries: the tests staging 96-column chunks of bf16 (192 bytes a row) faulted
# with CUDA_ERROR_MISALIGNED_ADDRESS on an H100. The heuristic never picks such chunks, and a
# config that would is refused before it reaches the GPU.
@pytest.mark.parametrize("n", [64, 128, 192, 256, 384, 576, 2048, 7168])
def test_mosaic_ragged_heuristic_stages_aligned_rows(n):
  cfg = ragged_mosaic.heuristics(4096, n, 512, 8)
  assert (cfg.block_n // cfg.chunks) * 2 % 128 == 0, cfg


@pytest.mark.lowering
@pytest.mark.parametrize("bad", [MosaicConfig(192, chunks=2), MosaicConfig(64, chunks=2)],
                         ids=str)
def test_mosaic_ragged_refuses_unaligned_staging(bad):
  S = jax.ShapeDtypeStruct
  fp8 = jnp.float8_e4m3fn
  args = (S((100, 256), fp8), S((100, 2), jnp.float32), S((2, 384, 256), fp8),
          S((2, 3, 2), jnp.float32), S((2,), jnp.int32))
  fn = lambda q, sq, w, sw, g: ragged_fp8_matmul(QuantizedActivation(q, sq), w, sw, g,
                                                 config=bad, implementation="mosaic_gpu")
  with pytest.raises(InputError, match="128 bytes"):
    lower("h200", fn, *args)


@pytest.mark.parametrize("impl", [MOSAIC_GPU])
def test_mosaic_gpu_equals_dense_per_expert(impl):
  """Each expert's rows to the bit as the dense kernel's product on them alone: the same
  tiles, K order and rescales, whichever block a row sits in; gathered rows, col scales."""
  t, topk, e, n, k = 70, 3, 4, 256, 384
  qw, sw = experts(("md",), e, n, k)
  qa = group_quant(activations(rng("mdx"), (t, k)), fmt="e4m3fn", layout="col",
                   implementation="xla")
  rows, sizes = pairs("mdi", t, topk, e)
  cfg = MosaicConfig(128, stages=2, persistent=True)
  f = jax.jit(lambda qa: ragged_fp8_matmul(qa, qw, sw, sizes, rows=rows, config=cfg,
                                           implementation=impl))
  got = np.asarray(f(qa))
  np.testing.assert_array_equal(np.asarray(f(qa)), got)
  bounds = np.concatenate([[0], np.cumsum(sizes)])
  for x in range(e):
    r = np.asarray(rows)[bounds[x]:bounds[x + 1]]
    one = type(qa)(qa.q[r], qa.scale[:, r], layout="col")
    want = fp8_matmul(one, qw[x], sw[x], config=dataclasses.replace(cfg, persistent=False),
                      implementation=impl)
    np.testing.assert_array_equal(got[bounds[x]:bounds[x + 1]], np.asarray(want))


@pytest.mark.parametrize("act,layout,ue8m0", [("silu_mul", "col", False),
                                               ("silu_round_mul", "row", True)])
@pytest.mark.parametrize("impl", [MOSAIC_GPU])
def test_mosaic_gpu_swiglu(impl, act, layout, ue8m0):
  """The gate and up pair (both products and the activation in the kernel) against the
  reference, gathered rows, two of them past the groups; and against its unfused steps on the
  same kernel (same products and roundings: only the sigmoid's last f32 bit may differ)."""
  t, topk, e, n, k = 45, 3, 5, 256, 384
  (wg, sg), (wu, su) = (experts(("ms", p), e, n, k) for p in "gu")
  rows, sizes = pairs("msi", t, topk, e)
  sizes = sizes.at[2].add(-2)
  qa = group_quant(activations(rng("msx"), (t, k)), fmt="e4m3fn", layout=layout, ue8m0=ue8m0,
                   implementation="xla")
  cfg = MosaicConfig(128, stages=2, persistent=True)
  got = ragged_swiglu(qa, wg, sg, wu, su, sizes, rows=rows, act=act, ue8m0=ue8m0, config=cfg,
                      implementation=impl)
  want = reference.ragged_swiglu(qa, wg, sg, wu, su, sizes, rows, act, jnp.bfloat16,
                                 FORMATS["e4m3fn"], ue8m0)
  assert_hidden_close(got, want)
  assert not np.any(np.asarray(got.q, np.float32)[int(sizes.sum()):])
  g, u = (ragged_fp8_matmul(qa, w, sw, sizes, rows=rows, config=cfg, implementation=impl)
          for w, sw in ((wg, sg), (wu, su)))
  steps = group_quant(reference.swiglu(g, u, act, jnp.bfloat16), fmt="e4m3fn", ue8m0=ue8m0,
                      implementation="xla")
  np.testing.assert_array_equal(np.asarray(got.scale), np.asarray(steps.scale))
  same = np.mean(np.asarray(got.q, np.float32) == np.asarray(steps.q, np.float32))
  assert same >= 0.999, same


@pytest.mark.lowering
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("config", [None, MosaicConfig(128, stages=2),
                                    MosaicConfig(256, stages=3, persistent=True, chunks=2),
                                    MosaicConfig(192, chunks=2)], ids=str)
def test_mosaic_gpu_lowers(target, config):
  """Its tiles' loads, the scalar reads of the tile table and the power-of-two stores lower to
  Mosaic GPU for Hopper (DeepSeek-V3's gate at 256 experts, 64 tokens routed top 8); other
  targets decline it."""
  S = jax.ShapeDtypeStruct
  fp8 = jnp.float8_e4m3fn
  fn = lambda q, s, w, sw, g, r: ragged_fp8_matmul(
      QuantizedActivation(q, s, layout="col"), w, sw, g, rows=r, config=config,
      implementation="mosaic_gpu")
  args = (S((64, 7168), fp8), S((56, 64), jnp.float32), S((256, 2048, 7168), fp8),
          S((256, 16, 56), jnp.float32), S((256,), jnp.int32), S((512,), jnp.int32))
  if target != "h200":
    with pytest.raises(Unsupported):
      lower(target, fn, *args)
  elif config is not None and 2048 % config.block_n:
    with pytest.raises(InputError, match="block_n dividing N"):  # a tile would span 2 experts
      lower(target, fn, *args)
  else:
    assert "mosaic_gpu" in lower(target, fn, *args)
  if config is None:  # the gate and up pair, its activation in the epilogue
    pair = lambda q, s, w, sw, g, r: ragged_swiglu(
        QuantizedActivation(q, s, layout="col"), w, sw, w, sw, g, rows=r, act="silu_round_mul",
        implementation="mosaic_gpu")
    if target != "h200":
      with pytest.raises(Unsupported):
        lower(target, pair, *args)
    else:
      assert "mosaic_gpu" in lower(target, pair, *args)


@pytest.mark.parametrize("m,experts,first", [
    (16384 * 8, 256, "mosaic_gpu"),  # DeepSeek-V3 at 16384 tokens: 512 rows an expert
    (4096 * 10, 512, "mosaic_gpu"),  # Qwen3.5 at 4096 tokens: 80 rows an expert
    (1024 * 8, 256, "triton"),  # 32 rows an expert: Triton's small tiles
    (80 * 8, 8, "mosaic_gpu"), (79 * 8, 8, "triton")])
def test_gpu_order(m, experts, first):
  """Mosaic GPU first from MOSAIC_MIN_ROWS rows an expert on average; Triton after it, and
  Mosaic GPU after Triton below (where `triton` is not installed)."""
  order = api.gpu_order(m, experts)
  assert order[0] == first and sorted(order) == sorted(api.IMPLEMENTATIONS)
  assert order[-1] == "xla"


def test_mosaic_heuristics_tile_one_expert():
  """The Mosaic GPU pick's width divides N wherever the kernel builds (N % 64 == 0): a tile
  spanning two experts is refused (`test_mosaic_gpu_lowers`), and the dispatcher would not
  move on from that refusal."""
  for n in range(64, 8193, 64):
    for k in (1024, 7168):
      for m in (128, 4096, 131072):
        assert n % ragged_mosaic.heuristics(m, n, k, 64).block_n == 0, (m, n, k)


def test_xla_cost_grows_with_rows_not_experts():
  """The XLA path's compiled FLOPs at 128 experts against 8, the same rows: within 1.5x
  (ragged_dot on XLA:CPU computes every group densely: 16x)."""
  m, n, k = 256, 256, 256

  def flops(e):
    qw, sw = experts(("cost", e), e, n, k)
    qa = group_quant(activations(rng("cx"), (m, k)), fmt="e4m3fn", implementation="xla")
    sizes = jnp.full((e,), m // e, jnp.int32)
    f = jax.jit(lambda qa, s, qw, sw: ragged_fp8_matmul(qa, qw, sw, s, implementation="xla"))
    # XLA:CPU computes FP8 in f16, converting the weights (one op an element) as the program
    # starts: a pass the size of the weights, not of the products, left out here.
    return f.lower(qa, sizes, qw, sw).compile().cost_analysis()["flops"] - e * n * k

  assert flops(128) <= 1.5 * flops(8)
  assert xla.block_m(256, 128) == 2 and xla.block_m(256, 8) == 32 and xla.block_m(1, 256) == 1


def test_errors():
  qw, sw = experts(("err",), 3, 130, 256)
  x = activations(rng("err_x"), (4, 256))
  sizes = jnp.asarray([1, 2, 1], jnp.int32)
  with pytest.raises(InputError, match="group_sizes has 2 groups"):
    ragged_fp8_matmul(x, qw, sw, sizes[:2])
  with pytest.raises(InputError, match="integer"):
    ragged_fp8_matmul(x, qw, sw, sizes.astype(jnp.float32))
  with pytest.raises(InputError, match=r"sum\(group_sizes\)"):
    ragged_fp8_matmul(x, qw, sw, sizes + 1)
  with pytest.raises(InputError, match="group_sizes must lie"):
    ragged_fp8_matmul(x, qw, sw, jnp.asarray([-1, 2, 1], jnp.int32))
  with pytest.raises(InputError, match="rows must lie"):
    ragged_fp8_matmul(x, qw, sw, sizes, rows=jnp.asarray([0, 1, 4, 2], jnp.int32))
  with pytest.raises(InputError, match=r"\[T, K\]"):
    ragged_fp8_matmul(x[None], qw, sw, sizes)
  with pytest.raises(InputError, match="K = 128"):
    ragged_fp8_matmul(x[:, :128], qw, sw, sizes)
  with pytest.raises(InputError, match="does not match"):
    ragged_matmul(x, jnp.zeros((3, 8, 128), jnp.bfloat16), sizes)
