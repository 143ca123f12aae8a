"""jfusedq's exceptions, and the opt-in checks of values that are only known inside jit.

Every argument the library rejects raises a `JfusedqError`: an `InputError` (a `ValueError`:
shape, size, range, option) or a `DTypeError` (a `TypeError`), naming the argument, what it got
and what it needs, before anything is traced. Checkpoint problems raise
`jfusedq.checkpoint.CheckpointError`, also a `JfusedqError`. (`jfusedq.Unsupported`, the
dispatcher's "this backend cannot build the call, try the next", is a NotImplementedError and
not an input error.)

Values that are traced (token ids, positions inside a jitted step) cannot be checked before
tracing. By default the code that reads them defines a clamp (documented where it happens);
inside `debug_checks()` the functions traced there also check them at run time and raise,
through `jax.debug.callback`, an error naming the argument and the bad values.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np


class JfusedqError(Exception):
  """Base class of the errors jfusedq raises for bad arguments, data or checkpoints."""


class InputError(JfusedqError, ValueError):
  """An argument's shape, size, value or option is outside what the function takes."""


class DTypeError(JfusedqError, TypeError):
  """An argument has a dtype the function does not take."""


_debug: contextvars.ContextVar[bool] = contextvars.ContextVar("jfusedq_debug_checks",
                                                              default=False)


@contextlib.contextmanager
def debug_checks(enabled: bool = True) -> Iterator[None]:
  """Run-time range checks of traced values (token ids, cache positions) in what is traced
  inside the block: an out-of-range value then raises instead of being clamped. It acts at
  trace time, so a function jitted (and cached) before the block keeps its unchecked trace."""
  token = _debug.set(enabled)
  try:
    yield
  finally:
    _debug.reset(token)


def debug_checks_enabled() -> bool:
  return _debug.get()


def _raise_outside(name: str, lo: int, hi: int, x) -> None:
  x = np.asarray(x)
  bad = x[(x < lo) | (x >= hi)]
  if bad.size:
    raise InputError(f"{name} must lie in [{lo}, {hi}), got {bad.size} value(s) outside, e.g. "
                     f"{bad.ravel()[:4].tolist()}")


def check_range(name: str, x, lo: int, hi: int) -> None:
  """Raise InputError if an integer array `x` holds a value outside [lo, hi): now when `x` is
  concrete, at run time under `debug_checks()` when it is traced, else not at all."""
  if isinstance(x, jax.core.Tracer):
    if debug_checks_enabled():
      jax.debug.callback(lambda v: _raise_outside(name, lo, hi, v), jnp.asarray(x))
    return
  _raise_outside(name, lo, hi, x)
