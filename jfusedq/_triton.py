"""Kernels in the Triton language, compiled and launched by XLA.

The installed `triton` package's frontend turns a kernel, its argument types and its constexprs
into TTIR; the TTIR goes into the custom call Pallas-Triton lowers to (`__gpu$xla.gpu.triton`),
and XLA compiles it with its own Triton, as it compiles a Pallas kernel. Such a kernel is part
of the program XLA schedules: it is captured in XLA's CUDA graphs like any fusion.

Why not jax-triton: its `triton_kernel_call` is a legacy custom call, which XLA keeps out of
command buffers, so each of its kernels split the decode step's CUDA graph and was launched by
the host: on one H200 a decode step with Triton kernels first ran in 5-10 graphs with
277-1455 us of idle GPU through jax-triton, in one graph with 2.6-8.2 us idle through XLA. The
price: the fp8 GEMM as XLA's Triton builds it took 0.98-1.13x the kernel time of Triton 3.6's
own build.

Python scalars among a call's arguments (row counts) become constants of the TTIR: one kernel
per value, as shapes are static under `jit` anyway. Importing this module never fails: without
`triton`, `jit` leaves a kernel a plain function (its `tl.constexpr` annotations are kept
unevaluated by the kernel modules' `from __future__ import annotations`), and a call raises
`Unsupported`.
"""

from __future__ import annotations

import functools
import io

import jax
import jax.numpy as jnp
from jax._src import dispatch
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax.extend.core import Primitive

from jfusedq import _target
from jfusedq.ops._dispatch import Unsupported

try:
  import triton
  import triton.language as tl
except ImportError:  # the kernels are then never compiled: `require` declines first
  triton = tl = None

INSTALL = "pip install 'jfusedq[triton]'"
CUSTOM_CALL = "__gpu$xla.gpu.triton"
# Triton's pointer type for each array dtype a kernel takes or returns.
POINTER = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32", "uint8": "*u8",
           "int32": "*i32", "float8_e4m3fn": "*fp8e4nv", "float8_e4m3fnuz": "*fp8e4b8"}
# Compute capability of the NVIDIA kinds an abstract device may name (a real device says).
_CUDA_ARCH = {"NVIDIA H100": 90, "NVIDIA H200": 90, "NVIDIA GH200": 90, "NVIDIA A100": 80}


def jit(fn):
  return triton.jit(fn) if triton is not None else fn


def _gpu_target(target: _target.Target):
  """Triton's GPUTarget for `target` (the frontend's codegen depends on it: fp8 types)."""
  from triton.backends.compiler import GPUTarget
  mesh_device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  if target.platform == "rocm":
    arch = target.device_kind if mesh_device is not None else (
        getattr(jax.devices()[0], "compute_capability", "") or target.device_kind)
    arch = arch.split(":")[0]
    if not arch.startswith("gfx"):
      raise Unsupported(f"triton: no gfx architecture known for {target.device_kind!r}")
    return GPUTarget("hip", arch, 64)
  if mesh_device is None:
    cc = int(str(jax.devices()[0].compute_capability).replace(".", ""))
  else:
    cc = next((v for k, v in _CUDA_ARCH.items() if target.device_kind.startswith(k)), None)
    if cc is None:
      raise Unsupported(f"triton: no compute capability known for {target.device_kind!r}")
  return GPUTarget("cuda", cc, 32)


def signature(kernel, args, outs, constexprs) -> tuple[tuple, tuple]:
  """(argument types, constants) of `kernel` called on `args` (arrays and Python scalars)
  writing `outs`, as sorted item tuples: arrays become pointers, scalars constants."""
  runtime = [n for n in kernel.arg_names if n not in constexprs]
  if len(runtime) != len(args) + len(outs):
    raise TypeError(f"{kernel.__name__} takes {runtime} besides its constexprs; got "
                    f"{len(args)} arguments and {len(outs)} outputs")
  types, consts = {}, dict(constexprs)
  for n, a in zip(runtime, [*args, *outs]):
    if hasattr(a, "dtype") and hasattr(a, "shape"):
      types[n] = POINTER[jnp.dtype(a.dtype).name]
    else:
      consts[n] = a
  types.update({n: "constexpr" for n in consts})
  return tuple(sorted(types.items())), tuple(sorted(consts.items()))


def source(kernel, types, consts):
  """Triton's ASTSource of `kernel` for a `signature`."""
  from triton.compiler import ASTSource
  types = dict(types)
  # Every array is handed over 16-byte aligned, as XLA allocates them.
  attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
           if types[n].startswith("*")}
  return ASTSource(kernel, signature=types, constexprs=dict(consts), attrs=attrs)


