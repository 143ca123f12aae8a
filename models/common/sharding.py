"""Tensor parallelism: partition specs by module name, split checks, and `tp_apply`, which runs
a model built with `tp_axis` inside `jax.shard_map` over that mesh axis."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jfusedq.fp8 import BLOCK
from models.common.layers import CausalLMOutput


def param_names(path) -> list[str]:
  """Module / parameter names of a state path, without the Variable's trailing "value"."""
  out = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        out.append(str(getattr(k, attr)))
        break
  return out[:-1] if out and out[-1] == "value" else out


def partition_specs(state, axis: str, *, column: Collection[str], row: Collection[str],
                    heads: Collection[str] = ()):
  """PartitionSpecs of an `nnx.split` state for tensor parallelism over `axis`.

  A projection's `weight` / `weight_scale_inv` (`[..., N, K]`, stacked experts `[E, N, K]`)
  is split on N when its module name is in `column`, on K when in `row`; a parameter named in
  `heads` is split on its leading axis (per-head or per-channel vectors). Everything else is
  replicated.
  """
  def spec(path, x):
    names = param_names(path)
    owner, leaf = (names[-2] if len(names) > 1 else ""), names[-1]
    if leaf in heads:
      return P(axis, *([None] * (x.ndim - 1)))
    if leaf in ("weight", "weight_scale_inv") and (owner in column or owner in row):
      dim = x.ndim - (2 if owner in column else 1)
      return P(*[axis if i == dim else None for i in range(x.ndim)])
    return P()
  return jax.tree_util.tree_map_with_path(spec, state)


def check_split(state, specs, n: int) -> None:
  """Raises unless every split dimension divides over `n` devices and each device's share of
  an FP8 weight holds whole 128 x 128 blocks (one block, one scale, on one device)."""
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  for (path, leaf), spec in zip(leaves, jax.tree.leaves(specs, is_leaf=lambda s: isinstance(
      s, P))):
    name = ".".join(param_names(path))
    fp8 = jnp.dtype(leaf.dtype).itemsize == 1
    for dim, s in zip(leaf.shape, spec):
      if s is None:
        continue
      if dim % n:
        raise ValueError(f"parameter {name} {list(leaf.shape)}: an axis of size {dim} does not "
                         f"split over {n} devices")
      if fp8 and (dim // n) % BLOCK:
        raise ValueError(f"FP8 parameter {name} {list(leaf.shape)}: {dim // n} rows/columns per "
                         f"device is not a multiple of the {BLOCK} x {BLOCK} weight block, so "
                         f"one block (one scale) would straddle two devices")


def split_specs(model: nnx.Module, state: nnx.State, n: int):
  """The model's partition specs of `state`, after the checks that its heads (`check_tp`) and
  FP8 blocks (`check_split`) split over `n` devices; ValueError naming what does not."""
  model.check_tp(n)
  specs = model.partition_specs(state)
  check_split(state, specs, n)
  return specs


def tp_sizes(model: nnx.Module) -> list[int]:
  """Every device count that `model` (built with a tp_axis; `nnx.eval_shape` will do) splits
  over, as `split_specs` checks it. Each divides every split dimension, so the candidates are
  the divisors of their greatest common divisor."""
  state = nnx.state(model)
  specs = model.partition_specs(state)
  is_spec = lambda s: isinstance(s, P)
  dims = [dim for leaf, spec in zip(jax.tree.leaves(state), jax.tree.leaves(specs, is_leaf=is_spec))
          for dim, s in zip(leaf.shape, spec) if s is not None]
  g = math.gcd(*dims)

  def splits(n):
    try:
      split_specs(model, state, n)
    except ValueError:
      return False
    return True

  return [n for n in range(1, g + 1) if g % n == 0 and splits(n)]


def tp_specs(model: nnx.Module, mesh: jax.sharding.Mesh, state: nnx.State):
  """The model's partition specs of `state` over its tp_axis of `mesh`, after the checks that
  the axis exists and that the model splits over it (`split_specs`)."""
  axis = model.opts.tp_axis
  if axis is None or axis not in mesh.axis_names:
    raise ValueError(f"the model's tp_axis {axis!r} is not an axis of the mesh "
                     f"{mesh.axis_names}; build it with tp_axis=...")
  return split_specs(model, state, mesh.shape[axis])


# A parameter's placement: its Variable -> a NamedSharding, or None (loaded whole).
Where = Callable[[nnx.Variable], NamedSharding | None]


def param_shardings(model: nnx.Module, mesh: jax.sharding.Mesh | None) -> Where:
  """Where each parameter of `model` (abstract or not) goes on `mesh`: a function of the
  Variable giving its NamedSharding, split as `tp_apply` splits it (after the same checks);
  None for every parameter without a mesh. A loader given these reads only its shards."""
  if mesh is None:
    return lambda var: None
  specs = tp_specs(model, mesh, nnx.state(model))
  by_name = {tuple(param_names(path)): spec for path, spec in
             jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda s: isinstance(s, P))[0]}
  by_var = {id(v): NamedSharding(mesh, by_name[tuple(map(str, path))])
            for path, v in nnx.graph.iter_graph(model) if isinstance(v, nnx.Variable)}
  return lambda var: by_var[id(var)]


