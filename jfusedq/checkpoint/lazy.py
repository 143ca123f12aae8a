"""Tensors read by slices: a checkpoint tensor, or a parameter made of checkpoint tensors
(concatenated, permuted, stacked, dequantised, quantised), read only where a shard needs it.

An index is one 1-D integer array per axis, the rows, columns, ... wanted (their outer
product). A `Lazy` reads a dense array at any index. An `Fp8` reads FP8 codes with their
128 x 128 block scales at an index whose last two arrays hold whole blocks (each block's
indices in order from a multiple of 128), and returns those blocks' scales in that order.
`place` and `place_fp8` build a jax.Array on a sharding from the shards of this process's
devices. Every step is per element or per 128 x 128 block, so a parameter read shard by shard
has the bits of one read whole (shards of FP8 parameters hold whole blocks: `check_split`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jfusedq.checkpoint.safetensors import SafetensorsFile
from jfusedq.fp8 import BLOCK, Fp8Format
from jfusedq.nn.weights import e4m3fn_to_e4m3fnuz, quantize_weight
from jfusedq.ops.fp8_matmul.reference import dequantize_weight

Index = tuple[np.ndarray, ...]


def whole(shape: Sequence[int]) -> Index:
  return tuple(np.arange(n) for n in shape)


def _blocks(ix: np.ndarray) -> np.ndarray:
  """The blocks an index of whole blocks holds, in its order."""
  return ix[ix % BLOCK == 0] // BLOCK


def _at(idx: Index, axis: int, ix: np.ndarray) -> Index:
  return idx[:axis] + (ix,) + idx[axis + 1:]


class Lazy:
  """A dense `[*shape]` array of `dtype`, read by index."""

  shape: tuple[int, ...]
  dtype: np.dtype

  def read(self, idx: Index) -> np.ndarray:
    raise NotImplementedError


class Stored(Lazy):
  """Tensor `name` of a safetensors file: a read copies only the indexed elements."""

  def __init__(self, file: SafetensorsFile, name: str):
    self.file, self.name = file, name
    self.shape, self.dtype = file.spec(name)

  def read(self, idx: Index) -> np.ndarray:
    return self.file.read(self.name, idx)


class Host(Lazy):
  """An array in memory (a numpy array, or what converts to one)."""

  def __init__(self, a):
    self.a = np.asarray(a)
    self.shape, self.dtype = self.a.shape, self.a.dtype

  def read(self, idx: Index) -> np.ndarray:
    return self.a[np.ix_(*idx)]


class Cast(Lazy):
  """`src` rounded to `dtype` as jnp rounds it (bf16 masters of f32 weights)."""

  def __init__(self, src: Lazy, dtype):
    self.src, self.shape, self.dtype = src, src.shape, np.dtype(dtype)

  def read(self, idx: Index) -> np.ndarray:
    return np.asarray(jnp.asarray(self.src.read(idx)).astype(self.dtype))


class Concat(Lazy):
  """Parts (one dtype) concatenated along `axis`."""

  def __init__(self, parts: Sequence[Lazy], axis: int = 0):
    self.parts, self.axis = list(parts), axis
    self.starts = np.cumsum([0] + [p.shape[axis] for p in parts])
    shape = list(parts[0].shape)
    shape[axis] = int(self.starts[-1])
    self.shape, self.dtype = tuple(shape), parts[0].dtype

  def read(self, idx: Index) -> np.ndarray:
    ix, a = idx[self.axis], self.axis
    which = np.searchsorted(self.starts, ix, side="right") - 1
    out = np.empty([len(i) for i in idx], self.dtype)
    for p, part in enumerate(self.parts):
      sel = which == p
      if sel.any():
        out[(slice(None),) * a + (sel,)] = part.read(_at(idx, a, ix[sel] - self.starts[p]))
    return out


class Take(Lazy):
  """`src` at `indices` along `axis` (a permutation, or a range of it)."""

  def __init__(self, src: Lazy, indices, axis: int = 0):
    self.src, self.indices, self.axis = src, np.asarray(indices), axis
    self.shape = src.shape[:axis] + (len(self.indices),) + src.shape[axis + 1:]
    self.dtype = src.dtype

  def read(self, idx: Index) -> np.ndarray:
    return self.src.read(_at(idx, self.axis, self.indices[idx[self.axis]]))


class Pick(Lazy):
  """`src` at position `i` of `axis`, the axis dropped (`w[:, 0]`, one expert of a stack)."""

  def __init__(self, src: Lazy, i: int, axis: int = 0):
    self.src, self.i, self.axis = src, i, axis
    self.shape, self.dtype = src.shape[:axis] + src.shape[axis + 1:], src.dtype

  def read(self, idx: Index) -> np.ndarray:
    a = self.axis
    return self.src.read(idx[:a] + (np.array([self.i]),) + idx[a:]).squeeze(a)


class Stack(Lazy):
  """Parts of one shape and dtype stacked on a new leading axis (experts)."""

  def __init__(self, parts: Sequence[Lazy]):
    self.parts = list(parts)
    self.shape, self.dtype = (len(parts),) + parts[0].shape, parts[0].dtype

  def read(self, idx: Index) -> np.ndarray:
    return np.stack([self.parts[e].read(idx[1:]) for e in idx[0]])


class F32(Lazy):
  """`src` as f32 (exact for the checkpoint's float dtypes)."""

  def __init__(self, src: Lazy):
    self.src, self.shape, self.dtype = src, src.shape, np.dtype(np.float32)

  def read(self, idx: Index) -> np.ndarray:
    return self.src.read(idx).astype(np.float32)


class Fp8:
  """FP8 codes `[..., N, K]` and f32 block scales `[..., ceil(N/128), ceil(K/128)]`."""

  shape: tuple[int, ...]
  dtype: np.dtype

  def read(self, idx: Index) -> tuple[np.ndarray, np.ndarray]:
    raise NotImplementedError


class StoredFp8(Fp8):
  """Codes and scales (f32, or bf16 / f16 read as f32) as stored."""

  def __init__(self, q: Lazy, s: Lazy):
    self.q, self.s, self.shape, self.dtype = q, s, q.shape, q.dtype

  def read(self, idx: Index):
    s = self.s.read(idx[:-2] + (_blocks(idx[-2]), _blocks(idx[-1])))
    return self.q.read(idx), s.astype(np.float32)


class Quantized(Fp8):
  """A dense `[N, K]` weight quantised by `quantize_weight` (per block)."""

  def __init__(self, src: Lazy, fmt: Fp8Format):
    self.src, self.fmt, self.shape, self.dtype = src, fmt, src.shape, np.dtype(fmt.dtype)

  def read(self, idx: Index):
    q, s = quantize_weight(jnp.asarray(self.src.read(idx)), self.fmt)
    return np.asarray(q), np.asarray(s)


class Converted(Fp8):
  """e4m3fn codes reinterpreted as e4m3fnuz (`e4m3fn_to_e4m3fnuz`: scales doubled, exact)."""

  def __init__(self, src: Fp8, fmt: Fp8Format):
    self.src, self.shape, self.dtype = src, src.shape, np.dtype(fmt.dtype)

  def read(self, idx: Index):
    q, s = e4m3fn_to_e4m3fnuz(*map(jnp.asarray, self.src.read(idx)))
    return np.asarray(q), np.asarray(s)


class Dequantized(Lazy):
  """A `[N, K]` Fp8 as f32 (`dequantize_weight`), read through the blocks holding the index."""

  def __init__(self, src: Fp8):
    self.src, self.shape, self.dtype = src, src.shape, np.dtype(np.float32)

  def read(self, idx: Index) -> np.ndarray:
    cover, pos = [], []
    for ix, n in zip(idx, self.shape):
      blocks = np.unique(ix // BLOCK)
      c = np.concatenate([np.arange(b * BLOCK, min((b + 1) * BLOCK, n)) for b in blocks])
      cover.append(c)
      pos.append(np.searchsorted(c, ix))
    w = np.asarray(dequantize_weight(*map(jnp.asarray, self.src.read(tuple(cover)))))
    return w[np.ix_(*pos)]


class ConcatFp8(Fp8):
  """Parts (one format) concatenated along N, every part but the last whole blocks of rows,
  so each block keeps its scale."""

  def __init__(self, parts: Sequence[Fp8]):
    self.parts = list(parts)
    self.starts = np.cumsum([0] + [p.shape[-2] for p in parts])
    self.shape = parts[0].shape[:-2] + (int(self.starts[-1]), parts[0].shape[-1])
    self.dtype = parts[0].dtype

  def read(self, idx: Index):
    rows = idx[-2]
    which = np.searchsorted(self.starts, rows, side="right") - 1
    bwhich = which[rows % BLOCK == 0]
    q = np.empty([len(i) for i in idx], self.dtype)
    s = np.empty(q.shape[:-2] + (len(bwhich), len(_blocks(idx[-1]))), np.float32)
    for p, part in enumerate(self.parts):
      sel = which == p
      if sel.any():
        q[..., sel, :], s[..., bwhich == p, :] = part.read(
            idx[:-2] + (rows[sel] - self.starts[p], idx[-1]))
    return q, s


class TakeFp8(Fp8):
  """Rows `rows` of a `[N, K]` Fp8 where they move whole, aligned blocks (each keeps its
  scale)."""

  def __init__(self, src: Fp8, rows: np.ndarray):
    self.src, self.rows, self.shape, self.dtype = src, rows, (len(rows),) + src.shape[1:], src.dtype

  def read(self, idx: Index):
    return self.src.read((self.rows[idx[0]],) + idx[1:])


class StackFp8(Fp8):
  """Parts of one shape and format stacked on a new leading axis (experts)."""

  def __init__(self, parts: Sequence[Fp8]):
    self.parts = list(parts)
    self.shape, self.dtype = (len(parts),) + parts[0].shape, parts[0].dtype

  def read(self, idx: Index):
    qs, ss = zip(*(self.parts[e].read(idx[1:]) for e in idx[0]))
    return np.stack(qs), np.stack(ss)


def _index(index: tuple[slice, ...], shape: Sequence[int]) -> Index:
  return tuple(np.arange(*sl.indices(n)) for sl, n in zip(index, shape))


def _build(shape, sharding, make: Callable[[Index], jax.Array]) -> jax.Array:
  """A global `[*shape]` array on `sharding` from `make(index)`, called once per distinct shard
  of this process's devices."""
  made, arrays = {}, []
  for dev, index in sharding.addressable_devices_indices_map(tuple(shape)).items():
    key = tuple(sl.indices(n) for sl, n in zip(index, shape))
    if key not in made:
      made[key] = make(_index(index, shape))
    arrays.append(jax.device_put(made[key], dev))
  return jax.make_array_from_single_device_arrays(tuple(shape), sharding, arrays)


def place(t: Lazy, dtype, sharding: jax.sharding.Sharding | None = None) -> jax.Array:
  """`t` as a jax.Array of `dtype`: whole on the default device (no `sharding`), or on
  `sharding`, reading only this process's shards."""
  make = lambda idx: jnp.asarray(t.read(idx)).astype(dtype)
  with jax.ensure_compile_time_eval():  # concrete under a trace (nnx.eval_shape) too
    return make(whole(t.shape)) if sharding is None else _build(t.shape, sharding, make)


def place_fp8(t: Fp8, sharding: jax.sharding.Sharding | None = None
              ) -> tuple[jax.Array, jax.Array]:
  """(codes, scales) of `t` as jax.Arrays: whole, or both on `sharding` (the scales split as
  the codes, block for block), reading only this process's shards."""
  with jax.ensure_compile_time_eval():  # concrete under a trace (nnx.eval_shape) too
    return _place_fp8(t, sharding)


def _place_fp8(t: Fp8, sharding):
  if sharding is None:
    q, s = t.read(whole(t.shape))
    return jnp.asarray(q), jnp.asarray(s)
  sshape = t.shape[:-2] + tuple(-(-n // BLOCK) for n in t.shape[-2:])
  made = {}

  def shard(idx: Index):
    key = tuple((int(i[0]), len(i)) if len(i) else (0, 0) for i in idx)
    if key not in made:
      made[key] = t.read(idx)
    return made[key]

  q = _build(t.shape, sharding, lambda idx: jnp.asarray(shard(idx)[0]))
  # A scale shard is the codes shard's blocks: its index is the codes index over 128.
  scale_idx = lambda idx: idx[:-2] + tuple(
      np.arange(i[0] * BLOCK, min((i[-1] + 1) * BLOCK, n)) for i, n in zip(idx[-2:],
                                                                         t.shape[-2:]))
  s = _build(sshape, sharding, lambda idx: jnp.asarray(shard(scale_idx(idx))[1]))
  return q, s
