"""The ragged products in XLA: a loop over the row tiles that routing fills (`tiles.py`).

Each step slices one tile of rows and its expert's weight (dequantised to f32 for FP8) and
multiplies them, so the work grows with the rows (plus under one tile a group), not with the
number of experts: `jax.lax.ragged_dot` on XLA:CPU computes every group on every row, E times
the routed FLOPs. The loop's trip count is the traced number of filled tiles. XLA:CPU computes
FP8 in f16 and converts an FP8 weight whole as the program starts: one elementwise pass the size
of the weights, not of the products.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jfusedq.fp8 import BLOCK, Fp8Format, QuantizedActivation
from jfusedq.ops import _common
from jfusedq.ops.fp8_matmul.reference import dequantize_weight
from jfusedq.ops.group_quant.reference import group_quant
from jfusedq.ops.ragged_fp8_matmul import tiles
from jfusedq.ops.ragged_fp8_matmul.reference import swiglu


def block_m(m: int, groups: int) -> int:
  """Rows a step: the power of two nearest the mean rows a group holds, 1 to 128 (under one
  tile of waste a group, and few steps where groups are large)."""
  return min(128, _common.pow2_floor(m // max(1, min(groups, m))))


def _tiled(x: jax.Array, expert_weight, e: int, n: int, group_sizes, rows,
           out_dtype) -> jax.Array:
  """x `[T, K]` (rows `[M]` picking its rows, or None); expert_weight(i) -> f32 `[N, K]` of
  the E experts."""
  if rows is not None:
    x = x[rows]
  m, k = x.shape
  bm = block_m(m, e)
  expert, start, _, end, count = tiles.tile_map(group_sizes, m, bm)
  # Padded by a tile, so a slice at any start stays in bounds without XLA shifting it back.
  x = jnp.pad(x, ((0, bm), (0, 0)))

  def step(t, out):
    s = start[t]
    y = jnp.einsum("mk,nk->mn", lax.dynamic_slice(x, (s, 0), (bm, k)), expert_weight(expert[t]),
                   precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    own = (s + jnp.arange(bm) < end[t])[:, None]
    return lax.dynamic_update_slice(out, jnp.where(own, y, lax.dynamic_slice(out, (s, 0),
                                                                             (bm, n))), (s, 0))

  out = lax.fori_loop(0, count, step, jnp.zeros((m + bm, n), jnp.float32))
  return out[:m].astype(out_dtype)


def ragged_fp8_matmul(a: QuantizedActivation, qw, w_scale, group_sizes, rows=None,
                      out_dtype=jnp.bfloat16) -> jax.Array:
  """As `reference.ragged_fp8_matmul`, one filled tile at a time."""
  weight = lambda i: dequantize_weight(qw[i], w_scale[i])
  e, n, _ = qw.shape
  return _tiled(a.dequantize(jnp.float32), weight, e, n, group_sizes, rows, out_dtype)


def ragged_matmul(a, w, group_sizes, rows=None, out_dtype=jnp.bfloat16) -> jax.Array:
  """As `reference.ragged_matmul`, one filled tile at a time."""
  weight = lambda i: w[i].astype(jnp.float32)
  e, n, _ = w.shape
  return _tiled(a.astype(jnp.float32), weight, e, n, group_sizes, rows, out_dtype)


def ragged_swiglu(a, gate, gate_scale, up, up_scale, group_sizes, rows, act: str, dtype,
                  fmt: Fp8Format | None, ue8m0: bool):
  """As `reference.ragged_swiglu`: both products in one loop over the filled tiles (each step
  one [rows, 2N] product against the expert's gate and up side by side)."""
  if gate_scale is None:
    weight = lambda i: jnp.concatenate([gate[i], up[i]]).astype(jnp.float32)
    x = a.astype(jnp.float32)
  else:
    weight = lambda i: jnp.concatenate([dequantize_weight(gate[i], gate_scale[i]),
                                        dequantize_weight(up[i], up_scale[i])])
    x = a.dequantize(jnp.float32)
  e, n, _ = gate.shape
  gu = _tiled(x, weight, e, 2 * n, group_sizes, rows, dtype)
  h = swiglu(gu[:, :n], gu[:, n:], act, dtype)
  return h if gate_scale is None else group_quant(h, fmt, group_size=BLOCK, ue8m0=ue8m0)
