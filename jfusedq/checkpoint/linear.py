"""Projection weights from a checkpoint: FP8 block-scaled (DeepSeek format) or high precision."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jfusedq.checkpoint.checkpoint import Checkpoint, CheckpointError, TensorMismatchError
from jfusedq.fp8 import BLOCK, E4M3FN, E4M3FNUZ, Fp8Format, resolve_format
from jfusedq.nn.weights import e4m3fn_to_e4m3fnuz, quantize_weight
from jfusedq.ops.fp8_matmul.reference import dequantize_weight

FLOATS = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32))
FP8 = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e4m3fnuz))


@dataclasses.dataclass(frozen=True)
class QuantConfig:
  """How a model's projections are quantised: FP8 `fmt`, 128 x 128 weight blocks.

  `not_converted`: module names (Hugging Face `modules_to_not_convert`) whose projections stay
  in high precision; a module is excluded when any entry is a substring of its full name, as
  in transformers' FP8 integration.
  """

  fmt: Fp8Format
  not_converted: tuple[str, ...] = ()

  @classmethod
  def from_hf(cls, qc: dict | None, fmt: Fp8Format | str | None = None) -> QuantConfig:
    """From config.json's `quantization_config` (None: quantise everything on load)."""
    fmt = resolve_format(fmt)
    if not qc:
      return cls(fmt)
    method = qc.get("quant_method", "fp8")
    if method != "fp8":
      raise CheckpointError(f"quantization_config.quant_method={method!r}: only DeepSeek-style "
                            f"block FP8 ('fp8') checkpoints are supported")
    block = qc.get("weight_block_size")
    if block is not None and list(block) != [BLOCK, BLOCK]:
      raise CheckpointError(f"quantization_config.weight_block_size={block}: the block-scaled "
                            f"GEMM needs [{BLOCK}, {BLOCK}]")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
      raise CheckpointError(f"quantization_config.activation_scheme="
                            f"{qc['activation_scheme']!r}: activations are quantised dynamically "
                            f"(per 1 x 128 group); static activation scales are not supported")
    return cls(fmt, tuple(qc.get("modules_to_not_convert") or ()))

  def quantizes(self, module: str) -> bool:
    return not any(key in module for key in self.not_converted)


def load_linear(ckpt: Checkpoint, names: str | Sequence[str], *, in_features: int,
                out_features: int | Sequence[int] | None = None, fmt: Fp8Format | None = None,
                dtype=jnp.bfloat16) -> tuple[jax.Array, jax.Array | None]:
  """A projection's weight `[N, K]` (Hugging Face layout), parts concatenated along N.

  Each name `m` reads `m.weight` `[N_i, K]` and, when that is FP8, `m.weight_scale_inv`
  `[ceil(N_i/128), ceil(K/128)]` (f32 in DeepSeek's format; bf16 / f16 read as f32). Several
  names make one fused projection (DeepSeek's q_a_proj + kv_a_proj_with_mqa).

  With `fmt` (FP8 wanted): FP8 parts are kept as stored (e4m3fn codes reinterpreted for an
  e4m3fnuz target with doubled scales, which is exact); high-precision parts are quantised with
  `quantize_weight`. Parts concatenate block-exactly when every part but the last has N_i a
  multiple of 128; otherwise a block would mix two parts' scales, so the whole weight is
  dequantised and quantised again (that changes codes; real DeepSeek sizes never need it).
  Without `fmt`: the weight in `dtype` (FP8 parts dequantised).

  Returns:
    (weight, scale): fp8 `[N, K]` and f32 `[ceil(N/128), ceil(K/128)]`; or (`[N, K]` in dtype,
    None).
  Raises:
    MissingTensorError, TensorMismatchError: naming the tensor.
  """
  names = [names] if isinstance(names, str) else list(names)
  if out_features is None or isinstance(out_features, int):
    outs = [out_features] * len(names) if len(names) == 1 else [None] * len(names)
    total = out_features
  else:
    outs, total = list(out_features), sum(out_features)
    if len(outs) != len(names):
      raise ValueError(f"{len(names)} names but {len(outs)} out_features")
  parts = [_read(ckpt, m, in_features, n) for m, n in zip(names, outs)]
  n = sum(p[0].shape[0] for p in parts)
  if total is not None and n != total:
    raise TensorMismatchError(f"projection {'+'.join(ckpt.prefix + m for m in names)} has "
                              f"{n} output rows in all, expected {total}")
  if fmt is None:
    w = jnp.concatenate([_dense(q, s) for q, s in parts], axis=0)
    return w.astype(dtype), None
  fmt = resolve_format(fmt)
  if all(q.shape[0] % BLOCK == 0 for q, _ in parts[:-1]):
    qs = [_to_format(q, s, fmt) if s is not None else quantize_weight(_dense(q, s), fmt)
          for q, s in parts]
    return (jnp.concatenate([q for q, _ in qs], axis=0),
            jnp.concatenate([s for _, s in qs], axis=0))
  w = jnp.concatenate([_dense(q, s) for q, s in parts], axis=0)
  return quantize_weight(w, fmt)


def _read(ckpt: Checkpoint, module: str, k: int, n: int | None):
  name = f"{module}.weight"
  w = ckpt.get(name, dtype=FLOATS + FP8)
  if w.ndim != 2 or w.shape[1] != k or (n is not None and w.shape[0] != n):
    raise TensorMismatchError(f"tensor {ckpt.prefix + name!r} has shape {list(w.shape)}, "
                              f"expected [{n if n is not None else 'N'}, {k}]")
  if w.dtype in FP8:
    want = (-(-w.shape[0] // BLOCK), -(-k // BLOCK))
    # DeepSeek stores f32 scales; some FP8 releases store bf16 / f16 ones.
    s = ckpt.get(f"{module}.weight_scale_inv", shape=want, dtype=FLOATS)
    check_scales(ckpt.prefix + f"{module}.weight_scale_inv", s)
    return jnp.asarray(w), jnp.asarray(s).astype(jnp.float32)
  return jnp.asarray(w), None


def check_scales(name: str, s) -> None:
  """Weight scales multiply every code of their block: each must be finite and > 0."""
  s = np.asarray(s, np.float32)
  bad = ~(np.isfinite(s) & (s > 0))
  if bad.any():
    at = tuple(int(i) for i in np.argwhere(bad)[0])
    raise TensorMismatchError(f"tensor {name!r} holds {int(bad.sum())} scale(s) that are not "
                              f"finite and > 0 (first at {list(at)}: {s[at]}); scales must be "
                              f"finite and positive")


def _dense(q, s) -> jax.Array:
  return q.astype(jnp.float32) if s is None else dequantize_weight(q, s)


def _to_format(q, s, fmt: Fp8Format):
  have, want = jnp.dtype(q.dtype), jnp.dtype(fmt.dtype)
  if have == want:
    return q, s
  if have == E4M3FN and want == E4M3FNUZ:
    return e4m3fn_to_e4m3fnuz(q, s)
  # An e4m3fnuz checkpoint for an e4m3fn target (rare): quantised again from its values.
  return quantize_weight(dequantize_weight(q, s), fmt)


def load_array(ckpt: Checkpoint, name: str, shape: Sequence[int], dtype) -> jax.Array:
  """A high-precision tensor (norm, embedding, router) checked for `shape`, cast to `dtype`."""
  a = ckpt.get(name, shape=shape, dtype=FLOATS)
  return jnp.asarray(a).astype(dtype)
