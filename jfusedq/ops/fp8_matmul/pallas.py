"""Pallas kernel for the block-scaled W8A8 GEMM (DeepSeek format).

Grid (M blocks, N blocks, K splits). A program walks its share of the K blocks of 128 (the
scale granularity): one fp8 x fp8 dot per block into f32, scaled by the activation's per-row
scale and the weight block's scalar scale, accumulated in f32. `block_n` divides 128, so a
program's columns share one weight-scale row. Loads and stores are masked, so M, N and K need
not be multiples of anything (Pallas-Triton does not mask overhanging blocks by itself).
With K split, each split writes an f32 partial and XLA adds them (deterministic, unlike
atomics); decode shapes need the split to put enough programs on the GPU. XLA's sum is a
second kernel of 1.0-2.1 us on the H200; summing in this kernel instead (the last split of a
tile to count itself in on a zeroed counter adds the partials) was no faster (up to 35% slower,
benchmarks/README.md): the count's round trip and the partials' reload sit at the end of every
tile, one CTA a tile does the reload, and the counters need a memset.

On Hopper this kernel does not reach the FP8 tensor cores: Pallas emits `tt.dot` without
`maxNumImpreciseAcc`, and Triton then lowers an fp8 dot to fp8 -> f16 conversions and
`mma.sync` f16 (seen in the PTX of the lowered kernel compiled for sm_90a), so M >= 256 runs at
0.34-0.50x of XLA's bf16 dot. The Triton-language kernel (triton.py) sets it and gets wgmma
e4m3. Decode (M <= 64) reads the weight and is unaffected.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jfusedq import _target
from jfusedq.fp8 import BLOCK
from jfusedq.ops import _common

BLOCK_K = BLOCK  # the scale block: one scale per activation row and weight block per step


@dataclasses.dataclass(frozen=True)
class Config:
  """Tiling: rows and columns per program, K splits, warps and software-pipeline stages."""

  block_m: int
  block_n: int
  k_splits: int = 1
  num_warps: int = 4
  num_stages: int = 3

  def __post_init__(self):
    for name in ("block_m", "block_n", "k_splits", "num_warps"):
      v = getattr(self, name)
      if not _common.is_pow2(v):
        raise ValueError(f"Config.{name} must be a positive power of two, got {v!r}")
    if self.block_m < 16 or not 16 <= self.block_n <= BLOCK_K:
      raise ValueError(f"Config needs block_m >= 16 and 16 <= block_n <= {BLOCK_K} (one weight-"
                       f"scale row per program), got {self}")
    if not isinstance(self.num_stages, int) or self.num_stages < 1:
      raise ValueError(f"Config.num_stages must be a positive int, got {self.num_stages!r}")


def heuristics(m: int, n: int, k: int, device_kind: str | None = None, batch: int = 1) -> Config:
  """Block sizes by M (and the device's SM count, for the K split; `batch` products per launch
  count as more tiles).

  Set from the H200 sweep. M <= 64 (decode) is bound by reading the weight: 64-column tiles,
  and K split until about four (M <= 16) or two programs per SM stream the weight, at most 8
  splits (their f32 partials cost a pass; half as many splits ran 4-25% slower at M = 64).
  Larger M: 64 x 128 tiles of 4 warps beat 128 x 128 ones there (1.1-1.25x at M = 4096; wider
  tiles ran slower still, 256 x 128 at a third).
  """
  sms = _target.sm_count(device_kind)
  kb = -(-k // BLOCK_K)
  if m <= 64:
    block_m = max(16, pl.next_power_of_2(m))
    block_n = 64
    tiles = -(-m // block_m) * -(-n // block_n) * batch
    want = max(1, (4 if m <= 16 else 2) * sms // tiles)
    k_splits = min(_common.pow2_floor(want), 8, _common.pow2_floor(kb))
    return Config(block_m, block_n, k_splits, num_warps=4, num_stages=4)
  return Config(64, 128, 1, num_warps=4, num_stages=4)


def grouped_fp8_matmul(qa: jax.Array, sa: jax.Array, a_layout: str, qw: jax.Array,
                       sw: jax.Array, ids: jax.Array | None, config: Config,
                       out_dtype) -> jax.Array:
  """out[b] = qa[b // (B / G)] . qw[ids[b]]^T with block scales -> [B, M, N].

  qa [G, M, K] fp8, sa [G, M, KB] ("row") or [G, KB, M] ("col"), qw [E, N, K],
  sw [E, NB, KB], ids [B] int32 (None: B = E, ids = 0..E-1); G divides B. Product b is the
  third grid axis (with the K splits): its program reads expert ids[b] of the stacked weight in
  place, by offset, as the Triton kernel does; no expert is gathered into a copy first.
  """
  g, m, k = qa.shape
  e, n, _ = qw.shape
  b = e if ids is None else ids.shape[0]
  kb = -(-k // BLOCK_K)
  bm, bn, splits = config.block_m, config.block_n, config.k_splits
  per_split = -(-kb // splits)
  per_group = b // g
  fp8 = qa.dtype
  # e4m3fnuz operands travel as their bits: a masked load then fills with integer 0 (+0), where
  # a float fill needs a cast to fnuz that the Triton lowering lacks. e4m3fn loads as itself,
  # so the loaded tile feeds the tensor cores without a bitcast in registers between.
  as_bits = fp8 == jnp.float8_e4m3fnuz
  to_bits = (lambda t: lax.bitcast_convert_type(t, jnp.uint8)) if as_bits else (lambda t: t)
  fill = 0 if as_bits else 0.0

  def kernel(ids_ref, a_ref, sa_ref, w_ref, sw_ref, o_ref):
    pid_m, pid_n, pid_kb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    # One product (the dense call) needs no index arithmetic: its zero offsets fold away.
    pid_k, pid_b = (pid_kb, jnp.int32(0)) if b == 1 else (pid_kb % splits, pid_kb // splits)
    expert = pid_b if ids_ref is None else ids_ref[pid_b]
    group = pid_b if per_group == 1 else pid_b // per_group
    m0, n0 = pid_m * bm, pid_n * bn
    rows = m0 + lax.broadcasted_iota(jnp.int32, (bm,), 0)
    cols = n0 + lax.broadcasted_iota(jnp.int32, (bn,), 0)
    row_ok, col_ok = rows < m, cols < n
    first = pid_k * per_split
    last = jnp.minimum(first + per_split, kb)

    def load_sa(kblock):
      return plgpu.load(sa_ref.at[group, pl.ds(m0, bm), kblock] if a_layout == "row"
                        else sa_ref.at[group, kblock, pl.ds(m0, bm)], mask=row_ok, other=0.0)

    # Col-layout scales ([KB, M]) are loaded one K block ahead, as in triton.py (see there why;
    # 1.00-1.05x row layout's time at M = 16, against 1.00-1.13x loaded in their step); the
    # index is clamped to the last block, so the final step's extra read stays in bounds.
    # Row-layout and weight scales stay in their step: ahead, they ran slower here in 9 of 10
    # cells (benchmarks/README.md).
    ahead = a_layout == "col"

    def step(kblock, carry):
      acc, s_next = carry
      k0 = kblock * BLOCK_K
      k_ok = (k0 + lax.broadcasted_iota(jnp.int32, (BLOCK_K,), 0)) < k
      a = plgpu.load(a_ref.at[group, pl.ds(m0, bm), pl.ds(k0, BLOCK_K)],
                     mask=row_ok[:, None] & k_ok[None, :], other=fill)
      w = plgpu.load(w_ref.at[expert, pl.ds(n0, bn), pl.ds(k0, BLOCK_K)],
                     mask=col_ok[:, None] & k_ok[None, :], other=fill)
      if as_bits:
        a, w = lax.bitcast_convert_type(a, fp8), lax.bitcast_convert_type(w, fp8)
      if ahead:
        s_a, s_next = s_next, load_sa(jnp.minimum(kblock + 1, kb - 1))
      else:
        s_a = load_sa(kblock)
      s_w = sw_ref[expert, n0 // BLOCK_K, kblock]
      # fp8 x fp8 -> f32 on the tensor cores, contracting both operands' K (w is [N, K]).
      d = lax.dot_general(a, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
      return acc + d * (s_a[:, None] * s_w), s_next

    s_first = load_sa(jnp.minimum(first, kb - 1)) if ahead else None
    acc, _ = lax.fori_loop(first, last, step, (jnp.zeros((bm, bn), jnp.float32), s_first))
    out = (o_ref.at[pid_b, pl.ds(m0, bm), pl.ds(n0, bn)] if splits == 1
           else o_ref.at[pid_k, pid_b, pl.ds(m0, bm), pl.ds(n0, bn)])
    plgpu.store(out, acc.astype(o_ref.dtype), mask=row_ok[:, None] & col_ok[None, :])

  out_shape = (jax.ShapeDtypeStruct((b, m, n), out_dtype) if splits == 1
               else jax.ShapeDtypeStruct((splits, b, m, n), jnp.float32))
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  operands = [to_bits(qa), sa, to_bits(qw), sw]
  if ids is None:
    body = lambda *refs: kernel(None, *refs)
  else:
    body, operands = kernel, [ids.astype(jnp.int32), *operands]
  out = pl.pallas_call(
      body,
      grid=(pl.cdiv(m, bm), pl.cdiv(n, bn), splits * b),
      in_specs=[any_spec] * len(operands),
      out_specs=any_spec,
      out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
      interpret=_target.interpret(),
      name="fp8_matmul",
  )(*operands)
  return out if splits == 1 else out.sum(axis=0).astype(out_dtype)


def dense(grouped):
  """The one-product case of a grouped kernel: qa [M, K] fp8, sa [M, KB] ("row") or [KB, M]
  ("col"), qw [N, K], sw [NB, KB] -> [M, N]."""
  def fp8_matmul(qa: jax.Array, sa: jax.Array, a_layout: str, qw: jax.Array, sw: jax.Array,
                 config: Config, out_dtype) -> jax.Array:
    return grouped(qa[None], sa[None], a_layout, qw[None], sw[None], None, config,
                   out_dtype)[0]
  return fp8_matmul


fp8_matmul = dense(grouped_fp8_matmul)
