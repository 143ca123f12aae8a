"""The optional Triton backend's plumbing, provable on CPU: the jax-triton API shim and the
error an explicit implementation="triton" gives where it cannot run."""

import jax
import jax.numpy as jnp
import pytest

from jfusedq import Fp8Format, Unsupported, _triton, fp8_matmul, group_quant, rmsnorm, rmsnorm_quant
from jfusedq.nn import quantize_weight


def test_out_keyword_follows_the_installed_api():
  def triton_call_03(*args, kernel, out_shape, grid, name="", **metaparams):
    pass

  def triton_call_04(*args, kernel, out_type=None, grid, name="", **kwargs):
    pass

  assert _triton.out_keyword(triton_call_03) == "out_shape"
  assert _triton.out_keyword(triton_call_04) == "out_type"


def test_call_passes_the_shape_keyword_and_scalars(monkeypatch):
  seen = {}

  class FakeJaxTriton:
    @staticmethod
    def triton_call(*args, kernel, out_type=None, grid, name="", **kwargs):
      seen.update(args=args, kernel=kernel, out_type=out_type, grid=grid, kwargs=kwargs)
      return jnp.zeros(out_type.shape, out_type.dtype)

  monkeypatch.setattr(_triton, "require", lambda target=None: FakeJaxTriton)
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
    with pytest.raises(Unsupported, match=r"triton needs a CUDA or ROCm GPU \(and jax-triton\)"):
      call()
  assert not _triton.available()