def place(a, sharding: NamedSharding) -> jax.Array:
  """`a` laid out on `sharding`. A host value on a mesh spanning several processes (each
  holding the same value) is cut there: each process supplies its own devices' shards, where
  `jax.device_put` would first compare the value across processes (a collective per array)."""
  local = not isinstance(a, jax.core.Tracer) and (not isinstance(a, jax.Array) or
                                                  a.is_fully_addressable)
  if sharding.is_fully_addressable or not local:
    return jax.device_put(a, sharding)
  return jax.make_array_from_callback(jnp.shape(a), sharding, lambda idx: a[idx],
                                      dtype=a.dtype)


def tp_apply(model: nnx.Module, mesh: jax.sharding.Mesh, *, with_cache: bool = False,
             explicit_params: bool = False):
  """A jitted `f(tokens, cache=None, pos=0) -> (logits, cache)` running `model` (built with
  `tp_axis`) inside `jax.shard_map` over that axis of `mesh`.

  Parameters are split per the model's `partition_specs(state)` (checked by its `check_tp`
  and `check_split`) and placed once, so each device holds only its shard; tokens and logits
  are replicated; the cache (when `with_cache`) is laid out per the model's `cache_specs()`.
  With `explicit_params`, returns `(f(params, tokens, cache, pos), params)` instead: an outer
  jit then takes the weights as arguments, where a closure would make them constants of the
  compiled program.
  """
  graphdef, state = nnx.split(model)
  pspecs = tp_specs(model, mesh, state)
  cspecs = model.cache_specs() if with_cache else P()

  def body(state, tokens, cache, pos):
    out = nnx.merge(graphdef, state)(tokens, cache=cache if with_cache else None, pos=pos)
    return out.logits, out.cache if with_cache else jnp.zeros(())

  # check_vma=False: the Pallas and Triton kernels inside shard_map need it.
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(pspecs, P(), cspecs, P()),
                             out_specs=(P(), cspecs), check_vma=False))
  put = lambda tree, specs: jax.tree.map(lambda a, s: place(a, NamedSharding(mesh, s)), tree,
                                        specs)
  state = put(state, pspecs)
  rep = NamedSharding(mesh, P())

  def pure(params, tokens, cache=None, pos=0):
    cache = put(cache, cspecs) if with_cache else None
    logits, new = fn(params, place(tokens, rep), cache, place(jnp.asarray(pos, jnp.int32), rep))
    return CausalLMOutput(logits, new if with_cache else None)

  if explicit_params:
    return pure, state
  return lambda tokens, cache=None, pos=0: pure(state, tokens, cache, pos)