@functools.cache
def _ttir(kernel, types, consts, num_warps, num_stages, gpu) -> bytes:
  """MLIR bytecode of `kernel`'s TTIR, parsed by jaxlib's Triton dialect (XLA's own), so a
  module XLA could not read fails here, at lowering, not inside XLA's compiler."""
  from jax._src.lib import triton as jaxlib_triton
  from triton._C.libtriton import ir as triton_ir
  from triton.compiler.compiler import make_backend

  src = source(kernel, types, consts)
  backend = make_backend(gpu)
  options = backend.parse_options(dict(num_warps=num_warps, num_stages=num_stages))
  context = triton_ir.context()
  triton_ir.load_dialects(context)
  backend.load_dialects(context)
  module = src.make_ir(gpu, options, backend.get_codegen_implementation(options),
                       backend.get_module_map(), context)
  stages = {}
  backend.add_stages(stages, options, src.language)
  text = str(stages["ttir"](module, {}))  # inlined and simplified: TTIR as Pallas hands it over
  ctx = mlir.JaxIrContext()
  ctx.append_dialect_registry(mlir.upstream_dialects)
  jaxlib_triton.dialect.register_dialect(ctx)
  ctx.load_all_available_dialects()
  with ctx:
    buf = io.BytesIO()
    ir.Module.parse(text).operation.write_bytecode(buf)
  return buf.getvalue()


triton_call_p = Primitive("jfusedq_triton_call")
triton_call_p.multiple_results = True
triton_call_p.def_impl(functools.partial(dispatch.apply_primitive, triton_call_p))
triton_call_p.def_abstract_eval(lambda *avals, out_avals, **params: out_avals)


def _lowering(ctx, *operands, out_avals, ttir, name, num_warps, num_stages, grid):
  layouts = lambda avals: [list(reversed(range(a.ndim))) for a in avals]
  config = dict(name=ir.StringAttr.get(name), ir=ir.StringAttr.get(ttir),
                num_stages=mlir.i32_attr(num_stages), num_warps=mlir.i32_attr(num_warps),
                grid_x=mlir.i32_attr(grid[0]), grid_y=mlir.i32_attr(grid[1]),
                grid_z=mlir.i32_attr(grid[2]), debug=ir.BoolAttr.get(False))
  return mlir.custom_call(
      CUSTOM_CALL, operands=list(operands), backend_config=config, api_version=4,
      result_types=[ir.RankedTensorType.get(a.shape, mlir.dtype_to_ir_type(a.dtype))
                    for a in out_avals],
      operand_layouts=layouts(ctx.avals_in), result_layouts=layouts(out_avals)).results


for _platform in ("cuda", "rocm"):
  mlir.register_lowering(triton_call_p, _lowering, platform=_platform)


class XlaLauncher:
  """Launches through XLA's Triton custom call (module docstring)."""

  @staticmethod
  def triton_call(*args, kernel, out_shape, grid, num_warps=4, num_stages=3, **constexprs):
    many = isinstance(out_shape, (list, tuple))
    outs = list(out_shape) if many else [out_shape]
    ttir = _ttir(kernel, *signature(kernel, args, outs, constexprs), num_warps, num_stages,
                 _gpu_target(_target.current()))
    grid = tuple(grid) + (1,) * (3 - len(grid))
    res = triton_call_p.bind(
        *(a for a in args if isinstance(a, jax.Array)),
        out_avals=tuple(jax.core.ShapedArray(o.shape, o.dtype) for o in outs), ttir=ttir,
        name=kernel.__name__, num_warps=num_warps, num_stages=num_stages, grid=grid)
    return list(res) if many else res[0]


def _launcher():
  """The launcher (tests put Triton's interpreter or a recorder here), or why there is none."""
  if triton is None:
    return "the triton package is not installed"
  return XlaLauncher


def missing(target: _target.Target | None = None) -> str | None:
  """Why the Triton kernels cannot run on `target` (default: the current one), each cause that
  holds (no GPU, a platform other than CUDA / ROCm, no triton package), or None."""
  target = target or _target.current()
  why = []
  if target.platform == "cpu":
    why.append("no GPU (the target is the CPU): XLA compiles Triton kernels for CUDA and ROCm "
               "GPUs only")
  elif not target.is_gpu:
    why.append(f"the target is {target.platform}: XLA compiles Triton kernels for CUDA and "
               f"ROCm GPUs only")
  launcher = _launcher()
  if isinstance(launcher, str):
    why.append(f"{launcher} ({INSTALL})")
  return "; ".join(why) or None


def require(target: _target.Target | None = None):
  """The launcher; raises Unsupported naming what is `missing`."""
  why = missing(target)
  if why is not None:
    raise Unsupported(f"triton: {why}")
  return _launcher()


def available() -> bool:
  try:
    require()
  except Unsupported:
    return False
  return True


def call(kernel, *args, out_shape, grid, **kw):
  """Runs `kernel` over `grid`; `args` are arrays and Python scalars (constants of the kernel).

  Output pointers follow the inputs in the kernel's signature, constexprs come last as
  keywords (and num_warps, num_stages). The call has no batching rule: a vmapped call runs
  once per batch element.
  """
  launcher = require()
  arrays = [i for i, a in enumerate(args) if isinstance(a, jax.Array)]

  def run(*operands):
    full = list(args)
    for i, a in zip(arrays, operands):
      full[i] = a
    return launcher.triton_call(*full, kernel=kernel, grid=grid, out_shape=out_shape, **kw)

  return jax.custom_batching.sequential_vmap(run)(*(args[i] for i in arrays))
