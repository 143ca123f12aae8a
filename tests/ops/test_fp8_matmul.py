"""fp8_matmul: every implementation against the f32 reference, the reference against a float64
matmul of the dequantised operands; input kinds, odd shapes, every heuristic config, the Mosaic
GPU kernel, errors, lowering."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jfusedq as jf
from jax.sharding import AbstractDevice, AbstractMesh, PartitionSpec as P

from helpers import (FORMATS, MOSAIC_GPU, TARGETS, TRITON_CALL, activations, experts,
                     implementations, lower, rng)
from helpers import assert_gemm_close as assert_close
from jfusedq import (QuantizedActivation, _target, default_format, fp8_matmul, group_quant,
                     grouped_fp8_matmul, rmsnorm_quant)
from jfusedq.errors import InputError
from jfusedq.nn import quantize_weight
from jfusedq.ops._dispatch import Unsupported
from jfusedq.ops.fp8_matmul import Config
from jfusedq.ops.fp8_matmul import api as mm_api
from jfusedq.ops.fp8_matmul import mosaic_gpu
from jfusedq.ops.fp8_matmul.mosaic_gpu import Config as MosaicConfig
from jfusedq.ops.fp8_matmul import pallas as mm_pallas
from jfusedq.ops.fp8_matmul import triton as mm_triton
from jfusedq.ops.fp8_matmul.reference import dequantize_weight
from jfusedq.testing import (DECODE_TOKENS, EDGE_PROJECTIONS, PREFILL_TOKENS, PROJECTIONS,
                             rel_rms)

KERNELS = implementations("fp8_matmul", kernels=True)
PARTIAL_N, PARTIAL_K = EDGE_PROJECTIONS["partial_blocks"]


def problem(key, m_shape, n, k, fmt="e4m3fn"):
  r = rng(*key)
  x = activations(r, (*m_shape, k))
  w = jnp.asarray(r.standard_normal((n, k)) * np.exp(r.uniform(-1, 1, (n, 1))), jnp.float32)
  qw, sw = quantize_weight(w, FORMATS[fmt])
  # Random scales on top, so a wrong scale index cannot hide behind uniform scales.
  sw = sw * jnp.asarray(r.uniform(0.5, 2.0, sw.shape), jnp.float32)
  return x, qw, sw


@pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3fnuz"])
def test_reference_matches_float64(fmt):
  x, qw, sw = problem(("f64", fmt), (7,), PROJECTIONS["deepseek_v3.q_a_kv_a"][0], 640, fmt)
  qa = group_quant(x, fmt=FORMATS[fmt], implementation="xla")
  got = fp8_matmul(qa, qw, sw, implementation="xla")
  a64 = np.asarray(qa.dequantize(), np.float64)
  w64 = np.asarray(dequantize_weight(qw, sw), np.float64)
  want = a64 @ w64.T
  # The final bf16 rounding (2**-9 relative) and the f32 accumulation (at most
  # K * 2**-24 * sum|a w| per element, which matters only where the sum cancels).
  assert rel_rms(got, want) <= 2.0**-9
  bound = 2.0**-8 * np.abs(want) + 640 * 2.0**-24 * (np.abs(a64) @ np.abs(w64).T)
  assert np.all(np.abs(np.asarray(got, np.float64) - want) <= bound)


GROUPED = {  # (activation groups, leading dims of a group, expert of each product or None)
    "dense": (1, (3,), None),               # every expert on the same rows (MoE prefill)
    "batched": (5, (2, 3), None),           # expert e on its own rows (MoE down projection)
    "gathered": (4, (1,), (3, 0, 0, 4, 1, 1, 2, 3)),  # 2 experts per token, repeats (decode)
    "one_each": (8, (1,), (4, 0, 2, 2, 1, 3, 0, 4)),
}


@pytest.mark.parametrize("impl", implementations("fp8_matmul"))
class TestEveryImplementation:
  """The contract each implementation meets, checked against the reference."""

  @pytest.mark.parametrize("m_shape,n,k", [
      ((1,), *PROJECTIONS["deepseek_v3.q_a_kv_a"]), ((5,), 2112, 1536), ((16,), 256, 512),
      ((33,), PARTIAL_N, PARTIAL_K), ((2, 3), 384, 640)])
  @pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3fnuz"])
  def test_shapes_and_formats(self, impl, m_shape, n, k, fmt):
    if impl == "triton" and fmt == "e4m3fnuz" and default_format().name == "e4m3fn":
      pytest.skip("triton multiplies e4m3fnuz only where the GPU does (AMD MI300)")
    x, qw, sw = problem(("shape", m_shape, n, k, fmt), m_shape, n, k, fmt)
    if impl == "pallas" and fmt == "e4m3fnuz" and _target.current().platform == "cuda":
      # NVIDIA has no fnuz dot: Pallas must decline clearly, and the default order falls back.
      with pytest.raises(Unsupported, match="e4m3fnuz"):
        fp8_matmul(x, qw, sw, implementation=impl)
      assert_close(fp8_matmul(x, qw, sw), fp8_matmul(x, qw, sw, implementation="xla"))
      return
    got = fp8_matmul(x, qw, sw, implementation=impl)
    assert got.shape == (*m_shape, n) and got.dtype == jnp.bfloat16
    assert_close(got, fp8_matmul(x, qw, sw, implementation="xla"))

  def test_input_kinds_identical(self, impl):
    """bf16 array, its (fp8, scale) and its (bf16, fp8, scale): identical outputs."""
    x, qw, sw = problem(("kinds",), (9,), 384, 1024)
    qa = group_quant(x, fmt="e4m3fn", implementation=impl)  # as the weight, on any device
    outs = [fp8_matmul(a, qw, sw, implementation=impl)
            for a in (x, qa, QuantizedActivation(qa.q, qa.scale, hp=x))]
    for out in outs[1:]:
      np.testing.assert_array_equal(np.asarray(out), np.asarray(outs[0]))
    # The fused norm's tuple, with and without its bf16 copy: the fp8 part is what is used.
    w = jnp.asarray(rng("kinds-w").standard_normal(1024), jnp.bfloat16)
    fused = rmsnorm_quant(x, w, keep_hp=True, implementation=impl, fmt=FORMATS["e4m3fn"]).quant
    np.testing.assert_array_equal(
        np.asarray(fp8_matmul(fused, qw, sw, implementation=impl)),
        np.asarray(fp8_matmul(QuantizedActivation(fused.q, fused.scale), qw, sw,
                              implementation=impl)))

  def test_column_major_scales(self, impl):
    x, qw, sw = problem(("col",), (2, 5), 256, 640)
    row = group_quant(x, fmt="e4m3fn", implementation="xla")
    col = group_quant(x, fmt="e4m3fn", layout="col", implementation="xla")
    np.testing.assert_array_equal(np.asarray(fp8_matmul(row, qw, sw, implementation=impl)),
                                  np.asarray(fp8_matmul(col, qw, sw, implementation=impl)))

  @pytest.mark.parametrize("case", sorted(GROUPED))
  def test_grouped_equals_per_product(self, impl, case):
    # 5 experts with partial blocks on both axes.
    g, lead, ids = GROUPED[case]
    qw, sw = experts(("grouped", case), 5, PARTIAL_N, PARTIAL_K)
    x = activations(rng("grouped_x", case), (g, *lead, PARTIAL_K))
    idx = None if ids is None else jnp.asarray(ids, jnp.int32)
    got = grouped_fp8_matmul(x, qw, sw, idx, implementation=impl)
    b = 5 if ids is None else len(ids)
    assert got.shape == (b, *lead, PARTIAL_N)
    for i in range(b):
      e = i if ids is None else ids[i]
      assert_close(got[i], fp8_matmul(x[i // (b // g)], qw[e], sw[e], implementation="xla"))

  def test_grouped_quantized_input_and_determinism(self, impl):
    qw, sw = experts(("grouped_q",), 3, 130, 256)
    x = activations(rng("grouped_q_x"), (3, 1, 256))
    ids = jnp.asarray([2, 2, 0, 1, 1, 0], jnp.int32)
    col = group_quant(x, fmt="e4m3fn", layout="col", implementation="xla")
    f = jax.jit(lambda a: grouped_fp8_matmul(a, qw, sw, ids, implementation=impl))
    a, b = f(col), f(col)
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    np.testing.assert_array_equal(
        np.asarray(a), np.asarray(grouped_fp8_matmul(x, qw, sw, ids, implementation=impl)))

  def test_grouped_ids_out_of_range(self, impl):
    """Traced ids outside [0, E) give zero products in every implementation (the kernels read
    a clamped id); concrete ones raise, traced ones under debug_checks."""
    qw, sw = experts(("grouped_oob",), 3, 130, 256)
    x = activations(rng("grouped_oob_x"), (4, 1, 256))
    ids = jnp.asarray([2, 3, -1, 1], jnp.int32)
    got = jax.jit(lambda i: grouped_fp8_matmul(x, qw, sw, i, implementation=impl))(ids)
    assert not np.any(np.asarray(got)[1:3])
    for b in (0, 3):
      assert_close(got[b], fp8_matmul(x[b], qw[ids[b]], sw[ids[b]], implementation="xla"))
    with pytest.raises(InputError, match="ids must lie in"):
      grouped_fp8_matmul(x, qw, sw, ids, implementation=impl)
    with pytest.raises(Exception, match="ids must lie in"), jf.debug_checks():
      jax.block_until_ready(jax.jit(lambda i: grouped_fp8_matmul(
          x, qw, sw, i, implementation=impl))(ids))

  def test_jit_deterministic(self, impl):
    x, qw, sw = problem(("jit",), (3, 4), 256, 512)
    config = None if impl == "xla" else Config(16, 64, k_splits=2)
    f = jax.jit(lambda x: fp8_matmul(x, qw, sw, implementation=impl, config=config))
    a, b = f(x), f(x)
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert_close(a, fp8_matmul(x, qw, sw, implementation="xla"))


def heuristic_configs():
  kinds = ["NVIDIA H200", "AMD Instinct MI300X", "gfx950", "cpu"]
  return sorted({h(m, n, k, kind) for kind in kinds
                 for h in (mm_pallas.heuristics, mm_triton.heuristics)
                 for m in DECODE_TOKENS + PREFILL_TOKENS
                 for n, k in PROJECTIONS.values()}, key=str)


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("config", heuristic_configs(), ids=str)
def test_every_heuristic_config(impl, config):
  # Every split count has K blocks to divide.
  x, qw, sw = problem(("config", str(config)), (20,), *EDGE_PROJECTIONS["partial_k_blocks"])
  got = fp8_matmul(x, qw, sw, implementation=impl, config=config)
  assert_close(got, fp8_matmul(x, qw, sw, implementation="xla"))


def test_triton_heuristics_by_wave_fill():
  # The H200 sweep: 128 x 128 tiles where they fill the last wave, 64 x 128 where it is ragged.
  big = mm_triton.heuristics(4096, 7168, 16384, "NVIDIA H200")
  assert (big.block_m, big.block_n, big.num_warps) == (128, 128, 8)
  assert mm_triton.heuristics(4096, 2112, 7168, "NVIDIA H200") == mm_pallas.heuristics(
      4096, 2112, 7168, "NVIDIA H200")
  assert mm_triton.heuristics(1, 7168, 16384, "NVIDIA H200") == mm_pallas.heuristics(
      1, 7168, 16384, "NVIDIA H200")


def test_triton_five_stages_for_long_k_at_m64():
  # The H200 sweeps at M = 64: 5 stages where each program walks >= 32 K blocks and two
  # programs per SM hold the grid (5 stages of 16 KB leave room for two, not three).
  stages = lambda m, n, k, kind="NVIDIA H200": mm_triton.heuristics(m, n, k, kind).num_stages
  assert stages(64, 12288, 4096) == stages(64, 7168, 16384) == stages(40, 12288, 4096) == 5
  assert stages(64, 24576, 1536) == 4  # 12 K blocks a program
  assert stages(64, 4096, 8192) == 4  # 4 splits: 16 blocks a program
  assert stages(64, 24576, 4096) == 4  # 384 programs: more than two a SM
  assert stages(16, 12288, 4096) == stages(256, 12288, 4096) == 4  # not measured there
  assert stages(64, 12288, 4096, "AMD Instinct MI300X") == 4  # measured on Hopper only


@pytest.mark.parametrize("impl", KERNELS)
def test_split_k_deterministic_on_gpu(impl):
  # Decode size (M = 1, 8 K splits over 64 tiles), where a GPU runs the splits in a different
  # order from launch to launch: twelve launches must agree to the bit (the partials are summed
  # by XLA in split order, never by atomics). The interpreter runs programs in order, so this
  # needs the GPU.
  if jax.devices()[0].platform != "gpu":
    pytest.skip("the splits' order varies only on a GPU")
  x, qw, sw = problem(("split_order",), (1,), 4096, 8192)
  qa = group_quant(x, implementation="xla")
  cfg = mm_pallas.heuristics(1, 4096, 8192, jax.devices()[0].device_kind)
  assert cfg.k_splits == 8
  f = jax.jit(lambda qa: fp8_matmul(qa, qw, sw, implementation=impl))
  outs = [np.asarray(f(qa)) for _ in range(12)]
  assert all(o.tobytes() == outs[0].tobytes() for o in outs[1:])
  assert_close(jnp.asarray(outs[0]), fp8_matmul(qa, qw, sw, implementation="xla"))


@pytest.mark.lowering
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("gathered", [False, True], ids=["dense", "gathered"])
def test_grouped_pallas_lowers_to_one_kernel(target, gathered):
  # Pallas runs every product in one launch and reads the experts in place (no gather).
  S = jax.ShapeDtypeStruct
  fp8 = jnp.float8_e4m3fn
  g, ids = (3, [S((6,), jnp.int32)]) if gathered else (5, [])

  def fn(q, s, w, sw, *ids):
    return grouped_fp8_matmul(QuantizedActivation(q, s), w, sw, *ids, implementation="pallas")

  text = lower(target, fn, S((g, 4, 1536), fp8), S((g, 4, 12), jnp.float32),
               S((5, 2112, 1536), fp8), S((5, 17, 12), jnp.float32), *ids)
  assert text.count(TRITON_CALL) == 1
  assert "gather" not in text


def test_grouped_errors():
  qw, sw = experts(("grouped_err",), 3, 130, 256)
  x = activations(rng("grouped_err_x"), (2, 1, 256))
  with pytest.raises(ValueError, match="do not divide"):
    grouped_fp8_matmul(x, qw, sw, jnp.asarray([0, 1, 2], jnp.int32))
  with pytest.raises(ValueError, match="ids must be"):
    grouped_fp8_matmul(x, qw, sw, jnp.asarray([0.0, 1.0]))
  with pytest.raises(ValueError, match=r"\[E, N, K\]"):
    grouped_fp8_matmul(x, qw[0], sw[0])
  with pytest.raises(ValueError, match="weight_scale shape"):
    grouped_fp8_matmul(x, qw, sw[:2], jnp.asarray([0, 1], jnp.int32))
  with pytest.raises(ValueError, match="does not match the weight's K"):
    grouped_fp8_matmul(x[..., :128], qw, sw, jnp.asarray([0, 1], jnp.int32))


def test_errors():
  x, qw, sw = problem(("errors",), (2,), 256, 384)
  with pytest.raises(TypeError, match="weight must be"):
    fp8_matmul(x, qw.astype(jnp.bfloat16), sw)
  with pytest.raises(ValueError, match="does not match the weight's K"):
    fp8_matmul(x[:, :256], qw, sw)
  with pytest.raises(ValueError, match="weight_scale shape"):
    fp8_matmul(x, qw, sw[:, :2])
  with pytest.raises(TypeError, match="weight_scale must be float32"):
    fp8_matmul(x, qw, sw.astype(jnp.bfloat16))
  with pytest.raises(ValueError, match="group_size=64"):
    fp8_matmul(group_quant(x, group_size=64), qw, sw)
  with pytest.raises(TypeError, match="activation is"):
    fp8_matmul(group_quant(x, fmt="e4m3fnuz"), qw, sw)
  with pytest.raises(TypeError, match="a must be"):
    fp8_matmul(x.astype(jnp.int8), qw, sw)
  with pytest.raises(ValueError, match="unknown implementation"):
    fp8_matmul(x, qw, sw, implementation="cublas")
  with pytest.raises(ValueError, match="block_n"):
    Config(16, 256)


@pytest.mark.lowering
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("layout", ["row", "col"])
@pytest.mark.parametrize("config", [Config(16, 64, 4), Config(128, 128, 1, 8, 3)], ids=str)
def test_lowers(target, layout, config):
  fp8 = jnp.float8_e4m3fnuz if target == "gfx942" else jnp.float8_e4m3fn
  S = jax.ShapeDtypeStruct

  def fn(q, s, w, sw):
    return fp8_matmul(QuantizedActivation(q, s, layout=layout), w, sw, implementation="pallas",
                      config=config)

  scale = S((5, 12) if layout == "row" else (12, 5), jnp.float32)
  text = lower(target, fn, S((5, 1536), fp8), scale, S((2112, 1536), fp8), S((17, 12), jnp.float32))
  assert text.count(TRITON_CALL) == 1


# Mosaic GPU (Hopper wgmma) kernel: run by the GPU interpreter on CPU, lowered for the H200.
# Outside the shared suite: it takes K % 128 == 0 and N % 64 == 0 only (helpers.MOSAIC_GPU).
# Every tile width the heuristic picks (192, 128, 64), persistent or not, one to three wgmma
# chunks, a ragged last tile (N = 320 in tiles of 128: the weight's rows past N arrive as
# zeros, the store clips), M short of its last 128-row tile (the same, for rows), M padded to
# 8, both layouts.
@pytest.mark.parametrize("m_shape,n,k,layout,config", [
    ((1,), 128, 256, "row", None),  # decode row, padded to 8 rows of a 128-row tile
    ((100,), 192, 384, "col", None),
    ((2, 65), 320, 256, "row", MosaicConfig(128, stages=2)),
    ((64,), 192, 512, "col", MosaicConfig(64, stages=1)),
    ((130,), 64, 256, "row", None),
    ((3,), 64, 2176, "col", None),  # K past 2048: one tile a CTA
    ((100,), 320, 256, "row", MosaicConfig(192, stages=2, chunks=2)),  # wgmma in two groups
    ((2, 65), 192, 384, "col", MosaicConfig(192, stages=3, chunks=3)),
    ((130,), 256, 256, "row", MosaicConfig(128, stages=2, chunks=2)),
    # Chunks of 64 inside 192-wide tiles: the second tile's chunks start 64 columns into a
    # weight block, each chunk takes one block's scale.
    ((130,), 448, 256, "col", MosaicConfig(192, stages=2, chunks=3)),
    # K in parts, summed outside: each CTA's pipeline starts at its part's first K block.
    ((130,), 192, 512, "row", MosaicConfig(64, stages=2, splits=2)),
    ((2, 65), 320, 768, "col", MosaicConfig(192, stages=2, chunks=3, splits=3)),
    # 18 K blocks (two weight-scale boxes of 16, the second partly past the array, padded to
    # 20 for TMA's 16-byte row stride); the second part's K blocks cross from one box to the next.
    ((64,), 192, 2304, "row", MosaicConfig(64, stages=2, splits=2)),
    # 256 columns, the chunks one after another; N = 320 leaves the second tile ragged.
    ((130,), 320, 384, "row", MosaicConfig(256, stages=2, chunks=2)),
    ((2, 65), 512, 256, "col", MosaicConfig(256, stages=3, chunks=4)),
], ids=str)
@pytest.mark.parametrize("impl", [MOSAIC_GPU])
def test_mosaic_gpu(impl, m_shape, n, k, layout, config):
  x, qw, sw = problem(("mosaic", m_shape, n, k), m_shape, n, k)
  qa = group_quant(x, layout=layout, implementation="xla")
  f = jax.jit(lambda qa: fp8_matmul(qa, qw, sw, implementation=impl, config=config))
  got = f(qa)
  assert np.asarray(f(qa)).tobytes() == np.asarray(got).tobytes()
  assert_close(got, fp8_matmul(qa, qw, sw, implementation="xla"))
  # bf16 input: quantised by Pallas for it, same result as the tuple.
  np.testing.assert_array_equal(np.asarray(fp8_matmul(x, qw, sw, implementation=impl,
                                                      config=config)), np.asarray(got))


@pytest.mark.parametrize("m,n,k,layout,config", [
    (300, 320, 384, "row", MosaicConfig(128, stages=2, persistent=True)),  # 9 tiles on 4 CTAs
    (130, 192, 256, "col", MosaicConfig(64, stages=3, persistent=True)),  # 6 tiles on 4 CTAs
    (300, 384, 256, "row", MosaicConfig(192, stages=2, persistent=True, chunks=2)),
    (300, 576, 256, "col", MosaicConfig(192, stages=2, persistent=True, chunks=3)),
    (300, 768, 256, "row", MosaicConfig(256, stages=3, persistent=True, chunks=4)),
    # Bands of 2 row tiles over 3: the last band narrower.
    (300, 320, 384, "col", MosaicConfig(128, stages=2, persistent=True, band=2)),
], ids=str)
@pytest.mark.parametrize("impl", [MOSAIC_GPU])
def test_mosaic_gpu_persistent(monkeypatch, impl, m, n, k, layout, config):
  run_on_four_sms(monkeypatch, impl, ("mosaic_persistent", m, n, k), m, n, k, layout, config)


def run_on_four_sms(monkeypatch, impl, key, m, n, k, layout, config):
  """The Mosaic GPU kernel's product under `config` on four SMs, checked against XLA's.

  Four SMs: every persistent CTA walks two or three tiles (a ragged count), reusing the
  pipeline's buffers and the output staging, on the interpreter and on a real GPU alike."""
  monkeypatch.setattr("jfusedq._target.sm_count", lambda device_kind=None: 4)
  x, qw, sw = problem(key, (m,), n, k)
  qa = group_quant(x, layout=layout, implementation="xla")
  got = fp8_matmul(qa, qw, sw, implementation=impl, config=config)
  assert_close(got, fp8_matmul(qa, qw, sw, implementation="xla"))
  return got


