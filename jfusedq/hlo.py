"""Kernels per step, counted from a compiled XLA module (the CLI's "kernels per layer" table).

Every instruction XLA runs as its own launch counts: fusions, custom calls (Pallas/Triton,
cuBLAS), collectives and unfused ops; bookkeeping instructions (parameters, tuples, bitcasts,
the `-done` halves of async pairs) do not. Loop and branch bodies are counted once each, so a
`while` contributes its body's kernels, not times its trip count.
"""

from __future__ import annotations

import collections
import re

import jax

_BOOKKEEPING = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
    "replica-id", "add-dependency", "opt-barrier", "domain", "async-update", "async-done",
    "copy-done", "all-reduce-done", "all-gather-done", "collective-permute-done", "send-done",
    "recv-done",
}
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                "collective-broadcast", "ragged-all-to-all")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%[^\s=]+\s*=\s*(.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%([^\s(]+)\s*\(.*\{\s*$")
_CALLED = re.compile(r"(?:body|condition|to_apply|true_computation|false_computation)=%([\w.\-]+)"
                     r"|branch_computations=\{([^}]*)\}")


def _opcode(rest: str) -> str:
  if rest.startswith("("):  # tuple-shaped result: skip to the matching parenthesis
    depth = 0
    for i, ch in enumerate(rest):
      depth += {"(": 1, ")": -1}.get(ch, 0)
      if depth == 0:
        rest = rest[i + 1:]
        break
  else:
    rest = rest.split(" ", 1)[1] if " " in rest else rest
  return rest.strip().split("(", 1)[0].strip()


def _category(op: str) -> str | None:
  if op in _BOOKKEEPING:
    return None
  if op == "fusion":
    return "fusion"
  if op == "custom-call":
    return "custom-call"
  if op.removesuffix("-start") in _COLLECTIVES:
    return "collective"
  return "other"


def kernel_counts(hlo_text: str) -> dict[str, int]:
  """{"fusion", "custom-call", "collective", "other", "total"} for a compiled module's text."""
  comps: dict[str, list[str]] = {}
  entry, current = None, None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header:
      current = header.group(2)
      comps[current] = []
      if header.group(1):
        entry = current
    elif current is not None and _INSTR.match(line):
      comps[current].append(_INSTR.match(line).group(1))
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  counts: collections.Counter = collections.Counter()
  seen, stack = set(), [entry]
  while stack:
    name = stack.pop()
    if name in seen or name not in comps:
      continue
    seen.add(name)
    for rest in comps[name]:
      op = _opcode(rest)
      if op in ("while", "conditional", "call"):
        for single, branches in _CALLED.findall(rest):
          stack += [single] if single else [b.strip().lstrip("%") for b in branches.split(",")]
        continue
      cat = _category(op)
      if cat:
        counts[cat] += 1
  out = {k: counts.get(k, 0) for k in ("fusion", "custom-call", "collective", "other")}
  out["total"] = sum(out.values())
  return out


def count_kernels(fn, *args, **kwargs) -> dict[str, int]:
  """Kernel counts of `jax.jit(fn)` compiled for these arguments."""
  return kernel_counts(jax.jit(fn).lower(*args, **kwargs).compile().as_text())
