"""`implementation=` / `strategy=` handling shared by every op and collective (tokamax style).

A call names its candidates (an op's backends, an all-reduce's strategies):
  * None tries the default order, best first (an op's: the platform's backends; overridden for
    a block of code by `implementations`);
  * a string asks for exactly that candidate and never falls back;
  * a sequence is tried in order.
An unknown name raises `jfusedq.InputError`. A candidate is skipped when a gate rules it out
(e.g. an operator opt-out) or when it declines the call by raising `Unsupported` at trace time;
any other exception propagates, so a wrong result is never traded for a silent fallback. The
candidate that ran is logged once on the "jfusedq" logger, with what was skipped and why.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from jfusedq import _target
from jfusedq.errors import InputError

log = logging.getLogger("jfusedq")
_logged: set[tuple] = set()

Order = str | Sequence[str]


class Unsupported(NotImplementedError):
  """A backend cannot build this call (shape, option or platform); the next one may."""


# Triton first: with its kernels in XLA's own Triton custom call (_triton.py), the fused decode
# step of Qwen3.5 / DeepSeek-V3 layers ran 0.5-1.8% faster than with Pallas first on one H200
# (batch 1 and 16). Pallas next: it runs where `triton` is not installed.
GPU_ORDER = ("triton", "pallas", "xla")

# Candidate names per op / collective, filled in by the modules that define them, so that
# `implementations` can reject a misspelt name when it is entered.
CANDIDATES: dict[str, tuple[str, ...]] = {}
_kinds: dict[str, str] = {}

_overrides: contextvars.ContextVar[Mapping[str, Order]] = contextvars.ContextVar(
    "jfusedq_implementations", default={})


def declare(op: str, names: Sequence[str], kind: str = "implementation") -> None:
  CANDIDATES[op], _kinds[op] = tuple(names), kind


@contextlib.contextmanager
def implementations(**orders: Order | None) -> Iterator[None]:
  """Within the block, calls of the named ops / collectives that pass `implementation=None`
  (`strategy=None` for the all-reduces) behave as if they had passed the given value.

  E.g. `with jfusedq.implementations(rmsnorm_quant="xla", fp8_matmul=("pallas", "xla")):`.
  Keys: "rmsnorm_quant", "rmsnorm", "group_quant", "fp8_matmul", "grouped_fp8_matmul",
  "ragged_fp8_matmul", "ragged_matmul", "attention", "mla_decode" (backend names) and
  "allreduce_rmsnorm_quant" (strategy names, for every entry of jfusedq.parallel:
  `allreduce_rmsnorm_quant`, `reduce_scatter_rmsnorm_quant`, their `_sharded` wrapper and
  `chosen_strategy`). The all-reduce strategies pass `implementation=None` on to their ops, so
  an op's override reaches them too. None restores the default order inside a nested block. Read
  when a call is traced: a function `jit` compiled before the block keeps its choice inside it
  (call `jax.clear_caches()` or trace anew). Blocks nest (the inner value wins) and are local
  to the thread or asyncio task (a context variable).
  """
  for op, order in orders.items():
    if op not in CANDIDATES:
      raise InputError(f"implementations: unknown op {op!r}; choose from {sorted(CANDIDATES)}")
    if order is not None:
      _names(op, order, CANDIDATES[op], _kinds[op])
  token = _overrides.set({**_overrides.get(), **orders})
  try:
    yield
  finally:
    _overrides.reset(token)


def requested(op: str, implementation: Order | None) -> Order | None:
  """What the caller asked `op` for: `implementation`, or the `implementations` override;
  names `op` does not declare raise here, before a step of the op (a GEMM's quantisation)
  passes them on and the error names that step instead."""
  order = _overrides.get().get(op) if implementation is None else implementation
  if order is not None and op in CANDIDATES:
    _names(op, order, CANDIDATES[op], _kinds[op])
  return order


def among(op: str, order: Order | None) -> tuple[str, ...] | None:
  """The names of `order` that `op` declares, in order; None (its default order) when none is:
  one setting for every op of a layer or model, whose ops have different backends."""
  if order is None:
    return None
  names = tuple(n for n in ((order,) if isinstance(order, str) else order)
                if n in CANDIDATES.get(op, ()))
  return names or None


def default_order(target: _target.Target | None = None,
                  gpu: Sequence[str] = GPU_ORDER) -> tuple[str, ...]:
  """`gpu` on a GPU (an op may measure a different best order); XLA alone elsewhere."""
  target = target or _target.current()
  # Interpret mode makes Pallas correct but slow on CPU: there XLA is the fast path.
  return tuple(gpu) if target.is_gpu else ("xla",)


def _names(op: str, order: Order, known: Sequence[str], kind: str = "implementation"
           ) -> tuple[str, ...]:
  names = (order,) if isinstance(order, str) else tuple(order)
  unknown = [name for name in names if name not in known]
  if unknown or not names:
    raise InputError(f"{op}: unknown {kind} {unknown or order!r}; choose from {sorted(known)}")
  return names


def candidates(op: str, implementation: Order | None, known: Sequence[str],
               default: Sequence[str], kind: str = "implementation"
               ) -> tuple[tuple[str, ...], bool]:
  """(names to try, whether one was named and must not fall back); raises on unknown names."""
  implementation = requested(op, implementation)
  if implementation is None:
    return tuple(default), False
  return _names(op, implementation, known, kind), isinstance(implementation, str)


def resolve(op: str, backends: Mapping[str, Callable[[], Any]], implementation: Order | None, *,
            default: Sequence[str], gate: Callable[[str], str | None] = lambda name: None,
            kind: str = "implementation", label: str | None = None,
            log_choice: bool = True) -> tuple[str, Any]:
  """Runs the first candidate that is not gated off and does not decline; returns (its name,
  its result). `backends` maps each name to a zero-argument builder; `op` keys the override,
  `label` (default: op) names the call in messages."""
  order, explicit = candidates(op, implementation, backends, default, kind)
  op = label or op
  skipped = []
  for name in order:
    why = gate(name)
    if why is None:
      try:
        result = backends[name]()
      except Unsupported as e:
        if explicit:
          raise Unsupported(f"{op}: {kind} {name!r} was requested but cannot run this call: "
                            f"{e}") from e
        why = str(e)
      else:
        platform = _target.current().platform
        key = (op, name, tuple(skipped), platform)
        if log_choice and key not in _logged:
          _logged.add(key)
          log.info("%s: %s %s on %s%s", op, kind, name, platform,
                   "".join(f"; skipped {s}" for s in skipped))
        return name, result
    elif explicit:
      raise Unsupported(f"{op}: {kind} {name!r} was requested but is unavailable: {why}")
    skipped.append(f"{name} ({why})")
  raise Unsupported(f"{op}: no {kind} could run this call: " + "; ".join(skipped))


def dispatch(op: str, backends: Mapping[str, Callable[[], Any]], implementation: Order | None,
             *, gpu_order: Sequence[str] = GPU_ORDER):
  """An op's call: the result of the first of its backends that builds it (`resolve`)."""
  return resolve(op, backends, implementation, default=default_order(gpu=gpu_order))[1]