# The compute warpgroups taking turns at the tensor cores change the order of the issues
# only: the same bits as left to drift, per tile and persistent (the turns starting again at
# each of a CTA's tiles), in one chunk, in two chunks waited for in turn, and in chunks one
# after another (256 columns, a handoff around each chunk). A lost handoff hangs the interpreter
# as it would the GPU.
@pytest.mark.parametrize("m,n,k,layout,config", [
    (130, 192, 512, "col", MosaicConfig(64, stages=2)),
    (130, 320, 768, "row", MosaicConfig(192, stages=2, chunks=3, splits=3)),
    (130, 320, 384, "col", MosaicConfig(256, stages=2, chunks=2)),
    (300, 384, 384, "row", MosaicConfig(192, stages=2, persistent=True, chunks=2)),
    (300, 320, 384, "col", MosaicConfig(128, stages=3, persistent=True)),
], ids=str)
@pytest.mark.parametrize("impl", [MOSAIC_GPU])
def test_mosaic_gpu_pingpong(monkeypatch, impl, m, n, k, layout, config):
  run = lambda cfg: run_on_four_sms(monkeypatch, impl, ("mosaic_pingpong", m, n, k), m, n, k,
                                    layout, cfg)
  np.testing.assert_array_equal(np.asarray(run(dataclasses.replace(config, pingpong=True))),
                                np.asarray(run(config)))


