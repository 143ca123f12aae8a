"""Public entry points of the ragged (grouped) products: MoE experts over rows sorted by expert."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jfusedq.errors import InputError, check_range
from jfusedq.fp8 import QuantizedActivation
from jfusedq.ops import _common
from jfusedq.ops import _dispatch
from jfusedq.ops._dispatch import declare, dispatch
from jfusedq.ops.fp8_matmul import api as fp8_api
from jfusedq.ops.fp8_matmul.pallas import Config
from jfusedq.ops.ragged_fp8_matmul import triton, xla

IMPLEMENTATIONS = ("triton", "xla")
declare("ragged_fp8_matmul", IMPLEMENTATIONS)
declare("ragged_matmul", IMPLEMENTATIONS)


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
    implementation: "triton", "xla", a sequence tried in order, or None (Triton then XLA on a
      GPU, XLA elsewhere).
    config: the Triton tiling (`pallas.Config`; default `triton.heuristics`).
  Returns:
    `[M, N]` in out_dtype.
  """
  n, k = fp8_api._check_weight(weight, weight_scale, stacked=True)
  e = weight.shape[0]
  implementation = _dispatch.requested("ragged_fp8_matmul", implementation)
  qa = fp8_api._quantized(a, weight, k, implementation, ue8m0, "row")
  m = _check_rows(qa.q, rows)
  _check_groups(weight, group_sizes, m)

  def kernel():
    if m == 0:
      return jnp.zeros((0, n), out_dtype)
    fp8_api._check_kernel(weight, config, triton)
    cfg = config or triton.heuristics(m, n, k, e)
    return triton.ragged_matmul(qa.q, qa.scale, qa.layout, weight, weight_scale, group_sizes,
                                rows, cfg, out_dtype)

  backends = {"triton": kernel,
              "xla": lambda: xla.ragged_fp8_matmul(qa, weight, weight_scale, group_sizes, rows,
                                                   out_dtype)}
  return dispatch("ragged_fp8_matmul", backends, implementation)


def ragged_matmul(a: jax.Array, weight: jax.Array, group_sizes: jax.Array, *,
                  rows: jax.Array | None = None, out_dtype=jnp.bfloat16,
                  implementation: str | Sequence[str] | None = None,
                  config: Config | None = None) -> jax.Array:
  """`ragged_fp8_matmul`'s products in high precision: `a [T, K]` and `weight [E, N, K]` in
  bf16 (or f16 / f32: the kernel reads them in the activation's dtype), f32 accumulation, the
  weights read in place (the unquantised path's experts, with no gathered copy)."""
  _common.check_array("a", a)
  _common.check_float("a", a)
  _common.check_array("weight", weight)
  _common.check_float("weight", weight)
  if a.ndim != 2:
    raise InputError(f"a must be [T, K], got shape {tuple(a.shape)}")
  if weight.ndim != 3 or 0 in weight.shape:
    raise InputError(f"weight must be a non-empty [E, N, K], got shape {tuple(weight.shape)}")
  e, n, k = weight.shape
  if a.shape[1] != k:
    raise InputError(f"a has K = {a.shape[1]}, which does not match the weight's K = {k}")
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
  return dispatch("ragged_matmul", backends, implementation)


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

