"""Fused all-reduce + (add +) RMSNorm + per-group FP8 quant over a tensor-parallel axis.

Each device of a tensor-parallel group holds a partial sum `x_i [..., H]` (the output of a
row-parallel projection); the next layer wants `rmsnorm_quant(psum(x_i) + residual)` replicated
on every device. The collective stays XLA's (NCCL / RCCL); what differs between strategies is
what runs after it:

  "fused"               psum, then the single fused add + norm + quant kernel (`rmsnorm_quant`),
                        with the bf16 normalised copy as a side output when asked.
  "ar_norm_then_quant"  psum, the add + RMSNorm kernel (`rmsnorm`, bf16 out), then a separate
                        `group_quant` of that bf16 output. It quantises the bf16-rounded norm,
                        so scales move by up to a bf16 rounding and ~2% of codes by one step.
  "generic"             psum, then the plain jnp composition (`rmsnorm_quant(implementation=
                        "xla")`); always available.

Strategies go through the ops' dispatcher (`jfusedq.ops._dispatch`): `strategy=None` tries them
in that order, or in the one `jfusedq.implementations(allreduce_rmsnorm_quant=...)` sets. A
strategy is skipped when gated off (the operator opt-out `JFUSEDQ_DISABLE_FUSED_AR_QUANT=1`,
read at trace time, disables "fused") or when an op it needs declines the call with
`Unsupported` (e.g. a row width the Pallas kernels cannot tile); the choice is logged once on
the "jfusedq" logger and `chosen_strategy` resolves it without running anything. A named
strategy never falls back: it is built or it raises.

Sequence-parallel mode (`reduce_scatter_rmsnorm_quant`) keeps the residual stream sharded over
tokens: `psum_scatter` -> norm + quant of the local T/N rows -> `all_gather` of the fp8 codes and
f32 scales (as bytes: no backend has to support fp8 collectives), about 24% fewer bytes than a
bf16 all-reduce and 1/N of the norm work per device.

All of this runs inside `jax.shard_map`; `allreduce_rmsnorm_quant_sharded` builds the shard_map
for callers holding global arrays. Pallas kernels inside shard_map need `check_vma=False`.
Nothing here looks at local devices, so a multi-host mesh works the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jfusedq.errors import InputError
from jfusedq.fp8 import BLOCK, Fp8Format, QuantizedActivation, resolve_format
from jfusedq.ops import _common, _dispatch
from jfusedq.ops.group_quant import group_quant
from jfusedq.ops.rmsnorm import rmsnorm
from jfusedq.ops.rmsnorm_quant import rmsnorm_quant

STRATEGIES = ("fused", "ar_norm_then_quant", "generic")
DISABLE_ENV = "JFUSEDQ_DISABLE_FUSED_AR_QUANT"

AxisName = str | tuple[str, ...]


# --- strategy resolution -------------------------------------------------------------------

# The override key (`jfusedq.implementations`) of every entry point here.
OP = "allreduce_rmsnorm_quant"
_dispatch.declare(OP, STRATEGIES, kind="strategy")


def fused_disabled() -> bool:
  """The operator opt-out, read on every call (trace time), never cached at import."""
  return os.environ.get(DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def gate(name: str) -> str | None:
  """Why strategy `name` cannot be used (None: it may be tried).

  Platform support proper (a Pallas kernel that cannot tile this row, an FP8 format the lowering
  cannot emit) is reported by the ops themselves as `Unsupported` when the strategy is built.
  """
  if name == "fused" and fused_disabled():
    return f"disabled by {DISABLE_ENV}={os.environ[DISABLE_ENV]}"
  return None


def _check_strategy(strategy) -> None:
  """Argument errors, raised before any collective is traced."""
  if strategy is not None and "sequence_parallel" in ((strategy,) if isinstance(strategy, str)
                                                      else tuple(strategy)):
    raise InputError("strategy 'sequence_parallel' keeps the residual sharded over tokens: call "
                     "reduce_scatter_rmsnorm_quant inside shard_map, or "
                     "allreduce_rmsnorm_quant_sharded(..., sequence_parallel=True)")
  _dispatch.candidates(OP, strategy, STRATEGIES, STRATEGIES, kind="strategy")


def _resolve(label: str, strategy, build: Callable[[str], Any], log_choice: bool = True
             ) -> tuple[str, Any]:
  """Builds the first usable strategy; returns (its name, what `build` returned)."""
  backends = {name: functools.partial(build, name) for name in STRATEGIES}
  return _dispatch.resolve(OP, backends, strategy, default=STRATEGIES,
                           gate=lambda name: gate(name), kind="strategy", label=label,
                           log_choice=log_choice)


def _op_impl(op: str, implementation):
  # With no implementation asked for (nor set by `implementations` for this op), the kernel
  # strategies ask an op for its kernel backends only (best first on GPU; XLA alone on CPU):
  # when every kernel declines, the strategy falls through, instead of the op quietly running
  # its XLA path under the strategy's name.
  implementation = _dispatch.requested(op, implementation)
  if implementation is not None:
    return implementation
  order = _dispatch.default_order()
  return tuple(name for name in order if name != "xla") or order


def _fused(h, residual, weight, *, keep_bf16, implementation, **kw):
  out = rmsnorm_quant(h, weight, residual=residual, keep_hp=keep_bf16,
                      implementation=_op_impl("rmsnorm_quant", implementation), **kw)
  return out.quant, out.residual


def _ar_norm_then_quant(h, residual, weight, *, eps, weight_offset, keep_bf16, implementation,
                        **qkw):
  y, res_out = rmsnorm(h, weight, residual=residual, eps=eps, weight_offset=weight_offset,
                       implementation=_op_impl("rmsnorm", implementation))
  quant = group_quant(y, **qkw, implementation=_op_impl("group_quant", implementation))
  # y is already bf16(norm): exactly the copy the fused kernel would write as hp.
  hp = y if keep_bf16 else None
  return dataclasses.replace(quant, hp=hp), res_out


def _generic(h, residual, weight, *, keep_bf16, implementation, **kw):
  del implementation  # plain jnp whatever was asked for the kernels: the always-there fallback
  out = rmsnorm_quant(h, weight, residual=residual, keep_hp=keep_bf16, implementation="xla", **kw)
  return out.quant, out.residual


# Each builds one strategy's local step: (QuantizedActivation, residual_out or None) of
# `h + residual`, or raises Unsupported.
BUILDERS = {"fused": _fused, "ar_norm_then_quant": _ar_norm_then_quant, "generic": _generic}


def chosen_strategy(x, weight, *, residual=None, eps: float = 1e-6, weight_offset: float = 0.0,
                    group_size: int = BLOCK, fmt: Fp8Format | str | None = None,
                    layout: str = "row", ue8m0: bool = False, keep_bf16: bool = False,
                    strategy: str | Sequence[str] | None = None,
                    implementation: str | Sequence[str] | None = None) -> str:
  """The strategy `allreduce_rmsnorm_quant` would use for these arguments; runs nothing.

  `x`, `residual`, `weight` may be arrays or `jax.ShapeDtypeStruct`s of the per-device shapes
  the norm sees (`[..., H]`; for `reduce_scatter_rmsnorm_quant`, the local `[..., T/N, .., H]`).
  Call it under the same target (e.g. inside `use_abstract_mesh`) and environment as the real
  call. Raises what the call would raise when no strategy fits.
  """
  fmt = resolve_format(fmt)
  _check_shapes(x, residual, weight)
  _common.check_eps("eps", eps)
  _check_strategy(strategy)
  spec = lambda a: None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype)

  def build(name):
    fn = lambda h, r, w: BUILDERS[name](
        h, r, w, eps=eps, weight_offset=weight_offset, group_size=group_size, fmt=fmt,
        layout=layout, ue8m0=ue8m0, keep_bf16=keep_bf16, implementation=implementation)
    return jax.eval_shape(fn, spec(x), spec(residual), spec(weight))

  return _resolve("chosen_strategy", strategy, build, log_choice=False)[0]


# --- collectives ---------------------------------------------------------------------------


def axis_size(axis_name: AxisName) -> int:
  """Size of a bound mesh axis (or product of several); a clear error when it is not bound."""
  try:
    return lax.axis_size(axis_name)
  except NameError as e:
    mesh = jax.sharding.get_abstract_mesh()
    manual = [n for n, t in zip(getattr(mesh, "axis_names", ()), getattr(mesh, "axis_types", ()))
              if t == AxisType.Manual]
    raise InputError(f"axis_name {axis_name!r} is not a mesh axis in scope (manual axes here: "
                     f"{manual or 'none'}); call this inside jax.shard_map over a mesh with that "
                     f"axis, or use allreduce_rmsnorm_quant_sharded") from e


def _varying(x, axis_name: AxisName) -> bool:
  """Whether shard_map's type system (check_vma=True) marks `x` as differing over the axis."""
  names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
  try:
    varying = jax.typeof(x).mat.varying
  except AttributeError:
    return True  # unknown JAX internals: keep the (trivial) collective, which is always correct
  return any(n in varying for n in names)


