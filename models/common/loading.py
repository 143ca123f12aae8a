"""Checkpoint-loading helpers shared by the models' `from_pretrained`."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jfusedq.checkpoint import (Checkpoint, CheckpointError, ConfigError, QuantConfig,
                                TensorMismatchError)
from jfusedq.fp8 import Fp8Format
from models.common.sharding import param_names


class UnusedTensorsWarning(UserWarning):
  """A checkpoint holds tensors the model did not load."""


def open_checkpoint(path: str | os.PathLike, model_types: Sequence[str], loader: str
                    ) -> Checkpoint:
  """The checkpoint at `path`, after checking that its config.json exists, is a JSON object
  (`Checkpoint` checks the parse) and names one of `model_types` (what `loader` loads).

  Raises:
    CheckpointError: no such directory or no tensor file; ConfigError: the config.
  """
  ckpt = Checkpoint(path)
  if not os.path.exists(os.path.join(ckpt.path, "config.json")):
    raise ConfigError(f"{ckpt.path} has no config.json: {loader} reads the model's sizes from "
                      f"it (a Hugging Face checkpoint directory holds one)")
  mt = ckpt.config.get("model_type")
  if mt not in model_types:
    raise ConfigError(f"{ckpt.path}/config.json has model_type {mt!r}, but {loader} loads "
                      f"{list(model_types)} (models.registry.from_pretrained picks the loader "
                      f"by model_type)")
  return ckpt


def require_keys(cfg: dict, keys: Sequence[str], what: str) -> None:
  """Raises ConfigError listing the `keys` missing from a config.json dict (for `what`)."""
  missing = [k for k in keys if cfg.get(k) is None]
  if missing:
    raise ConfigError(f"config.json for {what} lacks {missing}: the model's sizes cannot be "
                      f"guessed")


def rope_parameters(cfg: dict) -> dict:
  """A config.json dict's RoPE parameters; raises ValueError unless it asks for SiLU and plain
  (unscaled) RoPE, all that the rotate-half RoPE and SwiGLU MLP of `models.common` compute."""
  if cfg.get("hidden_act", "silu") != "silu":
    raise ValueError(f"hidden_act={cfg['hidden_act']!r}: only silu is supported")
  rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type != "default":
    raise ValueError(f"rope_type={rope_type!r} is not supported (only 'default' RoPE)")
  return rope


def report_unread(ckpt: Checkpoint) -> None:
  """Warns (UnusedTensorsWarning) about tensors no loader read. A warning, not an error: real
  releases carry tensors a model need not run (DeepSeek-V3's multi-token-prediction layer 61,
  rotary caches), and refusing them would refuse the official checkpoints."""
  unread = ckpt.unread()
  if unread:
    warnings.warn(f"{len(unread)} tensor(s) of {ckpt.path} were not loaded (not used by this "
                  f"model): {unread[:8]}{' ...' if len(unread) > 8 else ''}",
                  UnusedTensorsWarning, stacklevel=3)


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
  value = jnp.asarray(value)
  var.set_value(value if value.dtype == dt else value.astype(dt))


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
  return dataclasses.replace(quant, not_converted=tuple(rename(m) for m in quant.not_converted))


def check_loaded(model: nnx.Module) -> None:
  """Raises if a parameter of the abstract model was left unfilled (a loader bug)."""
  missing = [".".join(param_names(p))
             for p, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]
             if isinstance(leaf, jax.ShapeDtypeStruct)]
  if missing:
    raise CheckpointError(f"parameters left unloaded (a loader bug: every parameter should map "
                          f"to a checkpoint tensor): {missing}")
