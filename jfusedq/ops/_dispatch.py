"""`implementation=` handling shared by every op (tokamax style).

`implementation=None` tries the platform's backends best first; a string asks for exactly one
backend and never falls back; a sequence is tried in order. A backend declines a call it cannot
build by raising `Unsupported` at trace time; any other exception propagates, so a wrong result
is never traded for a silent fallback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from jfusedq import _target

log = logging.getLogger("jfusedq")
_logged: set[tuple[str, str, str]] = set()


class Unsupported(NotImplementedError):
  """A backend cannot build this call (shape, option or platform); the next one may."""


# Triton first: with its kernels in XLA's own Triton custom call (_triton.py), the fused decode
# step of Qwen3.5 / DeepSeek-V3 layers ran 0.5-1.8% faster than with Pallas first on one H200
# (batch 1 and 16). Pallas next: it runs where `triton` is not installed.
GPU_ORDER = ("triton", "pallas", "xla")


def default_order(target: _target.Target | None = None,
                  gpu: Sequence[str] = GPU_ORDER) -> tuple[str, ...]:
  """`gpu` on a GPU (an op may measure a different best order); XLA alone elsewhere."""
  target = target or _target.current()
  # Interpret mode makes Pallas correct but slow on CPU: there XLA is the fast path.
  return tuple(gpu) if target.is_gpu else ("xla",)


def dispatch(op: str, backends: dict[str, Callable], implementation: str | Sequence[str] | None,
             *args, gpu_order: Sequence[str] = GPU_ORDER, **kwargs):
  if implementation is None:
    order = default_order(gpu=gpu_order)
  elif isinstance(implementation, str):
    order = (implementation,)
  else:
    order = tuple(implementation)
  unknown = [name for name in order if name not in backends]
  if unknown or not order:
    raise ValueError(f"{op}: unknown implementation {unknown or implementation!r}; "
                     f"choose from {sorted(backends)}")
  reasons = []
  for name in order:
    try:
      return backends[name](*args, **kwargs)
    except Unsupported as e:
      reasons.append(f"{name}: {e}")
      key = (op, name, str(e))
      if key not in _logged:
        _logged.add(key)
        log.info("%s: %s backend declined (%s); trying the next one", op, name, e)
  raise Unsupported(f"{op}: no implementation could run this call: " + "; ".join(reasons))
