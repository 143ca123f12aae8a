"""Triton kernels for MLA decode: split-K flash decoding over the latent cache as stored.

Grid (head blocks, splits, B x T), head blocks fastest, so the programs that read one split's
cache blocks run together and share them in L2. A program holds BLOCK_H query heads of one
token and walks its split's slots up to the token's position, BLOCK_S at a time, an online
softmax over the blocks in f32, and writes its split's normalised output and log-sum-exp; XLA
merges the splits. Three forms of the sums (`Config.form`):

  batched / flat (`mla_decode_kernel`): the latent axis cut into its 1 x 128 scale groups g,
  the codes exact in bf16, a per-slot scale applied after the score's product and on the
  probabilities before the output's:
    s      = (sum_g (q_lat_g . codes_g^T) scale_g + q_pe . k_pe^T) * scale   [BLOCK_H, BLOCK_S]
    acc_g += (p scale_g) (bf16) . codes_g                                       [BLOCK_H, 128]
  batched holds the groups as a batch axis of 3-D products ([G, BLOCK_H, 128] tiles:
  `mma.sync`); flat as a tuple of 2-D tiles, one product a group, which Hopper runs on wgmma
  from 64 heads a program (8 warps: the two warpgroups split the columns).
  dequant (`mla_decode_dequant_kernel`): each block's latent dequantised in registers and
  rounded to bf16 in shared memory, one product over the whole latent for the scores and one
  for the output:
    s    = (q_lat . latent^T + q_pe . k_pe^T) * scale      acc += p (bf16) . latent
  three wgmma a step instead of 2G + 1, the queries read from shared memory by the products,
  and (Triton 3.6, sm_90a, 64 heads x 64 slots in 8 warps) no register spills, where flat
  spills 264 bytes a thread.

A bf16 cache (no scales) takes the same paths with scale 1.
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
FORMS = ("batched", "flat", "dequant")
LONG_SLOTS = 4096  # the heuristics' 64-head tiling from here (measured at 4096 and 32768)


@dataclasses.dataclass(frozen=True)
class Config:
  """block_h query heads a program and block_s slots a step; splits of the slots (a grid
  axis); form: how the products are cut (module docstring): "batched", "flat" or "dequant"."""

  block_h: int = 32
  block_s: int = 32
  splits: int = 1
  num_warps: int = 4
  num_stages: int = 2
  form: str = "batched"

  def __post_init__(self):
    for f in ("block_h", "block_s"):
      v = getattr(self, f)
      if v < MIN_DOT or v & (v - 1):
        raise ValueError(f"Config.{f} must be a power of two >= {MIN_DOT}, got {v}")
    if self.splits < 1:
      raise ValueError(f"Config.splits must be >= 1, got {self.splits}")
    if self.form not in FORMS:
      raise ValueError(f"Config.form must be one of {FORMS}, got {self.form!r}")


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
                  form="flat")
  return Config(block_h=32, splits=splits(tokens, heads, slots, 32, device_kind), form="flat")


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


@_triton.jit
def mla_decode_dequant_kernel(ql_ptr, qp_ptr, kv_ptr, ks_ptr, kp_ptr, pos_ptr, o_ptr, lse_ptr,
                              T: tl.constexpr, NH: tl.constexpr, S: tl.constexpr,
                              L: tl.constexpr, R: tl.constexpr, GP: tl.constexpr,
                              RP: tl.constexpr, SCALE: tl.constexpr, SPLIT: tl.constexpr,
                              SPLITS: tl.constexpr, SCALED: tl.constexpr, GROUP: tl.constexpr,
                              BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr):
  G: tl.constexpr = (L + GROUP - 1) // GROUP
  LP: tl.constexpr = GP * GROUP  # the latent padded to whole groups, a power of two of them
  pid_h, pid_s, pid_bt = tl.program_id(0), tl.program_id(1), tl.program_id(2)
  b = pid_bt // T
  last = tl.load(pos_ptr) + pid_bt % T  # the token's position: slots 0 .. last are visible
  start = pid_s * SPLIT
  end = tl.minimum(tl.minimum(start + SPLIT, last + 1), S)

  rh = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
  rl, rr, rg = tl.arange(0, LP), tl.arange(0, RP), tl.arange(0, GP)
  h_ok, l_ok, r_ok, g_ok = rh < NH, rl < L, rr < R, rg < G
  q_row = (pid_bt * NH + rh).to(tl.int64)
  q_lat = tl.load(ql_ptr + q_row[:, None] * L + rl[None, :], mask=h_ok[:, None] & l_ok[None, :],
                  other=0.0).to(tl.bfloat16)
  q_pe = tl.load(qp_ptr + q_row[:, None] * R + rr[None, :], mask=h_ok[:, None] & r_ok[None, :],
                 other=0.0).to(tl.bfloat16)
  acc = tl.zeros([BLOCK_H, LP], tl.float32)
  m = tl.full([BLOCK_H], float("-inf"), tl.float32)
  den = tl.zeros([BLOCK_H], tl.float32)
  for s0 in range(start, end, BLOCK_S):
    rs = s0 + tl.arange(0, BLOCK_S)
    s_ok = rs < end
    slot = (b * S + rs).to(tl.int64)
    kp = tl.load(kp_ptr + slot[:, None] * R + rr[None, :], mask=s_ok[:, None] & r_ok[None, :],
                 other=0.0).to(tl.bfloat16)
    codes = tl.load(kv_ptr + slot[:, None] * L + rl[None, :],
                    mask=s_ok[:, None] & l_ok[None, :], other=0.0)
    if SCALED:
      sc = tl.load(ks_ptr + slot[:, None] * G + rg[None, :], mask=s_ok[:, None] & g_ok[None, :],
                   other=0.0)  # [BLOCK_S, GP]
      lat = tl.reshape(codes.to(tl.float32), [BLOCK_S, GP, GROUP]) * sc[:, :, None]
      lat = tl.reshape(lat, [BLOCK_S, LP]).to(tl.bfloat16)
    else:
      lat = codes.to(tl.bfloat16)
    s = tl.dot(q_lat, tl.trans(lat)) + tl.dot(q_pe, tl.trans(kp))
    s = tl.where(s_ok[None, :], s * SCALE, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    den = den * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), lat)
    m = m_new
  # A split past the token's position ran no step: den 0, lse -inf, output 0 (weight 0).
  seen = den > 0
  d = tl.where(seen, den, 1.0)
  lse = tl.where(seen, m + tl.log(d), float("-inf"))
  o_row = ((pid_bt * SPLITS + pid_s) * NH + rh).to(tl.int64)
  tl.store(o_ptr + o_row[:, None] * L + rl[None, :], acc / d[:, None],
           mask=h_ok[:, None] & l_ok[None, :])
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
  dequant = config.form == "dequant"
  form = {} if dequant else dict(FLAT=config.form == "flat")
  o, lse = _triton.call(
      mla_decode_dequant_kernel if dequant else mla_decode_kernel, q_lat, q_pe, kv, stand_in if kv_scale is None else kv_scale, k_pe,
      jnp.reshape(jnp.asarray(pos, jnp.int32), (1,)),
      out_shape=[jax.ShapeDtypeStruct((b * t, splits, nh, l), jnp.float32),
                 jax.ShapeDtypeStruct((b * t, splits, nh), jnp.float32)],
      grid=(-(-nh // config.block_h), splits, b * t), num_warps=config.num_warps,
      num_stages=config.num_stages, T=t, NH=nh, S=slots, L=l, R=r,
      GP=_common.pow2_ceil(-(-l // BLOCK)), RP=max(MIN_DOT, _common.pow2_ceil(r)),
      SCALE=float(scale), SPLIT=split, SPLITS=splits, SCALED=kv_scale is not None,
      GROUP=BLOCK, BLOCK_H=config.block_h, BLOCK_S=bs, **form)
  if splits > 1:
    top = jnp.max(lse, axis=1, keepdims=True)  # split 0 holds slot 0: finite
    w = jnp.exp(lse - top)
    o = jnp.sum(o * w[..., None], axis=1) / jnp.sum(w, axis=1)[..., None]
  else:
    o = o[:, 0]
  return o.reshape(b, t, nh, l)