@pytest.mark.parametrize("mt,nt,band", [(3, 5, 2), (32, 56, 16), (128, 24, 16), (5, 3, 16),
                                          (7, 4, 1), (9, 2, 4)])
def test_mosaic_gpu_tile_order(mt, nt, band):
  # Every tile once, each band's rows M fastest.
  t = jnp.arange(mt * nt)
  mi, ni = (np.asarray(v) for v in mosaic_gpu.tile_order(t, mt, nt, band))
  assert sorted(zip(mi.tolist(), ni.tolist())) == [(i, j) for i in range(mt) for j in range(nt)]
  assert (mi[1:min(band, mt)] - mi[:min(band, mt) - 1] == 1).all()
  assert (mi // band == np.repeat(np.arange(-(-mt // band)),
                                  [min(band, mt - b * band) * nt for b in
                                   range(-(-mt // band))])).all()


def test_mosaic_gpu_heuristics():
  # The widest tile dividing N whose tiles cover half of an H200's 132 SMs, else 64 columns.
  width = lambda m, n: mosaic_gpu.heuristics(m, n, 4096).block_n
  assert width(4096, 2112) == width(1024, 2112) == 192  # 32 / 8 row tiles x 11
  assert width(256, 2112) == 64  # 2 x 11 tiles of 192: 22
  assert width(256, 4096) == 64  # 2 x 32 of 128: 64, one short of 66
  assert width(256, 12288) == width(256, 24576) == 192  # 2 x 64, 2 x 128
  assert width(256, 7168) == 128  # N % 192 != 0; 2 x 56
  assert width(256, 1024) == 64  # 2 x 16 even at 64: the narrowest
  assert width(1, 320) == 64  # N % 128 != 0 and N % 192 != 0
  pick = mosaic_gpu.heuristics
  assert pick(1024, 12288, 4096) == pick(256, 12288, 4096) == MosaicConfig(192, persistent=True,
                                                                           chunks=2)
  assert pick(256, 2112, 1536) == MosaicConfig(64, persistent=True)  # a short K: no split
  assert pick(4096, 12288, 4096) == MosaicConfig(192, persistent=True, chunks=2)
  assert pick(4096, 7168, 16384) == MosaicConfig(128, persistent=True, chunks=1)
  # 2 x 33 tiles of 128 x 64, half of 132 SMs: K in two parts.
  assert pick(256, 2112, 7168) == MosaicConfig(64, splits=2)
  assert pick(256, 7168, 16384).splits == 1  # 2 x 56 tiles of 128 x 128


@pytest.mark.parametrize("impl", [MOSAIC_GPU])
def test_mosaic_gpu_declines(impl):
  x, qw, sw = problem(("mosaic_declines",), (3,), 256, 300)
  with pytest.raises(Unsupported, match="K % 128"):
    fp8_matmul(x, qw, sw, implementation=impl)
  # The default order never includes it; a sequence falls through to the next backend.
  assert_close(fp8_matmul(x, qw, sw, implementation=(impl, "xla")),
               fp8_matmul(x, qw, sw, implementation="xla"))
  x, qw, sw = problem(("mosaic_config",), (3,), 256, 256)
  with pytest.raises(Unsupported, match="not this kernel's"):
    fp8_matmul(x, qw, sw, implementation=impl, config=Config(16, 64))
  x, qw, sw = problem(("mosaic_fnuz",), (3,), 256, 256, "e4m3fnuz")
  with pytest.raises(Unsupported, match="e4m3fn"):
    fp8_matmul(x, qw, sw, implementation=impl)
  with pytest.raises(ValueError, match="block_n"):
    MosaicConfig(320)
  with pytest.raises(ValueError, match="256 columns"):
    MosaicConfig(256)
  with pytest.raises(ValueError, match="256 columns"):
    MosaicConfig(128, chunks=4)
  with pytest.raises(ValueError, match="stages"):
    MosaicConfig(128, stages=0)
  with pytest.raises(ValueError, match="band"):
    MosaicConfig(128, persistent=True, band=0)
  with pytest.raises(ValueError, match="splits"):
    MosaicConfig(128, persistent=True, splits=2)
  with pytest.raises(ValueError, match="pingpong"):  # one stage: the turns would deadlock
    MosaicConfig(128, stages=1, pingpong=True)
  x, qw, sw = problem(("mosaic_splits",), (3,), 128, 384)
  with pytest.raises(InputError, match="unequal parts"):  # 3 K blocks in 2 parts
    fp8_matmul(x, qw, sw, implementation=impl, config=MosaicConfig(64, splits=2))


def test_mosaic_gpu_fits_shared_memory():
  # A float32 output's staging beside 4 stages of 192-wide tiles overflows Hopper's shared
  # memory: the heuristic takes 3 stages there, and a config that cannot fit is refused by name.
  assert mosaic_gpu.smem_bytes(MosaicConfig(192), jnp.float32) > 232448
  cfg = mosaic_gpu.heuristics(4096, 12288, 4096, jnp.float32)
  assert cfg.stages == 3 and mosaic_gpu.smem_bytes(cfg, jnp.float32) <= 232448
  assert mosaic_gpu.heuristics(4096, 12288, 4096).stages == 4
  x, qw, sw = problem(("mosaic_smem",), (3,), 192, 256)
  with pytest.raises(InputError, match="shared memory"):
    fp8_matmul(x, qw, sw, out_dtype=jnp.float32, implementation="mosaic_gpu",
               config=MosaicConfig(192))


@pytest.mark.lowering
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("config,out_dtype", [
    (MosaicConfig(192), jnp.bfloat16), (MosaicConfig(192, persistent=True), jnp.bfloat16),
    # float32: the heuristic's 3 stages fit where 4 did not (test_mosaic_gpu_fits_shared_memory).
    (None, jnp.float32),
    # K in parts stages float32 partials: 64 columns, where 192 would overflow shared memory.
    (MosaicConfig(64, splits=2), jnp.bfloat16),
    (MosaicConfig(256, 3, persistent=True, chunks=2), jnp.bfloat16),  # 3 stages fit at 256
    (MosaicConfig(192, persistent=True, chunks=2, pingpong=True), jnp.bfloat16),
], ids=str)
def test_mosaic_gpu_lowers(target, config, out_dtype):
  S = jax.ShapeDtypeStruct
  fp8 = jnp.float8_e4m3fn
  cfg = config or mosaic_gpu.heuristics(4096, 12288, 4096, out_dtype)

  def fn(q, s, w, sw):
    return fp8_matmul(QuantizedActivation(q, s), w, sw, implementation="mosaic_gpu",
                      config=cfg, out_dtype=out_dtype)

  args = S((256, 1536), fp8), S((256, 12), jnp.float32), S((2112, 1536), fp8), S((17, 12),
                                                                                   jnp.float32)
  if target != "h200":
    with pytest.raises(Unsupported):
      lower(target, fn, *args)
    return
  assert "mosaic_gpu" in lower(target, fn, *args)


@pytest.mark.lowering
@pytest.mark.parametrize("m,copies", [(1000, False), (1001, True)])
def test_mosaic_gpu_copies_no_rows(m, copies):
  # Rows past M come in as TMA's zeros and leave clipped by its stores: a prefill of any M
  # divisible by 8 runs with no padded copy of the activation or slice of the output.
  S = jax.ShapeDtypeStruct
  fp8 = jnp.float8_e4m3fn
  fn = lambda q, s, w, sw: fp8_matmul(QuantizedActivation(q, s, layout="col"), w, sw,
                                      implementation="mosaic_gpu")
  text = lower("h200", fn, S((m, 1536), fp8), S((12, m), jnp.float32), S((2112, 1536), fp8),
               S((17, 12), jnp.float32))
  assert ("stablehlo.pad" in text) == copies and ("stablehlo.slice" in text) == copies


@pytest.mark.parametrize("m_shape", [(255,), (2, 128)])
def test_bf16_input_quantised_in_scale_layout(monkeypatch, m_shape):
  # A bf16 activation is quantised with its scales in the layout the projection reads as
  # stored (column from 256 rows: no transpose before the Mosaic GPU kernel); same product.
  layouts = []
  quant = mm_api.group_quant
  monkeypatch.setattr(mm_api, "group_quant",
                      lambda *a, **kw: layouts.append(kw["layout"]) or quant(*a, **kw))
  x, qw, sw = problem(("layout", *m_shape), m_shape, 192, 384)
  got = fp8_matmul(x, qw, sw, implementation="xla")
  assert layouts == ["col" if np.prod(m_shape) >= 256 else "row"]
  row = quant(x, fmt="e4m3fn", layout="row", implementation="xla")
  np.testing.assert_array_equal(np.asarray(got),
                                np.asarray(fp8_matmul(row, qw, sw, implementation="xla")))


@pytest.mark.parametrize("m,n,k,first", [
    (1, 2112, 7168, "triton"), (16, 7168, 16384, "triton"), (17, 2112, 7168, "triton"),
    (64, 24576, 1536, "triton"), (255, 24576, 1536, "triton"),
    (256, 2112, 7168, "mosaic_gpu"),  # 2 x 33 tiles of 128 x 64: half the SMs
    (256, 4096, 8192, "mosaic_gpu"),  # 2 x 64 tiles of 128 x 64
    (256, 12288, 4096, "mosaic_gpu"),  # 2 x 64 tiles of 128 x 192
    (256, 2048, 7168, "mosaic_gpu"),  # 2 x 32 tiles of 128 x 64: the fewest measured
    (256, 1024, 4096, "triton"),  # 2 x 16 tiles at the narrowest
    (1024, 2112, 7168, "mosaic_gpu"), (4096, 24576, 1536, "mosaic_gpu"),
    (256, 7168, 16384, "mosaic_gpu"), (1024, 7168, 16384, "mosaic_gpu"),  # at every K
    (4096, 7168, 16384, "mosaic_gpu"),  # persistent from M = 4096: at every K
    (4096, 2100, 7168, "triton")])  # N % 64: the Mosaic GPU kernel cannot tile it
def test_gpu_order(monkeypatch, m, n, k, first):
  # Triton where M < 256 (0.99-1.06x Pallas's speed at M <= 16, 1.15-1.72x at M = 64, and since
  # both go to XLA's Triton custom call, both in the step's CUDA graph); from M = 256, Mosaic GPU
  # where it has at least 64 tiles (measured ahead there); Pallas after Triton, for
  # machines without `triton`.
  from jfusedq import _target
  monkeypatch.setattr(_target, "current", lambda: _target.Target("cuda", "NVIDIA H200"))
  assert mm_api.gpu_order(m, n, k)[0] == first
  assert mm_api.gpu_order(m, n, k)[-2:] == ("pallas", "xla")


@pytest.mark.lowering
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("m,k,mosaic", [(4096, 1536, True), (1024, 16384, True),
                                        (4096, 16384, True), (256, 1536, True),
                                        (255, 1536, False)])
def test_default_order_lowers(target, m, k, mosaic):
  # With no implementation asked for, Hopper runs the Mosaic GPU kernel where it was measured
  # to win (api.gpu_order: M >= 256, at least 64 tiles; N = 2112 here, so M = 256 has 66 tiles
  # of 128 x 64) and the portable kernels elsewhere; ROCm never.
  S = jax.ShapeDtypeStruct
  fp8 = jnp.float8_e4m3fnuz if target == "gfx942" else jnp.float8_e4m3fn

  def fn(q, s, w, sw):
    return fp8_matmul(QuantizedActivation(q, s), w, sw)

  kb = k // 128
  text = lower(target, fn, S((m, k), fp8), S((m, kb), jnp.float32), S((2112, k), fp8),
               S((17, kb), jnp.float32))
  assert ("mosaic_gpu" in text) == (mosaic and target == "h200")


@pytest.mark.lowering
def test_mosaic_gpu_lowers_in_shard_map():
  # A row-parallel projection as the models run it under TP: K split over two H200s, the
  # Mosaic GPU kernel (default at this M) inside shard_map, then the psum.
  S = jax.ShapeDtypeStruct
  fp8 = jnp.float8_e4m3fn
  mesh = AbstractMesh((2,), ("tp",), abstract_device=AbstractDevice("NVIDIA H200", None, "cuda"))

  def body(q, s, w, sw):
    return jax.lax.psum(fp8_matmul(QuantizedActivation(q, s), w, sw), "tp")

  fn = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"),) * 4, out_specs=P(),
                     check_vma=False)
  split = jax.sharding.NamedSharding(mesh, P(None, "tp"))
  with jax.sharding.use_abstract_mesh(mesh):
    text = jax.jit(fn).trace(
        S((4096, 3072), fp8, sharding=split), S((4096, 24), jnp.float32, sharding=split),
        S((2112, 3072), fp8, sharding=split), S((17, 24), jnp.float32, sharding=split),
    ).lower().as_text()
  assert "mosaic_gpu" in text and "all_reduce" in text
