"""The ragged products in plain jnp, float32: the contract every implementation meets.

Rows sorted by group: row r of the (gathered) activation belongs to group e while
`sum(group_sizes[:e]) <= r < sum(group_sizes[:e + 1])` and is multiplied by expert e's weight;
rows past the last group are zero (`jax.lax.ragged_dot`'s convention). Computed with
`jax.lax.ragged_dot` on the dequantised operands at the highest precision, which XLA on CPU
evaluates densely (every group on every row): a reference for tests, not a path to run.

`ragged_swiglu` is the MoE experts' first half: the gate and up products of the same rows, the
experts' activation on them (`swiglu`), and the hidden quantised per 1 x 128 group for the down
product.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jfusedq.fp8 import BLOCK, Fp8Format, QuantizedActivation
from jfusedq.ops.fp8_matmul.reference import dequantize_weight
from jfusedq.ops.group_quant.reference import group_quant

ACTIVATIONS = ("silu_mul", "silu_round_mul")


def swiglu(g: jax.Array, u: jax.Array, act: str, dtype) -> jax.Array:
  """The experts' activation on the gate and up products, each first rounded to dtype (as the
  projections output them): "silu_mul" `silu(g) * u` in f32, rounded once (DeepSeek-V3);
  "silu_round_mul" `silu(g)` rounded to dtype, times u, rounded (Hugging Face's Qwen3.5
  experts). `silu(x) = x * sigmoid(x)`."""
  # Each rounding as reduce_precision in f32: under jit XLA on GPU may drop an f32 -> bf16 ->
  # f32 round trip (excess precision allowed), never a reduce_precision.
  info = jnp.finfo(dtype)
  rounded = lambda v: jax.lax.reduce_precision(v.astype(jnp.float32), info.nexp, info.nmant)
  g, u = rounded(g), rounded(u)
  s = jax.nn.silu(g)
  if act == "silu_round_mul":
    s = rounded(s)
  return rounded(s * u).astype(dtype)


def _ragged(x: jax.Array, w: jax.Array, group_sizes: jax.Array, rows, out_dtype) -> jax.Array:
  """x `[T, K]` f32 (rows `[M]` picking its rows, or None), w `[E, N, K]` f32 -> `[M, N]`."""
  if rows is not None:
    x = x[rows]
  out = jax.lax.ragged_dot(x, jnp.swapaxes(w, 1, 2), group_sizes.astype(jnp.int32),
                           precision=jax.lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)
  return out.astype(out_dtype)


def ragged_fp8_matmul(a: QuantizedActivation, qw: jax.Array, w_scale: jax.Array,
                      group_sizes: jax.Array, rows: jax.Array | None = None,
                      out_dtype=jnp.bfloat16) -> jax.Array:
  """`a` (`q [T, K]`), `qw [E, N, K]` fp8 with `w_scale [E, NB, KB]`, `group_sizes [E]` ->
  `[M, N]`: row r is `a[rows[r]]` (or `a[r]`) times its group's dequantised expert."""
  w = jax.vmap(dequantize_weight)(qw, w_scale)
  return _ragged(a.dequantize(jnp.float32), w, group_sizes, rows, out_dtype)


def ragged_matmul(a: jax.Array, w: jax.Array, group_sizes: jax.Array,
                  rows: jax.Array | None = None, out_dtype=jnp.bfloat16) -> jax.Array:
  """The high-precision product: `a [T, K]`, `w [E, N, K]` -> `[M, N]`, in f32 from the
  operands as given."""
  return _ragged(a.astype(jnp.float32), w.astype(jnp.float32), group_sizes, rows, out_dtype)


def ragged_swiglu(a, gate: jax.Array, gate_scale: jax.Array | None, up: jax.Array,
                  up_scale: jax.Array | None, group_sizes: jax.Array, rows: jax.Array | None,
                  act: str, dtype, fmt: Fp8Format | None, ue8m0: bool):
  """`swiglu(a_rows @ gate_e^T, a_rows @ up_e^T)` per sorted row (products as
  `ragged_fp8_matmul`'s, in dtype), quantised to `fmt` per 1 x 128 group, row scales; with the
  scales None (high-precision a and weights, products as `ragged_matmul`'s) the hidden itself."""
  if gate_scale is None:
    g, u = (ragged_matmul(a, w, group_sizes, rows, dtype) for w in (gate, up))
    return swiglu(g, u, act, dtype)
  g = ragged_fp8_matmul(a, gate, gate_scale, group_sizes, rows, dtype)
  u = ragged_fp8_matmul(a, up, up_scale, group_sizes, rows, dtype)
  return group_quant(swiglu(g, u, act, dtype), fmt, group_size=BLOCK, ue8m0=ue8m0)
