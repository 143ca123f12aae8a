"""FP8 formats per platform and the quantised activation that fused kernels hand to GEMMs.

Two OCP-style E4M3 encodings matter for inference:

* `float8_e4m3fn`  (max 448, has -0, NaN = 0x7F/0xFF): NVIDIA sm89+, AMD gfx950 (MI350/MI355).
* `float8_e4m3fnuz` (max 240, no -0, NaN = 0x80, exponent bias 8): AMD gfx942 (MI300/MI325).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jfusedq import _target
from jfusedq.errors import DTypeError, InputError

# DeepSeek-style block scaling: activations in 1 x BLOCK groups, weights in BLOCK x BLOCK blocks.
BLOCK = 128
# Smallest group amax a scale is taken from, so that an all-zero group gets a finite scale.
AMAX_MIN = 1e-10
# A group whose amax is above this (inf) or not comparable to it (NaN) held a non-finite value:
# its scale is NaN, so that corrupt input stays visible instead of becoming plausible codes.
F32_MAX = float(np.finfo(np.float32).max)

E4M3FN = jnp.dtype(jnp.float8_e4m3fn)
E4M3FNUZ = jnp.dtype(jnp.float8_e4m3fnuz)
_FINITE_MAX = {E4M3FN: 448.0, E4M3FNUZ: 240.0}
# gfx940/941/942 (MI300A/X, MI325X) implement the fnuz variant in hardware.
_FNUZ_KINDS = ("gfx940", "gfx941", "gfx942", "mi300", "mi325")


@dataclasses.dataclass(frozen=True)
class Fp8Format:
  """An FP8 dtype and the magnitude quantisation clamps to.

  `max` may be lowered below the dtype's finite max: SGLang and vLLM use 224 for e4m3fnuz so
  that rounding never lands on the largest code.
  """

  dtype: np.dtype
  max: float

  def __post_init__(self):
    dtype = jnp.dtype(self.dtype)
    if dtype not in _FINITE_MAX:
      raise InputError(f"unsupported FP8 dtype {dtype}; expected float8_e4m3fn or float8_e4m3fnuz")
    if not 0.0 < float(self.max) <= _FINITE_MAX[dtype]:
      raise InputError(f"fp8_max={self.max} outside (0, {_FINITE_MAX[dtype]}] for {dtype}")
    object.__setattr__(self, "dtype", dtype)
    object.__setattr__(self, "max", float(self.max))

  @classmethod
  def e4m3fn(cls, fp8_max: float | None = None) -> Fp8Format:
    return cls(E4M3FN, _FINITE_MAX[E4M3FN] if fp8_max is None else fp8_max)

  @classmethod
  def e4m3fnuz(cls, fp8_max: float | None = None) -> Fp8Format:
    return cls(E4M3FNUZ, _FINITE_MAX[E4M3FNUZ] if fp8_max is None else fp8_max)

  @property
  def name(self) -> str:
    return self.dtype.name.removeprefix("float8_")

  @property
  def inv_max(self) -> float:
    """`1 / max` rounded to f32: every scale is `amax * inv_max`, written as that product
    because XLA's CPU compiler turns `amax / max` into it in some programs and not in others
    (JAX 0.11 did in the reference, 0.12 does not), which made the implementations' scales
    differ by an ulp depending on the JAX version."""
    return float(np.float32(1.0) / np.float32(self.max))


def default_format(device_kind: str | None = None, platform: str | None = None,
                   *, fp8_max: float | None = None) -> Fp8Format:
  """The FP8 format native to a device (the current target when none is given)."""
  if device_kind is None:
    target = _target.current()
    device_kind, platform = target.device_kind, target.platform
  kind = device_kind.lower()
  if platform == "rocm" or kind.startswith("gfx") or "instinct" in kind:
    if any(k in kind for k in _FNUZ_KINDS):
      return Fp8Format.e4m3fnuz(fp8_max)
  return Fp8Format.e4m3fn(fp8_max)


def resolve_format(fmt: Fp8Format | str | None) -> Fp8Format:
  if fmt is None:
    return default_format()
  if isinstance(fmt, Fp8Format):
    return fmt
  if isinstance(fmt, str) and fmt.removeprefix("float8_") in ("e4m3fn", "e4m3fnuz"):
    return getattr(Fp8Format, fmt.removeprefix("float8_"))()
  raise InputError(f"fmt must be an Fp8Format, 'e4m3fn' or 'e4m3fnuz'; got {fmt!r}")


def encode_e4m3fnuz(y: jax.Array) -> jax.Array:
  """Round f32 `y` (already clamped to +-240) to nearest-even e4m3fnuz and return its bits.

  Written with integer ops only so that it runs inside Pallas-Triton kernels, whose lowering
  cannot cast to `float8_e4m3fnuz`. Zero of either sign gives 0x00 (fnuz has no -0); NaN gives
  0x80. Bitcast the uint8 result to `float8_e4m3fnuz` outside the kernel.
  """
  a = jnp.abs(y)
  bits = lax.bitcast_convert_type(a, jnp.int32)
  # Normal range (a >= 2**-7): rebias the f32 exponent (127 -> 8) and round the mantissa to
  # 3 bits, nearest-even, in the integer domain.
  normal = (bits - (119 << 23) + 0x7FFFF + ((bits >> 20) & 1)) >> 20
  # Subnormal range: adding 2**13 makes the f32 ulp 2**-10, the fnuz subnormal step, so the
  # float add itself rounds nearest-even; the mantissa that remains is the code (0..8).
  magic = 2.0**13
  sub = lax.bitcast_convert_type(a + magic, jnp.int32) - int(np.float32(magic).view(np.int32))
  code = jnp.where(a < 2.0**-7, sub, normal)
  code = jnp.where((y < 0) & (code != 0), code | 0x80, code)
  code = jnp.where(jnp.isnan(y), 0x80, code)
  return code.astype(jnp.uint8)


def keep_codes(q: jax.Array) -> jax.Array:
  """`q` (fp8 codes) as a value XLA must materialise, so a consumer in the same graph reads the
  codes and not the f32 values they were rounded from.

  Under its default flags (`--xla_allow_excess_precision`) XLA on GPU removes an
  f32 -> fp8 -> f32 convert pair: the H200 then ran `fp8_matmul(bf16, implementation="xla")` as
  W8A16, 2.5-2.6% from the W8A8 result. `lax.reduce_precision` cannot stand in for the cast (it
  has IEEE semantics, not e4m3fn's range or e4m3fnuz's bias); an optimisation barrier is not
  simplified through.
  """
  return lax.optimization_barrier(q)


ScaleLayout = Literal["row", "col"]


@dataclasses.dataclass(frozen=True)
class QuantizedActivation:
  """An activation quantised in 1 x G groups, the "(fp8, scale)" / "(bf16, fp8, scale)" tuple.

  q:      fp8 `[..., K]`.
  scale:  f32, `[..., ceil(K/G)]` when `layout == "row"`, `[ceil(K/G), ...]` when `"col"`
          (group axis first, for GEMMs that read one scale column per K block).
          Dequantised value: `q[..., k] * scale[..., k // G]`.
  hp:     optional high-precision copy `[..., K]` (bf16) for consumers that need one.
  group_size, layout: static metadata; consumers check them instead of guessing.
  """

  q: jax.Array
  scale: jax.Array
  hp: jax.Array | None = None
  group_size: int = BLOCK
  layout: ScaleLayout = "row"

  def __post_init__(self):
    if self.layout not in ("row", "col"):
      raise InputError(f"layout must be 'row' or 'col', got {self.layout!r}")
    if not isinstance(self.group_size, int) or self.group_size <= 0:
      raise InputError(f"group_size must be a positive int, got {self.group_size!r}")

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.q.shape)

  def row_scale(self) -> jax.Array:
    """Scales as `[..., ceil(K/G)]` whatever the stored layout."""
    return self.scale if self.layout == "row" else jnp.moveaxis(self.scale, 0, -1)

  def with_layout(self, layout: ScaleLayout) -> QuantizedActivation:
    """The same activation with its scales stored in `layout` (a transpose when it differs)."""
    if layout == self.layout:
      return self
    scale = self.row_scale() if layout == "row" else jnp.moveaxis(self.scale, -1, 0)
    return dataclasses.replace(self, scale=scale, layout=layout)

  def unflatten(self, lead: Sequence[int]) -> QuantizedActivation:
    """The leading (token) dims reshaped to `lead`, K kept: `[*lead, K]` codes and hp, scales
    `[*lead, G]` or `[G, *lead]` in the stored layout."""
    lead = tuple(lead)
    groups = self.scale.shape[-1] if self.layout == "row" else self.scale.shape[0]
    k = self.q.shape[-1]
    scale = self.scale.reshape(*lead, groups) if self.layout == "row" else self.scale.reshape(
        groups, *lead)
    hp = None if self.hp is None else self.hp.reshape(*lead, k)
    return dataclasses.replace(self, q=self.q.reshape(*lead, k), scale=scale, hp=hp)

  def flatten(self) -> QuantizedActivation:
    """The 2-D view a GEMM kernel takes: `[M, K]` codes, `[M, G]` or `[G, M]` scales."""
    return self.unflatten((math.prod(self.q.shape[:-1]),))

  def map_leading(self, fn: Callable[[jax.Array], jax.Array]) -> QuantizedActivation:
    """`fn` applied to the leading dims of q, hp and the row-layout scales (which share them);
    the result stores row scales."""
    hp = None if self.hp is None else fn(self.hp)
    return dataclasses.replace(self, q=fn(self.q), scale=fn(self.row_scale()), hp=hp,
                               layout="row")

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    k = self.q.shape[-1]
    s = jnp.repeat(self.row_scale(), self.group_size, axis=-1)[..., :k]
    return (self.q.astype(jnp.float32) * s).astype(dtype)

  def validate(self) -> None:
    """Raises if q, scale and hp do not fit the recorded group size and layout."""
    if jnp.dtype(self.q.dtype) not in _FINITE_MAX:
      raise DTypeError(f"q must be float8_e4m3fn or float8_e4m3fnuz, got {self.q.dtype}")
    if self.scale.dtype != jnp.float32:
      raise DTypeError(f"scale must be float32, got {self.scale.dtype}")
    *lead, k = self.q.shape
    groups = -(-k // self.group_size)
    want = (*lead, groups) if self.layout == "row" else (groups, *lead)
    if tuple(self.scale.shape) != want:
      raise InputError(f"scale shape {tuple(self.scale.shape)} does not match q "
                       f"{tuple(self.q.shape)}"
                       f" with group_size={self.group_size}, layout={self.layout!r}: want {want}")
    if self.hp is not None and tuple(self.hp.shape) != tuple(self.q.shape):
      raise InputError(f"hp shape {tuple(self.hp.shape)} differs from q {tuple(self.q.shape)}")


jax.tree_util.register_dataclass(
    QuantizedActivation, data_fields=["q", "scale", "hp"], meta_fields=["group_size", "layout"])
