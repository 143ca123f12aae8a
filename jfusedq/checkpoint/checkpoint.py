"""A Hugging Face checkpoint directory: config.json and its tensors, read by name."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator, Sequence

import numpy as np

from jfusedq.checkpoint.lazy import Stored
from jfusedq.checkpoint.safetensors import SafetensorsFile
from jfusedq.errors import InputError, JfusedqError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(JfusedqError):
  """A checkpoint lacks something a model needs, or holds it in the wrong form."""


class ConfigError(CheckpointError, InputError):
  """config.json is missing, not JSON, lacks a key the model needs or names another model."""


class MissingTensorError(CheckpointError, KeyError):
  """A tensor a model needs is not in the checkpoint."""

  def __str__(self):  # KeyError would print the message quoted
    return str(self.args[0])


class TensorMismatchError(CheckpointError, ValueError):
  """A tensor has the wrong shape or dtype."""


def read_config(path: str | os.PathLike) -> dict:
  """config.json at `path` as a dict. Raises ConfigError: missing, not JSON, not an object."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise ConfigError(f"{path} does not exist: a Hugging Face checkpoint directory holds a "
                      f"config.json with the model's sizes")
  with open(path) as f:
    try:
      cfg = json.load(f)
    except json.JSONDecodeError as e:
      raise ConfigError(f"{path} is not valid JSON: {e}") from None
  if not isinstance(cfg, dict):
    raise ConfigError(f"{path} holds a JSON {type(cfg).__name__}, not an object")
  return cfg


class Checkpoint:
  """Tensors of a checkpoint directory by name, with the directory's config.json.

  The directory holds `config.json` and either a sharded `model.safetensors.index.json`
  (`weight_map`: tensor name -> file), a single `model.safetensors`, or any `*.safetensors`
  files (their union). Shards are opened lazily and tensors memory-mapped.

  `prefix` scopes every name: `Checkpoint(path, prefix="model.")["norm.weight"]` reads
  `model.norm.weight`; `scope("layers.0.")` narrows further.
  """

  def __init__(self, path: str | os.PathLike, *, prefix: str = ""):
    self.path = os.fspath(path)
    if not os.path.isdir(self.path):
      raise CheckpointError(f"checkpoint directory {self.path!r} does not exist")
    self.prefix = prefix
    cfg = os.path.join(self.path, "config.json")
    self.config: dict = read_config(cfg) if os.path.exists(cfg) else {}
    self._read: set[str] = set()  # full names read by get() / tensor(), shared by views
    self._files: dict[str, SafetensorsFile] = {}
    index = os.path.join(self.path, INDEX)
    if os.path.exists(index):
      with open(index) as f:
        self._where = dict(json.load(f)["weight_map"])
      for fname in sorted(set(self._where.values())):
        if not os.path.exists(os.path.join(self.path, fname)):
          raise CheckpointError(f"{index} names shard {fname!r}, which is not in {self.path}")
    else:
      single = os.path.join(self.path, SINGLE)
      files = [single] if os.path.exists(single) else sorted(
          glob.glob(os.path.join(self.path, "*.safetensors")))
      if not files:
        raise CheckpointError(f"no {INDEX}, {SINGLE} or *.safetensors file in {self.path}")
      self._where = {}
      for path in files:
        fname = os.path.basename(path)
        for name in self._file(fname):
          if name in self._where:
            raise CheckpointError(f"tensor {name!r} is in both {self._where[name]} and {fname}")
          self._where[name] = fname

  def _file(self, fname: str) -> SafetensorsFile:
    if fname not in self._files:
      self._files[fname] = SafetensorsFile(os.path.join(self.path, fname))
    return self._files[fname]

  def scope(self, prefix: str) -> Checkpoint:
    """A view whose names are relative to `self.prefix + prefix` (shares the open files)."""
    view = object.__new__(Checkpoint)
    view.__dict__.update(self.__dict__)
    view.prefix = self.prefix + prefix
    return view

  def __contains__(self, name: str) -> bool:
    return self.prefix + name in self._where

  def keys(self) -> Iterator[str]:
    """Names under this view's prefix, relative to it."""
    n = len(self.prefix)
    return (k[n:] for k in sorted(self._where) if k.startswith(self.prefix))

  def spec(self, name: str) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) of a tensor without reading its data."""
    full = self._full(name)
    f = self._file(self._where[full])
    if full not in f:
      raise CheckpointError(f"tensor {full!r} is listed for {self._where[full]} in {INDEX} but "
                            f"that file does not hold it")
    return f.spec(full)

  def _full(self, name: str) -> str:
    full = self.prefix + name
    if full not in self._where:
      near = [k for k in self._where if k.rsplit(".", 1)[0] == full.rsplit(".", 1)[0]]
      hint = f"; tensors of that module: {sorted(near)}" if near else ""
      raise MissingTensorError(f"tensor {full!r} is missing from the checkpoint {self.path}{hint}")
    return full

  def get(self, name: str, *, shape: Sequence[int] | None = None,
          dtype: Sequence | np.dtype | str | None = None) -> np.ndarray:
    """The tensor `prefix + name` as a read-only numpy array of its stored dtype.

    Args:
      shape: if given, the shape it must have.
      dtype: if given, a dtype (or sequence of dtypes) it must have.
    Raises:
      MissingTensorError, TensorMismatchError: naming the tensor.
    """
    full = self._checked(name, shape, dtype)
    return self._file(self._where[full])[full]

  def tensor(self, name: str, *, shape: Sequence[int] | None = None,
             dtype: Sequence | np.dtype | str | None = None) -> Stored:
    """The tensor `prefix + name`, checked as by get(), to be read by slices: a loader reads
    only the shards its devices hold."""
    full = self._checked(name, shape, dtype)
    return Stored(self._file(self._where[full]), full)

  def _checked(self, name: str, shape, dtype) -> str:
    full = self._full(name)
    got_shape, got_dtype = self.spec(name)
    if shape is not None and tuple(got_shape) != tuple(shape):
      raise TensorMismatchError(f"tensor {full!r} has shape {list(got_shape)}, expected "
                                f"{list(shape)} ({self._where[full]})")
    if dtype is not None:
      allowed = [np.dtype(d) for d in (dtype if isinstance(dtype, (list, tuple)) else [dtype])]
      if got_dtype not in allowed:
        raise TensorMismatchError(f"tensor {full!r} has dtype {got_dtype}, expected one of "
                                  f"{[str(d) for d in allowed]} ({self._where[full]})")
    self._read.add(full)
    return full

  def unread(self) -> list[str]:
    """Names of the checkpoint (all prefixes) that no get() / tensor() took: after loading a
    model, the tensors it does not use."""
    return sorted(set(self._where) - self._read)

  def __getitem__(self, name: str) -> np.ndarray:
    return self.get(name)
