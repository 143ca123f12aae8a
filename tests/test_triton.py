"""The optional Triton backend, as far as CPU proves it: the launcher's argument handling, the
error an explicit implementation="triton" gives where it cannot run, every kernel lowered into
XLA's Triton custom call for sm90, gfx942 and gfx950 (its TTIR read by XLA's own Triton
dialect), and every kernel compiled ahead of time for those targets by the installed Triton."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jfusedq import (Fp8Format, Unsupported, _target, _triton, fp8_matmul, group_quant,
                     grouped_fp8_matmul, mla_decode, ragged_fp8_matmul, ragged_matmul,
                     ragged_swiglu, rmsnorm, rmsnorm_quant)
from jfusedq.nn import StackedLinear, quantize_weight
from jfusedq.ops.fp8_matmul import Config
from jfusedq.ops.mla_decode.triton import Config as MlaConfig
from helpers import TRITON_CALL, lower


def test_call_passes_arrays_scalars_and_keywords(monkeypatch):
  seen = {}

  class FakeLauncher:
    @staticmethod
    def triton_call(*args, kernel, out_shape, grid, **kwargs):
      seen.update(args=args, kernel=kernel, out_shape=out_shape, grid=grid, kwargs=kwargs)
      return jnp.zeros(out_shape.shape, out_shape.dtype)

  monkeypatch.setattr(_triton, "require", lambda target=None: FakeLauncher)
  x = jnp.ones((4, 8))
  out = _triton.call("kernel", x, 4, out_shape=jax.ShapeDtypeStruct((4,), jnp.float32), grid=(2,),
                     BLOCK=8)
  assert out.shape == (4,) and seen["grid"] == (2,) and seen["kwargs"] == {"BLOCK": 8}
  assert seen["args"][1] == 4 and seen["args"][0].shape == (4, 8)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU error")
def test_explicit_triton_on_cpu_names_what_is_missing():
  x = jnp.ones((2, 256), jnp.bfloat16)
  w = jnp.ones((256,), jnp.bfloat16)
  qw, sw = quantize_weight(jnp.ones((128, 256)), Fp8Format.e4m3fn())
  calls = [lambda: group_quant(x, implementation="triton"),
           lambda: rmsnorm_quant(x, w, implementation="triton"),
           lambda: rmsnorm(x, w, implementation="triton"),
           lambda: fp8_matmul(x, qw, sw, implementation="triton")]
  for call in calls:
    with pytest.raises(Unsupported, match=r"triton: no GPU \(the target is the CPU\)"):
      call()
  assert not _triton.available()


@pytest.mark.parametrize("platform, installed, causes", [
    ("cpu", True, ["no GPU"]), ("cpu", False, ["no GPU", "not installed"]),
    ("tpu", True, ["the target is tpu"]), ("cuda", False, ["not installed"]),
    ("cuda", True, [])])
def test_unavailability_names_each_real_cause(monkeypatch, platform, installed, causes):
  monkeypatch.setattr(_triton, "_launcher", lambda: _triton.XlaLauncher if installed
                      else "the triton package is not installed")
  why = _triton.missing(_target.Target(platform, "NVIDIA H200"))
  parts = [] if why is None else why.split("; ")
  assert len(parts) == len(causes) and all(c in p for c, p in zip(causes, parts)), why
  assert ("pip install" in (why or "")) == (not installed)
  assert ("GPUs only" in (why or "")) == (platform != "cuda")


# --- ahead-of-time compile of every Triton kernel for sm90, gfx942 and gfx950 ---------------
# The public ops run with the launcher replaced by a recorder (their outputs are zeros: only the
# recorded kernel, arguments and constexprs matter), then each recorded call is compiled by
# Triton itself for the target: the Triton path's counterpart of the Pallas lowering tests.

AOT = {"h200": ("cuda", "NVIDIA H200", 90, 32), "gfx942": ("rocm", "gfx942", "gfx942", 64),
       "gfx950": ("rocm", "gfx950", "gfx950", 64)}


class Recorder:
  def __init__(self):
    self.calls = []
    self.launches = []  # (name, grid)

  def triton_call(self, *args, kernel, out_shape, grid, num_warps=4, num_stages=3, **constexprs):
    self.calls.append((kernel, args, out_shape, num_warps, num_stages, constexprs))
    self.launches.append((kernel.__name__, grid))
    many = isinstance(out_shape, (list, tuple))
    outs = [jnp.zeros(s.shape, s.dtype) for s in (out_shape if many else [out_shape])]
    return outs if many else outs[0]


def recorded_calls(monkeypatch, target, ops, recorder=None):
  from jfusedq import _target
  platform, kind = AOT[target][:2]
  recorder = recorder or Recorder()
  monkeypatch.setattr(_target, "current", lambda: _target.Target(platform, kind))
  monkeypatch.setattr(_triton, "_launcher", lambda: recorder)
  for op in ops:
    op()
  return recorder.calls


def test_experts_run_in_one_launch(monkeypatch):
  # Both models' MoE experts: one GEMM launch per projection, the products on its third grid
  # axis. Mapped per expert, each launch read a sliced copy of its expert's weight (measured:
  # a third of a decode step on the H200).
  layer = StackedLinear(5, 256, 320, fmt=Fp8Format.e4m3fn(), implementation="triton",
                        rngs=nnx.Rngs(0))
  r = np.random.default_rng(5)
  x = jnp.asarray(r.standard_normal((3, 256)), jnp.bfloat16)
  h = jnp.asarray(r.standard_normal((5, 3, 256)), jnp.bfloat16)
  idx = jnp.asarray([[0, 4], [2, 2], [3, 1]], jnp.int32)
  recorder = Recorder()
  recorded_calls(monkeypatch, "h200", [lambda: layer(x), lambda: layer(h, batched=True),
                                       lambda: layer.gathered(x, idx)], recorder)
  gemms = [grid for name, grid in recorder.launches if name == "fp8_matmul_kernel"]
  assert [grid[2] for grid in gemms] == [5, 5, 6]


def compile_call(target, call):
  triton = pytest.importorskip("triton")
  from triton.backends.compiler import GPUTarget
  kernel, args, out_shape, num_warps, num_stages, constexprs = call
  outs = out_shape if isinstance(out_shape, (list, tuple)) else [out_shape]
  # The source the launcher hands XLA: arrays as aligned pointers, scalars as constants.
  src = _triton.source(kernel, *_triton.signature(kernel, args, outs, constexprs))
  platform, _, arch, warp = AOT[target]
  gpu = GPUTarget("cuda" if platform == "cuda" else "hip", arch, warp)
  # FP fusion on, Triton's default up to 3.9 (explicit: Triton 3.10 changes it).
  return triton.compile(src, target=gpu, options=dict(num_warps=num_warps, num_stages=num_stages,
                                                      enable_fp_fusion=True))


def row_ops():
  r = np.random.default_rng(7)
  x = jnp.asarray(r.standard_normal((6, 2112)), jnp.bfloat16)
  res = jnp.asarray(r.standard_normal((6, 2112)), jnp.bfloat16)
  w = jnp.asarray(r.standard_normal(2112), jnp.bfloat16)
  x2 = jnp.asarray(r.standard_normal((6, 576)), jnp.bfloat16)
  w2 = jnp.asarray(r.standard_normal(576), jnp.bfloat16)
  fnuz = Fp8Format.e4m3fnuz()
  # The bandwidth tilings: the norm's row in pieces (5120 = 4096 + 1024), the quant's 4 warps.
  xb = jnp.asarray(r.standard_normal((4096, 5120)), jnp.bfloat16)
  wb = jnp.asarray(r.standard_normal(5120), jnp.bfloat16)
  return [lambda: group_quant(x, implementation="triton"),
          lambda: group_quant(xb, fmt=fnuz, implementation="triton"),
          lambda: rmsnorm_quant(xb, wb, residual=xb, keep_hp=True, fmt=fnuz, layout="col",
                                implementation="triton"),
          lambda: group_quant(x, fmt=fnuz, group_size=64, layout="col", ue8m0=True,
                              implementation="triton"),
          lambda: rmsnorm_quant(x, w, residual=res, x2=x2, weight2=w2, keep_hp=True,
                                weight_offset=1.0, implementation="triton"),
          lambda: rmsnorm(x, w, residual=res, implementation="triton")]


def matmul_ops(fmt):
  r = np.random.default_rng(8)
  qw, sw = quantize_weight(jnp.asarray(r.standard_normal((2112, 1536)), jnp.float32), fmt)
  x = jnp.asarray(r.standard_normal((2, 1536)), jnp.bfloat16)
  xl = jnp.asarray(r.standard_normal((300, 1536)), jnp.bfloat16)
  qa = group_quant(x, fmt=fmt, implementation="xla")
  qal = group_quant(xl, fmt=fmt, layout="col", implementation="xla")
  big = Config(128, 128, 1, num_warps=8, num_stages=4)  # two warp groups (large M)
  qg = group_quant(x[:, None], fmt=fmt, implementation="xla")  # 2 tokens, 2 experts each
  ids = jnp.asarray([1, 0, 0, 1], jnp.int32)
  sizes = jnp.asarray([120, 180], jnp.int32)
  rows = jnp.asarray(r.integers(0, 300, 300), jnp.int32)
  pair = (jnp.stack([qw, qw]), jnp.stack([sw, sw]), jnp.stack([qw, qw])[::-1],
          jnp.stack([sw, sw])[::-1])
  return [lambda: fp8_matmul(qa, qw, sw, implementation="triton"),  # K split, swapped
          lambda: fp8_matmul(qal, qw, sw, implementation="triton"),  # 64 x 128, col scales
          lambda: fp8_matmul(qal, qw, sw, implementation="triton", config=big),
          lambda: grouped_fp8_matmul(qg, jnp.stack([qw, qw]), jnp.stack([sw, sw]), ids,
                                     implementation="triton"),
          # Ragged: decode tiles (swapped, K split) and prefill tiles gathering col-scaled rows.
          lambda: ragged_fp8_matmul(qa, jnp.stack([qw, qw]), jnp.stack([sw, sw]),
                                    jnp.asarray([1, 1], jnp.int32), implementation="triton"),
          lambda: ragged_fp8_matmul(qal, jnp.stack([qw, qw]), jnp.stack([sw, sw]), sizes,
                                    rows=rows, implementation="triton", config=big),
          # The experts' gate and up with the hidden's quantisation: decode and prefill tiles.
          lambda: ragged_swiglu(qa, *pair, jnp.asarray([1, 1], jnp.int32),
                                implementation="triton"),
          lambda: ragged_swiglu(qal, *pair, sizes, rows=rows, act="silu_round_mul", ue8m0=True,
                                implementation="triton")]


def decode_ops(fmt):
  """MLA decode over an FP8 latent cache (DeepSeek-V3's widths, 128 heads, slots split), a
  bf16 one (odd heads and slots), and the FP8 one in the flat form at 64 heads a program."""
  r = np.random.default_rng(10)
  q_lat = jnp.asarray(r.standard_normal((1, 1, 128, 512)), jnp.bfloat16)
  q_pe = jnp.asarray(r.standard_normal((1, 1, 128, 64)), jnp.bfloat16)
  lat = group_quant(jnp.asarray(r.standard_normal((1, 4096, 512)), jnp.bfloat16), fmt=fmt,
                    implementation="xla")
  k_pe = jnp.asarray(r.standard_normal((1, 4096, 64)), jnp.bfloat16)
  return [lambda: mla_decode(q_lat, q_pe, lat.q, lat.scale, k_pe, pos=4000, scale=0.1,
                             implementation="triton"),
          lambda: mla_decode(q_lat[:, :, :20], q_pe[:, :, :20], lat.dequantize()[:, :300],
                             None, k_pe[:, :300], pos=200, scale=0.1, implementation="triton"),
          lambda: mla_decode(q_lat, q_pe, lat.q, lat.scale, k_pe, pos=4000, scale=0.1,
                             implementation="triton", config=MlaConfig(
                                 block_h=64, num_warps=8, splits=8, flat=True))]


@pytest.mark.lowering
@pytest.mark.parametrize("target", AOT)
def test_mla_decode_compiles_to_mma(monkeypatch, target):
  pytest.importorskip("triton")
  fmt = Fp8Format.e4m3fnuz() if target == "gfx942" else Fp8Format.e4m3fn()
  calls = recorded_calls(monkeypatch, target, decode_ops(fmt))
  assert len(calls) == 3
  for i, call in enumerate(calls):
    asm = compile_call(target, call).asm
    if target == "h200":
      assert ("wgmma.mma_async" if i == 2 else "mma") in asm["ptx"] and "bf16" in asm["ptx"]
    else:
      assert re.search(r"v_mfma_f32_\w+bf16", asm["amdgcn"])


@pytest.mark.lowering
@pytest.mark.parametrize("target", AOT)
def test_row_kernels_compile(monkeypatch, target):
  pytest.importorskip("triton")
  calls = recorded_calls(monkeypatch, target, row_ops())
  assert len(calls) == 6
  assert [(c[5]["P0"], c[5]["P1"]) for c in calls if "P1" in c[5]][:1] == [(4096, 1024)]
  assert [c[3] for c in calls if c[0].__name__ == "group_quant_kernel"][1] == 4  # warps
  for call in calls:
    compile_call(target, call)


@pytest.mark.lowering
@pytest.mark.parametrize("target", AOT)
def test_matmul_compiles_to_fp8_mma(monkeypatch, target):
  pytest.importorskip("triton")
  fmt = Fp8Format.e4m3fnuz() if target == "gfx942" else Fp8Format.e4m3fn()
  calls = recorded_calls(monkeypatch, target, matmul_ops(fmt))
  assert len(calls) == 8
  for call in calls:
    asm = compile_call(target, call).asm
    if target == "h200":
      # The FP8 tensor cores, for decode (swapped, tokens in N) and prefill tiles alike.
      assert "wgmma.mma_async" in asm["ptx"] and "e4m3.e4m3" in asm["ptx"]
    else:  # fp8 MFMA: ..._fp8_fp8 on gfx942 (fnuz), ..._f8f6f4 on gfx950
      assert re.search(r"v_mfma_f32_\w+_(fp8_fp8|f8f6f4)", asm["amdgcn"])


@pytest.mark.lowering
@pytest.mark.parametrize("target", AOT)
def test_bf16_ragged_compiles_to_mma(monkeypatch, target):
  # The unquantised path's experts: bf16 operands on the tensor cores, no scales read.
  pytest.importorskip("triton")
  r = np.random.default_rng(9)
  x = jnp.asarray(r.standard_normal((300, 512)), jnp.bfloat16)
  w = jnp.asarray(r.standard_normal((3, 384, 512)), jnp.bfloat16)
  sizes = jnp.asarray([100, 0, 200], jnp.int32)
  calls = recorded_calls(monkeypatch, target, [
      lambda: ragged_matmul(x, w, sizes, implementation="triton"),
      lambda: ragged_matmul(x[:2], w, jnp.asarray([1, 1, 0], jnp.int32),
                            implementation="triton"),
      lambda: ragged_swiglu(x, w, None, w[::-1], None, sizes, implementation="triton")])
  for call in calls:
    asm = compile_call(target, call).asm
    if target == "h200":
      assert "mma" in asm["ptx"] and "bf16" in asm["ptx"]
    else:
      assert re.search(r"v_mfma_f32_\w+bf16", asm["amdgcn"])


@pytest.mark.lowering
@pytest.mark.parametrize("target", AOT)
def test_kernels_lower_into_xla_triton_calls(target):
  # Each op lowers to XLA's Triton custom call (the one Pallas uses, captured in CUDA graphs),
  # its TTIR parsed by jaxlib's Triton dialect, and never to jax-triton's legacy custom call.
  pytest.importorskip("triton")
  fmt = Fp8Format.e4m3fnuz() if target == "gfx942" else Fp8Format.e4m3fn()
  for op in [*row_ops(), *matmul_ops(fmt), *decode_ops(fmt)]:
    text = lower(target, op)
    assert text.count(TRITON_CALL) == 1 and "triton_kernel_call" not in text


@pytest.mark.lowering
def test_row_count_is_a_constant_of_the_kernel():
  # Python scalars are baked into the TTIR: two row counts, two kernels; the same count, one.
  pytest.importorskip("triton")
  config = lambda text: re.search(r'ir = "([^"]*)"', text).group(1)
  texts = [lower("h200", lambda x: group_quant(x, implementation="triton"),
                 jax.ShapeDtypeStruct((t, 512), jnp.bfloat16)) for t in (5, 6, 5)]
  assert config(texts[0]) != config(texts[1]) and config(texts[0]) == config(texts[2])


def test_launcher_rejects_a_wrong_argument_count():
  pytest.importorskip("triton")
  from jfusedq.ops.group_quant.triton import group_quant_kernel
  with pytest.raises(TypeError, match="group_quant_kernel takes"):
    _triton.signature(group_quant_kernel, [jnp.ones((2, 128), jnp.bfloat16)], [], {})