def _psum(x, axis_name: AxisName, n: int):
  # A one-device axis needs no collective, but under check_vma=True only a psum turns a
  # per-device value into a replicated one, so there the trivial psum stays.
  if n == 1 and not _varying(x, axis_name):
    return x
  return lax.psum(x, axis_name)


def _all_gather(a, axis_name: AxisName, axis: int, n: int):
  """Tiled all-gather of `a` along `axis`; fp8 travels as uint8 (same bytes, any backend)."""
  if n == 1 and not _varying(a, axis_name):
    return a
  fp8 = jnp.issubdtype(a.dtype, jnp.floating) and jnp.finfo(a.dtype).bits == 8
  b = lax.bitcast_convert_type(a, jnp.uint8) if fp8 else a
  # "invarying": the gathered value is the same on every device, so out_specs=P() type-checks
  # under check_vma=True.
  try:
    g = lax.all_gather(b, axis_name, axis=axis, tiled=True, to="invarying")
  except (TypeError, ValueError):  # a JAX without that `to` value: the plain (varying) gather
    g = lax.all_gather(b, axis_name, axis=axis, tiled=True)
  return lax.bitcast_convert_type(g, a.dtype) if fp8 else g


def _check_shapes(x, residual, weight, x_name="x_partial"):
  if x.ndim < 1:
    raise InputError(f"{x_name} must have at least one dimension (the hidden axis)")
  if weight.shape != x.shape[-1:]:
    raise InputError(f"weight shape {tuple(weight.shape)} does not match {x_name}'s hidden size "
                     f"{x.shape[-1]} ({x_name} shape {tuple(x.shape)})")
  if residual is not None and residual.shape != x.shape:
    raise InputError(f"residual shape {tuple(residual.shape)} differs from {x_name} shape "
                     f"{tuple(x.shape)}")


