"""Row tiles of a ragged product: which expert each tile of rows reads, and which rows it owns.

Rows come sorted by group (expert) in contiguous runs, `group_sizes [E]` long. Rows past the
last group belong to a final pseudo-group with expert id E, whose rows are zeros
(`jax.lax.ragged_dot`'s convention). Two cuts, each tile reading exactly one expert's weight:
  tile_map   (Triton) every group's run in tiles of `block_m` rows from its own first row; its
             last tile is partial (rows past the run are masked, not padded: no copy of the
             activation is made).
  block_map  (Mosaic GPU) the aligned `block_m`-row blocks of all rows, a block holding rows
             of g groups visited g times, each visit storing its group's rows only: a TMA box
             starts at a block, and the tiles' stores are sums of power-of-two boxes.
Either wastes under one tile a non-empty group. The tile count is traced; the grid covers the
most any routing can need.
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
  starts, ends = _runs(group_sizes, m)
  tiles = (ends - starts + block_m - 1) // block_m
  t, g, first, live, tile_end = _search(tiles, max_tiles(m, e, block_m))
  start = starts[g] + (t - first) * block_m
  return (jnp.where(live, g, e), jnp.where(live, start, m), jnp.where(live, ends[g], m),
          tile_end[e - 1])


def max_blocks(m: int, groups: int, block_m: int) -> int:
  """The most tiles `block_map` can cut: the blocks, and one more for each group boundary
  inside a block (at most min(groups + 1, m) non-empty groups, the pseudo-group counted)."""
  return -(-m // block_m) + min(groups + 1, m) - 1


def block_map(group_sizes: jax.Array, m: int, block_m: int) -> jax.Array:
  """`group_sizes [E]` -> int32 `[4, max_blocks]`: per tile its block, expert (E: the zero
  pseudo-group), and the rows it stores, lo .. hi - 1, all inside the block; tiles past the
  last store nothing (lo == hi == 0). Clipped as `tile_map`'s."""
  e = group_sizes.shape[0]
  starts, ends = _runs(group_sizes, m)
  first_block = starts // block_m
  blocks = jnp.where(ends > starts, (ends - 1) // block_m - first_block + 1, 0)
  t, g, first, live, _ = _search(blocks, max_blocks(m, e, block_m))
  block = first_block[g] + t - first
  lo = jnp.maximum(starts[g], block * block_m)
  hi = jnp.minimum(ends[g], block * block_m + block_m)
  zero = jnp.zeros_like(t)
  return jnp.stack([jnp.where(live, block, zero), jnp.where(live, g, e),
                    jnp.where(live, lo, zero), jnp.where(live, hi, zero)])


# Prefix sums and the search as compare-and-reduce over small [E, E] / [tiles, E] blocks: a few
# fused kernels, where cumsum and searchsorted lowered to reduce-windows and a while loop of ~40
# kernels on the GPU (40 us at decode, longer than the product).
def _inclusive(v: jax.Array) -> jax.Array:
  return jnp.sum(jnp.where(jnp.tri(v.shape[0], dtype=bool), v[None, :], 0), axis=1,
                 dtype=jnp.int32)


def _runs(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
  """(starts, ends) `[E + 1]` of the groups' runs and the pseudo-group's (to m), sizes clipped
  at 0 and ends at m."""
  i32 = jnp.int32
  ends = jnp.minimum(_inclusive(jnp.maximum(group_sizes.astype(i32), 0)), m)
  ends = jnp.concatenate([ends, jnp.full((1,), m, i32)])
  return jnp.concatenate([jnp.zeros((1,), i32), ends[:-1]]), ends


def _search(counts: jax.Array, total: int) -> tuple[jax.Array, ...]:
  """Tiles 0 .. total - 1 laid out group after group, `counts [E + 1]` each: (t, each tile's
  group clipped to E, the group's first tile, whether the tile is real, the groups' end
  tiles)."""
  e = counts.shape[0] - 1
  tile_end = _inclusive(counts)
  t = jnp.arange(total, dtype=jnp.int32)
  group = jnp.sum(tile_end[None, :] <= t[:, None], axis=1, dtype=jnp.int32)  # e + 1 past last
  g = jnp.minimum(group, e)
  return t, g, tile_end[g] - counts[g], group <= e, tile_end
