"""The ragged product on Hopper: `fp8_matmul`'s Mosaic GPU kernel (FP8 wgmma, warp-specialised)
over the row tiles of `tiles.tile_map`, each reading one expert's weight in place.

TMA copies whole boxes of consecutive rows and cannot gather, so the (token, expert) pairs'
rows (`rows`) are gathered into expert order by XLA first, a copy of M x K fp8 codes that the
Triton kernel avoids by gathering in its loads; each tile then loads 128 rows from its
group's first row rounded down to 8 (TMA boxes into tiled shared memory start at multiples of
the 8-row tiling) and stores its own expert's rows alone: a group's rows are computed by its
own tiles only, where aligned 128-row blocks would compute a block straddling g groups g
times.

`ragged_swiglu` runs the kernel's gate and up pair: both products of each activation block,
the activation on the two sums in the epilogue and its quantisation there (the tile's 128
columns are each row's whole group), the codes stored and each tile's 128 row scales written
whole, then gathered per row.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jfusedq.fp8 import BLOCK, Fp8Format, QuantizedActivation
from jfusedq.ops.fp8_matmul import mosaic_gpu
from jfusedq.ops.fp8_matmul.mosaic_gpu import BLOCK_M, ROW_TILE, Config, check
from jfusedq.ops.ragged_fp8_matmul import tiles

__all__ = ["Config", "check", "heuristics", "ragged_matmul", "ragged_swiglu", "swiglu_config"]


def heuristics(m: int, n: int, k: int, groups: int, out_dtype=jnp.bfloat16) -> Config:
  """The dense kernel's pick for the tiles a uniform routing fills (`tiles.max_tiles` row
  tiles), persistent and with K in one part (the ragged kernel takes no split); a 192-wide
  tile in three chunks: a tile's rows are stored from any row of its staging, which TMA reads
  only from 128-byte boundaries (the tests staging 96-column chunks of bf16, 192 bytes a row,
  faulted with CUDA_ERROR_MISALIGNED_ADDRESS on an H100)."""
  rows = min(tiles.max_tiles(m, groups, BLOCK_M, ROW_TILE) * BLOCK_M, max(m, BLOCK_M))
  cfg = mosaic_gpu.heuristics(rows, n, k, out_dtype)
  return dataclasses.replace(cfg, persistent=True, splits=1,
                             chunks=3 if cfg.block_n == 192 else cfg.chunks)


# The pair's pipeline depth: the one timed (benchmarks/README.md). A fourth stage fits beside
# the staging of codes and row scales (`fp8_matmul.mosaic_gpu.smem_bytes`), untimed.
SWIGLU_STAGES = 3


def swiglu_config() -> Config:
  """The pair's tiling: 128 hidden columns, persistent, SWIGLU_STAGES stages."""
  return Config(BLOCK, stages=SWIGLU_STAGES, persistent=True)


def ragged_matmul(qa: jax.Array, sa: jax.Array, a_layout: str, w: jax.Array, sw: jax.Array,
                  group_sizes: jax.Array, rows: jax.Array | None, config: Config | None,
                  out_dtype) -> jax.Array:
  """qa `[T, K]` fp8 with scales `sa` in `a_layout`, w `[E, N, K]` with `sw [E, NB, KB]`,
  group_sizes `[E]`, rows `[M]` or None -> `[M, N]`."""
  e, n, k = w.shape
  check(qa, n, k)
  qa, sa = _gather(qa, sa, a_layout, rows)
  m = qa.shape[0]
  cfg = config or heuristics(m, n, k, e, out_dtype)
  return mosaic_gpu.fp8_matmul(qa, sa, a_layout, w, sw, cfg, out_dtype,
                               row_tiles=_row_tiles(group_sizes, m))


def ragged_swiglu(qa: jax.Array, sa: jax.Array, a_layout: str, gate: jax.Array,
                  gate_scale: jax.Array, up: jax.Array, up_scale: jax.Array,
                  group_sizes: jax.Array, rows: jax.Array | None, config: Config | None,
                  act: str, dtype, fmt: Fp8Format, ue8m0: bool) -> QuantizedActivation:
  """`api.ragged_swiglu` for FP8 weights: the hidden `[M, N]` quantised, row scales."""
  check(qa, gate.shape[1], gate.shape[2])
  qa, sa = _gather(qa, sa, a_layout, rows)
  m = qa.shape[0]
  codes, slots = mosaic_gpu.fp8_matmul(
      qa, sa, a_layout, gate, gate_scale, config or swiglu_config(), dtype,
      row_tiles=_row_tiles(group_sizes, m), up=(up, up_scale), act=act, quant=(fmt, ue8m0))
  scale = slots[:, tiles.row_slots(group_sizes, m, BLOCK_M, ROW_TILE)].T
  return QuantizedActivation(codes, scale, group_size=BLOCK)


def _row_tiles(group_sizes, m):
  """The kernel's tiles, int32 `[4, tiles]`: each one's first loaded row (a multiple of 8),
  expert, and the rows it stores, lo .. hi - 1 (at most 128 rows from the first loaded);
  tiles past the last hold lo == hi."""
  expert, start, first, end, _ = tiles.tile_map(group_sizes, m, BLOCK_M, ROW_TILE)
  return jnp.stack([start, expert, first, jnp.minimum(end, start + BLOCK_M)])


def _gather(qa, sa, a_layout, rows):
  """The codes and scales of the sorted rows (all of them, in order, where `rows` is None).

  The codes move as 4-byte words (K is a multiple of 128): XLA's gather of the 1-byte codes
  ran at about half the copy bandwidth (1.14 ms for 131072 rows of 7168 on an H100)."""
  if rows is None:
    return qa, sa
  t, k = qa.shape
  words = lax.bitcast_convert_type(qa.reshape(t, k // 4, 4), jnp.uint32)[rows]
  qa = lax.bitcast_convert_type(words, qa.dtype).reshape(rows.shape[0], k)
  return qa, sa[rows] if a_layout == "row" else sa[:, rows]
