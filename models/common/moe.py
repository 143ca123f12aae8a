"""Routed MoE experts shared by the models: the (token, expert) pairs a router picked, sorted by
expert on the device, through grouped products whose work grows with tokens x top_k.

For M tokens routed to k experts each (weights w, ids idx `[M, k]`) and expert
e(x) = down_e(act(gate_e(x), up_e(x))):

    y[m] = sum_j w[m, j] * e_{idx[m, j]}(x[m])                     (f32 sum, then dtype)

Two formulations, picked at trace time by shape:
  gathered  (FP8, M * k < PAIRS_PER_EXPERT * E, or one token: decode) a product
            per pair, each reading its pair's expert in place (`grouped_fp8_matmul`); a step
            reads only the chosen experts' weights.
  sorted    (otherwise, and always in bf16) the M * k pairs sorted by expert (a stable argsort:
            ties keep token order), `group_sizes` counted by expert; gate, up and `act` in one
            kernel (`ragged_swiglu`: each pair's token row read in place, or on Mosaic GPU
            gathered first; in FP8 the hidden quantised there too), the down product on the
            sorted hidden rows, then the rows back in pair order and mixed by w. Expert
            weights are read in place (no gathered copy) and no expert computes a token it
            was not picked for.
Expert ids outside [0, E) count for no group: their pairs give zero rows, never another expert's
output.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jfusedq.fp8 import QuantizedActivation
from jfusedq.nn import StackedLinear, high_precision
from jfusedq.ops import _common, _dispatch
from jfusedq.ops.ragged_fp8_matmul import ragged_swiglu
from jfusedq.ops.ragged_fp8_matmul.reference import swiglu

# Pairs an expert on average below which a product per pair beats the sorted ragged products
# (one token always runs per pair): at DeepSeek-V3's 256 experts on an H100 the ragged products
# took 0.67-0.89x the per-pair ones' time over up + down at 16 tokens (0.5 an expert), and one
# token's 8 pairs 1.01-1.08x (benchmarks/README.md); 2-15 tokens untimed.
PAIRS_PER_EXPERT = 0.5


class Experts(nnx.Module):
  """E routed SwiGLU experts, weights stacked as Hugging Face lays them out: `gate_proj` and
  `up_proj` `[E, I, H]`, `down_proj` `[E, H, I]` (FP8 with 128 x 128 block scales when `fmt`
  is given). Under tensor parallelism I is split (gate/up column-, down row-parallel): the
  output is a partial sum. `act`: the activation's rounding, "silu_mul" (DeepSeek-V3) or
  "silu_round_mul" (Hugging Face's Qwen3.5), as `ragged_fp8_matmul.reference.swiglu`. Formulas
  in the module docstring."""

  def __init__(self, num: int, hidden: int, intermediate: int, *, fmt, ue8m0: bool, dtype,
               param_dtype, act: str, implementation=None,
               kernel_init: Callable | None = None, rngs: nnx.Rngs):
    kw = dict(fmt=fmt, ue8m0=ue8m0, dtype=dtype, param_dtype=param_dtype,
              implementation=implementation, rngs=rngs)
    if kernel_init is not None:
      kw["kernel_init"] = kernel_init
    self.gate_proj = StackedLinear(num, hidden, intermediate, **kw)
    self.up_proj = StackedLinear(num, hidden, intermediate, **kw)
    self.down_proj = StackedLinear(num, intermediate, hidden, **kw)
    self.num_experts, self.dtype, self.act = num, dtype, act

  @property
  def takes_fp8(self) -> bool:
    return self.gate_proj.fmt is not None

  def __call__(self, x: jax.Array | QuantizedActivation, weights: jax.Array, idx: jax.Array,
               *, gathered: bool | None = None) -> jax.Array:
    """x `[..., H]`; weights, idx `[..., k]` from the router -> `[..., H]`.
    `gathered`: force a formulation (None: by shape, module docstring)."""
    lead, k = weights.shape[:-1], weights.shape[-1]
    m = math.prod(lead)
    if gathered is None:
      gathered = self.takes_fp8 and (m * k < PAIRS_PER_EXPERT * self.num_experts or m == 1)
    flat = x.flatten() if isinstance(x, QuantizedActivation) else x.reshape(m, x.shape[-1])
    ids = idx.reshape(m, k)
    y = (self._gathered(flat, ids) if gathered else self._sorted(flat, ids))  # [M, k, H]
    y = jnp.einsum("mjh,mj->mh", y.astype(jnp.float32), weights.reshape(m, k))
    return y.reshape(*lead, -1).astype(self.dtype)

  def _gathered(self, x, ids):
    x = x.with_layout("row") if isinstance(x, QuantizedActivation) else x
    h = swiglu(self.gate_proj.gathered(x, ids), self.up_proj.gathered(x, ids), self.act,
               self.dtype)
    return self.down_proj.gathered(h, ids, batched=True)

  def _sorted(self, x, ids):
    m, k = ids.shape
    flat = ids.reshape(-1)
    # An id outside [0, E) sorts last and counts for no group: its rows are the zero tail.
    e = self.num_experts
    clamped, valid = _common.expert_ids(flat, e)
    key = jnp.where(valid, clamped, e)
    order = jnp.argsort(key, stable=True)
    rows = (order // k).astype(jnp.int32)  # the token of each sorted pair
    sizes = jnp.bincount(key, length=e + 1)[:e].astype(jnp.int32)
    # One kernel takes x for both projections: with FP8 weights it quantises a bf16 x itself.
    g, u = self.gate_proj, self.up_proj
    scale = lambda p: p.weight_scale_inv[...] if self.takes_fp8 else None
    h = ragged_swiglu(x if self.takes_fp8 else high_precision(x).astype(self.dtype),
                      g.weight[...], scale(g), u.weight[...], scale(u), sizes, rows=rows,
                      act=self.act, dtype=self.dtype, ue8m0=self.down_proj.ue8m0,
                      implementation=_dispatch.among("ragged_swiglu", g.implementation))
    y = self.down_proj.ragged(h, sizes)  # [M * k, H], sorted pairs
    # Back to pair order: the inverse permutation gathers rows (an index scatter, no row one).
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(m * k, dtype=order.dtype))
    return y[inverse].reshape(m, k, -1)
