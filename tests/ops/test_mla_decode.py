"""mla_decode: every implementation against the f32 reference over odd shapes (heads not a
multiple of the kernel's 16, slots not a multiple of its 32, a partial 128-group, T > 1),
positions (the first slot only, the last slot, a split past the position), FP8 and bf16
caches, the slot splits, determinism; the GPU's default order; errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import TRITON, activations, rng
from jfusedq import _target, _triton, group_quant, mla_decode
from jfusedq.errors import DTypeError, InputError
from jfusedq.ops.mla_decode import reference
from jfusedq.ops.mla_decode.api import KERNEL_SLOTS
from jfusedq.ops.mla_decode.triton import Config, heuristics
from jfusedq.testing import rel_rms

IMPLS = ("xla", TRITON)
# The kernel's scores are exact products summed in f32; it rounds the latent and the
# probabilities to bf16 (2**-9 relative each) for the output's product, whose errors average
# over the slots (0.0016 measured at 151 slots): 2**-8 relative RMS leaves them room and still
# fails a wrong mask, scale or merge, which move the output O(1).
TOL = 2.0**-8


def problem(key, b, t, nh, l, r, s, fmt="e4m3fn"):
  """Queries, and a cache of s slots in the model's form: 1 x 128 codes and scales (fmt), or
  bf16 with no scales (fmt None)."""
  g = rng(*key)
  q_lat = activations(g, (b, t, nh, l))
  q_pe = jnp.asarray(g.standard_normal((b, t, nh, r)), jnp.bfloat16)
  lat = jnp.asarray(g.standard_normal((b, s, l)), jnp.bfloat16)
  k_pe = jnp.asarray(g.standard_normal((b, s, r)), jnp.bfloat16)
  if fmt is None:
    return q_lat, q_pe, lat, None, k_pe
  qa = group_quant(lat, fmt=fmt, implementation="xla")
  return q_lat, q_pe, qa.q, qa.scale, k_pe


def want(args, pos, scale):
  return reference.mla_decode(*args, pos, scale)


@pytest.mark.parametrize("impl", IMPLS)
class TestEveryImplementation:

  @pytest.mark.parametrize("b,t,nh,l,r,s,pos", [
      (1, 1, 16, 512, 64, 64, 63),     # DeepSeek-V3's widths, the position at the last slot
      (2, 1, 20, 256, 64, 300, 150),   # heads past a block, slots past a step, half unwritten
      (1, 3, 8, 192, 32, 70, 40),      # T = 3 (causal among them), a partial 128-group
      (1, 1, 4, 128, 16, 33, 0),       # the first slot only
  ])
  def test_shapes_and_positions(self, impl, b, t, nh, l, r, s, pos):
    args = problem(("p", b, t, nh, l, s), b, t, nh, l, r, s)
    scale = 0.5 / (l + r) ** 0.5 * 4
    got = mla_decode(*args, pos=pos, scale=scale, implementation=impl)
    assert got.shape == (b, t, nh, l) and got.dtype == jnp.float32
    assert rel_rms(got, want(args, pos, scale)) <= TOL

  @pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3fnuz", None])
  def test_cache_formats(self, impl, fmt):
    if impl == "triton" and fmt == "e4m3fnuz":
      pytest.skip("the Triton interpreter and NVIDIA GPUs have no e4m3fnuz conversion")
    args = problem(("f", fmt), 1, 1, 16, 256, 64, 96, fmt)
    got = mla_decode(*args, pos=90, scale=0.1, implementation=impl)
    assert rel_rms(got, want(args, 90, 0.1)) <= TOL

  def test_traced_position_and_determinism(self, impl):
    args = problem(("j",), 2, 1, 16, 256, 64, 128)
    run = jax.jit(lambda pos, *a: mla_decode(*a, pos=pos, scale=0.1, implementation=impl))
    got = run(jnp.int32(77), *args)
    assert rel_rms(got, want(args, 77, 0.1)) <= TOL
    np.testing.assert_array_equal(np.asarray(run(jnp.int32(77), *args)), np.asarray(got))


@pytest.mark.parametrize("impl", [TRITON])
def test_triton_splits_merge_to_one(impl):
  # Splits past the position run no step (lse -inf) and must weigh nothing in the merge.
  args = problem(("s",), 1, 1, 16, 256, 64, 512)
  one = mla_decode(*args, pos=200, scale=0.1, implementation="triton", config=Config(splits=1))
  many = mla_decode(*args, pos=200, scale=0.1, implementation="triton",
                    config=Config(block_s=64, splits=6))
  assert rel_rms(many, one) <= TOL and rel_rms(many, want(args, 200, 0.1)) <= TOL


@pytest.mark.parametrize("impl", [TRITON])
@pytest.mark.parametrize("fmt", ["e4m3fn", None])
@pytest.mark.parametrize("b,t,nh,l,s,pos", [(1, 1, 64, 512, 150, 149), (2, 3, 20, 320, 70, 40)])
def test_triton_flat(impl, fmt, b, t, nh, l, s, pos):
  # The flat form (one 2-D product a latent group, here 4 groups, or 3 with a partial last one)
  # rounds as the grouped one: same tolerance.
  args = problem(("fl", b, t, nh, l, fmt), b, t, nh, l, 64, s, fmt)
  cfg = Config(block_h=64 if nh >= 64 else 16, block_s=64, splits=2, num_warps=8, flat=True)
  got = mla_decode(*args, pos=pos, scale=0.1, implementation="triton", config=cfg)
  assert rel_rms(got, want(args, pos, 0.1)) <= TOL


def test_errors():
  q_lat, q_pe, kv, ks, k_pe = problem(("e",), 1, 1, 4, 256, 16, 8)
  with pytest.raises(InputError, match="kv_scale"):
    mla_decode(q_lat, q_pe, kv, None, k_pe, pos=0, scale=0.1)
  with pytest.raises(InputError, match="kv_scale must be float32"):
    mla_decode(q_lat, q_pe, kv, ks[..., :1], k_pe, pos=0, scale=0.1)
  with pytest.raises(DTypeError, match="must be float8"):
    mla_decode(q_lat, q_pe, kv.astype(jnp.bfloat16), ks, k_pe, pos=0, scale=0.1)
  with pytest.raises(InputError, match="disagree"):
    mla_decode(q_lat, q_pe[..., :8], kv, ks, k_pe, pos=0, scale=0.1)
  with pytest.raises(InputError, match="pos"):
    mla_decode(q_lat, q_pe, kv, ks, k_pe, pos=8, scale=0.1)
  with pytest.raises(InputError, match="unknown"):
    mla_decode(q_lat, q_pe, kv, ks, k_pe, pos=0, scale=0.1, implementation="cudnn")


@pytest.mark.parametrize("slots", [KERNEL_SLOTS - 1, KERNEL_SLOTS])
def test_gpu_default_order_follows_the_cache_length(monkeypatch, slots):
  # On a GPU the kernel comes first from KERNEL_SLOTS slots on (its cost grows with the
  # position, the XLA path's with the slots), XLA first below.
  launched = []

  class Recorder:
    @staticmethod
    def triton_call(*args, kernel, out_shape, grid, **kwargs):
      launched.append(kernel.__name__)
      return [jnp.zeros(o.shape, o.dtype) for o in out_shape]

  monkeypatch.setattr(_target, "current", lambda: _target.Target("cuda", "NVIDIA H200"))
  monkeypatch.setattr(_triton, "require", lambda target=None: Recorder)
  args = problem(("o", slots), 1, 1, 16, 128, 16, slots)
  mla_decode(*args, pos=slots - 1, scale=0.1)
  assert launched == (["mla_decode_kernel"] if slots >= KERNEL_SLOTS else [])


@pytest.mark.parametrize("slots,pick", [
    # The sweep's fastest at 128 heads, batch 1 (at 4096 slots within 1% of it;
    # benchmarks/README.md).
    (4096, Config(block_h=64, block_s=32, splits=64, num_warps=8, flat=True)),
    (32768, Config(block_h=64, block_s=64, splits=66, num_warps=8, flat=True)),
    (256, Config(block_h=32, block_s=32, splits=2, flat=True))])
def test_heuristics_pick_the_measured_fastest(slots, pick):
  assert heuristics(1, 128, slots, "NVIDIA H100 80GB HBM3") == pick
  # 16 heads (DeepSeek-V3 under 8-way tensor parallelism) keep the 32-head tiling.
  assert heuristics(1, 16, slots, "NVIDIA H100 80GB HBM3").block_h == 32
