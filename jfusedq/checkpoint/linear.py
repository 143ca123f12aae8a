"""Projection weights from a checkpoint: FP8 block-scaled (DeepSeek format) or high precision."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jfusedq.checkpoint import lazy
from jfusedq.checkpoint.checkpoint import Checkpoint, CheckpointError, TensorMismatchError
from jfusedq.fp8 import BLOCK, E4M3FN, E4M3FNUZ, Fp8Format, resolve_format

FLOATS = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32))
FP8 = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e4m3fnuz))


@dataclasses.dataclass(frozen=True)
class QuantConfig:
  """How a model's projections are quantised: FP8 `fmt`, 128 x 128 weight blocks.

  `not_converted`: module names (Hugging Face `modules_to_not_convert`) whose projections stay
  in high precision; a module is excluded when any entry is a substring of its full name, as
  in transformers' FP8 integration. `ue8m0`: activation scales rounded up to powers of two
  (DESIGN.md 3.1; `quantization_config.scale_fmt = "ue8m0"`, DeepSeek-V3.1).
  """

  fmt: Fp8Format
  not_converted: tuple[str, ...] = ()
  ue8m0: bool = False

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
    return cls(fmt, tuple(qc.get("modules_to_not_convert") or ()),
               qc.get("scale_fmt") == "ue8m0")

  def quantizes(self, module: str) -> bool:
    return not any(key in module for key in self.not_converted)


def projection(ckpt: Checkpoint, names: str | Sequence[str], *, in_features: int,
               out_features: int | Sequence[int] | None = None, fmt: Fp8Format | None = None,
               rows: np.ndarray | None = None) -> lazy.Lazy | lazy.Fp8:
  """A projection's weight `[N, K]` (Hugging Face layout), parts concatenated along N, then
  rows `rows` (a permutation) taken; lazy: read by slices (`lazy.place` / `lazy.place_fp8`).

  Each name `m` reads `m.weight` `[N_i, K]` and, when that is FP8, `m.weight_scale_inv`
  `[ceil(N_i/128), ceil(K/128)]` (f32 in DeepSeek's format; bf16 / f16 read as f32). Several
  names make one fused projection (DeepSeek's q_a_proj + kv_a_proj_with_mqa).

  With `fmt` (FP8 wanted), an `lazy.Fp8`: FP8 parts are kept as stored (e4m3fn codes
  reinterpreted for an e4m3fnuz target with doubled scales, which is exact); high-precision
  parts are quantised with `quantize_weight`. Parts concatenate block-exactly when every part
  but the last has N_i a multiple of 128, and `rows` moves blocks whole when it maps aligned
  128-row blocks to aligned blocks; otherwise a block would mix two parts' (or rows') scales,
  so the weight is dequantised and quantised again (that changes codes; real DeepSeek sizes
  never need it). Without `fmt`: the dense weight in f32 (FP8 parts dequantised).
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
  parts = [_stored(ckpt, m, in_features, n) for m, n in zip(names, outs)]
  n = sum(p.shape[0] for p in parts)
  if total is not None and n != total:
    raise TensorMismatchError(f"projection {'+'.join(ckpt.prefix + m for m in names)} has "
                              f"{n} output rows in all, expected {total}")
  one = lambda ps, cat: ps[0] if len(ps) == 1 else cat(ps)
  if fmt is None:
    w = one([_dense(p) for p in parts], lazy.Concat)
    return w if rows is None else lazy.Take(w, rows)
  fmt = resolve_format(fmt)
  if all(p.shape[0] % BLOCK == 0 for p in parts[:-1]):
    w = one([_to_format(p, fmt) if isinstance(p, lazy.Fp8) else lazy.Quantized(p, fmt)
             for p in parts], lazy.ConcatFp8)
  else:
    w = lazy.Quantized(lazy.Concat([_dense(p) for p in parts]), fmt)
  if rows is None:
    return w
  blocks = rows.reshape(-1, BLOCK) if rows.size % BLOCK == 0 else None
  if blocks is not None and np.all(blocks[:, 0] % BLOCK == 0) and np.all(
      blocks == blocks[:, :1] + np.arange(BLOCK)):
    return lazy.TakeFp8(w, rows)
  return lazy.Quantized(lazy.Take(lazy.Dequantized(w), rows), fmt)


def load_linear(ckpt: Checkpoint, names: str | Sequence[str], *, in_features: int,
                out_features: int | Sequence[int] | None = None, fmt: Fp8Format | None = None,
                dtype=jnp.bfloat16, rows: np.ndarray | None = None,
                sharding: jax.sharding.Sharding | None = None
                ) -> tuple[jax.Array, jax.Array | None]:
  """A projection's weight as `projection` makes it, read and placed: whole on the default
  device, or on `sharding` (the scales split as the codes), each process reading only the
  slices its devices hold.

  Returns:
    (weight, scale): fp8 `[N, K]` and f32 `[ceil(N/128), ceil(K/128)]`; or (`[N, K]` in dtype,
    None).
  """
  w = projection(ckpt, names, in_features=in_features, out_features=out_features, fmt=fmt,
                 rows=rows)
  return lazy.place_fp8(w, sharding) if fmt is not None else (lazy.place(w, dtype, sharding),
                                                              None)


def load_experts(ckpt: Checkpoint, names: Sequence[str], *, in_features: int,
                 out_features: int | None = None, fmt: Fp8Format | None = None, dtype=jnp.bfloat16,
                 sharding: jax.sharding.Sharding | None = None
                 ) -> tuple[jax.Array, jax.Array | None]:
  """Projections `names` (one per expert, each as `projection`) stacked: `[E, N, K]` and, with
  `fmt`, scales `[E, ceil(N/128), ceil(K/128)]`; placed as by `load_linear`."""
  ws = [projection(ckpt, m, in_features=in_features, out_features=out_features, fmt=fmt)
        for m in names]
  if fmt is not None:
    return lazy.place_fp8(lazy.StackFp8(ws), sharding)
  return lazy.place(lazy.Stack(ws), dtype, sharding), None


def _stored(ckpt: Checkpoint, module: str, k: int, n: int | None) -> lazy.Lazy | lazy.Fp8:
  name = f"{module}.weight"
  w = ckpt.tensor(name, dtype=FLOATS + FP8)
  if len(w.shape) != 2 or w.shape[1] != k or (n is not None and w.shape[0] != n):
    raise TensorMismatchError(f"tensor {ckpt.prefix + name!r} has shape {list(w.shape)}, "
                              f"expected [{n if n is not None else 'N'}, {k}]")
  if w.dtype not in FP8:
    return w
  want = (-(-w.shape[0] // BLOCK), -(-k // BLOCK))
  # DeepSeek stores f32 scales; some FP8 releases store bf16 / f16 ones.
  s = ckpt.tensor(f"{module}.weight_scale_inv", shape=want, dtype=FLOATS)
  # Whole (they are 1 / 16384 of the codes' bytes) so that every process checks every scale.
  check_scales(ckpt.prefix + f"{module}.weight_scale_inv", s.read(lazy.whole(want)))
  return lazy.StoredFp8(w, s)


def check_scales(name: str, s) -> None:
  """Weight scales multiply every code of their block: each must be finite and > 0."""
  s = np.asarray(s, np.float32)
  bad = ~(np.isfinite(s) & (s > 0))
  if bad.any():
    at = tuple(int(i) for i in np.argwhere(bad)[0])
    raise TensorMismatchError(f"tensor {name!r} holds {int(bad.sum())} scale(s) that are not "
                              f"finite and > 0 (first at {list(at)}: {s[at]}); scales must be "
                              f"finite and positive")


def _dense(p: lazy.Lazy | lazy.Fp8) -> lazy.Lazy:
  return lazy.Dequantized(p) if isinstance(p, lazy.Fp8) else lazy.F32(p)


def _to_format(p: lazy.Fp8, fmt: Fp8Format) -> lazy.Fp8:
  have, want = np.dtype(p.dtype), np.dtype(fmt.dtype)
  if have == want:
    return p
  if have == E4M3FN and want == E4M3FNUZ:
    return lazy.Converted(p, fmt)
  # An e4m3fnuz checkpoint for an e4m3fn target (rare): quantised again from its values.
  return lazy.Quantized(lazy.Dequantized(p), fmt)


def load_array(ckpt: Checkpoint, name: str, shape: Sequence[int], dtype,
               sharding: jax.sharding.Sharding | None = None) -> jax.Array:
  """A high-precision tensor (norm, embedding, router) checked for `shape`, cast to `dtype`;
  whole, or on `sharding` reading only this process's shards."""
  return lazy.place(ckpt.tensor(name, shape=shape, dtype=FLOATS), dtype, sharding)
