"""Triton kernel for MLA decode: split-K flash decoding over the latent cache as stored.

Grid (head blocks, splits, B x T), head blocks fastest, so the programs that read one split's
cache blocks run together and share them in L2. A program holds BLOCK_H query heads of one
token and walks its split's slots up to the token's position, BLOCK_S at a time, the latent
axis cut into its 1 x 128 scale groups g, the codes exact in bf16:
  s      = (sum_g (q_lat_g . codes_g^T) scale_g + q_pe . k_pe^T) * scale   [BLOCK_H, BLOCK_S]
  online softmax over the blocks; acc_g += (p scale_g) (bf16) . codes_g     [BLOCK_H, 128]
in f32, and writes its split's normalised output and log-sum-exp; XLA merges the splits. No
dequantised latent is formed: a per-slot scale applies after the score's dot and on the
probabilities before the output's (a kernel that dequantised each [BLOCK_S, L] block in f32
registers took 13x its bf16-cache time over a 32768-slot decode step on an H100). A bf16 cache
(no scales) takes the same path with scale 1.

Two forms of the same sums (`Config.flat`): the groups as a batch axis of 3-D products
([G, BLOCK_H, 128] tiles: `mma.sync`), or a tuple of 2-D tiles, one product a group, which
Hopper runs on wgmma from 64 heads a program (8 warps: the two warpgroups split the columns).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jfusedq import _target, _triton
from jfusedq._triton import tl
from jfusedq.fp8 import BLOCK
from jfusedq.ops import _common

MIN_DOT = 16  # tl.dot's smallest M, N and K
LONG_SLOTS = 4096  # the heuristics' 64-head tiling from here (measured at 4096 and 32768)


@dataclasses.dataclass(frozen=True)
class Config:
  """block_h query heads a program and block_s slots a step; splits of the slots (a grid
  axis); flat: one 2-D product a latent group (Hopper's wgmma from 64 heads a program) instead
  of the groups as a batch axis of 3-D products, the same sums on the exact codes."""

  block_h: int = 32
  block_s: int = 32
  splits: int = 1
  num_warps: int = 4
  num_stages: int = 2
  flat: bool = False

  def __post_init__(self):
    for f in ("block_h", "block_s"):
      v = getattr(self, f)
      if v < MIN_DOT or v & (v - 1):
        raise ValueError(f"Config.{f} must be a power of two >= {MIN_DOT}, got {v}")
    if self.splits < 1:
      raise ValueError(f"Config.splits must be >= 1, got {self.splits}")


def heuristics(tokens: int, heads: int, slots: int, device_kind: str | None = None) -> Config:
  """The flat form (on an H100 at 128 heads it ran ahead of the batched one at every tiling
  timed against it at 4096 slots and at five of six at 32768; benchmarks/README.md).
  From LONG_SLOTS slots and 64 heads: 64 heads a program in 8 warps (wgmma), about one program
  an SM, at least 64 slots a split, 64 slots a step where a split holds 256 or more: the
  fastest of that sweep at 32768 slots, 1.43x the 32-head pick's speed, and within 1% of the
  fastest at 4096, 1.24x.
  Below: 32 heads a program and 32 slots a step in 4 warps, about two programs an SM, at
  least 128 slots a split: the fastest of the batched form's sweep at 256 slots."""
  if heads >= 64 and slots >= LONG_SLOTS:
    n = splits(tokens, heads, slots, 64, device_kind, per_sm=1, min_slots=64)
    return Config(block_h=64, block_s=64 if slots >= 256 * n else 32, splits=n, num_warps=8,
                  flat=True)
  return Config(block_h=32, splits=splits(tokens, heads, slots, 32, device_kind), flat=True)


def splits(tokens: int, heads: int, slots: int, block_h: int, device_kind: str | None = None,
           per_sm: int = 2, min_slots: int = 128) -> int:
  """The slot splits that give about `per_sm` programs an SM at `block_h` heads a program, at
  least `min_slots` slots a split."""
  programs = tokens * -(-heads // block_h)
  return max(1, min(-(-per_sm * _target.sm_count(device_kind) // programs),
                    -(-slots // min_slots)))


@_triton.jit
def mla_decode_kernel(ql_ptr, qp_ptr, kv_ptr, ks_ptr, kp_ptr, pos_ptr, o_ptr, lse_ptr,
                      T: tl.constexpr, NH: tl.constexpr, S: tl.constexpr, L: tl.constexpr,
                      R: tl.constexpr, GP: tl.constexpr, RP: tl.constexpr,
                      SCALE: tl.constexpr, SPLIT: tl.constexpr, SPLITS: tl.constexpr,
                      SCALED: tl.constexpr, FLAT: tl.constexpr, GROUP: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr):
  G: tl.constexpr = (L + GROUP - 1) // GROUP
  pid_h, pid_s, pid_bt = tl.program_id(0), tl.program_id(1), tl.program_id(2)
  b = pid_bt // T
  last = tl.load(pos_ptr) + pid_bt % T  # the token's position: slots 0 .. last are visible
  start = pid_s * SPLIT
  end = tl.minimum(tl.minimum(start + SPLIT, last + 1), S)

  # The latent axis as [groups, 128]: each slot's scales broadcast over their groups.
  rg = tl.arange(0, GP)
  col = rg[:, None, None] * GROUP + tl.arange(0, GROUP)[None, None, :]  # [GP, 1, GROUP]
  c_ok = col < L
  rh = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
  rr = tl.arange(0, RP)
  h_ok, r_ok = rh < NH, rr < R
  q_row = (pid_bt * NH + rh).to(tl.int64)
  q_pe = tl.load(qp_ptr + q_row[:, None] * R + rr[None, :],
                 mask=h_ok[:, None] & r_ok[None, :], other=0.0).to(tl.bfloat16)
  if FLAT:
    cg = tl.arange(0, GROUP)
    q_lat = ()
    acc = ()
    for g in tl.static_range(G):
      c = g * GROUP + cg
      q_lat = q_lat + (tl.load(ql_ptr + q_row[:, None] * L + c[None, :],
                               mask=h_ok[:, None] & (c < L)[None, :], other=0.0).to(tl.bfloat16),)
      acc = acc + (tl.zeros([BLOCK_H, GROUP], tl.float32),)
  else:
    q_lat = tl.load(ql_ptr + q_row[None, :, None] * L + col,
                    mask=h_ok[None, :, None] & c_ok, other=0.0).to(tl.bfloat16)
    acc = tl.zeros([GP, BLOCK_H, GROUP], tl.float32)

  m = tl.full([BLOCK_H], float("-inf"), tl.float32)
  den = tl.zeros([BLOCK_H], tl.float32)
  for s0 in range(start, end, BLOCK_S):
    rs = s0 + tl.arange(0, BLOCK_S)
    s_ok = rs < end
    slot = (b * S + rs).to(tl.int64)
    kp = tl.load(kp_ptr + slot[:, None] * R + rr[None, :], mask=s_ok[:, None] & r_ok[None, :],
                 other=0.0).to(tl.bfloat16)
    if FLAT:
      # One 2-D product a group (Hopper's wgmma from 64 heads a program), the group's codes
      # and scales kept for the output's product.
      s = tl.dot(q_pe, tl.trans(kp))
      kv = ()
      sc = ()
      for g in tl.static_range(G):
        c = g * GROUP + cg
        kv_g = tl.load(kv_ptr + slot[:, None] * L + c[None, :],
                       mask=s_ok[:, None] & (c < L)[None, :], other=0.0).to(tl.bfloat16)
        part = tl.dot(q_lat[g], tl.trans(kv_g))
        if SCALED:
          sc_g = tl.load(ks_ptr + slot * G + g, mask=s_ok, other=0.0)  # [BLOCK_S]
          part = part * sc_g[None, :]
          sc = sc + (sc_g,)
        s += part
        kv = kv + (kv_g,)
    else:
      # Codes (or bf16 latent) exact in bf16: [GP, BLOCK_S, GROUP], per-group batched dots.
      kv = tl.load(kv_ptr + slot[None, :, None] * L + col, mask=s_ok[None, :, None] & c_ok,
                   other=0.0).to(tl.bfloat16)
      per_group = tl.dot(q_lat, tl.trans(kv, (0, 2, 1)))  # [GP, BLOCK_H, BLOCK_S] f32
      if SCALED:
        sc = tl.load(ks_ptr + slot[None, :] * G + rg[:, None],
                     mask=(rg < G)[:, None] & s_ok[None, :], other=0.0)  # [GP, BLOCK_S]
        per_group = per_group * sc[:, None, :]
      s = tl.sum(per_group, 0) + tl.dot(q_pe, tl.trans(kp))
    s = tl.where(s_ok[None, :], s * SCALE, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    den = den * alpha + tl.sum(p, 1)
    if FLAT:
      new = ()
      for g in tl.static_range(G):
        pg = (p * sc[g][None, :]).to(tl.bfloat16) if SCALED else p.to(tl.bfloat16)
        new = new + (acc[g] * alpha[:, None] + tl.dot(pg, kv[g]),)
      acc = new
    else:
      # p . latent per group: the group's scale varies along the slots, so it weighs p.
      if SCALED:
        pg = (p[None, :, :] * sc[:, None, :]).to(tl.bfloat16)
      else:
        pg = tl.broadcast_to(p.to(tl.bfloat16)[None, :, :], [GP, BLOCK_H, BLOCK_S])
      acc = acc * alpha[None, :, None] + tl.dot(pg, kv)
    m = m_new
  # A split past the token's position ran no step: den 0, lse -inf, output 0 (weight 0).
  seen = den > 0
  d = tl.where(seen, den, 1.0)
  lse = tl.where(seen, m + tl.log(d), float("-inf"))
  o_row = ((pid_bt * SPLITS + pid_s) * NH + rh).to(tl.int64)
  if FLAT:
    for g in tl.static_range(G):
      c = g * GROUP + cg
      tl.store(o_ptr + o_row[:, None] * L + c[None, :], acc[g] / d[:, None],
               mask=h_ok[:, None] & (c < L)[None, :])
  else:
    tl.store(o_ptr + o_row[None, :, None] * L + col, acc / d[None, :, None],
             mask=h_ok[None, :, None] & c_ok)
  tl.store(lse_ptr + o_row, lse, mask=h_ok)


def mla_decode(q_lat, q_pe, kv, kv_scale, k_pe, pos, scale: float, config: Config) -> jax.Array:
  """The api's call on the kernel: per-split outputs, merged by their log-sum-exp."""
  _triton.require()
  b, t, nh, l = q_lat.shape
  slots, r = kv.shape[1], q_pe.shape[-1]
  bs, splits = config.block_s, min(config.splits, -(-slots // config.block_s))
  split = -(-slots // splits // bs) * bs
  splits = -(-slots // split)
  stand_in = jnp.zeros((1,), jnp.float32)  # no scales (a bf16 cache): never read
  # The queries rounded to bf16 here, as the kernel would on loading them: half their bytes,
  # and fewer of the kernel's registers (Triton 3.6's sm_90a build of the 64-head, 64-slot
  # tiling spills 440 bytes a thread with f32 queries, 264 with bf16).
  q_lat, q_pe = q_lat.astype(jnp.bfloat16), q_pe.astype(jnp.bfloat16)
  o, lse = _triton.call(
      mla_decode_kernel, q_lat, q_pe, kv, stand_in if kv_scale is None else kv_scale, k_pe,
      jnp.reshape(jnp.asarray(pos, jnp.int32), (1,)),
      out_shape=[jax.ShapeDtypeStruct((b * t, splits, nh, l), jnp.float32),
                 jax.ShapeDtypeStruct((b * t, splits, nh), jnp.float32)],
      grid=(-(-nh // config.block_h), splits, b * t), num_warps=config.num_warps,
      num_stages=config.num_stages, T=t, NH=nh, S=slots, L=l, R=r,
      GP=_common.pow2_ceil(-(-l // BLOCK)), RP=max(MIN_DOT, _common.pow2_ceil(r)),
      SCALE=float(scale), SPLIT=split, SPLITS=splits, SCALED=kv_scale is not None,
      FLAT=config.flat, GROUP=BLOCK,
      BLOCK_H=config.block_h, BLOCK_S=bs)
  if splits > 1:
    top = jnp.max(lse, axis=1, keepdims=True)  # split 0 holds slot 0: finite
    w = jnp.exp(lse - top)
    o = jnp.sum(o * w[..., None], axis=1) / jnp.sum(w, axis=1)[..., None]
  else:
    o = o[:, 0]
  return o.reshape(b, t, nh, l)