# --- public entry points -------------------------------------------------------------------


def allreduce_rmsnorm_quant(x_partial: jax.Array, residual: jax.Array | None, weight: jax.Array,
                            *, axis_name: AxisName, eps: float = 1e-6,
                            weight_offset: float = 0.0, group_size: int = BLOCK,
                            fmt: Fp8Format | str | None = None, layout: str = "row",
                            ue8m0: bool = False, keep_bf16: bool = False,
                            strategy: str | Sequence[str] | None = None,
                            implementation: str | Sequence[str] | None = None
                            ) -> tuple[QuantizedActivation, jax.Array]:
  """`rmsnorm_quant(psum(x_partial) + residual)`, replicated; call inside `jax.shard_map`.

  Equal to `rmsnorm_quant(lax.psum(x_partial, axis_name), weight, residual=residual, ...)`:
  the sum with the residual is rounded to x's dtype before the norm reads it.

  Args:
    x_partial: `[..., H]` this device's partial sum (bf16/f16/f32).
    residual: `[..., H]` replicated residual stream (same dtype), or None.
    weight: `[H]` norm weight, replicated.
    axis_name: the tensor-parallel mesh axis (or a tuple of axes) to reduce over. Size 1: no
      collective.
    eps, weight_offset, group_size, fmt, layout, ue8m0: as for `rmsnorm_quant`.
    keep_bf16: also return the normalised activation in x's dtype as `quant.hp` (Qwen3.5 GDN).
    strategy: None (try "fused", "ar_norm_then_quant", "generic" in order), one name (exactly
      that: it raises `Unsupported` if it cannot be built, e.g. "fused" while
      JFUSEDQ_DISABLE_FUSED_AR_QUANT=1), or a sequence tried in order. The variable is read when
      the call is traced: a function jit has already compiled keeps its choice.
    implementation: passed to the ops of the "fused" and "ar_norm_then_quant" strategies;
      None asks for the platform's best backend without falling back inside the op.
  Returns:
    (quant, residual_out): `quant` the QuantizedActivation `[..., H]` (+ `hp`); `residual_out`
    `[..., H]` in x's dtype: `psum + residual` rounded, or the psum itself when `residual` is
    None (the new residual stream either way).
  """
  fmt = resolve_format(fmt)
  _check_shapes(x_partial, residual, weight)
  _common.check_eps("eps", eps)
  n = axis_size(axis_name)
  _check_strategy(strategy)
  h = _psum(x_partial, axis_name, n)
  build = lambda name: BUILDERS[name](
      h, residual, weight, eps=eps, weight_offset=weight_offset, group_size=group_size,
      fmt=fmt, layout=layout, ue8m0=ue8m0, keep_bf16=keep_bf16, implementation=implementation)
  _, (quant, res_out) = _resolve("allreduce_rmsnorm_quant", strategy, build)
  return quant, h if res_out is None else res_out


