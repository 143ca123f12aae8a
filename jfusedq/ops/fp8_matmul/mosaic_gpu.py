"""Mosaic GPU kernel for the block-scaled W8A8 GEMM on Hopper (sm90): FP8 wgmma.

Why a third kernel: the Pallas-Triton lowering emits `tt.dot` without `maxNumImpreciseAcc`, so
Triton turns its fp8 dot into f16 `mma.sync` (pallas.py); this kernel issues e4m3 x e4m3 wgmma
through Mosaic GPU directly.

Grid (M / block_m, N / block_n), one warpgroup per program. A pipeline of `stages` TMA copies
walks K in blocks of 128 (the scale granularity); per block:
  1. d = a[block_m, 128] . w[block_n, 128]^T on the tensor cores (both operands K-major in
     shared memory, as fp8 wgmma requires), into a fresh f32 accumulator;
  2. acc += d * s_a[:, None] * s_w[None, :] in registers (s_a: the rows' activation scales,
     s_w: the weight block's scale repeated over its columns).
Scaling per block keeps the accumulation in f32 (Hopper's fp8 MMA accumulates with reduced
precision inside one instruction chain). The epilogue goes registers -> shared -> TMA store.

Shapes: K a multiple of 128, N of 64; M is padded to block_m by the caller's XLA (a copy of the
activation, small next to the weight at the M this kernel is for). Correct on the H200 but
slower than the Triton kernel there (0.48-0.85x XLA's bf16 dot at M = 4096,
benchmarks/results/fp8_matmul_deepseek.json): opt-in (`implementation="mosaic_gpu"`), outside
the default order.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jfusedq import _target
from jfusedq.fp8 import E4M3FN
from jfusedq.ops._dispatch import Unsupported

BLOCK_K = 128
# 128-byte swizzle: one K block of fp8 is 128 bytes per row, the widest TMA/wgmma swizzle.
_TRANSFORMS = (plgpu.TilingTransform((8, BLOCK_K)), plgpu.SwizzleTransform(128))


@dataclasses.dataclass(frozen=True)
class Config:
  """Tile (block_m in {64, 128}, block_n in {64, 128}) and TMA pipeline depth."""

  block_m: int
  block_n: int
  stages: int = 4

  def __post_init__(self):
    if self.block_m not in (64, 128) or self.block_n not in (64, 128):
      raise ValueError(f"Config needs block_m and block_n in (64, 128), got {self}")
    if not isinstance(self.stages, int) or self.stages < 1:
      raise ValueError(f"Config.stages must be a positive int, got {self.stages!r}")


def heuristics(m: int, n: int) -> Config:
  """128 x 128 tiles where M and N allow; 64 where N is only a multiple of 64 (2112)."""
  return Config(128 if m > 64 else 64, 128 if n % 128 == 0 else 64)


def check(qa: jax.Array, n: int, k: int) -> None:
  """Raises Unsupported for what this kernel does not build (the dispatcher moves on)."""
  target = _target.current()
  kind = target.device_kind.lower()
  if target.platform == "cuda" and not ("h100" in kind or "h200" in kind or "h800" in kind):
    raise Unsupported(f"the Mosaic GPU kernel is built for Hopper (sm90), not {target.device_kind}")
  if target.platform not in ("cuda", "cpu"):
    raise Unsupported(f"Mosaic GPU runs on NVIDIA GPUs, not {target.platform}")
  if qa.dtype != E4M3FN:
    raise Unsupported(f"Hopper's fp8 wgmma takes float8_e4m3fn, not {qa.dtype}")
  if k % BLOCK_K or n % 64:
    raise Unsupported(f"the Mosaic GPU kernel needs K % 128 == 0 and N % 64 == 0, got N={n}, "
                      f"K={k}")


def fp8_matmul(qa: jax.Array, sa: jax.Array, a_layout: str, qw: jax.Array, sw: jax.Array,
               config: Config | None, out_dtype) -> jax.Array:
  """qa [M, K] fp8, sa [M, KB] ("row") or [KB, M] ("col"), qw [N, K], sw [NB, KB] -> [M, N]."""
  m, k = qa.shape
  n = qw.shape[0]
  check(qa, n, k)
  cfg = config or heuristics(m, n)
  bm, bn, kb = cfg.block_m, cfg.block_n, k // BLOCK_K
  if n % bn:
    raise ValueError(f"block_n={bn} does not divide N={n}")
  mp = -(-m // bm) * bm
  sa_col = sa if a_layout == "col" else sa.T
  if mp != m:
    qa = jnp.pad(qa, ((0, mp - m), (0, 0)))
    sa_col = jnp.pad(sa_col, ((0, 0), (0, mp - m)))
  # The weight block's scale repeated over its 128 columns: one TMA row per K block.
  sw_cols = jnp.repeat(sw.T, BLOCK_K, axis=1)[:, :n]

  def kernel(a_gmem, sa_gmem, w_gmem, sw_gmem, o_gmem):
    mi, ni = lax.axis_index("m"), lax.axis_index("n")

    def step(_, a_smem, w_smem, sa_smem, sw_smem, acc):
      def mma(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, w_smem.transpose((1, 0)))
        plgpu.wgmma_wait(0)
        return acc_ref[...]

      d = pl.run_scoped(mma, plgpu.ACC((bm, bn), jnp.float32))
      s_a = plgpu.load(sa_smem.at[0], layout=plgpu.Layout.WGMMA.reduce(1))
      s_w = plgpu.load(sw_smem.at[0], layout=plgpu.Layout.WGMMA.reduce(0))
      return acc + d * s_a[:, None] * s_w[None, :]

    acc = plgpu.emit_pipeline(
        step, grid=(kb,),
        in_specs=[plgpu.BlockSpec((bm, BLOCK_K), lambda b: (mi, b), transforms=_TRANSFORMS),
                  plgpu.BlockSpec((bn, BLOCK_K), lambda b: (ni, b), transforms=_TRANSFORMS),
                  plgpu.BlockSpec((1, bm), lambda b: (b, mi)),
                  plgpu.BlockSpec((1, bn), lambda b: (b, ni))],
        max_concurrent_steps=cfg.stages,
        init_carry=plgpu.layout_cast(jnp.zeros((bm, bn), jnp.float32), plgpu.Layout.WGMMA),
    )(a_gmem, w_gmem, sa_gmem, sw_gmem)

    def epilogue(o_smem):
      o_smem[...] = acc.astype(out_dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)])
      plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(epilogue, plgpu.SMEM((bm, bn), out_dtype))

  out = plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((mp, n), out_dtype), grid=(mp // bm, n // bn),
      grid_names=("m", "n"),
      interpret=plgpu.InterpretGPUParams() if _target.interpret() else False,
  )(qa, sa_col, qw, sw_cols)
  return out[:m] if mp != m else out
