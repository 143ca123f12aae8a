"""Public entry point of fused (add +) RMSNorm + per-group FP8 quantisation."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from jfusedq.errors import DTypeError, InputError
from jfusedq.fp8 import BLOCK, Fp8Format, QuantizedActivation, resolve_format
from jfusedq.ops import _common
from jfusedq.ops._dispatch import declare, dispatch
from jfusedq.ops.group_quant import pallas as gq_pallas
from jfusedq.ops.rmsnorm_quant import pallas, reference, triton
from jfusedq.ops.rmsnorm_quant.reference import RmsNormQuantOutput

declare("rmsnorm_quant", ("pallas", "triton", "xla"))


# Triton first (_dispatch.GPU_ORDER): on the H200 it ran 1.05-1.29x the Pallas kernel's speed
# at T >= 4096 for H = 1536, 2048, 4096, 5120 and 7168. Without `triton` installed it declines
# and Pallas runs.


def rmsnorm_quant(x: jax.Array, weight: jax.Array, *, residual: jax.Array | None = None,
                  eps: float = 1e-6, weight_offset: float = 0.0, group_size: int = BLOCK,
                  fmt: Fp8Format | str | None = None, layout: str = "row", ue8m0: bool = False,
                  keep_hp: bool = False, x2: jax.Array | None = None,
                  weight2: jax.Array | None = None, eps2: float | None = None,
                  implementation: str | Sequence[str] | None = None,
                  config: gq_pallas.Config | None = None) -> RmsNormQuantOutput:
  """(Residual add +) RMSNorm + per-group FP8 quantisation in one pass over the row.

  Steps, per row of `x [..., H]`:
    1. h = x + residual in f32, residual_out = h rounded to x.dtype; the norm reads residual_out.
    2. y = h * rsqrt(mean(h^2) + eps) * (weight + weight_offset), in f32.
    3. QuantizedActivation of y in 1 x group_size groups (see `group_quant`), plus hp = y in
       x.dtype when `keep_hp`.
    4. If `x2 [..., H2]` is given: norm2 = rmsnorm(x2, weight2, eps2) in x2.dtype, unquantised
       (DeepSeek MLA: q_a_layernorm quantised + kv_a_layernorm bf16 in one launch).

  Args:
    x: `[..., H]` bf16/f16/f32, any H >= 1; leading sizes of 0 give empty outputs. A row
      holding a NaN or +-inf (or whose residual sum overflows x.dtype to inf) gets every scale
      NaN and NaN codes (hp and norm NaN), in every implementation; finite rows up to the
      dtype's maximum normalise without overflow.
    weight: `[H]`.
    residual: optional `[..., H]`, same dtype as x.
    eps: >= 0 (InputError otherwise).
    weight_offset: 0 for `y * w` (DeepSeek), 1 for `y * (1 + w)` (Qwen3.5 zero-centred norms).
    group_size, fmt, layout, ue8m0: as for `group_quant`.
    keep_hp: also return the normalised activation in x.dtype (`quant.hp`).
    x2, weight2, eps2: the optional second, norm-only input (eps2 defaults to eps).
    implementation: "triton", "pallas", "xla", a sequence tried in order, or None
      (Triton, Pallas, XLA on a GPU; else XLA).
    config: rows and warps per program (Pallas and Triton); default from each one's heuristics.
  Returns:
    RmsNormQuantOutput(quant, residual, norm2); residual / norm2 are None when not asked for.
  """
  check_inputs(x, weight, residual, group_size, layout, x2, weight2)
  fmt = resolve_format(fmt)
  _common.check_eps("eps", eps)
  eps2 = eps if eps2 is None else eps2
  _common.check_eps("eps2", eps2)
  kw = dict(residual=residual, eps=float(eps), weight_offset=float(weight_offset), fmt=fmt,
            group_size=group_size, layout=layout, ue8m0=ue8m0, keep_hp=keep_hp, x2=x2,
            weight2=weight2, eps2=float(eps2))

  def xla():
    return reference.rmsnorm_quant(x, weight, **kw)

  def rowwise(kernels):
    def run():
      if _common.rows(x) == 0:
        return xla()
      flat, lead = _common.flat, x.shape[:-1]
      q, scale, res_out, hp, norm2 = kernels.rmsnorm_quant(
          flat(x), weight, **{**kw, "residual": flat(residual), "x2": flat(x2)}, config=config)
      quant = QuantizedActivation(q, scale, hp, group_size=group_size,
                                  layout=layout).unflatten(lead)
      return RmsNormQuantOutput(quant, _common.unflat(res_out, lead), _common.unflat(norm2, lead))
    return run

  return dispatch("rmsnorm_quant", {"pallas": rowwise(pallas), "triton": rowwise(triton),
                                    "xla": xla}, implementation)


def check_inputs(x, weight, residual, group_size, layout, x2, weight2) -> None:
  for name, a in (("x", x), ("weight", weight), ("residual", residual), ("x2", x2),
                  ("weight2", weight2)):
    if a is not None:
      _common.check_array(name, a)
  _common.check_float("x", x)
  _common.check_last_axis("x", x, "hidden axis H")
  _common.check_group_size(group_size)
  _common.check_layout(layout)
  if weight.shape != x.shape[-1:]:
    raise InputError(f"weight shape {tuple(weight.shape)} does not match x's hidden size "
                     f"{x.shape[-1]}: want ({x.shape[-1]},)")
  _common.check_float("weight", weight)
  if residual is not None:
    if residual.shape != x.shape:
      raise InputError(f"residual shape {tuple(residual.shape)} differs from x shape "
                       f"{tuple(x.shape)}")
    if residual.dtype != x.dtype:
      raise DTypeError(f"residual dtype {residual.dtype} differs from x dtype {x.dtype}")
  if (x2 is None) != (weight2 is None):
    raise InputError("x2 and weight2 must be given together, got "
                     f"{'x2' if weight2 is None else 'weight2'} alone")
  if x2 is not None:
    _common.check_float("x2", x2)
    _common.check_float("weight2", weight2)
    _common.check_last_axis("x2", x2, "hidden axis H2")
    if x2.shape[:-1] != x.shape[:-1]:
      raise InputError(f"x2 leading shape {tuple(x2.shape[:-1])} differs from x's "
                       f"{tuple(x.shape[:-1])}")
    if weight2.shape != x2.shape[-1:]:
      raise InputError(f"weight2 shape {tuple(weight2.shape)} does not match x2's hidden size "
                       f"{x2.shape[-1]}")
