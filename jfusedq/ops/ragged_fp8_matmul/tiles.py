"""Row tiles of a ragged product: which expert each tile of rows reads, and which rows it owns.

Rows come sorted by group (expert) in contiguous runs, `group_sizes [E]` long. Every group's
run is cut into tiles of `block_m` rows from its own first row, so a tile never spans two
experts and reads exactly one expert's weight; its last tile is partial (rows past the run are
masked, not padded: no copy of the activation is made). Rows past the last group belong to a
final pseudo-group with expert id E, whose tiles write zeros (`jax.lax.ragged_dot`'s
convention). The tile count is traced; the grid covers the most any routing can need.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def max_tiles(m: int, groups: int, block_m: int) -> int:
  """The most tiles `m` rows in `groups` groups (and the zero pseudo-group) can need: each
  non-empty group (at most min(groups + 1, m) of them) wastes under one tile."""
  return (m + min(groups + 1, m) * (block_m - 1)) // block_m


def tile_map(group_sizes: jax.Array, m: int, block_m: int) -> tuple[jax.Array, ...]:
  """`group_sizes [E]` -> (expert, start, end), int32 `[max_tiles]` each, and the number of
  real-expert tiles (a traced scalar).

  Tile t reads expert[t] (E: the zero pseudo-group) and owns rows start[t] ..
  min(end[t], start[t] + block_m) - 1, end[t] being its group's end; tiles past the last hold
  start == end (nothing to do). Group sizes are clipped at 0, and
  rows past `m` dropped, so any traced sizes give in-bounds tiles.
  """
  e = group_sizes.shape[0]
  i32 = jnp.int32
  # Prefix sums and the search as compare-and-reduce over small [E, E] / [tiles, E] blocks: a
  # few fused kernels, where cumsum and searchsorted lowered to reduce-windows and a while loop
  # of ~40 kernels on the GPU (40 us at decode, longer than the product).
  inclusive = lambda v: jnp.sum(jnp.where(jnp.tri(v.shape[0], dtype=bool), v[None, :], 0),
                                axis=1, dtype=i32)
  ends = jnp.minimum(inclusive(jnp.maximum(group_sizes.astype(i32), 0)), m)
  ends = jnp.concatenate([ends, jnp.full((1,), m, i32)])
  starts = jnp.concatenate([jnp.zeros((1,), i32), ends[:-1]])
  tiles = (ends - starts + block_m - 1) // block_m
  tile_end = inclusive(tiles)
  t = jnp.arange(max_tiles(m, e, block_m), dtype=i32)
  group = jnp.sum(tile_end[None, :] <= t[:, None], axis=1, dtype=i32)  # e + 1 past the last
  g = jnp.minimum(group, e)
  start = starts[g] + (t - (tile_end[g] - tiles[g])) * block_m
  live = group <= e
  return (jnp.where(live, g, e), jnp.where(live, start, m), jnp.where(live, ends[g], m),
          tile_end[e - 1])
