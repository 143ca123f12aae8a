"""pytest plugin: the Triton kernels' numerics on CPU, through Triton's interpreter.

    python -m pytest -p tests.triton_interpret -k triton tests/ops tests/nn

Makes the target an NVIDIA H200 and replaces the launcher (XLA's Triton custom call) with a
`jax.pure_callback` that runs each kernel in Triton's interpreter over numpy buffers (torch,
which the interpreter expects, is not needed).
Every masked-in address a kernel loads or stores is checked against the call's own arrays, so
an out-of-bounds access fails the test instead of passing unseen, and outputs start poisoned
(0x7F bytes) so an unwritten element cannot pass as a value. Only the `-k triton` cases are
meant to run under it (each op's shared suite over `helpers.IMPLEMENTATIONS`, whose `triton`
entry this plugin makes runnable, and the Triton-named tests): Pallas kernels would be built
for the GPU here, which is absent. ROCm
targets are not interpreted: Triton 3.6's interpreter has no fp8e4b8 (e4m3fnuz) type.
"""

from __future__ import annotations

import os
import threading

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter as _interp  # noqa: E402

from jfusedq import _target, _triton  # noqa: E402

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}
_LOCK = threading.Lock()  # the interpreter keeps global state: one kernel at a time
_RANGES: list[tuple[int, int]] = []  # the running call's arrays, [start, end) addresses


def pytest_configure(config):
  del config
  real = _target.current
  _target.current = lambda: (_target.Target("cuda", "NVIDIA H200") if real().platform == "cpu"
                             else real())
  _triton._launcher = lambda: _Interpreter


class _DType:
  """A dtype as the interpreter names it (str -> "bfloat16"). Triton caches types by dtype
  object, as torch's are singletons: equal by name, or a recycled id() would hand a bf16 array
  an earlier f32 array's pointer type."""

  def __init__(self, name: str):
    self.name = name

  def __str__(self):
    return self.name

  def __eq__(self, other):
    return isinstance(other, _DType) and other.name == self.name

  def __hash__(self):
    return hash(self.name)


class _Buffer:
  """The part of torch.Tensor the interpreter touches, over a contiguous numpy array."""

  def __init__(self, arr: np.ndarray, dtype):
    self.arr, self.dtype = np.ascontiguousarray(arr), _DType(jnp.dtype(dtype).name)

  def data_ptr(self):
    return self.arr.ctypes.data

  def untyped_storage(self):
    return self

  def cpu(self):
    return self

  def new_empty(self, *args, **kwargs):
    return _Buffer(self.arr, self.dtype.name)

  def set_(self, storage, offset, size, stride):
    self.arr = storage.arr
    return self

  def storage_offset(self):
    return 0

  def size(self):
    return self.arr.shape

  def stride(self):
    return tuple(s // self.arr.itemsize for s in self.arr.strides)

  def copy_(self, other):
    if other.arr is not self.arr:
      np.copyto(self.arr, other.arr)


def _bits(a: np.ndarray) -> np.ndarray:
  return a.view(_UINT[a.dtype.itemsize])


def _poisoned(shape, dtype) -> np.ndarray:
  size = jnp.dtype(dtype).itemsize
  return np.full(int(np.prod(shape)) * size, 0x7F, np.uint8).view(_UINT[size]).reshape(shape)


class _Interpreter:
  @staticmethod
  def triton_call(*args, kernel, out_shape, grid, num_warps=4, num_stages=3, **meta):
    del num_warps, num_stages
    many = isinstance(out_shape, (list, tuple))
    shapes = list(out_shape) if many else [out_shape]
    arrays = [i for i, a in enumerate(args) if isinstance(a, jax.Array)]

    def host(*operands):
      full = list(args)
      for i, a in zip(arrays, operands):
        a = np.asarray(a)
        full[i] = _Buffer(_bits(a).copy(), a.dtype)
      outs = [_Buffer(_poisoned(s.shape, s.dtype), s.dtype) for s in shapes]
      with _LOCK:
        _RANGES[:] = [(b.arr.ctypes.data, b.arr.ctypes.data + b.arr.nbytes)
                      for b in (*full, *outs) if isinstance(b, _Buffer)]
        try:
          kernel[grid](*full, *outs, **meta)
        finally:
          _RANGES.clear()
      return [o.arr.view(s.dtype) for o, s in zip(outs, shapes)]

    res = jax.pure_callback(host, [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in shapes],
                            *[args[i] for i in arrays], vmap_method="sequential")
    return res if many else res[0]


# --- fixes to the interpreter (Triton 3.6 - 3.9) ---------------------------------------------

# Its float conversion to fp8 drops the carry of a mantissa that rounds up (7.94 -> 4) and
# rounds half up: convert through ml_dtypes (nearest even, like the GPUs' cvt).
_ML = {tl.float8e4nv: ml_dtypes.float8_e4m3fn, tl.float8e4b8: ml_dtypes.float8_e4m3fnuz,
       tl.float16: np.float16, tl.bfloat16: ml_dtypes.bfloat16, tl.float32: np.float32}
_convert_float = _interp._convert_float


def _convert(data, in_dt, out_dt, rounding_mode):
  narrow = (tl.float8e4nv, tl.float8e4b8, tl.bfloat16)
  if (in_dt in narrow or out_dt in narrow) and in_dt in _ML and out_dt in _ML:
    assert rounding_mode in (None, _interp._ir.ROUNDING_MODE.RTNE), rounding_mode
    a = np.ascontiguousarray(data).view(_ML[in_dt]).reshape(data.shape)
    out = a.astype(_ML[out_dt])
    return out.view(f"uint{out.dtype.itemsize * 8}")
  return _convert_float(data, in_dt, out_dt, rounding_mode)


_interp._convert_float = _convert

# numpy >= 2.4 refuses int() of a one-element 1-d array, which the interpreter's scalars are.
_patch_lang_tensor = _interp._patch_lang_tensor


def _patch_tensor(tensor, scope):
  _patch_lang_tensor(tensor, scope)
  scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))


