"""Triton kernel for the block-scaled W8A8 GEMM (DeepSeek format).

Grid (M blocks x N blocks, K splits), the first axis ordered in groups of GROUP_M row blocks so
that programs running together share weight and activation tiles in L2. A program walks its
share of the K blocks of 128 (the scale granularity): one fp8 x fp8 `tl.dot` per block into
f32, scaled by the activation's per-row scale and the weight block's scalar scale (`block_n`
divides 128, so a program's columns share one weight-scale row), accumulated in f32. Loads
and stores are masked, so M, N and K need not be multiples of anything. With K split, each
split writes an f32 partial and XLA adds them (deterministic, unlike atomics).

Grouped (MoE experts): the third grid axis runs B products in one launch, product b reading
activation group b // A_DIV and weight `ids[b]` of a stacked `[E, N, K]` by pointer offset, so
no expert's weight is sliced or gathered into a copy first.

Tiling: `pallas.Config`, chosen by `heuristics`. The operands are loaded as fp8 (not
as bytes bitcast in registers, which would route them through registers between shared memory
and the MMA); a masked load fills with +0, a code in both formats.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jfusedq import _target, _triton
from jfusedq._triton import tl
from jfusedq.ops.fp8_matmul import pallas
from jfusedq.ops.fp8_matmul.pallas import BLOCK_K, Config

GROUP_M = 8  # row blocks per L2 group


@_triton.jit
def scaled_dot(a_ptrs, w_ptrs, sa_ptr, sa_step, sa_offs, sw_row, m_ok, n_ok, first, last,
               K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               SWAP: tl.constexpr, BK: tl.constexpr, SCALED: tl.constexpr = True,
               w2_ptrs=None, sw2_row=None, PAIR: tl.constexpr = False):
  """The main loop over K blocks first .. last - 1 -> f32 `[BLOCK_M, BLOCK_N]`: one dot a
  block, times (SCALED: fp8 operands) the activation rows' scales (`sa_ptr + block * sa_step +
  sa_offs`, masked by `m_ok`) and the weight block's scalar scale (`sw_row + block`); without
  SCALED (bf16 operands) the scale pointers are not read. `a_ptrs` / `w_ptrs` point at the
  first block's `[BLOCK_M, BK]` / `[BLOCK_N, BK]` tiles, rows masked by m_ok / n_ok.
  PAIR: a second weight (`w2_ptrs`, `sw2_row`, laid out as the first) against the same
  activation tile, each block loaded once for both: -> (acc, acc2)."""
  KB: tl.constexpr = (K + BK - 1) // BK
  rk = tl.arange(0, BK)
  if SWAP:
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
  else:
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
  acc2 = acc
  # Scales are loaded one K block ahead (a loop-carried load), so their read overlaps a
  # block's MMA instead of preceding it: 0.4-8% faster with row-layout scales than loading
  # them in their step (M = 1 / 16 / 64). Column-layout scales ([KB, M]) of each block lie in a
  # new stretch of memory (a row's share one L1 line for 32 blocks): loaded in their step the
  # loop ran 1.14-1.44x the row layout's time at M = 64, ahead 0.99-1.14x.
  # Block indices are clamped to the last one (KB - 1): an empty split or the last step reads
  # a block it does not use, in bounds.
  if SCALED:
    s_a_next = tl.load(sa_ptr + tl.minimum(first, KB - 1) * sa_step + sa_offs, mask=m_ok,
                       other=0.0)
    s_w_next = tl.load(sw_row + tl.minimum(first, KB - 1))
    s_w2_next = s_w_next
    if PAIR:
      s_w2_next = tl.load(sw2_row + tl.minimum(first, KB - 1))
  else:
    s_a_next, s_w_next, s_w2_next = 1.0, 1.0, 1.0  # not read
  for b in range(first, last):
    if K % BK == 0:
      a_mask = m_ok[:, None]
      w_mask = n_ok[:, None]
    else:
      k_ok = rk < K - b * BK
      a_mask = m_ok[:, None] & k_ok[None, :]
      w_mask = n_ok[:, None] & k_ok[None, :]
    a = tl.load(a_ptrs + b * BK, mask=a_mask, other=0.0)
    w = tl.load(w_ptrs + b * BK, mask=w_mask, other=0.0)
    s_a, s_w, s_w2 = s_a_next, s_w_next, s_w2_next
    if SCALED:
      nxt = tl.minimum(b + 1, KB - 1)
      s_a_next = tl.load(sa_ptr + nxt * sa_step + sa_offs, mask=m_ok, other=0.0)
      s_w_next = tl.load(sw_row + nxt)
      if PAIR:
        s_w2_next = tl.load(sw2_row + nxt)
    acc = _block(acc, a, w, s_a, s_w, SWAP, SCALED)
    if PAIR:
      w2 = tl.load(w2_ptrs + b * BK, mask=w_mask, other=0.0)
      acc2 = _block(acc2, a, w2, s_a, s_w2, SWAP, SCALED)
  if SWAP:
    acc = tl.trans(acc)
    acc2 = tl.trans(acc2)
  if PAIR:
    out = acc, acc2
  else:
    out = acc
  return out


@_triton.jit
def _block(acc, a, w, s_a, s_w, SWAP: tl.constexpr, SCALED: tl.constexpr):
  """acc + one K block's product: fp8 x fp8 -> f32 on the tensor cores, both operands straight
  from shared memory (w is [N, K], so its transpose is K-major as the fp8 MMA wants it, and
  a's when swapped), times the rows' and the weight block's scales (SCALED)."""
  if SWAP:
    d = tl.dot(w, tl.trans(a))
    if SCALED:
      d = d * (s_w * s_a[None, :])
  else:
    d = tl.dot(a, tl.trans(w))
    if SCALED:
      d = d * (s_a[:, None] * s_w)
  return acc + d


@_triton.jit
def fp8_matmul_kernel(a_ptr, sa_ptr, w_ptr, sw_ptr, ids_ptr, m, o_ptr, N: tl.constexpr,
                      K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      PER_SPLIT: tl.constexpr, A_COL: tl.constexpr, GROUP_M: tl.constexpr,
                      SWAP: tl.constexpr, A_DIV: tl.constexpr, BATCH: tl.constexpr,
                      BK: tl.constexpr):
  KB: tl.constexpr = (K + BK - 1) // BK
  NB: tl.constexpr = (N + BK - 1) // BK
  GRID_N: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
  pid, pid_k, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
  group = pid // (GROUP_M * GRID_N)
  first_m = group * GROUP_M
  size_m = tl.minimum(tl.cdiv(m, BLOCK_M) - first_m, GROUP_M)
  pid_m = first_m + (pid % (GROUP_M * GRID_N)) % size_m
  pid_n = (pid % (GROUP_M * GRID_N)) // size_m
  expert = tl.load(ids_ptr + pid_b).to(tl.int64)
  a_ptr += (pid_b // A_DIV).to(tl.int64) * m * K
  sa_ptr += (pid_b // A_DIV).to(tl.int64) * m * KB
  w_ptr += expert * N * K
  sw_ptr += expert * NB * KB
  o_ptr += (pid_k.to(tl.int64) * BATCH + pid_b) * m * N

  rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
  rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
  rk = tl.arange(0, BK)
  m_ok, n_ok = rm < m, rn < N
  a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * K + rk[None, :]
  w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * K + rk[None, :]
  sw_row = sw_ptr + (pid_n * BLOCK_N // BK) * KB
  first = pid_k * PER_SPLIT
  last = tl.minimum(first + PER_SPLIT, KB)
  if A_COL:
    sa_step, sa_offs = m, rm
  else:
    sa_step, sa_offs = 1, rm * KB
  acc = scaled_dot(a_ptrs, w_ptrs, sa_ptr, sa_step, sa_offs, sw_row, m_ok, n_ok, first, last,
                   K, BLOCK_M, BLOCK_N, SWAP, BK)

  o_offs = rm.to(tl.int64)[:, None] * N + rn[None, :]
  tl.store(o_ptr + o_offs, acc.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def heuristics(m: int, n: int, k: int, device_kind: str | None = None, batch: int = 1) -> Config:
  """Pallas's tiling, except 128 x 128 tiles of two warp groups where they fill the GPU.

  The 128 x 128 tiles (8 warps, 4 stages) where they fill the last wave of programs to >= 90%:
  there they ran 1-12% faster than 64 x 128 of 4 warps at M = 4096 on the H200; the smaller tile
  won with a ragged last wave and at M <= 64 (benchmarks/README.md).

  One change to it on Hopper: at 33-64 rows (one 64-row tile), where the K split leaves each
  program >= 32 K blocks, 5 stages, if two programs per SM hold the grid (a stage of 64 x 128
  activation and weight is 16 KB: 5 stages fit two programs in 228 KB of shared memory, 4 fit
  three): up to 4% less time at M = 64, and 26% more with 12 blocks a program at more than two
  programs an SM.
  """
  device_kind = device_kind or _target.current().device_kind
  sms = _target.sm_count(device_kind)
  if m > 64:
    waves = -(-m // 128) * -(-n // 128) * batch / sms
    if waves >= 1 and waves / math.ceil(waves) >= 0.9:
      return Config(128, 128, 1, num_warps=8, num_stages=4)
  config = pallas.heuristics(m, n, k, device_kind, batch)
  programs = -(-m // config.block_m) * -(-n // config.block_n) * batch * config.k_splits
  per_split = -(-k // BLOCK_K) // config.k_splits
  if (m <= 64 and config.block_m == 64 and per_split >= 32 and programs <= 2 * sms
      and _target.is_hopper(device_kind)):  # where the rule was measured
    return dataclasses.replace(config, num_stages=5)
  return config


def grouped_fp8_matmul(qa: jax.Array, sa: jax.Array, a_layout: str, qw: jax.Array,
                       sw: jax.Array, ids: jax.Array | None, config: Config,
                       out_dtype) -> jax.Array:
  """`pallas.grouped_fp8_matmul`'s products and shapes, in one launch of the kernel above."""
  _triton.require()  # e4m3fnuz on CUDA is declined by the api, for both kernels
  g, m, k = qa.shape
  e, n, _ = qw.shape
  ids = jnp.arange(e, dtype=jnp.int32) if ids is None else ids.astype(jnp.int32)
  b = ids.shape[0]
  kb = -(-k // BLOCK_K)
  bm, bn, splits = config.block_m, config.block_n, config.k_splits
  out_shape = (jax.ShapeDtypeStruct((b, m, n), out_dtype) if splits == 1
               else jax.ShapeDtypeStruct((splits, b, m, n), jnp.float32))
  out = _triton.call(
      fp8_matmul_kernel, qa, sa, qw, sw, ids, m, out_shape=out_shape,
      grid=(-(-m // bm) * -(-n // bn), splits, b),
      num_warps=config.num_warps, num_stages=config.num_stages, N=n, K=k, BLOCK_M=bm,
      BLOCK_N=bn, PER_SPLIT=-(-kb // splits), A_COL=a_layout == "col", GROUP_M=GROUP_M,
      # Hopper's fp8 MMA (wgmma) needs 64 rows in M: with fewer tokens, compute w . a^T so
      # the weight's rows fill M and the tokens sit in N (8 to 256 allowed).
      SWAP=bm < 64 <= bn, A_DIV=b // g, BATCH=b, BK=BLOCK_K)
  return out if splits == 1 else out.sum(axis=0).astype(out_dtype)


fp8_matmul = pallas.dense(grouped_fp8_matmul)
