"""Argument checks and the kernels' `[rows, H]` view, shared by the ops."""

from __future__ import annotations

import math

import jax.numpy as jnp

from jfusedq.errors import DTypeError, InputError

FLOAT_INPUTS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def check_float(name: str, x) -> None:
  if jnp.dtype(x.dtype) not in FLOAT_INPUTS:
    raise DTypeError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}")


def check_array(name: str, x) -> None:
  """`x` is an array (jax, numpy or a tracer), not a list or a scalar."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise InputError(f"{name} must be an array, got {type(x).__name__}")


def check_last_axis(name: str, x, what: str) -> None:
  """`x [..., K]` has a last axis of at least one element (`what` names it). Leading sizes may
  be 0: the result is then empty, of the matching shape."""
  if x.ndim < 1:
    raise InputError(f"{name} must have at least one dimension ({what}), got a scalar")
  if x.shape[-1] == 0:
    raise InputError(f"{name} has an empty {what} (shape {tuple(x.shape)}): it needs >= 1 "
                     f"element")


def is_pow2(v) -> bool:
  return isinstance(v, int) and v >= 1 and not v & (v - 1)


def pow2_floor(n: int) -> int:
  """Largest power of two <= max(n, 1)."""
  return 1 << (max(n, 1).bit_length() - 1)


def pow2_ceil(n: int) -> int:
  """Smallest power of two >= max(n, 1)."""
  return 1 << (max(n, 1) - 1).bit_length()


def pow2_divisor(n: int) -> int:
  """Largest power of two dividing n (1 for 0)."""
  return n & -n if n else 1


def check_group_size(group_size) -> None:
  # Kernels tile rows in power-of-two arrays, so a group must be one to divide the tile.
  if not is_pow2(group_size) or group_size < 8:
    raise InputError(f"group_size must be a power of two >= 8 (64 and 128 are used), got "
                     f"{group_size!r}")


def check_eps(name: str, eps) -> None:
  """`eps` is a real number >= 0: a negative one can make mean(h^2) + eps negative, whose
  rsqrt is NaN, and NaN scales would pass silently into the next GEMM."""
  try:
    ok = float(eps) >= 0.0  # False for NaN
  except (TypeError, ValueError):
    ok = False
  if not ok:
    raise InputError(f"{name} must be a number >= 0, got {eps!r}")


def check_layout(layout) -> None:
  if layout not in ("row", "col"):
    raise InputError(f"layout must be 'row' or 'col', got {layout!r}")


def num_groups(k: int, group_size: int) -> int:
  return -(-k // group_size)


def rows(x) -> int:
  """Rows of the `[rows, H]` view of `x [..., H]`."""
  return math.prod(x.shape[:-1])


def flat(a):
  """`a [..., H]` as the kernels' `[rows, H]` (None stays None)."""
  return None if a is None else a.reshape(-1, a.shape[-1])


def unflat(a, lead):
  """A kernel's `[rows, H]` output back to `[*lead, H]` (None stays None)."""
  return None if a is None else a.reshape(*lead, a.shape[-1])


def expert_ids(ids, e: int):
  """(ids clamped into [0, E) as int32, whether each was in range): the experts' one rule for an
  id outside [0, E), read as a clamped expert and its product then zeroed (or its pair left out
  of every group), so no implementation reads out of bounds or returns another expert's row."""
  return jnp.clip(ids, 0, e - 1).astype(jnp.int32), (ids >= 0) & (ids < e)
