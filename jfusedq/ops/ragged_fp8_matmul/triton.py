"""Triton kernel for the ragged products: MoE experts over rows sorted by expert.

Grid (row tiles x N blocks, K splits), the tiles those of `tiles.tile_map` (one expert each,
from the start of its group), ordered in groups of GROUP_M tiles as the dense kernel orders row
blocks, so that tiles of one expert run together and share its weight blocks in L2. A program
reads its tile's expert, rows and, with `rows` given, each row's source index (the gather of
tokens into expert order happens in the loads: no sorted copy of the activation is made), then
runs the dense kernel's main loop (`fp8_matmul.triton.scaled_dot`) against that expert's
weight, read in place. Tiles of the zero pseudo-group write zeros; tiles past the routed count
skip the loop and store nothing. FP8 operands take the 1 x 128 / 128 x 128 block scales; bf16
operands (the unquantised path) none.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jfusedq import _target, _triton
from jfusedq._triton import tl
from jfusedq.ops import _common
from jfusedq.ops.fp8_matmul.pallas import BLOCK_K, Config
from jfusedq.ops.fp8_matmul.triton import GROUP_M, scaled_dot
from jfusedq.ops.ragged_fp8_matmul import tiles

BF16_BLOCK_K = 64  # K per step for bf16 operands: a 128 x 128 tile's stage is then 32 KB


@_triton.jit
def ragged_kernel(a_ptr, sa_ptr, w_ptr, sw_ptr, rows_ptr, te_ptr, ts_ptr, tend_ptr, o_ptr,
                  M: tl.constexpr, MA: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                  E: tl.constexpr, TILES: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, PER_SPLIT: tl.constexpr, A_COL: tl.constexpr,
                  GATHER: tl.constexpr, SCALED: tl.constexpr, SWAP: tl.constexpr,
                  GROUP_M: tl.constexpr, BK: tl.constexpr):
  KB: tl.constexpr = (K + BK - 1) // BK
  NB: tl.constexpr = (N + 127) // 128
  SKB: tl.constexpr = (K + 127) // 128
  GRID_N: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
  pid, pid_k = tl.program_id(0), tl.program_id(1)
  group = pid // (GROUP_M * GRID_N)
  first_t = group * GROUP_M
  size_t = tl.minimum(TILES - first_t, GROUP_M)
  tile = first_t + (pid % (GROUP_M * GRID_N)) % size_t
  pid_n = (pid % (GROUP_M * GRID_N)) // size_t
  expert = tl.load(te_ptr + tile)
  start = tl.load(ts_ptr + tile)
  end = tl.load(tend_ptr + tile)

  rm = start + tl.arange(0, BLOCK_M)
  rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
  rk = tl.arange(0, BK)
  m_ok, n_ok = rm < end, rn < N
  src = tl.load(rows_ptr + rm, mask=m_ok, other=0) if GATHER else rm
  # The zero pseudo-group (expert E) reads expert 0's pointers but runs no K block.
  real = expert < E
  e64 = tl.where(real, expert, 0).to(tl.int64)
  a_ptrs = a_ptr + src.to(tl.int64)[:, None] * K + rk[None, :]
  w_ptrs = w_ptr + e64 * N * K + rn.to(tl.int64)[:, None] * K + rk[None, :]
  sw_row = sw_ptr + e64 * NB * SKB + (pid_n * BLOCK_N // 128) * SKB
  if A_COL:
    sa_step, sa_offs = MA, src
  else:
    sa_step, sa_offs = 1, src * SKB
  first = pid_k * PER_SPLIT
  last = tl.minimum(first + PER_SPLIT, KB)
  last = tl.where(real & (start < end), last, first)
  acc = scaled_dot(a_ptrs, w_ptrs, sa_ptr, sa_step, sa_offs, sw_row, m_ok, n_ok, first, last,
                   K, BLOCK_M, BLOCK_N, SWAP, BK, SCALED)
  o_offs = (pid_k.to(tl.int64) * M + rm.to(tl.int64))[:, None] * N + rn[None, :]
  tl.store(o_ptr + o_offs, acc.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def heuristics(m: int, n: int, k: int, groups: int, device_kind: str | None = None,
               scaled: bool = True) -> Config:
  """Tiling by the mean rows a group holds if routing spreads them evenly (the sizes are
  traced: the tiling cannot see them).

  Few rows a group (decode and small batches): tiles of 16-64 rows (weights in the MMA's M
  below 64) and 64 columns, K split until about two programs an SM stream the experts'
  weights, as the dense kernel's decode tiling does. Many (prefill): 128 x 128 tiles of two
  warp groups, the dense kernel's large-M tile.
  """
  sms = _target.sm_count(device_kind)
  rows = m / max(1, min(groups, m))
  if rows > 64:
    return Config(128, 128, 1, num_warps=8, num_stages=4 if scaled else 3)
  block_m = min(64, max(16, _common.pow2_ceil(int(rows))))
  programs = tiles.max_tiles(m, groups, block_m) * -(-n // 64)
  kb = -(-k // (BLOCK_K if scaled else BF16_BLOCK_K))
  k_splits = min(_common.pow2_floor(max(1, 2 * sms // programs)), 8, _common.pow2_floor(kb))
  return Config(block_m, 64, k_splits, num_warps=4, num_stages=4)


def ragged_matmul(a: jax.Array, sa: jax.Array | None, a_layout: str, w: jax.Array,
                  sw: jax.Array | None, group_sizes: jax.Array, rows: jax.Array | None,
                  config: Config, out_dtype) -> jax.Array:
  """a `[T, K]` (fp8 with scales `sa` in `a_layout`, or bf16 with sa None), w `[E, N, K]`
  (fp8 with `sw [E, NB, KB]`, or bf16), group_sizes `[E]`, rows `[M]` or None -> `[M, N]`."""
  _triton.require()  # e4m3fnuz on CUDA is declined by the api
  t, k = a.shape
  e, n, _ = w.shape
  m = t if rows is None else rows.shape[0]
  scaled = sw is not None
  bk = BLOCK_K if scaled else BF16_BLOCK_K
  bm, bn, splits = config.block_m, config.block_n, config.k_splits
  expert, start, end, _ = tiles.tile_map(group_sizes, m, bm)
  count = expert.shape[0]
  kb = -(-k // bk)
  out_shape = (jax.ShapeDtypeStruct((m, n), out_dtype) if splits == 1
               else jax.ShapeDtypeStruct((splits, m, n), jnp.float32))
  # Unused pointers (no rows, no scales) get a one-element stand-in: the kernel never reads it.
  stand_in = jnp.zeros((1,), jnp.int32)
  out = _triton.call(
      ragged_kernel, a, stand_in if sa is None else sa, w, stand_in if sw is None else sw,
      stand_in if rows is None else rows.astype(jnp.int32), expert, start, end,
      out_shape=out_shape, grid=(count * -(-n // bn), splits),
      num_warps=config.num_warps, num_stages=config.num_stages, M=m, MA=t, N=n, K=k, E=e,
      TILES=count, BLOCK_M=bm, BLOCK_N=bn, PER_SPLIT=-(-kb // splits),
      A_COL=a_layout == "col", GATHER=rows is not None, SCALED=scaled,
      SWAP=bm < 64 <= bn, GROUP_M=GROUP_M, BK=bk)
  return out if splits == 1 else out.sum(axis=0).astype(out_dtype)
