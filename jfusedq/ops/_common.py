"""Argument checks and the kernels' `[rows, H]` view, shared by the ops."""

from __future__ import annotations

import math

import jax.numpy as jnp

FLOAT_INPUTS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def check_float(name: str, x) -> None:
  if jnp.dtype(x.dtype) not in FLOAT_INPUTS:
    raise TypeError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}")


def is_pow2(v) -> bool:
  return isinstance(v, int) and v >= 1 and not v & (v - 1)


def pow2_floor(n: int) -> int:
  """Largest power of two <= max(n, 1)."""
  return 1 << (max(n, 1).bit_length() - 1)


def pow2_divisor(n: int) -> int:
  """Largest power of two dividing n (1 for 0)."""
  return n & -n if n else 1


def check_group_size(group_size) -> None:
  # Kernels tile rows in power-of-two arrays, so a group must be one to divide the tile.
  if not is_pow2(group_size) or group_size < 8:
    raise ValueError(f"group_size must be a power of two >= 8 (64 and 128 are used), got "
                     f"{group_size!r}")


def check_layout(layout) -> None:
  if layout not in ("row", "col"):
    raise ValueError(f"scale layout must be 'row' or 'col', got {layout!r}")


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
