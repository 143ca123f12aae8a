"""(Residual add +) RMSNorm without quantisation: the norm kernel of the unfused chain.

The Pallas and Triton paths are the rmsnorm_quant kernels built with their quantisation stage
left out, so the two ops share one kernel each and agree bit for bit on the residual and the
norm.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax

from jfusedq.fp8 import BLOCK
from jfusedq.ops import _common
from jfusedq.ops._dispatch import declare, dispatch
from jfusedq.ops.group_quant import pallas as gq_pallas
from jfusedq.ops.rmsnorm_quant import api as rq_api
from jfusedq.ops.rmsnorm_quant import pallas as rq_pallas
from jfusedq.ops.rmsnorm_quant import triton as rq_triton
from jfusedq.ops.rmsnorm_quant.reference import add_residual
from jfusedq.ops.rmsnorm_quant.reference import rmsnorm as rmsnorm_ref

declare("rmsnorm", ("pallas", "triton", "xla"))


class RmsNormOutput(NamedTuple):
  y: jax.Array  # rmsnorm(x + residual) in x.dtype
  residual: jax.Array | None  # x + residual rounded to x.dtype, when a residual was given


def rmsnorm(x: jax.Array, weight: jax.Array, *, residual: jax.Array | None = None,
            eps: float = 1e-6, weight_offset: float = 0.0,
            implementation: str | Sequence[str] | None = None,
            config: gq_pallas.Config | None = None) -> RmsNormOutput:
  """h = x (+ residual, rounded to x.dtype); y = h * rsqrt(mean(h^2) + eps) * (w + offset).

  Shapes: x, residual `[..., H]`; weight `[H]`; y `[..., H]` in x.dtype. eps >= 0.
  """
  rq_api.check_inputs(x, weight, residual, BLOCK, "row", None, None)
  _common.check_eps("eps", eps)

  def xla():
    h = x if residual is None else add_residual(x, residual)
    y = rmsnorm_ref(h, weight, eps, weight_offset).astype(x.dtype)
    return RmsNormOutput(y, h if residual is not None else None)

  def rowwise(kernels):
    def run():
      if _common.rows(x) == 0:
        return xla()
      _, _, res_out, y, _ = kernels.rmsnorm_quant(
          _common.flat(x), weight, residual=_common.flat(residual), eps=float(eps),
          weight_offset=float(weight_offset), fmt=None, group_size=BLOCK, layout="row",
          ue8m0=False, keep_hp=True, x2=None, weight2=None, eps2=None, config=config)
      lead = x.shape[:-1]
      return RmsNormOutput(_common.unflat(y, lead), _common.unflat(res_out, lead))
    return run

  return dispatch("rmsnorm", {"pallas": rowwise(rq_pallas), "triton": rowwise(rq_triton),
                              "xla": xla}, implementation)