def reduce_scatter_rmsnorm_quant(x_partial: jax.Array, residual: jax.Array | None,
                                 weight: jax.Array, *, axis_name: AxisName, token_axis: int = 0,
                                 eps: float = 1e-6, weight_offset: float = 0.0,
                                 group_size: int = BLOCK, fmt: Fp8Format | str | None = None,
                                 layout: str = "row", ue8m0: bool = False,
                                 keep_bf16: bool = False,
                                 strategy: str | Sequence[str] | None = None,
                                 implementation: str | Sequence[str] | None = None
                                 ) -> tuple[QuantizedActivation, jax.Array]:
  """Sequence-parallel variant: the residual stream stays sharded over tokens.

  psum_scatter(x_partial) over `token_axis` -> norm + quant of the local T/N rows (+ the local
  residual shard, with `strategy` choosing the local composition exactly as in
  `allreduce_rmsnorm_quant`) -> all_gather of the fp8 codes, f32 scales (and bf16 copy).

  Args:
    x_partial: `[..., T, ..., H]` this device's partial sum over all T tokens.
    residual: this device's token shard `[..., T/N, ..., H]` of the residual stream, or None.
    token_axis: the axis of x_partial holding tokens (not the last); T must divide by N.
    Others: as for `allreduce_rmsnorm_quant`.
  Returns:
    (quant, residual_out): `quant` replicated, over all T tokens; `residual_out` the local shard
    `[..., T/N, ..., H]` of the new residual stream (the scattered sum alone if residual is None).
  """
  fmt = resolve_format(fmt)
  if x_partial.ndim < 2:
    raise InputError(f"x_partial must have a token axis and a hidden axis, got shape "
                     f"{tuple(x_partial.shape)}")
  ax = token_axis + x_partial.ndim if token_axis < 0 else token_axis
  if not 0 <= ax < x_partial.ndim - 1:
    raise InputError(f"token_axis={token_axis} must name an axis of x_partial other than the "
                     f"last (hidden) one; x_partial shape {tuple(x_partial.shape)}")
  n = axis_size(axis_name)
  t = x_partial.shape[ax]
  if t % n:
    raise InputError(f"sequence-parallel mode needs the token count to divide by the size of "
                     f"axis {axis_name!r}: T={t} tokens over {n} devices; pad T to a multiple of "
                     f"{n} or use allreduce_rmsnorm_quant")
  local = x_partial.shape[:ax] + (t // n,) + x_partial.shape[ax + 1:]
  _check_shapes(x_partial, None, weight)
  _common.check_eps("eps", eps)
  if residual is not None and residual.shape != local:
    raise InputError(f"residual shape {tuple(residual.shape)} is not this device's token shard "
                     f"{local} of x_partial {tuple(x_partial.shape)} (T/N = {t}/{n} along axis "
                     f"{ax})")
  _check_strategy(strategy)
  if n == 1 and not _varying(x_partial, axis_name):
    h = x_partial
  else:
    h = lax.psum_scatter(x_partial, axis_name, scatter_dimension=ax, tiled=True)
  # Quantise with row-major scales: they then share x's token axis and gather alongside q;
  # the column layout is a transpose of the gathered scales.
  build = lambda name: BUILDERS[name](
      h, residual, weight, eps=eps, weight_offset=weight_offset, group_size=group_size,
      fmt=fmt, layout="row", ue8m0=ue8m0, keep_bf16=keep_bf16, implementation=implementation)
  _, (quant, res_out) = _resolve("reduce_scatter_rmsnorm_quant", strategy, build)
  gather = lambda a: None if a is None else _all_gather(a, axis_name, ax, n)
  quant = QuantizedActivation(gather(quant.q), gather(quant.scale), gather(quant.hp),
                              group_size=group_size).with_layout(layout)
  return quant, h if res_out is None else res_out


def allreduce_rmsnorm_quant_sharded(x_partials: jax.Array, residual: jax.Array | None,
                                    weight: jax.Array, *, mesh: jax.sharding.Mesh,
                                    axis_name: AxisName, sequence_parallel: bool = False,
                                    token_axis: int = 0, **kwargs
                                    ) -> tuple[QuantizedActivation, jax.Array]:
  """`allreduce_rmsnorm_quant` for callers outside shard_map, on global arrays.

  Convention: the N = mesh-axis-size partial sums are stacked on a new leading axis,
  `x_partials [N, ..., H]`, sharded over `axis_name` (device i holds `x_partials[i]`); the
  inputs are placed that way if they are not already. Other mesh axes replicate everything.

  Args:
    x_partials: `[N, ..., H]`.
    residual: `[..., H]` global residual stream, or None. Replicated, or with
      `sequence_parallel=True` sharded over `axis_name` along `token_axis`.
    weight: `[H]`, replicated.
    mesh: a `Mesh` (or `AbstractMesh`) with `axis_name`; Auto or Explicit axis types.
    sequence_parallel: use `reduce_scatter_rmsnorm_quant` (residual kept token-sharded).
    token_axis: the token axis of `residual` / `x_partials[i]` (sequence-parallel only).
    **kwargs: eps, weight_offset, group_size, fmt, layout, ue8m0, keep_bf16, strategy,
      implementation, as for `allreduce_rmsnorm_quant`.
  Returns:
    (quant, residual_out): quant replicated over the mesh; residual_out `[..., H]` replicated,
    or token-sharded over `axis_name` with `sequence_parallel=True`.
  """
  names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
  missing = [a for a in names if a not in mesh.axis_names]
  if missing:
    raise InputError(f"axis_name {axis_name!r} is not an axis of the mesh (axes "
                     f"{mesh.axis_names})")
  n = 1
  for a in names:
    n *= mesh.shape[a]
  if x_partials.ndim < 2 or x_partials.shape[0] != n:
    raise InputError(f"x_partials must stack the {n} partial sums of axis {axis_name!r} on a "
                     f"leading axis: want shape [{n}, ..., H], got {tuple(x_partials.shape)}")
  part = P(axis_name)
  if sequence_parallel:
    ax = token_axis + x_partials.ndim - 1 if token_axis < 0 else token_axis
    res_spec = P(*([None] * ax), axis_name)
  else:
    res_spec = P()
  if residual is not None and residual.shape != x_partials.shape[1:]:
    raise InputError(f"residual shape {tuple(residual.shape)} differs from one partial sum's "
                     f"shape {tuple(x_partials.shape[1:])}")

  def body(xp, r, w):
    if sequence_parallel:
      return reduce_scatter_rmsnorm_quant(xp[0], r, w, axis_name=axis_name,
                                          token_axis=token_axis, **kwargs)
    return allreduce_rmsnorm_quant(xp[0], r, w, axis_name=axis_name, **kwargs)

  args = [_place(a, mesh, s) for a, s in ((x_partials, part), (residual, res_spec),
                                          (weight, P()))]
  quant_specs = QuantizedActivation(P(), P(), P() if kwargs.get("keep_bf16") else None,
                                    group_size=kwargs.get("group_size", BLOCK),
                                    layout=kwargs.get("layout", "row"))
  fn = jax.shard_map(body, mesh=mesh, in_specs=(part, res_spec, P()),
                     out_specs=(quant_specs, res_spec), check_vma=False)
  return fn(*args)


def _place(a, mesh, spec):
  """`a` resharded to `spec` on an Explicit mesh, where shard_map requires inputs to match its
  in_specs; on Auto axes shard_map reshards its inputs itself (and reshard would refuse)."""
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  used = [n for s in spec for n in ((s,) if isinstance(s, str) else (s or ()))]
  if a is None or AxisType.Explicit not in types.values():
    return a
  if any(types[n] != AxisType.Explicit for n in used):
    return a
  return jax.reshard(a, NamedSharding(mesh, spec))
