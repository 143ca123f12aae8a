"""Public entry point of causal attention over new tokens and a cached prefix (prefill).

Shapes: B batch, T new tokens, L cached positions before them, Hq query heads, Hkv key/value
heads (Hq a multiple: query head h reads key head h // (Hq / Hkv)), Dqk query/key and Dv value
dims (DeepSeek-V3's per-head MLA: 192 and 128; Qwen3.5's gated attention: 256 and 256).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jfusedq import _target
from jfusedq.errors import DTypeError, InputError
from jfusedq.ops import _common
from jfusedq.ops._dispatch import declare, resolve
from jfusedq.ops.attention import blocked, cudnn, reference

declare("attention", ("cudnn", "blocked", "xla"))

# Keys per block of the online softmax (`blocked`): its scores are [B, Hq, T, BLOCK] f32 at a
# time. 512 keeps a block's scores at 1 GiB for a 4096-token chunk of DeepSeek-V3's 128 heads.
BLOCK = 512
# Cached keys per cuDNN call (`cudnn`): DeepSeek-V3's latent prefix is expanded to per-head keys
# and values one segment at a time (80 KiB a token for 128 heads in bf16, 335 MB a segment), so
# the expansion's memory grows with the segment, not the context. Awaits the GPU measurement
# (benchmarks/prefill.py) of the per-call cost a smaller segment pays.
SEGMENT = 4096


@dataclasses.dataclass
class Prefix:
  """Keys and values cached before the new tokens, every one visible to every new token.

  fetch(start, size) -> (k `[B, size, Hkv, Dqk]`, v `[B, size, Hkv, Dv]`): positions start ..
    start + size - 1 (`start` a traced int32 >= 0, `size` a static int); DeepSeek-V3 expands
    its latent cache to per-head keys and values here, Qwen3.5 slices its cache.
  length: L, the positions cached (an int or a traced int32 scalar).
  slots: the cache's length, a static bound: attention calls fetch with start + size <= slots.
  """

  fetch: Callable[[jax.Array, int], tuple[jax.Array, jax.Array]]
  length: jax.Array | int
  slots: int


def _check(q, k, v, prefix: Prefix | None) -> None:
  for name, x in (("q", q), ("k", k), ("v", v)):
    _common.check_array(name, x)
    if x.ndim != 4:
      raise InputError(f"attention: {name} must be [B, T, heads, dims], got {tuple(x.shape)}")
    _common.check_float(name, x)
  if k.shape[:2] != q.shape[:2] or v.shape[:3] != k.shape[:3] or k.shape[3] != q.shape[3]:
    raise InputError(f"attention: q [B, T, Hq, Dqk], k [B, T, Hkv, Dqk], v [B, T, Hkv, Dv] "
                     f"disagree: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
  if q.shape[2] % k.shape[2]:
    raise InputError(f"attention: Hq = {q.shape[2]} query heads is not a multiple of Hkv = "
                     f"{k.shape[2]} key heads")
  if not q.dtype == k.dtype == v.dtype:
    raise DTypeError(f"attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, "
                     f"{v.dtype}")
  if prefix is not None and (not isinstance(prefix.slots, int) or prefix.slots < 1):
    raise InputError(f"attention: prefix.slots must be an int >= 1, got {prefix.slots!r}")


def merge(o_a, lse_a, o_b, lse_b):
  """Two partial attentions over disjoint key sets -> the attention over their union.

  o `[B, T, Hq, Dv]` (each normalised over its own keys), lse `[B, T, Hq]` f32 the log of its
  softmax denominator:  lse = log(e^lse_a + e^lse_b),  o = o_a e^(lse_a - lse) + o_b e^(lse_b -
  lse), in f32. A row whose keys were all masked has lse -inf and weighs nothing."""
  lse = jnp.logaddexp(lse_a, lse_b)
  safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
  w_a, w_b = jnp.exp(lse_a - safe)[..., None], jnp.exp(lse_b - safe)[..., None]
  return o_a.astype(jnp.float32) * w_a + o_b.astype(jnp.float32) * w_b, lse


def flash(q, k, v, prefix: Prefix | None, attend, segment: int) -> jax.Array:
  """The causal attention as partial attentions merged (`merge`): the new tokens over
  themselves (`attend(q, k, v, None, causal=True)`), then the prefix in segments of `segment`
  keys from its end back, `attend(q, k_seg, v_seg, n, causal=False)` with keys [0, n) of the
  segment valid: the last segment is fetched from slot 0 and holds only the first positions.
  `attend` returns (o f32, lse f32). -> o `[B, T, Hq, Dv]` f32."""
  o, lse = attend(q, k, v, None, True)
  if prefix is None:
    return o
  size = min(segment, prefix.slots)
  length = jnp.asarray(prefix.length, jnp.int32)

  def step(i, carry):
    end = length - i * size
    start = jnp.maximum(end - size, 0)
    pk, pv = prefix.fetch(start, size)
    return merge(*carry, *attend(q, pk.astype(q.dtype), pv.astype(q.dtype), end - start, False))

  o, _ = lax.fori_loop(0, (length + size - 1) // size, step, (o, lse))
  return o


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
              prefix: Prefix | None = None, block: int | None = None,
              implementation: str | Sequence[str] | None = None) -> jax.Array:
  """Causal attention of T new tokens over the L cached positions before them and themselves.

    o[t, h] = softmax_j(scale q[t, h] . key[j, h // r]) value[j, h // r]    (r = Hq / Hkv)
  over j in positions 0 .. L + t: the prefix's L keys (`prefix`), then the new tokens' own
  (k, v) up to t. In f32 from the dtype's products: scores f32, probabilities rounded to v's
  dtype before they weigh v, sums f32.

  Backends (`implementation`; None: "cudnn" then "blocked" on an NVIDIA GPU, "blocked" on CPU):
    cudnn: cuDNN's fused flash attention (through JAX's own cuDNN binding, whose public wrapper
      `jax.nn.dot_product_attention` rejects Dv != Dqk and rounds the softmax statistics it
      returns to bf16, too coarse to merge segments), one call for the new tokens (causal) and
      one per `SEGMENT` cached keys (`block` overrides), bf16 / f16 on CUDA only: the GPU path.
    blocked: an online softmax over `BLOCK` keys at a time (`block` overrides) in XLA
      (`lax.fori_loop`), any dtype and platform: the CPU path, and the GPU's where cuDNN
      declines (f32, ROCm).
    xla: every score at once, `[B, Hq, T, L + T]` f32, the prefix fetched whole: the reference
      the others are tested against.
  JAX's Pallas attention ops are not used: their GPU kernels take one head dim for q, k and v,
  and no cached prefix.

  Args:
    q: `[B, T, Hq, Dqk]`; k: `[B, T, Hkv, Dqk]`; v: `[B, T, Hkv, Dv]`: the new tokens.
    scale: multiplies q . k.
    prefix: the cached keys (`Prefix`), or None for none (L = 0).
  Returns:
    o `[B, T, Hq, Dv]` f32.
  """
  _check(q, k, v, prefix)
  if block is not None and (not isinstance(block, int) or block < 1):
    raise InputError(f"attention: block must be an int >= 1, got {block!r}")
  target = _target.current()
  default = ("cudnn", "blocked") if target.is_gpu else ("blocked",)
  backends = {
      "cudnn": lambda: flash(q, k, v, prefix, cudnn.attend(scale, target), block or SEGMENT),
      "blocked": lambda: flash(q, k, v, prefix, blocked.attend(scale, block or BLOCK),
                               block or BLOCK),
      "xla": lambda: reference.attention(q, k, v, prefix, scale),
  }
  return resolve("attention", backends, implementation, default=default)[1]
