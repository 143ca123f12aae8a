"""A reader and writer of the safetensors format, numpy + ml_dtypes only.

The format: an 8-byte little-endian header length n, n bytes of JSON header
`{name: {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}}`,
then the raw little-endian tensor bytes (offsets relative to the end of the header).

Parsed here rather than through the `safetensors` package because numpy has no bf16 / fp8
dtypes: `safetensors.numpy` refuses exactly the tensors an FP8 checkpoint is made of, while
ml_dtypes (a JAX dependency already) gives every one of them a numpy dtype. Tensors are
memory-mapped, so opening a shard reads only its header.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator, Mapping, Sequence

import ml_dtypes
import numpy as np

# safetensors dtype name -> numpy dtype (ml_dtypes for the ones numpy lacks).
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16), "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32), "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64), "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16), "F32": np.dtype(np.float32), "F64": np.dtype(np.float64),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    # PyTorch's float8_e4m3fn / float8_e5m2 are saved as F8_E4M3 / F8_E5M2.
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
NAMES: dict[np.dtype, str] = {v: k for k, v in DTYPES.items()}
# A header is JSON text of a few entries per tensor; anything this large is a corrupt file.
MAX_HEADER = 100 * 2**20


class SafetensorsError(ValueError):
  """A file is not valid safetensors (truncated, bad header, offsets out of range)."""


class SafetensorsFile(Mapping):
  """The tensors of one .safetensors file, by name, memory-mapped and read lazily.

  `f[name]` is a read-only numpy array `[*shape]` of the stored dtype (bf16/fp8 as ml_dtypes).
  """

  def __init__(self, path: str | os.PathLike):
    self.path = os.fspath(path)
    size = os.path.getsize(self.path)
    with open(self.path, "rb") as f:
      raw = f.read(8)
      if len(raw) < 8:
        raise SafetensorsError(f"{self.path}: {size} bytes, too short for a safetensors header")
      (n,) = struct.unpack("<Q", raw)
      if n > min(MAX_HEADER, size - 8):
        raise SafetensorsError(f"{self.path}: header length {n} exceeds the file ({size} bytes)")
      try:
        header = json.loads(f.read(n))
      except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{self.path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
      raise SafetensorsError(f"{self.path}: header is not a JSON object")
    self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
    self._start = 8 + n
    data_size = size - self._start
    self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
    for name, info in header.items():
      try:
        dtype_name, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
      except (KeyError, TypeError, ValueError):
        raise SafetensorsError(f"{self.path}: malformed header entry for tensor {name!r}: "
                               f"{info!r}") from None
      if dtype_name not in DTYPES:
        raise SafetensorsError(f"{self.path}: tensor {name!r} has dtype {dtype_name}, which this "
                               f"reader does not support ({sorted(DTYPES)})")
      dtype = DTYPES[dtype_name]
      want = math.prod(shape) * dtype.itemsize
      if not 0 <= begin <= end <= data_size or end - begin != want:
        raise SafetensorsError(
            f"{self.path}: tensor {name!r} ({dtype_name} {list(shape)}) has data_offsets "
            f"[{begin}, {end}]; expected {want} bytes within the {data_size} data bytes")
      self._entries[name] = (dtype, shape, begin, end)
    self._map: np.memmap | None = None

  def _data(self) -> np.ndarray:
    if self._map is None:
      self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
    return self._map

  def __getitem__(self, name: str) -> np.ndarray:
    dtype, shape, begin, end = self._entries[name]
    if begin == end:
      return np.zeros(shape, dtype)
    raw = self._data()[self._start + begin:self._start + end]
    return raw.view(dtype).reshape(shape)

  def read(self, name: str, index: Sequence[np.ndarray]) -> np.ndarray:
    """A copy of tensor `name` at `index`, one 1-D integer array per axis (their outer
    product): only those elements leave the file (a range is sliced from the memory map, other
    arrays gathered)."""
    a = self[name]
    ranges = [len(ix) > 0 and np.array_equal(ix, np.arange(ix[0], ix[0] + len(ix)))
              for ix in index]
    a = a[tuple(slice(ix[0], ix[0] + len(ix)) if r else slice(None)
                for ix, r in zip(index, ranges))]
    for axis, (ix, r) in enumerate(zip(index, ranges)):
      if not r:
        a = np.take(a, ix, axis=axis)
    return np.array(a)

  def __contains__(self, name) -> bool:  # Mapping's would go through __getitem__
    return name in self._entries

  def __iter__(self) -> Iterator[str]:
    return iter(self._entries)

  def __len__(self) -> int:
    return len(self._entries)

  def spec(self, name: str) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) of a tensor without reading it."""
    dtype, shape, _, _ = self._entries[name]
    return shape, dtype


def load_file(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """Every tensor of a file, copied into memory."""
  f = SafetensorsFile(path)
  return {k: np.array(f[k]) for k in f}


def save_file(tensors: Mapping[str, np.ndarray], path: str | os.PathLike,
              metadata: Mapping[str, str] | None = None) -> None:
  """Writes `tensors` (numpy arrays, bf16/fp8 as ml_dtypes; jax arrays are converted)."""
  header: dict = {}
  if metadata:
    header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
  arrays, offset = [], 0
  for name in sorted(tensors):
    a = np.asarray(tensors[name])
    a = np.ascontiguousarray(a).reshape(a.shape)  # ascontiguousarray makes a scalar [1]
    if a.dtype not in NAMES:
      raise TypeError(f"tensor {name!r}: dtype {a.dtype} has no safetensors name")
    header[name] = {"dtype": NAMES[a.dtype], "shape": list(a.shape),
                    "data_offsets": [offset, offset + a.nbytes]}
    arrays.append(a)
    offset += a.nbytes
  text = json.dumps(header, separators=(",", ":")).encode()
  text += b" " * (-len(text) % 8)  # data starts 8-byte aligned, as the reference writer does
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    for a in arrays:
      f.write(a.tobytes())  # little-endian hosts only (x86, ARM), like the reference writer
