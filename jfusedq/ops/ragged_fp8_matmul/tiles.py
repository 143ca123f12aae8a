"""Row tiles of a ragged product: which expert each tile of rows reads, and which rows it owns.

Rows come sorted by group (expert) in contiguous runs, `group_sizes [E]` long. Rows past the
last group belong to a final pseudo-group with expert id E, whose rows are zeros
(`jax.lax.ragged_dot`'s convention). `tile_map` cuts every group's run in tiles of `block_m`
rows from its own first row (rounded down to `align` rows where the loads need it: Mosaic GPU's
TMA boxes into tiled shared memory start at multiples of its 8-row tiling), each tile reading
exactly one expert's weight; a group's last tile is partial (the rows past its run are loaded
but neither kept nor stored: no padded copy of the activation is made). It wastes under one
tile (and `align` - 1 rows) a non-empty group. The tile count is traced; the grid covers the
most any routing can need.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def max_tiles(m: int, groups: int, block_m: int, align: int = 1) -> int:
  """The most tiles `m` rows in `groups` groups (and the zero pseudo-group) can need: each
  non-empty group (at most min(groups + 1, m) of them) spans at most align - 1 rows more than
  its own and wastes under one tile."""
  return (m + min(groups + 1, m) * (block_m + align - 2)) // block_m


def tile_map(group_sizes: jax.Array, m: int, block_m: int,
             align: int = 1) -> tuple[jax.Array, ...]:
  """`group_sizes [E]` -> (expert, start, first, end), int32 `[max_tiles]` each, and the
  number of real-expert tiles (a traced scalar).

  Tile t reads expert[t] (E: the zero pseudo-group), loads rows start[t] .. start[t] +
  block_m - 1 (start[t] a multiple of `align`) and owns rows first[t] .. min(end[t], start[t]
  + block_m) - 1, first[t] >= start[t] (equal but in a group's first tile when align > 1),
  end[t] being its group's end; tiles past the last hold first == end (nothing to do). Group
  sizes are clipped at 0, and rows past `m` dropped, so any traced sizes give in-bounds tiles.
  """
  e = group_sizes.shape[0]
  starts, ends, base, tiles = _cut(group_sizes, m, block_m, align)
  t, g, first, live, tile_end = _search(tiles, max_tiles(m, e, block_m, align))
  start = base[g] + (t - first) * block_m
  m_aligned = m - m % align
  return (jnp.where(live, g, e), jnp.where(live, start, m_aligned),
          jnp.where(live, jnp.maximum(start, starts[g]), m), jnp.where(live, ends[g], m),
          tile_end[e - 1])


def row_slots(group_sizes: jax.Array, m: int, block_m: int, align: int = 1) -> jax.Array:
  """Each row's slot `[m]` int32 among `tile_map`'s tiles' loaded rows: tile t's row start[t] +
  i is slot t * block_m + i, and row r's slot is its owning tile's (a kernel writing per-tile
  results whole, read back per row)."""
  e = group_sizes.shape[0]
  _, ends, base, tiles = _cut(group_sizes, m, block_m, align)
  first = _inclusive(tiles) - tiles
  r = jnp.arange(m, dtype=jnp.int32)
  g = jnp.minimum(jnp.sum(ends[None, :] <= r[:, None], axis=1, dtype=jnp.int32), e)
  off = r - base[g]
  return (first[g] + off // block_m) * block_m + off % block_m


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


def _cut(group_sizes: jax.Array, m: int, block_m: int, align: int) -> tuple[jax.Array, ...]:
  """The runs' (starts, ends) `[E + 1]`, the rows their tiles start from (starts rounded down
  to `align`) and their tile counts (0 for an empty run)."""
  starts, ends = _runs(group_sizes, m)
  base = starts - starts % align
  return starts, ends, base, jnp.where(ends > starts, (ends - base + block_m - 1) // block_m, 0)


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
