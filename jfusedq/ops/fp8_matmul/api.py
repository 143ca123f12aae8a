"""Public entry point of the block-scaled FP8 projection (W8A8, 1x128 / 128x128 scales)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jfusedq import _target
from jfusedq.errors import DTypeError, InputError, check_range
from jfusedq.fp8 import BLOCK, E4M3FN, E4M3FNUZ, Fp8Format, QuantizedActivation
from jfusedq.ops import _common
from jfusedq.ops import _dispatch
from jfusedq.ops._dispatch import Unsupported, declare, dispatch
from jfusedq.ops.fp8_matmul import mosaic_gpu, pallas, reference, triton
from jfusedq.ops.group_quant import group_quant

IMPLEMENTATIONS = ("pallas", "triton", "mosaic_gpu", "xla")
declare("fp8_matmul", IMPLEMENTATIONS)
declare("grouped_fp8_matmul", IMPLEMENTATIONS)

# Triton first (_dispatch.GPU_ORDER): the Pallas-Triton lowering feeds fp8 to f16 mma.sync
# instead of fp8 wgmma, and Triton ran 2.0-2.3x the Pallas kernel's speed at M = 4096 on the H200;
# without `triton` installed it declines and Pallas runs.
# The warp-specialised Mosaic GPU kernel (Hopper) goes first from M = 256 where it has at least
# MOSAIC_MIN_TILES tiles, the fewest measured (1.20x Triton's speed there; fewer tiles are
# unmeasured; every cell: benchmarks/README.md). Off Hopper it declines and the order goes on.
MOSAIC_MIN_M, MOSAIC_MIN_TILES = 256, 64
# Grouped (MoE) products: Triton first as well (the Pallas grouped kernel ran up to 11% behind
# it, benchmarks/README.md).


def scale_layout(m: int) -> str:
  """The activation-scale layout the projection of an `[M, K]` activation reads as stored.

  "col" (`[KB, M]`) from MOSAIC_MIN_M rows: the Mosaic GPU kernel's TMA box takes a K block's
  scales for consecutive rows, and row-layout scales cost an XLA transpose before it (up to
  1.13x the GEMM's time at M = 256 on the H200). "row" below: the Triton decode kernels load a
  row's scales one K block ahead, and column-layout ones ran 1.06-1.15x the time at M = 64.
  Producers (`RMSNorm`, the quantisation of a bf16 input) write this layout."""
  return "col" if m >= MOSAIC_MIN_M else "row"


def gpu_order(m: int, n: int, k: int) -> tuple[str, ...]:
  """The GPU backends for an `[M, K]` activation and an `[N, K]` weight, best first (measured,
  above)."""
  order = _dispatch.GPU_ORDER
  if m < MOSAIC_MIN_M or n % 64:
    return order
  block_n = mosaic_gpu.heuristics(m, n, k).block_n
  return ("mosaic_gpu", *order) if mosaic_gpu.tiles(m, n, block_n) >= MOSAIC_MIN_TILES else order


def fp8_matmul(a: jax.Array | QuantizedActivation, weight: jax.Array, weight_scale: jax.Array, *,
               out_dtype=jnp.bfloat16, implementation: str | Sequence[str] | None = None,
               config: pallas.Config | None = None, ue8m0: bool = False) -> jax.Array:
  """`a [..., K]` times `weight [N, K]`^T with DeepSeek block scales -> `[..., N]`.

  Steps:
    1. If `a` is an array (bf16/f16/f32), quantise it per 1 x 128 group to the weight's FP8
       format (`group_quant`; power-of-two scales with `ue8m0`); a `QuantizedActivation`
       (with or without `hp`) is used as is after checking its group size (must be 128),
       layout and dtype.
    2. For each K block of 128: fp8 dot in f32, times the activation row's scale and the
       weight block's scale (`weight_scale` multiplies the dequantised block, the HF
       `weight_scale_inv` convention); accumulate in f32.
    3. Cast to `out_dtype` (bf16).

  Args:
    a: `[..., K]` array or QuantizedActivation (`q [..., K]`, scale per layout).
    weight: `[N, K]` float8_e4m3fn or float8_e4m3fnuz; any N, K.
    weight_scale: `[ceil(N/128), ceil(K/128)]` float32.
    implementation: "triton", "pallas", "mosaic_gpu" (Hopper), "xla", a sequence tried in
      order, or None (`gpu_order(M, N, K)` on a GPU, else XLA).
    config: tiling: `pallas.Config` (Pallas and Triton; default `pallas.heuristics` /
      `triton.heuristics`, by M and device) or `mosaic_gpu.Config`.
  """
  n, k = _check_weight(weight, weight_scale)
  # An `implementations` override counts as passed here, so it reaches the quantisation too.
  implementation = _dispatch.requested("fp8_matmul", implementation)
  qa = _quantized(a, weight, k, implementation, ue8m0)

  def xla():
    return reference.fp8_matmul(qa, weight, weight_scale, out_dtype)

  def tiled(kernels, heuristics):
    def run():
      m = _common.rows(qa.q)
      if m == 0:
        return xla()
      _check_kernel(weight, config, kernels)
      a2 = qa.flatten()
      out = kernels.fp8_matmul(a2.q, a2.scale, a2.layout, weight, weight_scale,
                               config or heuristics(m, n, k), out_dtype)
      return _common.unflat(out, qa.q.shape[:-1])
    return run

  backends = {"pallas": tiled(pallas, pallas.heuristics),
              "triton": tiled(triton, triton.heuristics),
              "mosaic_gpu": tiled(mosaic_gpu, lambda m, n, k: mosaic_gpu.heuristics(m, n, k,
                                                                                  out_dtype)),
              "xla": xla}
  return dispatch("fp8_matmul", backends, implementation,
                  gpu_order=gpu_order(_common.rows(qa.q), n, k))


def grouped_fp8_matmul(a: jax.Array | QuantizedActivation, weight: jax.Array,
                       weight_scale: jax.Array, ids: jax.Array | None = None, *,
                       out_dtype=jnp.bfloat16,
                       implementation: str | Sequence[str] | None = None,
                       config: pallas.Config | None = None, ue8m0: bool = False) -> jax.Array:
  """B block-scaled products in one call, for MoE experts: `out[b] = a[b // (B/G)] @ W[ids[b]]^T`.

  Steps: as `fp8_matmul`, for every product b. The Triton and Pallas kernels run all B in one
  launch and read each expert's weight in place; Mosaic GPU and XLA gather `weight[ids]` (a
  copy) and map `fp8_matmul` over the products.

  Args:
    a: `[G, ..., K]` array or QuantizedActivation (row or col scales; `hp` is not used).
    weight: `[E, N, K]` fp8, E experts; weight_scale `[E, ceil(N/128), ceil(K/128)]` f32.
    ids: `[B]` integer expert of each product, G dividing B, consecutive products sharing an
      activation group (decode: token m's k experts are products m*k .. m*k+k-1). None: B = E
      and product b uses expert b (every expert on its group of `a`). A product whose id lies
      outside [0, E) is zero in every implementation (the kernels read a clamped id, the
      product is then masked); concrete ids are checked and raise, traced ones under
      `jfusedq.debug_checks()`.
    implementation, config, ue8m0: as for `fp8_matmul` (the config tiles each product).
  Returns:
    `[B, ..., N]` in out_dtype.
  """
  n, k = _check_weight(weight, weight_scale, stacked=True)
  e = weight.shape[0]
  if ids is not None and (ids.ndim != 1 or not jnp.issubdtype(ids.dtype, jnp.integer)):
    raise InputError(f"ids must be a [B] integer array, got {ids.dtype}{list(ids.shape)}")
  b = e if ids is None else ids.shape[0]
  valid = None
  if ids is not None:
    check_range("ids", ids, 0, e)
    ids, valid = _common.expert_ids(ids, e)
  implementation = _dispatch.requested("grouped_fp8_matmul", implementation)
  qa = _quantized(a, weight, k, implementation, ue8m0, "row")
  if qa.q.ndim < 2:
    raise InputError(f"a must be [G, ..., K], got shape {qa.q.shape}")
  g, *lead, _ = qa.q.shape
  if g == 0 or b % g:
    raise InputError(f"a has {g} activation groups, which do not divide the {b} products (ids "
                     f"or the experts)")
  m = math.prod(lead)
  a3 = qa.with_layout("row").unflatten((g, m))
  q3, s3 = a3.q, a3.scale

  def per_product(impl):
    def run():
      w, ws = (weight, weight_scale) if ids is None else (weight[ids], weight_scale[ids])
      one = lambda q, s, w, ws: fp8_matmul(QuantizedActivation(q, s), w, ws,
                                           out_dtype=out_dtype, implementation=impl,
                                           config=config)
      # Over groups, then over the products sharing a group's activation (not repeated).
      per_group = jax.vmap(jax.vmap(one, in_axes=(None, None, 0, 0)))
      split = lambda t: t.reshape(g, b // g, *t.shape[1:])
      return per_group(q3, s3, split(w), split(ws)).reshape(b, m, n)
    return run

  def in_place(kernels):
    def run():
      if m == 0:
        return per_product("xla")()
      _check_kernel(weight, config, kernels)
      cfg = config or kernels.heuristics(m, n, k, batch=b)
      return kernels.grouped_fp8_matmul(q3, s3, "row", weight, weight_scale, ids, cfg,
                                        out_dtype)
    return run

  backends = {"triton": in_place(triton), "pallas": in_place(pallas),
              "mosaic_gpu": per_product("mosaic_gpu"), "xla": per_product("xla")}
  out = dispatch("grouped_fp8_matmul", backends, implementation)
  if valid is not None:
    out = jnp.where(valid[:, None, None], out, jnp.zeros((), out.dtype))
  return out.reshape(b, *lead, n)


def _check_kernel(weight, config, kernels) -> None:
  if weight.dtype == E4M3FNUZ and _target.current().platform == "cuda":
    raise Unsupported("NVIDIA tensor cores have no float8_e4m3fnuz dot; use e4m3fn weights "
                      "there, or implementation='xla'")
  if config is not None and not isinstance(config, kernels.Config):
    raise Unsupported(f"config is a {type(config).__module__}.Config, not this kernel's")


def _check_weight(weight, weight_scale, stacked: bool = False) -> tuple[int, int]:
  _common.check_array("weight", weight)
  _common.check_array("weight_scale", weight_scale)
  if weight.ndim != 2 + stacked:
    raise InputError(f"weight must be {'[E, N, K]' if stacked else '[N, K]'}, got shape "
                     f"{weight.shape}")
  if jnp.dtype(weight.dtype) not in (E4M3FN, E4M3FNUZ):
    raise DTypeError(f"weight must be float8_e4m3fn or float8_e4m3fnuz, got {weight.dtype}")
  *lead, n, k = weight.shape
  if n == 0 or k == 0:
    raise InputError(f"weight has an empty axis (shape {tuple(weight.shape)}): N and K need >= 1")
  want = (*lead, -(-n // BLOCK), -(-k // BLOCK))
  if weight_scale.dtype != jnp.float32:
    raise DTypeError(f"weight_scale must be float32, got {weight_scale.dtype}")
  if tuple(weight_scale.shape) != want:
    raise InputError(f"weight_scale shape {tuple(weight_scale.shape)} does not match weight "
                     f"{tuple(weight.shape)} in {BLOCK}x{BLOCK} blocks: want {want}")
  return n, k


def _quantized(a, weight, k, implementation, ue8m0, layout=None) -> QuantizedActivation:
  """`a` checked, or quantised with its scales in `layout` (None: `scale_layout` of its rows)."""
  if isinstance(a, QuantizedActivation):
    a.validate()
    _common.check_last_axis("a.q", a.q, "contracted axis K")
    if a.group_size != BLOCK:
      raise InputError(f"a (a QuantizedActivation) is quantised with group_size="
                       f"{a.group_size}; the block-scaled GEMM needs {BLOCK}")
    if a.q.dtype != weight.dtype:
      raise DTypeError(f"a: activation is {a.q.dtype} but the weight is {weight.dtype}; "
                       f"the codes must be in the weight's format")
  else:
    _common.check_array("a", a)
    _common.check_float("a", a)
    _common.check_last_axis("a", a, "contracted axis K")
    # The GEMM's backend choice carries to its quantisation step, which may still fall back
    # to XLA for a width its kernel cannot tile (the GEMM itself takes any K). Mosaic GPU has
    # no quantisation kernel: Pallas quantises for it.
    if isinstance(implementation, str):
      implementation = (implementation, "xla")
    if implementation is not None:
      implementation = tuple(dict.fromkeys({"mosaic_gpu": "pallas"}.get(i, i)
                                           for i in implementation))
    a = group_quant(a, group_size=BLOCK, fmt=activation_format(weight.dtype), ue8m0=ue8m0,
                    layout=layout or scale_layout(_common.rows(a)),
                    implementation=implementation)
  if a.q.shape[-1] != k:
    raise InputError(f"a has K = {a.q.shape[-1]}, which does not match the weight's K = {k}")
  return a


def activation_format(dtype) -> Fp8Format:
  """The format a bf16 activation is quantised to against an fp8 weight of `dtype`."""
  return Fp8Format.e4m3fn() if jnp.dtype(dtype) == E4M3FN else Fp8Format.e4m3fnuz()
