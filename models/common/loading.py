"""Checkpoint-loading helpers shared by the models' `from_pretrained`."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jfusedq.checkpoint import CheckpointError, QuantConfig, TensorMismatchError
from jfusedq.fp8 import Fp8Format
from models.common.sharding import param_names


def set_param(var: nnx.Variable, value, name: str) -> None:
  """Fills `var` (of an abstract model) with `value`, cast to its dtype; FP8 codes must come
  as the FP8 dtype the model holds. Errors name the tensor."""
  want = var.get_value()
  if tuple(value.shape) != tuple(want.shape):
    raise TensorMismatchError(f"{name}: loaded shape {list(value.shape)}, model expects "
                              f"{list(want.shape)}")
  dt = want.dtype
  if jnp.dtype(dt).itemsize == 1 and jnp.dtype(value.dtype) != jnp.dtype(dt):
    raise TensorMismatchError(f"{name}: loaded {value.dtype}, model expects {dt}")
  var.set_value(jnp.asarray(value).astype(dt))


def checkpoint_quant(qc: dict | None, fp8: bool | None, fmt: Fp8Format | str | None,
                     rename: Callable[[str], str] = lambda m: m) -> QuantConfig | None:
  """The QuantConfig a checkpoint loads with. `qc`: config.json's `quantization_config`;
  `fp8`: None (FP8 iff the checkpoint is FP8, i.e. has a quantization_config), True (FP8:
  high-precision weights are quantised on load) or False (unquantised: FP8 weights are
  dequantised); `rename` maps `modules_to_not_convert` entries to the model's module names."""
  if fp8 is None:
    fp8 = qc is not None
  if not fp8:
    return None
  quant = QuantConfig.from_hf(qc, fmt)
  return QuantConfig(quant.fmt, tuple(rename(m) for m in quant.not_converted))


def check_loaded(model: nnx.Module) -> None:
  """Raises if a parameter of the abstract model was left unfilled (a loader bug)."""
  missing = [".".join(param_names(p))
             for p, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]
             if isinstance(leaf, jax.ShapeDtypeStruct)]
  if missing:
    raise CheckpointError(f"parameters left unloaded (a loader bug: every parameter should map "
                          f"to a checkpoint tensor): {missing}")
