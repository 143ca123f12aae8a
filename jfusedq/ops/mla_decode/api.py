"""Public entry point of MLA decode: attention of a few new tokens over the latent cache.

Shapes: B batch, T new tokens (1 in a decode step), NH query heads (this device's), S cache
slots, L the latent width (DeepSeek-V3's kv_lora_rank, 512), R the rope key width (64).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jfusedq import _target
from jfusedq.errors import DTypeError, InputError, check_range
from jfusedq.fp8 import BLOCK, E4M3FN, E4M3FNUZ
from jfusedq.ops import _common, _dispatch
from jfusedq.ops._dispatch import Unsupported, declare, dispatch
from jfusedq.ops.mla_decode import reference, triton

declare("mla_decode", ("triton", "xla"))

# Cache slots from which the kernel comes first on a GPU. On an H100 (128 heads, one token) the
# XLA path took 18 us at 256 slots and 294 at 32768, the kernel 28 and 149: it reads only the
# slots up to the position but pays a floor of its own, and the two lines cross near 2k slots.
KERNEL_SLOTS = 2048


def mla_decode(q_lat: jax.Array, q_pe: jax.Array, kv: jax.Array, kv_scale: jax.Array | None,
               k_pe: jax.Array, *, pos: jax.Array | int, scale: float,
               implementation: str | Sequence[str] | None = None,
               config: triton.Config | None = None) -> jax.Array:
  """Absorbed multi-head latent attention (DeepSeek-V2/V3) over the cache as stored.

    s[t, h, j] = scale (q_lat[t, h] . latent[j] + q_pe[t, h] . k_pe[j])   for j <= pos + t
    o[t, h]    = softmax_j(s[t, h]) . latent
  with latent[j] = kv[j] x kv_scale[j, c // 128] (the 1 x 128 FP8 codes and their scales as
  the cache holds them), or kv itself without scales. q_lat is the query already through W_uk
  (`q_nope W_uk`), and o goes through W_uv after: neither weight is touched here.

  Backends (`implementation`; None: on a GPU "triton" then "xla" for a cache of
  `KERNEL_SLOTS` slots or more, "xla" then "triton" for a smaller one; "xla" elsewhere):
    triton: split-K flash decoding (`triton.py`): the cache read once a head block, scores and
      probabilities never in memory, the slots past the position never read; scores from the
      exact codes, the output from the latent and the probabilities rounded to bf16, sums f32.
    xla: the f32 reference (`reference.py`): every slot scored and masked.

  Args:
    q_lat: `[B, T, NH, L]` bf16/f16/f32. q_pe: `[B, T, NH, R]`, rotated.
    kv: `[B, S, L]` float8_e4m3fn / e4m3fnuz codes with kv_scale `[B, S, ceil(L / 128)]` f32,
      or bf16/f16/f32 with kv_scale None.
    k_pe: `[B, S, R]`, rotated (one head, shared by all).
    pos: the first new token's position (int or traced int32 scalar): token t sees slots
      0 .. pos + t, which must already hold it. Concrete values are checked to lie in
      [0, S - T]; traced ones under `jfusedq.debug_checks()`.
    scale: multiplies the scores.
    config: the Triton tiling (default `triton.heuristics`).
  Returns:
    o `[B, T, NH, L]` f32.
  """
  _check(q_lat, q_pe, kv, kv_scale, k_pe)
  b, t, nh, _ = q_lat.shape
  slots = kv.shape[1]
  if t > slots:
    raise InputError(f"mla_decode: {t} new tokens do not fit the cache's {slots} slots")
  check_range("pos", jnp.asarray(pos), 0, slots - t + 1)
  implementation = _dispatch.requested("mla_decode", implementation)

  def kernel():
    if kv.dtype == E4M3FNUZ and _target.current().platform == "cuda":
      raise Unsupported("triton: NVIDIA GPUs have no float8_e4m3fnuz conversion; use "
                        "implementation='xla'")
    if config is not None and not isinstance(config, triton.Config):
      raise Unsupported(f"config is a {type(config).__name__}, not mla_decode's triton.Config")
    cfg = config or triton.heuristics(b * t, nh, slots)
    return triton.mla_decode(q_lat, q_pe, kv, kv_scale, k_pe, pos, scale, cfg)

  backends = {"triton": kernel,
              "xla": lambda: reference.mla_decode(q_lat, q_pe, kv, kv_scale, k_pe, pos, scale)}
  order = ("triton", "xla") if slots >= KERNEL_SLOTS else ("xla", "triton")
  return dispatch("mla_decode", backends, implementation, gpu_order=order)


def _check(q_lat, q_pe, kv, kv_scale, k_pe) -> None:
  for name, x in (("q_lat", q_lat), ("q_pe", q_pe), ("kv", kv), ("k_pe", k_pe)):
    _common.check_array(name, x)
  for name, x in (("q_lat", q_lat), ("q_pe", q_pe), ("k_pe", k_pe)):
    _common.check_float(name, x)
  if q_lat.ndim != 4 or q_pe.ndim != 4 or kv.ndim != 3 or k_pe.ndim != 3:
    raise InputError(f"mla_decode: q_lat [B, T, NH, L], q_pe [B, T, NH, R], kv [B, S, L] and "
                     f"k_pe [B, S, R] expected, got {tuple(q_lat.shape)}, {tuple(q_pe.shape)}, "
                     f"{tuple(kv.shape)}, {tuple(k_pe.shape)}")
  b, t, nh, l = q_lat.shape
  r = q_pe.shape[-1]
  if (q_pe.shape[:3] != (b, t, nh) or kv.shape[0] != b or kv.shape[2] != l
      or k_pe.shape[:2] != kv.shape[:2] or k_pe.shape[2] != r):
    raise InputError(f"mla_decode: shapes disagree: q_lat {tuple(q_lat.shape)}, q_pe "
                     f"{tuple(q_pe.shape)}, kv {tuple(kv.shape)}, k_pe {tuple(k_pe.shape)}")
  if 0 in q_lat.shape or 0 in kv.shape or r == 0:
    raise InputError(f"mla_decode: empty axis in q_lat {tuple(q_lat.shape)}, kv "
                     f"{tuple(kv.shape)} or q_pe {tuple(q_pe.shape)}")
  fp8 = jnp.dtype(kv.dtype) in (E4M3FN, E4M3FNUZ)
  if kv_scale is None:
    if fp8:
      raise InputError("mla_decode: an FP8 kv needs its kv_scale")
    _common.check_float("kv", kv)
    return
  if not fp8:
    raise DTypeError(f"mla_decode: kv_scale is given, so kv must be float8_e4m3fn or "
                     f"float8_e4m3fnuz codes, got {kv.dtype}")
  _common.check_array("kv_scale", kv_scale)
  want = (*kv.shape[:2], -(-l // BLOCK))
  if tuple(kv_scale.shape) != want or kv_scale.dtype != jnp.float32:
    raise InputError(f"mla_decode: kv_scale must be float32{list(want)} (one scale a 1 x "
                     f"{BLOCK} group), got {kv_scale.dtype}{list(kv_scale.shape)}")
