"""The ragged product on Hopper: `fp8_matmul`'s Mosaic GPU kernel (FP8 wgmma, warp-specialised)
over the row tiles of `tiles.block_map`, each reading one expert's weight in place.

TMA copies whole boxes of consecutive rows and cannot gather, so the (token, expert) pairs'
rows (`rows`) are gathered into expert order by XLA first, a copy of M x K fp8 codes that the
Triton kernel avoids by gathering in its loads; the tiles then load aligned 128-row blocks,
and a block holding rows of several experts is computed once for each, each time storing its
expert's rows alone.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jfusedq.ops.fp8_matmul import mosaic_gpu
from jfusedq.ops.fp8_matmul.mosaic_gpu import BLOCK_M, Config, check
from jfusedq.ops.ragged_fp8_matmul import tiles

__all__ = ["Config", "check", "heuristics", "ragged_matmul"]


def heuristics(m: int, n: int, k: int, groups: int, out_dtype=jnp.bfloat16) -> Config:
  """The dense kernel's pick for the tiles a uniform routing fills (`tiles.max_blocks` row
  tiles), persistent and with K in one part (the ragged kernel takes no split)."""
  rows = min(tiles.max_blocks(m, groups, BLOCK_M) * BLOCK_M, max(m, BLOCK_M))
  cfg = mosaic_gpu.heuristics(rows, n, k, out_dtype)
  return dataclasses.replace(cfg, persistent=True, splits=1,
                             chunks=2 if cfg.block_n == 192 else cfg.chunks)


def ragged_matmul(qa: jax.Array, sa: jax.Array, a_layout: str, w: jax.Array, sw: jax.Array,
                  group_sizes: jax.Array, rows: jax.Array | None, config: Config | None,
                  out_dtype) -> jax.Array:
  """qa `[T, K]` fp8 with scales `sa` in `a_layout`, w `[E, N, K]` with `sw [E, NB, KB]`,
  group_sizes `[E]`, rows `[M]` or None -> `[M, N]`."""
  e, n, k = w.shape
  check(qa, n, k)
  if rows is not None:
    qa = qa[rows]
    sa = sa[rows] if a_layout == "row" else sa[:, rows]
  m = qa.shape[0]
  cfg = config or heuristics(m, n, k, e, out_dtype)
  return mosaic_gpu.fp8_matmul(qa, sa, a_layout, w, sw, cfg, out_dtype,
                               row_tiles=tiles.block_map(group_sizes, m, BLOCK_M))
