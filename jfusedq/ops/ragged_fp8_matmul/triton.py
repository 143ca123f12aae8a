"""Triton kernels for the ragged products: MoE experts over rows sorted by expert.

Grid (row tiles x N blocks, K splits), the tiles those of `tiles.tile_map` (one expert each,
from the start of its group), ordered in groups of GROUP_M tiles as the dense kernel orders row
blocks, so that tiles of one expert run together and share its weight blocks in L2. A program
reads its tile's expert, rows and, with `rows` given, each row's source index (the gather of
tokens into expert order happens in the loads: no sorted copy of the activation is made), then
runs the dense kernel's main loop (`fp8_matmul.triton.scaled_dot`) against that expert's
weight, read in place. Tiles of the zero pseudo-group write zeros; tiles past the routed count
skip the loop and store nothing. FP8 operands take the 1 x 128 / 128 x 128 block scales; bf16
operands (the unquantised path) none.

`ragged_swiglu_kernel` (and `_hp_` for bf16) tiles the same way with no K split and runs the
gate and up products in one loop (`scaled_dot`'s PAIR: each activation block loaded once for
both), then the activation on the tile in registers and, for FP8, the hidden's quantisation
(`group_quant.triton.store_quant`: a 128-column tile holds each row's whole group).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jfusedq import _target, _triton
from jfusedq._triton import tl
from jfusedq.ops import _common
from jfusedq.ops.fp8_matmul.pallas import BLOCK_K, Config
from jfusedq.ops.fp8_matmul.triton import GROUP_M, scaled_dot
from jfusedq.ops.group_quant.pallas import to_fp8
from jfusedq.ops.group_quant.triton import quant_out_shapes, quant_params, store_quant
from jfusedq.ops.ragged_fp8_matmul import tiles

BF16_BLOCK_K = 64  # K per step for bf16 operands: a 128 x 128 tile's stage is then 32 KB


@_triton.jit
def _tile(rows_ptr, te_ptr, ts_ptr, tend_ptr, N: tl.constexpr, E: tl.constexpr,
          TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          GATHER: tl.constexpr, GROUP_M: tl.constexpr):
  """This program's tile: (pid_n, its expert as int64 (0 for the zero pseudo-group), whether
  it runs the K loop, rows rm, columns rn, their masks, the source row of each)."""
  GRID_N: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
  pid = tl.program_id(0)
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
  m_ok, n_ok = rm < end, rn < N
  src = tl.load(rows_ptr + rm, mask=m_ok, other=0) if GATHER else rm
  # The zero pseudo-group (expert E) reads expert 0's pointers but runs no K block.
  real = expert < E
  e64 = tl.where(real, expert, 0).to(tl.int64)
  return pid_n, e64, real & (start < end), rm, rn, m_ok, n_ok, src


@_triton.jit
def _activation(a_ptr, src, MA: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                A_COL: tl.constexpr):
  """(pointers of the rows' first K block, scale step a block, scale offsets of the rows)."""
  SKB: tl.constexpr = (K + 127) // 128
  a_ptrs = a_ptr + src.to(tl.int64)[:, None] * K + tl.arange(0, BK)[None, :]
  if A_COL:
    sa_step, sa_offs = MA, src
  else:
    sa_step, sa_offs = 1, src * SKB
  return a_ptrs, sa_step, sa_offs


@_triton.jit
def _weight(w_ptr, sw_ptr, e64, rn, pid_n, N: tl.constexpr, K: tl.constexpr,
            BLOCK_N: tl.constexpr, BK: tl.constexpr):
  """(pointers of expert e64's first K block at columns rn, its weight-scale row)."""
  NB: tl.constexpr = (N + 127) // 128
  SKB: tl.constexpr = (K + 127) // 128
  w_ptrs = w_ptr + e64 * N * K + rn.to(tl.int64)[:, None] * K + tl.arange(0, BK)[None, :]
  return w_ptrs, sw_ptr + e64 * NB * SKB + (pid_n * BLOCK_N // 128) * SKB


@_triton.jit
def ragged_kernel(a_ptr, sa_ptr, w_ptr, sw_ptr, rows_ptr, te_ptr, ts_ptr, tend_ptr, o_ptr,
                  M: tl.constexpr, MA: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                  E: tl.constexpr, TILES: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, PER_SPLIT: tl.constexpr, A_COL: tl.constexpr,
                  GATHER: tl.constexpr, SCALED: tl.constexpr, SWAP: tl.constexpr,
                  GROUP_M: tl.constexpr, BK: tl.constexpr):
  KB: tl.constexpr = (K + BK - 1) // BK
  pid_n, e64, run, rm, rn, m_ok, n_ok, src = _tile(rows_ptr, te_ptr, ts_ptr, tend_ptr, N, E,
                                                   TILES, BLOCK_M, BLOCK_N, GATHER, GROUP_M)
  a_ptrs, sa_step, sa_offs = _activation(a_ptr, src, MA, K, BK, A_COL)
  w_ptrs, sw_row = _weight(w_ptr, sw_ptr, e64, rn, pid_n, N, K, BLOCK_N, BK)
  pid_k = tl.program_id(1)
  first = pid_k * PER_SPLIT
  last = tl.where(run, tl.minimum(first + PER_SPLIT, KB), first)
  acc = scaled_dot(a_ptrs, w_ptrs, sa_ptr, sa_step, sa_offs, sw_row, m_ok, n_ok, first, last,
                   K, BLOCK_M, BLOCK_N, SWAP, BK, SCALED)
  o_offs = (pid_k.to(tl.int64) * M + rm.to(tl.int64))[:, None] * N + rn[None, :]
  tl.store(o_ptr + o_offs, acc.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@_triton.jit
def _round(x, HDT: tl.constexpr):
  """x rounded to the hidden dtype HDT (nearest even) and back to f32."""
  if HDT == "bfloat16":
    x = x.to(tl.bfloat16).to(tl.float32)
  elif HDT == "float16":
    x = x.to(tl.float16).to(tl.float32)
  return x


@_triton.jit
def _hidden(a_ptr, sa_ptr, wg_ptr, swg_ptr, wu_ptr, swu_ptr, rows_ptr, te_ptr, ts_ptr, tend_ptr,
            MA: tl.constexpr, N: tl.constexpr, K: tl.constexpr, E: tl.constexpr,
            TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            A_COL: tl.constexpr, GATHER: tl.constexpr, SWAP: tl.constexpr,
            GROUP_M: tl.constexpr, ACT: tl.constexpr, HDT: tl.constexpr,
            SCALED: tl.constexpr, BK: tl.constexpr):
  """This program's tile of the hidden, f32 holding HDT values: (h, rm, rn, m_ok, n_ok,
  pid_n)."""
  KB: tl.constexpr = (K + BK - 1) // BK
  pid_n, e64, run, rm, rn, m_ok, n_ok, src = _tile(rows_ptr, te_ptr, ts_ptr, tend_ptr, N, E,
                                                   TILES, BLOCK_M, BLOCK_N, GATHER, GROUP_M)
  a_ptrs, sa_step, sa_offs = _activation(a_ptr, src, MA, K, BK, A_COL)
  wg_ptrs, swg_row = _weight(wg_ptr, swg_ptr, e64, rn, pid_n, N, K, BLOCK_N, BK)
  wu_ptrs, swu_row = _weight(wu_ptr, swu_ptr, e64, rn, pid_n, N, K, BLOCK_N, BK)
  g, u = scaled_dot(a_ptrs, wg_ptrs, sa_ptr, sa_step, sa_offs, swg_row, m_ok, n_ok, 0,
                    tl.where(run, KB, 0), K, BLOCK_M, BLOCK_N, SWAP, BK, SCALED, wu_ptrs,
                    swu_row, True)
  # The projections' outputs as the unfused path rounds them, then the model's activation.
  g, u = _round(g, HDT), _round(u, HDT)
  s = g * tl.sigmoid(g)
  if ACT == "silu_round_mul":
    s = _round(s, HDT)
  return _round(s * u, HDT), rm, rn, m_ok, n_ok, pid_n


@_triton.jit
def ragged_swiglu_kernel(a_ptr, sa_ptr, wg_ptr, swg_ptr, wu_ptr, swu_ptr, rows_ptr, te_ptr,
                         ts_ptr, tend_ptr, q_ptr, s_ptr, M: tl.constexpr, MA: tl.constexpr,
                         N: tl.constexpr, K: tl.constexpr, E: tl.constexpr,
                         TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         A_COL: tl.constexpr, GATHER: tl.constexpr, SWAP: tl.constexpr,
                         GROUP_M: tl.constexpr, ACT: tl.constexpr, HDT: tl.constexpr,
                         G: tl.constexpr, FP8_MAX: tl.constexpr, INV_MAX: tl.constexpr,
                         UE8M0: tl.constexpr, COL: tl.constexpr, FNUZ_BITS: tl.constexpr,
                         BK: tl.constexpr):
  h, rm, rn, m_ok, n_ok, pid_n = _hidden(
      a_ptr, sa_ptr, wg_ptr, swg_ptr, wu_ptr, swu_ptr, rows_ptr, te_ptr, ts_ptr, tend_ptr, MA,
      N, K, E, TILES, BLOCK_M, BLOCK_N, A_COL, GATHER, SWAP, GROUP_M, ACT, HDT, True, BK)
  # Each row's BLOCK_N columns are whole groups of G: the hidden's quantisation needs no other
  # program. Rows this tile does not own get row index M, which masks their scale store.
  store_quant(h, tl.where(m_ok, rm, M), M, rm.to(tl.int64)[:, None] * N + rn[None, :],
              m_ok[:, None] & n_ok[None, :], q_ptr, s_ptr, N, pid_n * (BLOCK_N // G), G,
              FP8_MAX, INV_MAX, UE8M0, COL, FNUZ_BITS)


@_triton.jit
def ragged_swiglu_hp_kernel(a_ptr, wg_ptr, wu_ptr, rows_ptr, te_ptr, ts_ptr, tend_ptr, o_ptr,
                            MA: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                            E: tl.constexpr, TILES: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, GATHER: tl.constexpr, SWAP: tl.constexpr,
                            GROUP_M: tl.constexpr, ACT: tl.constexpr, HDT: tl.constexpr,
                            BK: tl.constexpr):
  # Unquantised operands: no scales (their pointers are the weights', never read).
  h, rm, rn, m_ok, n_ok, _ = _hidden(
      a_ptr, a_ptr, wg_ptr, wg_ptr, wu_ptr, wu_ptr, rows_ptr, te_ptr, ts_ptr, tend_ptr, MA, N,
      K, E, TILES, BLOCK_M, BLOCK_N, False, GATHER, SWAP, GROUP_M, ACT, HDT, False, BK)
  tl.store(o_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], h.to(o_ptr.dtype.element_ty),
           mask=m_ok[:, None] & n_ok[None, :])


def heuristics(m: int, n: int, k: int, groups: int, device_kind: str | None = None,
               scaled: bool = True) -> Config:
  """Tiling by the mean rows a group holds if routing spreads them evenly (the sizes are
  traced: the tiling cannot see them).

  Few rows a group (decode and small batches): tiles of 16-64 rows (weights in the MMA's M
  below 64) and 64 columns, K split until about two programs an SM stream the experts'
  weights, as the dense kernel's decode tiling does. Many (prefill): 128 x 128 tiles of two
  warp groups, the dense kernel's large-M tile; FP8 at 65-128 rows a group, 64 x 128 tiles of
  one, which waste less of each group's last tile: 1.10-1.12x faster at 4096 tokens over
  DeepSeek-V3's and Qwen3.5's experts (128 and 80 rows a group; an H100), level at 16384.
  """
  sms = _target.sm_count(device_kind)
  rows = m / max(1, min(groups, m))
  if rows > 64 and (rows > 128 or not scaled):
    return Config(128, 128, 1, num_warps=8, num_stages=4 if scaled else 3)
  if rows > 64:
    return Config(64, 128, 1, num_warps=4, num_stages=4)
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
  expert, start, _, end, _ = tiles.tile_map(group_sizes, m, bm)
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


def swiglu_config(m: int, n: int, k: int, groups: int, device_kind: str | None = None,
                  scaled: bool = True) -> Config:
  """`heuristics`' decode tiling without its K split (the activation needs whole sums), FP8 with
  128 columns (one quantisation group a row); from 65 rows a group the 128 x 128 tile of two
  warp groups, 3 stages of two weights (3 x 48 KB of shared memory; bf16 stages are 64 deep in
  K, the same bytes): with two products a tile it beat the 64-row tile 1.15-1.22x at 4096
  tokens, where the single product loses to it (an H100). On ROCm at most 2 stages: Triton
  3.9's AMD block-pingpong pass fails on the paired loop at 4 (gfx950, the decode tile)."""
  if m / max(1, min(groups, m)) > 64:
    c = Config(128, 128, 1, num_warps=8, num_stages=3)
  else:
    c = heuristics(m, n, k, groups, device_kind, scaled)
  stages = min(c.num_stages, 2) if _target.current().platform == "rocm" else c.num_stages
  return Config(c.block_m, 128 if scaled else c.block_n, 1, num_warps=c.num_warps,
                num_stages=stages)


def ragged_swiglu(a: jax.Array, sa: jax.Array | None, a_layout: str, wg: jax.Array,
                  swg: jax.Array | None, wu: jax.Array, swu: jax.Array | None,
                  group_sizes: jax.Array, rows: jax.Array | None, config: Config, act: str,
                  hidden_dtype, fmt, ue8m0: bool):
  """a `[T, K]` fp8 (scales `sa` in `a_layout`), wg / wu `[E, N, K]` fp8 with `[E, NB, KB]`
  scales -> the hidden's (codes `[M, N]`, row scales `[M, NB]`); or a and the weights in high
  precision (the scales None) -> the hidden `[M, N]` in hidden_dtype."""
  target = _target.current()
  _triton.require(target)
  t, k = a.shape
  e, n, _ = wg.shape
  m = t if rows is None else rows.shape[0]
  bm = config.block_m
  expert, start, _, end, _ = tiles.tile_map(group_sizes, m, bm)
  count = expert.shape[0]
  kw = dict(grid=(count * -(-n // config.block_n),), num_warps=config.num_warps,
            num_stages=config.num_stages, MA=t, N=n, K=k, E=e, TILES=count, BLOCK_M=bm,
            BLOCK_N=config.block_n, GATHER=rows is not None, SWAP=bm < 64 <= config.block_n,
            GROUP_M=GROUP_M, ACT=act, HDT=jnp.dtype(hidden_dtype).name)
  # Without rows a one-element stand-in: the kernel never reads it.
  rows = jnp.zeros((1,), jnp.int32) if rows is None else rows.astype(jnp.int32)
  if swg is None:
    return _triton.call(ragged_swiglu_hp_kernel, a, wg.astype(a.dtype), wu.astype(a.dtype),
                        rows, expert, start, end,
                        out_shape=jax.ShapeDtypeStruct((m, n), hidden_dtype), BK=BF16_BLOCK_K,
                        **kw)
  q, scale = _triton.call(
      ragged_swiglu_kernel, a, sa, wg, swg, wu, swu, rows, expert, start, end,
      out_shape=quant_out_shapes(m, n, fmt, BLOCK_K, "row", target), M=m,
      A_COL=a_layout == "col", BK=BLOCK_K, **kw,
      **quant_params(fmt, BLOCK_K, "row", ue8m0, target))
  return to_fp8(q, fmt), scale
