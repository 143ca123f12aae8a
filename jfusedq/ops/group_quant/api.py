"""Public entry point of the standalone 1 x G FP8 quantisation."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from jfusedq.fp8 import BLOCK, Fp8Format, QuantizedActivation, resolve_format
from jfusedq.ops import _common
from jfusedq.ops._dispatch import declare, dispatch
from jfusedq.ops.group_quant import pallas, reference, triton

declare("group_quant", ("pallas", "triton", "xla"))


def group_quant(x: jax.Array, *, group_size: int = BLOCK, fmt: Fp8Format | str | None = None,
                layout: str = "row", ue8m0: bool = False,
                implementation: str | Sequence[str] | None = None,
                config: pallas.Config | None = None) -> QuantizedActivation:
  """Quantise `x [..., K]` to FP8 in groups of `group_size` consecutive columns.

  Steps, per row and group: amax = max(max|x|, 1e-10); scale = amax * f32(1 / fp8_max) (UE8M0:
  next power of two); q = fp8(clamp(x / scale, +-fp8_max)). A group holding a NaN or +-inf gets
  scale NaN and NaN codes, in every implementation, so corrupt input stays visible.

  Args:
    x: `[..., K]` bf16, f16 or f32; any K >= 1 (a last partial group uses its real columns);
      leading sizes of 0 give an empty result.
    group_size: columns per scale (power of two; 128 for DeepSeek-style GEMMs).
    fmt: FP8 format; default: the current device's native one.
    layout: "row" -> scale `[..., G]`; "col" -> scale `[G, ...]` (G = ceil(K/group_size)).
    ue8m0: round scales up to powers of two.
    implementation: "pallas", "triton", "xla", a sequence tried in order, or None (best
      available).
    config: rows and warps per program (Pallas and Triton); default from each one's heuristics.
  Returns:
    QuantizedActivation(q [..., K] fp8, scale f32), recording group_size and layout.
  """
  _common.check_array("x", x)
  _common.check_float("x", x)
  _common.check_last_axis("x", x, "quantised axis K")
  _common.check_group_size(group_size)
  _common.check_layout(layout)
  fmt = resolve_format(fmt)

  def xla():
    return reference.group_quant(x, fmt, group_size=group_size, layout=layout, ue8m0=ue8m0)

  def rowwise(kernels):
    def run():
      if _common.rows(x) == 0:
        return xla()
      q, scale = kernels.group_quant(_common.flat(x), fmt, group_size=group_size, layout=layout,
                                     ue8m0=ue8m0, config=config)
      return QuantizedActivation(q, scale, group_size=group_size,
                                 layout=layout).unflatten(x.shape[:-1])
    return run

  return dispatch("group_quant", {"pallas": rowwise(pallas), "triton": rowwise(triton),
                                  "xla": xla}, implementation)
