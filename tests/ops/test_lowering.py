"""ROCm/CUDA readiness on a CPU-only machine: every Pallas kernel, with every option, lowers to
the Triton custom call for H200 (cuda), MI355 (gfx950) and MI300 (gfx942) abstract devices."""

import jax
import jax.numpy as jnp
import pytest

from helpers import TARGETS, TRITON_CALL, lower, named
from jfusedq import Fp8Format, default_format, group_quant, rmsnorm_quant
from jfusedq.testing import WIDTHS

S = jax.ShapeDtypeStruct
pytestmark = pytest.mark.lowering


RMS_OPTIONS = {
    "plain": dict(),
    "residual": dict(residual=True),
    "offset1": dict(weight_offset=1.0),
    "keep_hp": dict(keep_hp=True),
    "x2": dict(x2=True),
    "col": dict(layout="col"),
    "ue8m0": dict(ue8m0=True),
    "g64": dict(group_size=64),
    "fp8_max_224": dict(fmt_max=224.0),
    "all": dict(residual=True, weight_offset=1.0, keep_hp=True, x2=True, layout="col",
                ue8m0=True, group_size=64),
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("option", RMS_OPTIONS)
@pytest.mark.parametrize("fmt", ["native", "e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("hidden", named(WIDTHS, "deepseek_v3.hidden", "deepseek_v3.q_a_kv_a"))
def test_rmsnorm_quant_lowers(target, option, fmt, hidden):
  opt = dict(RMS_OPTIONS[option])
  has_res, has_x2, fmt_max = opt.pop("residual", False), opt.pop("x2", False), opt.pop("fmt_max",
                                                                                       None)

  def fn(x, r, w, x2, w2):
    f = (default_format(fp8_max=fmt_max) if fmt == "native"
         else getattr(Fp8Format, fmt)(fp8_max=fmt_max if fmt == "e4m3fnuz" else None))
    return rmsnorm_quant(x, w, residual=r if has_res else None, x2=x2 if has_x2 else None,
                         weight2=w2 if has_x2 else None, fmt=f, implementation="pallas", **opt)

  text = lower(target, fn, S((2, 8, hidden), jnp.bfloat16), S((2, 8, hidden), jnp.bfloat16),
               S((hidden,), jnp.bfloat16), S((2, 8, 512), jnp.bfloat16), S((512,), jnp.bfloat16))
  assert text.count(TRITON_CALL) == 1
  fnuz = fmt == "e4m3fnuz" or (fmt == "native" and target == "gfx942")
  want = "f8E4M3FNUZ" if fnuz else "f8E4M3FN>"
  assert want in text


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("opt", [dict(), dict(layout="col"), dict(ue8m0=True),
                                 dict(group_size=64), dict(fmt="e4m3fnuz"),
                                 dict(fmt="e4m3fn", layout="col", ue8m0=True)])
@pytest.mark.parametrize("k", named(WIDTHS, "deepseek_v3.q_lora", "deepseek_v3.kv_a"))
def test_group_quant_lowers(target, opt, k):
  text = lower(target, lambda x: group_quant(x, implementation="pallas", **opt),
               S((16, k), jnp.bfloat16))
  assert text.count(TRITON_CALL) == 1


@pytest.mark.parametrize("target", TARGETS)
def test_default_implementation_on_gpu_targets_is_pallas(target):
  text = lower(target, lambda x, w: rmsnorm_quant(x, w), S((4, 7168), jnp.bfloat16),
               S((7168,), jnp.bfloat16))
  assert TRITON_CALL in text