_interp._patch_lang_tensor = _patch_tensor

# Its C++ load and store read their operands' raw buffers as if contiguous: a transposed view
# (`tl.trans`) or a broadcast one (zero strides) would be read scrambled.
_Builder = _interp.InterpreterBuilder
_trans, _load, _store = _Builder.create_trans, _Builder.create_masked_load, \
    _Builder.create_masked_store


def _contiguous(handle):
  if handle is not None:
    handle.data = np.ascontiguousarray(handle.data)
  return handle


def _in_bounds(kind, ptrs, mask):
  if not _RANGES:
    return
  p = ptrs.data.astype(np.uint64)[np.broadcast_to(mask.data, ptrs.data.shape).astype(bool)]
  ok = np.zeros(p.shape, bool)
  for lo, hi in _RANGES:
    ok |= (p >= lo) & (p < hi)
  if not ok.all():
    raise AssertionError(f"out-of-bounds {kind}: {int((~ok).sum())} of {p.size} addresses "
                         f"outside the call's arrays")


def _create_trans(self, arg, perm):
  return _contiguous(_trans(self, arg, perm))


def _bool(mask):
  # `&` of an int1 block and an int1 scalar leaves int32 data (Triton 3.6 - 3.9), which 3.9's
  # load and store refuse ('mask has unsupported dtype').
  mask = _contiguous(mask)
  mask.data = mask.data.astype(bool, copy=False)
  return mask


def _create_masked_load(self, ptrs, mask, other, *rest):
  ptrs, mask = _contiguous(ptrs), _bool(mask)
  _in_bounds("load", ptrs, mask)
  return _load(self, ptrs, mask, _contiguous(other), *rest)


def _create_masked_store(self, ptrs, value, mask, *rest):
  ptrs, mask = _contiguous(ptrs), _bool(mask)
  _in_bounds("store", ptrs, mask)
  return _store(self, ptrs, _contiguous(value), mask, *rest)


_Builder.create_trans = _create_trans
_Builder.create_masked_load = _create_masked_load
_Builder.create_masked_store = _create_masked_store

# Its dot multiplies bf16 operands as their uint16 bits (numpy has no bf16): widen them to f32,
# which holds every bf16 product exactly.
_dot = _Builder.create_dot


def _create_dot(self, a, b, d, *rest):
  if tl.bfloat16 in (a.dtype.scalar, b.dtype.scalar):
    a, b = (_interp.TensorHandle(np.ascontiguousarray(h.data).view(ml_dtypes.bfloat16)
                                 .astype(np.float32), tl.float32)
            if h.dtype.scalar == tl.bfloat16 else h for h in (a, b))
  return _dot(self, a, b, d, *rest)


_Builder.create_dot = _create_dot
