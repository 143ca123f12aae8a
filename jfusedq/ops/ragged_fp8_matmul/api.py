"""Public entry points of the ragged (grouped) products: MoE experts over rows sorted by expert."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jfusedq.errors import DTypeError, InputError, check_range
from jfusedq.fp8 import BLOCK, QuantizedActivation
from jfusedq.ops import _common
from jfusedq.ops import _dispatch
from jfusedq.ops._dispatch import Unsupported, declare, dispatch
from jfusedq.ops.fp8_matmul import api as fp8_api
from jfusedq.ops.fp8_matmul.pallas import Config
from jfusedq.ops.ragged_fp8_matmul import mosaic_gpu, triton, xla
from jfusedq.ops.ragged_fp8_matmul.reference import ACTIVATIONS

# The GPU order, best first: Triton, then Mosaic GPU (Hopper; it runs where `triton` is not
# installed), except from MOSAIC_MIN_ROWS sorted rows an expert on average, where Mosaic GPU's
# wgmma tiles outrun Triton's despite the XLA row gather before them: on an H100, 0.99-1.13x
# Triton's speed at 80 rows an expert, 1.07-1.39x at 128 to 512 (benchmarks/README.md); fewer
# rows are untimed.
IMPLEMENTATIONS = ("triton", "mosaic_gpu", "xla")
MOSAIC_MIN_ROWS = 80
declare("ragged_fp8_matmul", IMPLEMENTATIONS)
declare("ragged_matmul", ("triton", "xla"))
declare("ragged_swiglu", IMPLEMENTATIONS)


def gpu_order(m: int, experts: int) -> tuple[str, ...]:
  """The GPU backends for `m` sorted rows over `experts` groups, best first (above)."""
  if m >= MOSAIC_MIN_ROWS * experts:
    return ("mosaic_gpu", "triton", "xla")
  return IMPLEMENTATIONS


def ragged_fp8_matmul(a: jax.Array | QuantizedActivation, weight: jax.Array,
                      weight_scale: jax.Array, group_sizes: jax.Array, *,
                      rows: jax.Array | None = None, out_dtype=jnp.bfloat16,
                      implementation: str | Sequence[str] | None = None,
                      config: Config | None = None, ue8m0: bool = False) -> jax.Array:
  """Block-scaled W8A8 products of rows sorted by expert: `out[r] = a[rows[r]] @ W[e(r)]^T`.

  Rows come in contiguous runs, one a group: row r belongs to group e while
  `sum(group_sizes[:e]) <= r < sum(group_sizes[:e + 1])`; rows past the last group are 0. Each
  product is `fp8_matmul`'s (1 x 128 activation, 128 x 128 weight scales, f32 per K block).
  The work grows with the rows, not the experts: one kernel over all groups (Triton), each row
  tile reading its expert's weight in place; XLA loops over the filled tiles.

  Args:
    a: `[T, K]` bf16/f16/f32 (quantised per 1 x 128 group first, power-of-two scales with
      `ue8m0`) or a QuantizedActivation (row or col scales; `hp` unused).
    weight: `[E, N, K]` float8_e4m3fn / e4m3fnuz; weight_scale `[E, ceil(N/128), ceil(K/128)]`
      f32 (it multiplies the dequantised block).
    group_sizes: `[E]` integer, traced: rows of each expert, in order (empty experts, all rows
      on one expert, any routing). Their sum must not pass M; a traced size is not checked
      (under `jfusedq.debug_checks()` it is, at run time), negative sizes count as 0.
    rows: `[M]` integer source row in `a` of each sorted row (the tokens of the (token, expert)
      pairs, gathered in the kernel's loads), or None: `a`'s own rows, M = T.
    implementation: "triton", "mosaic_gpu" (Hopper; `rows` gathered by XLA first), "xla", a
      sequence tried in order, or None (`gpu_order(M, E)` on a GPU, XLA elsewhere).
    config: the tiling: `pallas.Config` (Triton; default `triton.heuristics`) or
      `mosaic_gpu.Config` (default `mosaic_gpu.heuristics`).
  Returns:
    `[M, N]` in out_dtype.
  """
  n, k = fp8_api._check_weight(weight, weight_scale, stacked=True)
  e = weight.shape[0]
  implementation = _dispatch.requested("ragged_fp8_matmul", implementation)
  qa = fp8_api._quantized(a, weight, k, implementation, ue8m0, "row")
  m = _check_rows(qa.q, rows)
  _check_groups(weight, group_sizes, m)

  def kernel(kernels, heuristics):
    def run():
      if m == 0:
        return jnp.zeros((0, n), out_dtype)
      fp8_api._check_kernel(weight, config, kernels)
      return kernels.ragged_matmul(qa.q, qa.scale, qa.layout, weight, weight_scale,
                                   group_sizes, rows, config or heuristics(), out_dtype)
    return run

  backends = {"triton": kernel(triton, lambda: triton.heuristics(m, n, k, e)),
              "mosaic_gpu": kernel(mosaic_gpu,
                                   lambda: mosaic_gpu.heuristics(m, n, k, e, out_dtype)),
              "xla": lambda: xla.ragged_fp8_matmul(qa, weight, weight_scale, group_sizes, rows,
                                                   out_dtype)}
  return dispatch("ragged_fp8_matmul", backends, implementation, gpu_order=gpu_order(m, e))


def ragged_matmul(a: jax.Array, weight: jax.Array, group_sizes: jax.Array, *,
                  rows: jax.Array | None = None, out_dtype=jnp.bfloat16,
                  implementation: str | Sequence[str] | None = None,
                  config: Config | None = None) -> jax.Array:
  """`ragged_fp8_matmul`'s products in high precision: `a [T, K]` and `weight [E, N, K]` in
  bf16 (or f16 / f32: the kernel reads them in the activation's dtype), f32 accumulation, the
  weights read in place (the unquantised path's experts, with no gathered copy)."""
  e, n, k = _check_high_precision(a, weight)
  m = _check_rows(a, rows)
  _check_groups(weight, group_sizes, m)

  def kernel():
    if m == 0:
      return jnp.zeros((0, n), out_dtype)
    fp8_api._check_kernel(weight, config, triton)
    cfg = config or triton.heuristics(m, n, k, e, scaled=False)
    return triton.ragged_matmul(a, None, "row", weight.astype(a.dtype), None, group_sizes,
                                rows, cfg, out_dtype)

  backends = {"triton": kernel,
              "xla": lambda: xla.ragged_matmul(a, weight, group_sizes, rows, out_dtype)}
  return dispatch("ragged_matmul", backends, implementation, gpu_order=("triton", "xla"))


def ragged_swiglu(a: jax.Array | QuantizedActivation, gate: jax.Array,
                  gate_scale: jax.Array | None, up: jax.Array, up_scale: jax.Array | None,
                  group_sizes: jax.Array, *, rows: jax.Array | None = None,
                  act: str = "silu_mul", dtype=jnp.bfloat16, ue8m0: bool = False,
                  implementation: str | Sequence[str] | None = None,
                  config: Config | None = None) -> QuantizedActivation | jax.Array:
  """The MoE experts' gate and up products and their activation in one kernel:
  `h[r] = swiglu(a[rows[r]] @ G[e(r)]^T, a[rows[r]] @ U[e(r)]^T)`, with FP8 weights quantised
  per 1 x 128 group for the down product.

  Rows and groups as `ragged_fp8_matmul`'s; one kernel computes both products, reading each
  activation block once for both weights. Each product is rounded to `dtype` as a projection
  would output it, then `act` (`reference.swiglu`: "silu_mul", DeepSeek-V3's rounding, or
  "silu_round_mul", Qwen3.5's). Neither the `[M, 2N]` products nor (FP8) the hidden in dtype
  is written to memory.
  - FP8 weights with their scales: the products are `ragged_fp8_matmul`'s (the same block
    scales, f32 per K block) and the hidden, in dtype, is quantised to the weights' format as
    `group_quant` does (row scales, the layout the ragged down product reads).
  - High-precision weights, both scales None: the products are `ragged_matmul`'s (the kernel
    reads the weights in `a`'s dtype) and the hidden is returned in dtype.

  Args:
    a: `[T, K]` bf16/f16/f32 (with FP8 weights quantised per 1 x 128 group first) or a
      QuantizedActivation (FP8 weights only).
    gate, up: `[E, N, K]`, fp8 (one format) with scales `[E, ceil(N/128), ceil(K/128)]` f32,
      or bf16/f16/f32 with gate_scale = up_scale = None.
    group_sizes, rows: as `ragged_fp8_matmul`.
    act: "silu_mul" or "silu_round_mul". dtype: the products' and the hidden's rounding.
    ue8m0: power-of-two scales for both quantisations (of `a` if bf16, and of the hidden).
    implementation: "triton", "mosaic_gpu" (Hopper, FP8 weights: the same in one kernel,
      `rows` gathered by XLA first), "xla", a sequence tried in order, or None
      (`gpu_order(M, E)` on a GPU, XLA elsewhere).
    config: the tiling: `pallas.Config` for Triton, with no K split, and block_n 128 for FP8
      weights (the epilogue quantises whole 128-column groups; default
      `triton.swiglu_config`); or `mosaic_gpu.Config` with block_n 128 and one chunk (default
      `mosaic_gpu.swiglu_config`).
  Returns:
    FP8: a QuantizedActivation, codes `[M, N]`, scales `[M, ceil(N/128)]` (layout "row").
    High precision: `[M, N]` in dtype.
  """
  if (gate_scale is None) != (up_scale is None):
    raise InputError("gate_scale and up_scale must both be arrays (FP8 weights) or both None "
                     "(high-precision weights)")
  quantized = gate_scale is not None
  if quantized:
    n, k = fp8_api._check_weight(gate, gate_scale, stacked=True)
    fp8_api._check_weight(up, up_scale, stacked=True)
  else:
    if isinstance(a, QuantizedActivation):
      raise InputError("a is a QuantizedActivation but the weights are unquantised (no "
                       "scales): pass the high-precision activation")
    _, n, k = _check_high_precision(a, gate, "gate")
    _check_high_precision(a, up, "up")
  if up.shape != gate.shape or up.dtype != gate.dtype:
    raise InputError(f"gate and up must match: gate {gate.dtype}{list(gate.shape)}, up "
                     f"{up.dtype}{list(up.shape)}")
  if act not in ACTIVATIONS:
    raise InputError(f"act must be one of {ACTIVATIONS}, got {act!r}")
  if not jnp.issubdtype(dtype, jnp.floating) or jnp.dtype(dtype).itemsize > 4:
    raise DTypeError(f"dtype must be bfloat16, float16 or float32, got {jnp.dtype(dtype)}")
  if isinstance(config, Config) and (config.k_splits != 1
                                     or quantized and config.block_n != BLOCK):
    raise InputError(f"ragged_swiglu needs k_splits=1 (its activation takes whole sums) and "
                     f"with FP8 weights block_n={BLOCK} (whole quantisation groups), got "
                     f"{config}")
  e = gate.shape[0]
  implementation = _dispatch.requested("ragged_swiglu", implementation)
  fmt = fp8_api.activation_format(gate.dtype) if quantized else None
  if quantized:
    a = fp8_api._quantized(a, gate, k, implementation, ue8m0, "row")
  m = _check_rows(a.q if quantized else a, rows)
  _check_groups(gate, group_sizes, m)

  def kernel():
    if m == 0:
      if not quantized:
        return jnp.zeros((0, n), dtype)
      return QuantizedActivation(jnp.zeros((0, n), fmt.dtype),
                                 jnp.zeros((0, -(-n // BLOCK)), jnp.float32), group_size=BLOCK)
    fp8_api._check_kernel(gate, config, triton)
    cfg = config or triton.swiglu_config(m, n, k, e, scaled=quantized)
    if not quantized:
      return triton.ragged_swiglu(a, None, "row", gate, None, up, None, group_sizes, rows, cfg,
                                  act, dtype, None, False)
    return QuantizedActivation(*triton.ragged_swiglu(
        a.q, a.scale, a.layout, gate, gate_scale, up, up_scale, group_sizes, rows, cfg, act,
        dtype, fmt, ue8m0), group_size=BLOCK)

  def mosaic():
    if not quantized:
      raise Unsupported("the Mosaic GPU ragged kernel takes FP8 weights")
    if m == 0:
      return kernel()
    fp8_api._check_kernel(gate, config, mosaic_gpu)
    return mosaic_gpu.ragged_swiglu(a.q, a.scale, a.layout, gate, gate_scale, up, up_scale,
                                    group_sizes, rows, config, act, dtype, fmt, ue8m0)

  backends = {"triton": kernel, "mosaic_gpu": mosaic,
              "xla": lambda: xla.ragged_swiglu(a, gate, gate_scale, up, up_scale, group_sizes,
                                               rows, act, dtype, fmt, ue8m0)}
  return dispatch("ragged_swiglu", backends, implementation, gpu_order=gpu_order(m, e))


def _check_high_precision(a, weight, name: str = "weight") -> tuple[int, int, int]:
  """(E, N, K) of a high-precision `a [T, K]` and `weight [E, N, K]`, checked."""
  _common.check_array("a", a)
  _common.check_float("a", a)
  _common.check_array(name, weight)
  _common.check_float(name, weight)
  if a.ndim != 2:
    raise InputError(f"a must be [T, K], got shape {tuple(a.shape)}")
  if weight.ndim != 3 or 0 in weight.shape:
    raise InputError(f"{name} must be a non-empty [E, N, K], got shape {tuple(weight.shape)}")
  e, n, k = weight.shape
  if a.shape[1] != k:
    raise InputError(f"a has K = {a.shape[1]}, which does not match the {name}'s K = {k}")
  return e, n, k


def _check_groups(weight, group_sizes, m: int) -> None:
  """`group_sizes` an `[E]` integer array; concrete sizes >= 0 summing to at most M (traced
  ones under `debug_checks()`)."""
  e = weight.shape[0]
  _common.check_array("group_sizes", group_sizes)
  if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise InputError(f"group_sizes must be an [E] integer array, got "
                     f"{group_sizes.dtype}{list(group_sizes.shape)}")
  if group_sizes.shape[0] != e:
    raise InputError(f"group_sizes has {group_sizes.shape[0]} groups but the weight has "
                     f"{e} experts")
  if e == 0:
    raise InputError("weight has no experts (E = 0)")
  check_range("group_sizes", group_sizes, 0, m + 1)
  check_range("sum(group_sizes)", jnp.sum(group_sizes), 0, m + 1)


def _check_rows(q, rows) -> int:
  """M, the sorted rows: `rows`' length, or `a`'s; `a` must be 2-D. Concrete row ids are
  checked to lie in [0, T) (traced ones under `debug_checks()`)."""
  if q.ndim != 2:
    raise InputError(f"a must be [T, K], got shape {tuple(q.shape)}")
  if rows is None:
    return q.shape[0]
  _common.check_array("rows", rows)
  if rows.ndim != 1 or not jnp.issubdtype(rows.dtype, jnp.integer):
    raise InputError(f"rows must be an [M] integer array, got {rows.dtype}{list(rows.shape)}")
  if q.shape[0] == 0 and rows.shape[0]:
    raise InputError("rows index into a, which has no rows (T = 0)")
  check_range("rows", rows, 0, q.shape[0])
  return rows.shape[0]

