"""Closeness checks for quantised outputs and the shape registry, shared by the tests and the
benchmarks."""

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


# --- Shapes -----------------------------------------------------------------------------------
# One registry for the tests and the benchmarks, each shape named by what it is. DeepSeek-V3:
# H = 7168, q_lora 1536, kv_lora 512 + 64 rope dims, 128 heads of 128 (+ 64 rope) dims, experts
# of 2048. Qwen3.5 (397B-A17B): H = 4096, Gated DeltaNet with 16 key and 64 value heads of 128.

# Row widths the norms and the quantiser see: H, or the K a projection reads.
WIDTHS = {
    "deepseek_v3.hidden": 7168,
    "deepseek_v3.q_lora": 1536,  # q_a_layernorm; q_b_proj's input
    "deepseek_v3.kv_lora": 512,  # kv_a_layernorm
    "deepseek_v3.kv_a": 576,  # kv_lora + the rope dims: kv_a_proj's output
    "deepseek_v3.q_a_kv_a": 2112,  # q_a and kv_a in one projection: 16.5 groups of 128
    "deepseek_v3.expert": 2048,  # the experts' intermediate width: down_proj's input
    "deepseek_v3.attn_out": 16384,  # 128 heads x 128: o_proj's input
    "qwen3_5.hidden": 4096,
    "qwen3_5.linear_value": 8192,  # 64 value heads x 128: out_proj's input
}

# (N, K) of the dense FP8 projections: output features, input features.
PROJECTIONS = {
    "deepseek_v3.q_a_kv_a": (2112, 7168),
    "deepseek_v3.q_b": (24576, 1536),
    "deepseek_v3.o_proj": (7168, 16384),
    "qwen3_5.in_proj_qkv": (12288, 4096),
    "qwen3_5.out_proj": (4096, 8192),
}

# (N, K) of one MoE expert's projections.
EXPERTS = {
    "deepseek_v3.gate_up": (2048, 7168),
    "deepseek_v3.down": (7168, 2048),
}

# Sizes no model has, for the edges of the tiling and the grouping.
EDGE_WIDTHS = {
    "one_group": 128,
    "partial_group": 100,  # less than one group: its only group is partial
    "odd": 4097,  # no factor of two: no row tile divides it
    "over_wide": 17408,  # more than a row tile holds
}
EDGE_PROJECTIONS = {
    "small": (256, 384),  # whole 128 blocks, seconds on a CPU: the benchmarks' --smoke shape
    "partial_blocks": (200, 300),  # a partial 128 block on both axes
    "partial_k_blocks": (200, 1100),  # 9 K blocks, the last partial: every K split has work
}

# Token counts (M rows of a projection, T of a norm): a decode step's batch, a prefill's.
DECODE_TOKENS = (1, 16, 64)
PREFILL_TOKENS = (256, 4096)
