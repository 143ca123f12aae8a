"""Closeness checks for quantised outputs, shared by the tests and the benchmarks."""

from __future__ import annotations

import numpy as np

from jfusedq.fp8 import QuantizedActivation


def code_index(q) -> np.ndarray:
  """FP8 codes as signed ordinals: neighbouring representable values differ by 1."""
  bits = np.asarray(q).view(np.uint8).astype(np.int32)
  mag = bits & 0x7F
  return np.where(bits & 0x80, -mag, mag)


def quant_mismatch(got: QuantizedActivation, want: QuantizedActivation, *,
                   max_code_frac: float, scale_rtol: float) -> str | None:
  """Why `got` is not close to `want`, or None.

  Close means: same dtype, shapes, group size and layout; every scale within `scale_rtol`
  relative; every code within one FP8 step; at most `max_code_frac` of codes differing.
  """
  if got.q.dtype != want.q.dtype:
    return f"q dtype {got.q.dtype} != {want.q.dtype}"
  if (got.group_size, got.layout) != (want.group_size, want.layout):
    return f"metadata {(got.group_size, got.layout)} != {(want.group_size, want.layout)}"
  if got.q.shape != want.q.shape or got.scale.shape != want.scale.shape:
    return f"shapes {got.q.shape}/{got.scale.shape} != {want.q.shape}/{want.scale.shape}"
  gs, ws = np.asarray(got.scale, np.float64), np.asarray(want.scale, np.float64)
  if not np.all(np.isfinite(gs)):
    return "non-finite scale"
  rel = np.max(np.abs(gs - ws) / np.abs(ws), initial=0.0)
  if rel > scale_rtol:
    return f"scale relative error {rel:.3g} > {scale_rtol:.3g}"
  steps = np.abs(code_index(got.q) - code_index(want.q))
  if steps.max(initial=0) > 1:
    return f"a code differs by {steps.max()} steps"
  frac = float(np.mean(steps > 0)) if steps.size else 0.0
  if frac > max_code_frac:
    return f"{frac:.3g} of codes differ (> {max_code_frac:.3g})"
  return None


def rel_rms(got, want) -> float:
  """Relative RMS error ||got - want|| / ||want|| in float64."""
  g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))
