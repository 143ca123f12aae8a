"""Optional support for kernels written in the Triton language and called through jax-triton.

Importing this module never fails: without `triton`, `jit` leaves a kernel a plain function
(its body, and the `tl.constexpr` annotations, which the kernel modules keep unevaluated with
`from __future__ import annotations`, are only read by Triton's compiler), and jax-triton is
imported on the first call, where a missing package or a non-GPU target raises `Unsupported`.

jax-triton renamed `triton_call`'s `out_shape=` to `out_type=` in 0.4 (0.4 needs Triton >=
3.7; 0.3.1 is what runs with Triton 3.6): `call` passes whichever the installed one takes.
"""

from __future__ import annotations

import functools
import inspect

import jax

from jfusedq import _target
from jfusedq.ops._dispatch import Unsupported

try:
  import triton
  import triton.language as tl
except ImportError:  # the kernels are then never compiled: `require` declines first
  triton = tl = None

INSTALL = "pip install 'jfusedq[triton]' (jax-triton and triton)"


def jit(fn):
  return triton.jit(fn) if triton is not None else fn


@functools.cache
def _jax_triton():
  """The jax_triton module, or the reason it cannot be used."""
  if triton is None:
    return "the triton package is not installed"
  try:
    import jax_triton
  except Exception as e:  # jax-triton raises ImportError subclasses and, on CPU jaxlibs, others
    return f"jax_triton does not import ({type(e).__name__}: {e})"
  return jax_triton


def require(target: _target.Target | None = None):
  """The jax_triton module; raises Unsupported when it or a GPU target is missing."""
  target = target or _target.current()
  if not target.is_gpu:
    raise Unsupported(f"triton needs a CUDA or ROCm GPU (and jax-triton), not {target.platform}")
  jt = _jax_triton()
  if isinstance(jt, str):
    raise Unsupported(f"{jt}; {INSTALL}")
  return jt


def available() -> bool:
  try:
    require()
  except Unsupported:
    return False
  return True


def out_keyword(triton_call) -> str:
  """The keyword of `triton_call` that takes the output shapes: out_type (>= 0.4) or out_shape."""
  return "out_type" if "out_type" in inspect.signature(triton_call).parameters else "out_shape"


def call(kernel, *args, out_shape, grid, name: str = "", **kw):
  """`jax_triton.triton_call` on either API; `args` are arrays and Python scalars.

  Output pointers follow the inputs in the kernel's signature, constexprs come last as
  keywords. jax-triton has no batching rule: a vmapped call runs once per batch element.
  """
  jt = require()
  key = out_keyword(jt.triton_call)
  arrays = [i for i, a in enumerate(args) if isinstance(a, jax.Array)]

  def run(*operands):
    full = list(args)
    for i, a in zip(arrays, operands):
      full[i] = a
    return jt.triton_call(*full, kernel=kernel, grid=grid, name=name, **{key: out_shape}, **kw)

  return jax.custom_batching.sequential_vmap(run)(*(args[i] for i in arrays))
