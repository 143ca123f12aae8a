"""Mosaic GPU kernel for the block-scaled W8A8 GEMM on Hopper (sm90): FP8 wgmma, warp-specialised.

Why a third kernel: the Pallas-Triton lowering emits `tt.dot` without `maxNumImpreciseAcc`, so
Triton turns its fp8 dot into f16 `mma.sync` (pallas.py); this kernel issues e4m3 x e4m3 wgmma
through Mosaic GPU directly.

Grid (M / 128, ceil(N / block_n), splits), three warpgroups per program: one memory warpgroup
walks K in blocks of 128 (the scale granularity) with a pipeline of `stages` TMA copies; two
compute warpgroups own 64 rows each of the 128 x block_n tile. Per K block, each compute warpgroup:
  1. d = a[64, 128] . w[block_n, 128]^T on the tensor cores (both operands K-major in shared
     memory, as fp8 wgmma requires), into a fresh f32 accumulator;
  2. acc += d * (s_a * s_w)[:, None] in registers (s_a: the rows' activation scales, s_w: the
     scale of the weight block the wgmma group's columns lie in), one FMA per value; a group
     whose columns cross a weight block's edge (a 192-wide tile in one or two groups) takes a
     per-column scale, d * s_a[:, None] * s_w[None, :]. The memory warpgroup copies the two
     weight-block scales a tile can touch, per K block, in one 128-byte TMA box (SW_BOX).
     Scalar scales because a per-column vector everywhere (two multiplies and an add per
     value) was measured slower.
Scaling per block keeps the accumulation in f32 (Hopper's fp8 MMA accumulates with reduced
precision inside one instruction chain). The memory warpgroup keeps the copies ahead of both
compute warpgroups, which a single warpgroup waiting on each wgmma could not. The two compute
warpgroups are left to drift apart, so that one's rescale can overlap the other's wgmma.
The epilogue goes registers -> shared -> TMA store, which clips the columns past N.

Shapes: K a multiple of 128, N of 64; M padded to a multiple of 8 by XLA (a copy of the
activation and the output) only where it is not one.

Schedules (`Config`): per-tile CTAs, or `persistent`: one CTA per SM loops over its tiles (in
bands of `band` row tiles, M fastest within a band: `tile_order`), each a pipeline over K, the
pipeline's buffers allocated once so the memory warpgroup runs ahead into the next tile (faster
than per tile wherever K is not split; the store stays out of the step, where it cost more than
the refills saved). `chunks` issues the tile's columns as that many wgmma groups and rescales
one while the next runs (the best count depends on the schedule). `pingpong` makes the compute
warpgroups take turns at issuing: the same bits as the unordered schedule, slower at every
shape measured, so no heuristic picks it; it stays an option of the benchmark's sweep.
`splits` (per-tile only) gives each tile that many CTAs, each a part of K, storing float32
partials that XLA sums: for a grid of tiles that leaves SMs idle.

The measurements behind these choices, the configs tried and not kept, and where the time goes
against cuBLAS: benchmarks/README.md, "Mosaic GPU GEMM".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jfusedq import _target
from jfusedq.errors import InputError
from jfusedq.fp8 import BLOCK, E4M3FN, Fp8Format
from jfusedq.ops._dispatch import Unsupported
from jfusedq.ops.group_quant.pallas import quantize_rows

BLOCK_K = BLOCK
BLOCK_M = 128  # two compute warpgroups of 64 rows (wgmma's M)
WG_M = 64
# 128-byte swizzle: one K block of fp8 is 128 bytes per row, the widest TMA/wgmma swizzle.
ROW_TILE = 8
_TRANSFORMS = (plgpu.TilingTransform((ROW_TILE, BLOCK_K)), plgpu.SwizzleTransform(128))
# The weight-block scales reach shared memory by TMA straight from the caller's sw [NB, KB]:
# per K block, the two weight blocks a tile can touch x SW_BOX K blocks, one 128-byte box. TMA
# needs a box row of 16 bytes or more and each pipeline stage's box at a 128-byte aligned
# address, while the stages of one operand sit back to back (a 16-byte box faulted with
# CUDA_ERROR_MISALIGNED_ADDRESS on the H200); its 16-byte row stride needs KB % 4 == 0.
SW_BOX = 16
TMA_SMEM_ALIGN = 128  # bytes: where a TMA copy's shared-memory end may start


@dataclasses.dataclass(frozen=True)
class Config:
  """Tile width (block_n in {64, 128, 192, 256}; the tile is 128 x block_n) and TMA pipeline
  depth.

  A compute warpgroup holds the running sum (block_n / 2 f32 registers per thread) and the
  fresh block product of its wgmma groups in flight: all of them up to 192 columns, one chunk
  at a time at 256 (the chunks then run one after another, each waited for before the next,
  as the sum's 128 registers leave room for one 64-register product only)."""

  block_n: int
  stages: int = 4
  # One CTA per SM walking tiles, the pipeline's buffers kept across them.
  persistent: bool = False
  # The tile's columns in this many wgmma groups: a group's rescale runs while the next
  # group's wgmma is still on the tensor cores.
  chunks: int = 1
  # Persistent only: the tiles in bands of this many row tiles, M fastest within a band (16: a
  # wave of 132 tiles spans about 16 x 8 of them; the other widths measured:
  # benchmarks/README.md).
  band: int = 16
  # K in this many equal parts, one CTA each (per-tile schedule only): float32 partial
  # products that XLA sums, for a grid of tiles too small to fill the SMs.
  splits: int = 1
  # The two compute warpgroups issue each K block's wgmma in turn, handing the turn over
  # through a barrier of theirs, so that one's rescale runs while the other's product is on the
  # tensor cores (left to drift, both can wait on the same stage and issue together). Needs 2
  # stages or more: with one, a warpgroup waiting for its turn holds the stage the other needs.
  # Slower than drifting at every shape measured (module docstring): a sweep option only.
  pingpong: bool = False

  def __post_init__(self):
    if self.block_n not in (64, 128, 192, 256):
      raise ValueError(f"Config needs block_n in (64, 128, 192, 256), got {self}")
    if self.chunks not in (1, 2, 3, 4) or (self.block_n // self.chunks) % 32:
      raise ValueError(f"Config.chunks must split block_n into multiples of 32, got {self}")
    if ((self.block_n == 256 and self.chunks not in (2, 4))
        or (self.block_n != 256 and self.chunks == 4)):
      raise ValueError(f"Config: 256 columns take chunks 2 or 4, and chunks 4 only 256 columns; "
                       f"got {self}")
    if not isinstance(self.stages, int) or self.stages < 1:
      raise ValueError(f"Config.stages must be a positive int, got {self.stages!r}")
    if not isinstance(self.band, int) or self.band < 1:
      raise ValueError(f"Config.band must be a positive int, got {self.band!r}")
    if not isinstance(self.splits, int) or self.splits < 1 or (self.splits > 1
                                                                and self.persistent):
      raise ValueError(f"Config.splits must be a positive int, 1 when persistent, got {self}")
    if self.pingpong and self.stages < 2:
      raise ValueError(f"Config.pingpong needs 2 stages or more, got {self}")


SPLIT_MIN_K = 2048  # K in parts only beyond it (a short K runs persistent, measured faster)


def smem_bytes(cfg: Config, out_dtype, weights: int = 1, row_scales: bool = False) -> int:
  """Shared memory of a CTA: the pipeline's stages (activation and `weights` weight blocks,
  their scales) and the two compute warpgroups' output staging (in out_dtype: the codes where
  the epilogue quantises, with their `row_scales`), with 1 KiB for the barriers."""
  stage = (BLOCK_M + weights * cfg.block_n) * BLOCK_K + 4 * (BLOCK_M + weights * 2 * SW_BOX)
  staged = jnp.dtype(jnp.float32 if cfg.splits > 1 else out_dtype).itemsize
  return (cfg.stages * stage + 2 * WG_M * cfg.block_n * staged + 2 * WG_M * 4 * row_scales
          + 1024)


def heuristics(m: int, n: int, k: int, out_dtype=jnp.bfloat16) -> Config:
  """The widest tile dividing N (fewer weight tiles re-read per activation tile) whose tiles
  cover half the SMs, else the narrowest; 4 stages; K in two parts where the tiles number at
  most half the SMs and K is over SPLIT_MIN_K, else persistent; a 192-wide tile in two chunks
  when persistent, else in three; 3 stages where 4 do not fit the shared memory beside the
  output staging (a float32 output at 192).

  Set from the H200 sweeps (benchmarks/README.md, "Mosaic GPU GEMM"): half the SMs because at
  M = 256, where 2 row tiles leave few column tiles, 64 columns took 24.8 us against 47.0 for
  192 at (N, K) = (2112, 7168) (66 tiles against 22).
  """
  widths = [bn for bn in (192, 128, 64) if n % bn == 0] or [64]  # N % 64: `check` declines
  block_n = next((bn for bn in widths if covers_half(m, n, bn)), widths[-1])
  few = 2 * tiles(m, n, block_n) <= _target.sm_count()
  splits = 2 if few and k > SPLIT_MIN_K and (k // BLOCK_K) % 2 == 0 else 1
  persistent = splits == 1
  chunks = (2 if persistent else 3) if block_n == 192 else 1
  cfg = Config(block_n, persistent=persistent, chunks=chunks, splits=splits)
  while smem_bytes(cfg, out_dtype) > _target.HOPPER_SMEM_BYTES and cfg.stages > 1:
    cfg = dataclasses.replace(cfg, stages=cfg.stages - 1)
  return cfg


def swiglu(g, u, act: str, dtype):
  """`ragged_fp8_matmul.reference.swiglu` on a tile's f32 sums in registers, in f32: each
  rounding to dtype as a round trip (the store rounds the result)."""
  rounded = lambda v: v.astype(dtype).astype(jnp.float32)
  g, u = rounded(g), rounded(u)
  s = g * jax.nn.sigmoid(g)
  if act == "silu_round_mul":
    s = rounded(s)
  return s * u


def tiles(m: int, n: int, block_n: int) -> int:
  """The 128 x block_n tiles of an `[M, N]` output."""
  return -(-m // BLOCK_M) * -(-n // block_n)


def covers_half(m: int, n: int, block_n: int) -> bool:
  """Whether the 128 x block_n tiles of an `[M, N]` output number at least half the SMs."""
  return 2 * tiles(m, n, block_n) >= _target.sm_count()


def tile_order(t, mt: int, nt: int, band: int):
  """The persistent schedule's t-th tile (row, column) of an mt x nt grid: bands of `band` row
  tiles (the last one narrower), M fastest within a band, so that the tiles at work together
  span `band` rows and about sm_count / band columns and their blocks stay in L2 (M fastest
  over all rows re-reads the whole activation from DRAM every wave, measured slower)."""
  # lax's truncating division (the operands are never negative): jnp's floor division by a
  # traced divisor does not lower in Mosaic GPU.
  first = t // (band * nt) * band
  rows = lax.min(mt - first, band)
  r = t - first * nt
  return first + lax.rem(r, rows), lax.div(r, rows)


def check(qa: jax.Array, n: int, k: int) -> None:
  """Raises Unsupported for what this kernel does not build (the dispatcher moves on)."""
  target = _target.current()
  if target.platform == "cuda" and not target.is_hopper:
    raise Unsupported(f"the Mosaic GPU kernel is built for Hopper (sm90), not {target.device_kind}")
  if target.platform not in ("cuda", "cpu"):
    raise Unsupported(f"Mosaic GPU runs on NVIDIA GPUs, not {target.platform}")
  if qa.dtype != E4M3FN:
    raise Unsupported(f"Hopper's fp8 wgmma takes float8_e4m3fn, not {qa.dtype}")
  if k % BLOCK_K or n % 64:
    raise Unsupported(f"the Mosaic GPU kernel needs K % 128 == 0 and N % 64 == 0, got N={n}, "
                      f"K={k}")


def fp8_matmul(qa: jax.Array, sa: jax.Array, a_layout: str, qw: jax.Array, sw: jax.Array,
               config: Config | None, out_dtype, *, row_tiles: jax.Array | None = None,
               up: tuple[jax.Array, jax.Array] | None = None, act: str = "silu_mul",
               quant: tuple[Fp8Format, bool] | None = None) -> jax.Array | tuple[jax.Array, ...]:
  """qa [M, K] fp8, sa [M, KB] ("row") or [KB, M] ("col"), qw [N, K], sw [NB, KB] -> [M, N].

  Ragged (MoE experts over rows sorted by expert), with `row_tiles` (int32 [4, tiles]: start,
  expert, lo, hi; `ragged_fp8_matmul.tiles.tile_map` of BLOCK_M aligned to ROW_TILE): qw
  [E, N, K] and sw [E, NB, KB], N a multiple of block_n and one part of K. Tile i computes the
  128 rows from start[i] (a multiple of ROW_TILE: TMA boxes into the tiled shared memory start
  at whole tiles) against expert[i]'s weight and stores rows lo[i] .. hi[i] - 1 only (inside
  those 128), in boxes of 64, 32, .., 1 rows (a TMA box's size is static); a tile storing
  nothing skips its K loop. Expert E, the rows past the groups, reads weight rows past the
  array, which TMA fills with zeros: those rows are zeros.

  With `up` (its codes and scales, shaped as qw and sw; block_n 128, one chunk): qw is the
  gate, and the output is the experts' activation of the two products,
  `ragged_fp8_matmul.reference.swiglu(a @ qw^T, a @ up^T, act, out_dtype)`: each activation
  block is loaded once for both, the two sums take a 256-wide tile's registers (the chunks one
  after another), and the activation runs on them in the epilogue.

  With `quant` ((fmt, ue8m0); with `up` and `row_tiles`): the activation, rounded to
  out_dtype, is quantised in the epilogue as `group_quant` quantises it, the tile's 128 columns
  one group a row. Returns (codes [M, N] in fmt, slot scales [N / 128, tiles * 128] f32): the
  scale of tile t's i-th loaded row (start[t] + i) at slot t * 128 + i, each tile writing all
  of its 128 slots (whole boxes: a store of fewer than four f32 is no TMA box), the rows' own
  slots picked after (`ragged_fp8_matmul.tiles.row_slots`)."""
  m, k = qa.shape
  n = qw.shape[-2]
  check(qa, n, k)
  cfg = config or heuristics(m, n, k, out_dtype)
  ragged = row_tiles is not None
  if ragged and (n % cfg.block_n or cfg.splits > 1):
    raise InputError(f"{cfg}: a ragged product needs block_n dividing N = {n} (a tile reads "
                     f"one expert) and splits=1")
  if up is not None and (cfg.block_n != BLOCK or cfg.chunks != 1 or cfg.splits > 1):
    raise InputError(f"{cfg}: the gate and up pair needs block_n={BLOCK}, chunks=1, splits=1")
  if quant is not None and (up is None or not ragged or quant[0].dtype != E4M3FN):
    raise InputError("quant takes the ragged gate and up pair, quantised to float8_e4m3fn")
  nw = 1 if up is None else 2  # weights a tile reads
  stage_dtype = out_dtype if quant is None else quant[0].dtype  # what the epilogue stages
  need = smem_bytes(cfg, stage_dtype, nw, row_scales=quant is not None)
  if need > _target.HOPPER_SMEM_BYTES:
    raise InputError(f"{cfg} with a {jnp.dtype(stage_dtype).name} output needs {need} bytes of "
                     f"shared memory, over Hopper's {_target.HOPPER_SMEM_BYTES}: fewer stages "
                     f"or a narrower tile")
  bn, kb = cfg.block_n, k // BLOCK_K
  if kb % cfg.splits:
    raise InputError(f"{cfg} splits K = {k} ({kb} blocks of {BLOCK_K}) into unequal parts")
  kp = kb // cfg.splits  # K blocks per CTA
  staged = jnp.float32 if cfg.splits > 1 else stage_dtype
  cw = bn // cfg.chunks
  row_bytes = cw * jnp.dtype(staged).itemsize
  if ragged and row_bytes % TMA_SMEM_ALIGN:
    raise InputError(f"{cfg}: a ragged tile stores its rows from any row of its staging, so a "
                     f"staged row must be a multiple of {TMA_SMEM_ALIGN} bytes (TMA's shared "
                     f"memory alignment); {cw} columns of {jnp.dtype(staged).name} are "
                     f"{row_bytes}: other chunks")
  # A warpgroup's accumulator chunks: (weight, its column chunk).
  parts = [(w, c) for w in range(nw) for c in range(cfg.chunks)]
  # Rows past M arrive as zeros and the stores clip them (TMA, as for the columns past N), so M
  # is padded only to the 8-row tiling of the activation's shared-memory layout, which TMA
  # needs the array's rows to divide: no copy of the activation or the output where M % 8 == 0.
  mp = -(-m // ROW_TILE) * ROW_TILE
  nt = -(-n // bn)
  # Row tiles: M's blocks, or the ragged product's tiles (each from its group's rows).
  mt = row_tiles.shape[1] if ragged else -(-m // BLOCK_M)
  nb = sw.shape[-2]
  # The experts' weights one above the other: expert e's tile ni is weight tile e * nt + ni.
  weights = [(qw, sw)] + ([up] if up is not None else [])
  ws = [w.reshape(-1, k) for w, _ in weights]
  sws = [s.reshape(-1, s.shape[-1]) for _, s in weights]
  sa_col = sa if a_layout == "col" else sa.T
  if mp != m:
    qa = jnp.pad(qa, ((0, mp - m), (0, 0)))
    sa_col = jnp.pad(sa_col, ((0, 0), (0, mp - m)))
  if kb % 4:
    sws = [jnp.pad(s, ((0, 0), (0, 4 - kb % 4))) for s in sws]

  # A ragged tile's rows start at any multiple of ROW_TILE: its rows are indexed by element.
  rows_dim = pl.Element(BLOCK_M) if ragged else BLOCK_M

  # r0: the tile's first row (ragged) or row block; b0: the CTA's first K block.
  def pipeline(step, context, r0, ni, b0=0, expert=0):
    w_spec = plgpu.BlockSpec((bn, BLOCK_K), lambda b: (expert * nt + ni, b0 + b),
                             transforms=_TRANSFORMS)
    # Element offset: the tile's first weight block, whatever the tile's width.
    sw_spec = plgpu.BlockSpec((pl.Element(2), SW_BOX),
                              lambda b: (expert * nb + ni * bn // BLOCK, (b0 + b) // SW_BOX))
    return plgpu.emit_pipeline_warp_specialized(
        step, grid=(kp,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
        max_concurrent_steps=cfg.stages, compute_context=context,
        in_specs=[plgpu.BlockSpec((rows_dim, BLOCK_K), lambda b: (r0, b0 + b),
                                  transforms=_TRANSFORMS), *[w_spec] * nw,
                  plgpu.BlockSpec((1, rows_dim), lambda b: (b0 + b, r0)), *[sw_spec] * nw])

  def handoff(turn, skip):
    """Meet the other compute warpgroup at `turn` (Config.pingpong; None: no ordering), unless
    `skip`."""
    if turn is not None:
      @pl.when(jnp.logical_not(skip))
      def _():
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

  outs = 1 if quant is None else 2  # the output, or the codes and the slot scales

  def tile(ti, ni, refs, o_smem, turn, allocations=None, ks=0, s_smem=None):
    a_gmem, sa_gmem, *refs = refs
    w_gmems, sw_gmems = refs[:nw], refs[nw:2 * nw]
    tiles_gmem, (o_gmem, *s_gmem) = refs[2 * nw:-outs], refs[-outs:]
    if ragged:
      row0, expert, lo, hi = (tiles_gmem[0][j, ti] for j in range(4))
      row0 = r0 = pl.multiple_of(row0, ROW_TILE)
    else:
      r0, expert = ti, 0
      row0 = ti * BLOCK_M
    b0 = ks * kp
    wg = lax.axis_index("wg")
    rows = pl.ds(wg * WG_M, WG_M)

    def step(idx, a_smem, *refs):
      w_smems, sa_smem, sw_smems, acc = refs[:nw], refs[nw], refs[nw + 1:-1], refs[-1]
      kg = b0 + idx[0]  # the K block

      def issue(j, d_ref):
        w, c = parts[j]
        plgpu.wgmma(d_ref, a_smem.at[rows], w_smems[w].at[pl.ds(c * cw, cw)].transpose((1, 0)))

      # The rows' scales, then each weight's two block scales.
      scales = lambda: (plgpu.load(sa_smem.at[0, rows], layout=plgpu.Layout.WGMMA.reduce(1)),
                        *[(sw[0, kg % SW_BOX], sw[1, kg % SW_BOX]) for sw in sw_smems])

      def rescale(j, d_ref, s_a, *s_w):  # acc[j] + part j's product times its scales
        w, c = parts[j]
        s0, s1 = s_w[w]
        # The chunk's first column, counted from the first weight block the tile touches.
        lo = (ni * bn) % BLOCK + c * cw
        if BLOCK % cw == 0:  # the chunk lies in one weight block: one FMA per value
          return acc[j] + d_ref[...] * (s_a * jnp.where(lo < BLOCK, s0, s1))[:, None]
        # Columns before the block edge take the first block's scale, the rest the second's.
        col = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (cw,), 0) + lo,
                                plgpu.Layout.WGMMA.reduce(0))
        s_w = jnp.where(col < BLOCK, s0, s1)
        return acc[j] + d_ref[...] * s_a[:, None] * s_w[None, :]

      # Config.pingpong: each issue between two handoffs, so the turns alternate: the first
      # warpgroup's issue, then the second's, then the first's next. Within a tile only (the
      # first warpgroup's first issue and the second's last take no handoff): a turn handed
      # across tiles would wait on the next tile's blocks, which the memory warpgroup copies
      # only once this tile's are all consumed.
      def ordered_issue(first, last, issues):
        handoff(turn, (wg == 0) & first)
        issues()
        handoff(turn, (wg == 1) & last)

      first, last = idx[0] == 0, idx[0] == kp - 1
      if nw * bn == 256:  # 256 columns of sums: the parts one after another (Config)
        s = scales()

        def chunk(j, d_ref):
          ordered_issue(first & (j == 0), last & (j == len(parts) - 1),
                        lambda: issue(j, d_ref))
          plgpu.wgmma_wait(0)
          return rescale(j, d_ref, *s)

        return tuple(pl.run_scoped(functools.partial(chunk, j), plgpu.ACC((WG_M, cw),
                                                                         jnp.float32))
                     for j in range(len(parts)))

      def mma(*d_refs):
        ordered_issue(first, last, lambda: [issue(j, d_ref) for j, d_ref in enumerate(d_refs)])
        s = scales()
        out = []
        for j, d_ref in enumerate(d_refs):
          plgpu.wgmma_wait(len(parts) - 1 - j)
          out.append(rescale(j, d_ref, *s))
        return tuple(out)

      return pl.run_scoped(mma, *[plgpu.ACC((WG_M, cw), jnp.float32)] * len(parts))

    def context(run):
      zero = plgpu.layout_cast(jnp.zeros((WG_M, cw), jnp.float32), plgpu.Layout.WGMMA)
      acc = run((zero,) * len(parts))
      if up is not None:  # the gate's chunks, then the up's
        acc = [swiglu(g, u, act, out_dtype) for g, u in zip(acc[:cfg.chunks], acc[cfg.chunks:])]
      if quant is not None:
        acc, scale = quantize_rows(acc[0].astype(out_dtype).astype(jnp.float32), *quant)
        acc = [acc]
      if cfg.persistent:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's store read o_smem
      for c, part in enumerate(acc):
        o_smem[wg, c] = part.astype(staged)
      if quant is not None:
        s_smem[wg] = scale
      plgpu.commit_smem()
      if quant is not None:
        plgpu.copy_smem_to_gmem(s_smem.at[wg],
                                s_gmem[0].at[ni, pl.ds(ti * BLOCK_M + wg * WG_M, WG_M)])
      dst = o_gmem.at[ks] if cfg.splits > 1 else o_gmem
      wg_row0 = row0 + wg * WG_M

      def store(at, size):  # rows at .. at + size - 1 of this warpgroup's 64
        for c in range(cfg.chunks):
          plgpu.copy_smem_to_gmem(o_smem.at[wg, c, pl.ds(at, size)],
                                  dst.at[pl.ds(wg_row0 + at, size), pl.ds(ni * bn + c * cw, cw)])

      if not ragged:
        store(0, WG_M)
      else:  # the tile's rows of this warpgroup's 64, as boxes of 64, 32, .., 1 rows
        first = lax.max(lax.min(lo - wg_row0, WG_M), 0)
        count = lax.max(lax.min(hi - wg_row0, WG_M), 0) - first
        size = WG_M
        while size:
          pl.when(count & size != 0)(functools.partial(store, first, size))
          first, size = first + (count & size), size // 2
      if not cfg.persistent:
        plgpu.wait_smem_to_gmem(0)

    run = lambda: pipeline(step, context, r0, ni, b0, expert)(
        a_gmem, *w_gmems, sa_gmem, *sw_gmems, allocations=allocations)
    if ragged:
      pl.when(lo < hi)(run)
    else:
      run()

  def kernel(*refs):
    # Allocated by all three warpgroups together (a collective scope), used by the compute two.
    # A buffer per column chunk: the ragged stores' row boxes cut from column slices of one
    # buffer left JAX 0.12's layout inference searching without end.
    out_smem = plgpu.SMEM((2, cfg.chunks, WG_M, cw), staged)
    turn = plgpu.Barrier(num_arrivals=2) if cfg.pingpong else None
    scale_smem = plgpu.SMEM((2, WG_M), jnp.float32) if quant is not None else None
    if not cfg.persistent:
      pl.run_scoped(lambda o_smem, turn, s_smem: tile(
          lax.axis_index("m"), lax.axis_index("n"), refs, o_smem, turn,
          ks=lax.axis_index("k") if cfg.splits > 1 else 0, s_smem=s_smem),
          out_smem, turn, scale_smem, collective_axes="wg")
    else:
      # The pipeline's buffers outlive the tiles: the memory warpgroup starts copying the next
      # tile's blocks while the compute warpgroups store the last one.
      a_gmem, sa_gmem, *operands = refs
      allocs = pipeline(None, None, 0, 0).get_allocations(a_gmem, *operands[:nw], sa_gmem,
                                                          *operands[nw:2 * nw])

      def scope(allocations, o_smem, turn, s_smem):
        @plgpu.nd_loop((mt * nt,), collective_axes="c")
        def _(info):
          (t,) = info.index
          tile(*tile_order(t, mt, nt, cfg.band), refs, o_smem, turn, allocations, s_smem=s_smem)

        plgpu.wait_smem_to_gmem(0)

      pl.run_scoped(scope, allocs, out_smem, turn, scale_smem, collective_axes="wg")

  if cfg.persistent:
    grid, names = (min(mt * nt, _target.sm_count()),), ("c",)
  else:
    grid, names = ((mt, nt, cfg.splits), ("m", "n", "k")) if cfg.splits > 1 else ((mt, nt),
                                                                                 ("m", "n"))
  out_shape = (cfg.splits, mp, n) if cfg.splits > 1 else (mp, n)
  out_type = jax.ShapeDtypeStruct(out_shape, staged)
  if quant is not None:
    out_type = (out_type, jax.ShapeDtypeStruct((n // BLOCK, mt * BLOCK_M), jnp.float32))
  out = plgpu.kernel(
      kernel, out_type=out_type, grid=grid, grid_names=names,
      num_threads=3, thread_name="wg",
      interpret=plgpu.InterpretGPUParams() if _target.interpret() else False,
  )(qa, sa_col, *ws, *sws, *([row_tiles] if ragged else []))
  if quant is not None:
    codes, slots = out
    return (codes[:m] if mp != m else codes), slots
  if cfg.splits > 1:
    out = out.sum(0).astype(out_dtype)
  return out[:m] if mp != m else out
