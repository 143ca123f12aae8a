"""Loading Llama models: Hugging Face checkpoint directories and GGUF files."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jfusedq.checkpoint import (MissingTensorError, QuantConfig, TensorMismatchError, lazy,
                                load_array, load_linear)
from jfusedq.fp8 import Fp8Format
from jfusedq.nn import Fp8Linear
from models.common import check_loaded, checkpoint_quant, set_param
from models.common.layers import Impl
from models.common.loading import open_checkpoint, report_unread
from models.common.sharding import param_shardings
from models.llama import gguf
from models.llama.config import MODEL_TYPES, LlamaConfig
from models.llama.model import LlamaForCausalLM


def _fill(model: LlamaForCausalLM, linear: Callable, array: Callable) -> None:
  """Every parameter of `model` by its Hugging Face name: `linear(module, name, in_features)`
  fills a projection, `array(variable, name, shape)` any other tensor."""
  cfg, h = model.cfg, model.cfg.hidden_size
  array(model.embed_tokens.weight, "model.embed_tokens.weight", (cfg.vocab_size, h))
  array(model.norm.weight, "model.norm.weight", (h,))
  for i, layer in enumerate(model.layers):
    base = f"model.layers.{i}."
    array(layer.input_layernorm.weight, base + "input_layernorm.weight", (h,))
    array(layer.post_attention_layernorm.weight, base + "post_attention_layernorm.weight", (h,))
    attn, mlp = layer.self_attn, layer.mlp
    for p in ("q_proj", "k_proj", "v_proj"):
      linear(getattr(attn, p), base + "self_attn." + p, h)
    linear(attn.o_proj, base + "self_attn.o_proj", cfg.num_heads * cfg.head_dim)
    linear(mlp.gate_proj, base + "mlp.gate_proj", h)
    linear(mlp.up_proj, base + "mlp.up_proj", h)
    linear(mlp.down_proj, base + "mlp.down_proj", cfg.intermediate_size)
  if model.lm_head is not None:
    linear(model.lm_head, "lm_head", h)


def _abstract(cfg: LlamaConfig, quant, **kw) -> LlamaForCausalLM:
  return nnx.eval_shape(lambda: LlamaForCausalLM(cfg, fp8=quant or False, rngs=nnx.Rngs(0),
                                                 **kw))


def _from_checkpoint(path, *, fp8, fmt, mesh, **kw) -> LlamaForCausalLM:
  ckpt = open_checkpoint(path, MODEL_TYPES, "models.llama.from_pretrained")
  cfg = LlamaConfig.from_hf(ckpt.config)
  model = _abstract(cfg, checkpoint_quant(ckpt.config.get("quantization_config"), fp8, fmt),
                    **kw)
  pdt = model.opts.param_dtype
  where = param_shardings(model, mesh)

  def linear(mod, name, k):
    fmt = model.opts.quant.fmt if isinstance(mod, Fp8Linear) else None
    w, s = load_linear(ckpt, name, in_features=k, fmt=fmt, dtype=pdt, sharding=where(mod.weight))
    set_param(mod.weight, w, name)
    if s is not None:
      set_param(mod.weight_scale_inv, s, name + " (weight_scale_inv)")

  def array(var, name, shape):
    set_param(var, load_array(ckpt, name, shape, pdt, where(var)), name)

  _fill(model, linear, array)
  report_unread(ckpt)
  return model


def from_tensors(cfg: LlamaConfig, tensors: Mapping[str, np.ndarray | lazy.Lazy], *,
                 fp8: bool | QuantConfig = False, fmt: Fp8Format | str | None = None,
                 mesh: Mesh | None = None, **kw) -> LlamaForCausalLM:
  """A model from high-precision arrays (or `lazy` tensors) by Hugging Face name and layout
  (what `gguf.tensors` returns), rounded to `param_dtype` masters; with `fp8` (True: the
  device's format, or a QuantConfig) the projections are those masters quantised to FP8
  128 x 128 blocks (`quantize_weight`); with `mesh`, placed on it as `from_pretrained` places
  them, reading lazy tensors only at this process's shards. `kw`: `LlamaForCausalLM`'s
  keywords."""
  quant = fp8 if isinstance(fp8, QuantConfig) else checkpoint_quant(None, fp8, fmt)
  model = _abstract(cfg, quant, **kw)
  pdt = model.opts.param_dtype
  where = param_shardings(model, mesh)

  def master(name, shape) -> lazy.Lazy:
    if name not in tensors:
      raise MissingTensorError(f"{name} is missing")
    w = tensors[name]
    w = w if isinstance(w, lazy.Lazy) else lazy.Host(w)
    if tuple(w.shape) != tuple(shape):
      raise TensorMismatchError(f"{name}: shape {list(w.shape)}, the config implies "
                                f"{list(shape)}")
    return w

  def linear(mod, name, k):
    w = master(name + ".weight", (mod.weight.shape[0], k))
    if isinstance(mod, Fp8Linear):
      q, s = lazy.place_fp8(lazy.Quantized(lazy.Cast(w, pdt), model.opts.quant.fmt),
                            where(mod.weight))
      set_param(mod.weight, q, name)
      set_param(mod.weight_scale_inv, s, name + " (weight_scale_inv)")
    else:
      set_param(mod.weight, lazy.place(w, pdt, where(mod.weight)), name)

  _fill(model, linear, lambda var, name, shape: set_param(
      var, lazy.place(master(name, shape), pdt, where(var)), name))
  check_loaded(model)
  return model


def from_pretrained(path: str | os.PathLike, *, fp8: bool | None = None,
                    fmt: Fp8Format | str | None = None, fused: bool | Sequence[bool] = True,
                    tp_axis: str | None = None, ar_strategy: str | Sequence[str] | None = None,
                    dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, implementation: Impl = None,
                    mesh: Mesh | None = None) -> LlamaForCausalLM:
  """A Llama model from a Hugging Face checkpoint directory (config.json + safetensors) or a
  GGUF file (`*.gguf`, e.g. SmolLM2-135M-Instruct).

  Args:
    fp8: None: FP8 iff the checkpoint is (config.json has a `quantization_config`; a GGUF file
      loads unquantised); True: FP8 (`fmt`, default the device's): FP8 checkpoint weights are
      kept with their scales, high-precision ones quantised on load by `quantize_weight`
      (128 x 128 blocks); False: the unquantised path (FP8 weights dequantised to param_dtype).
    fused, tp_axis, ar_strategy, dtype, param_dtype, implementation: as for `LlamaForCausalLM`.
    mesh: parameters are placed on it, split over `tp_axis` as `tp_apply` splits them, each
      process reading only the slices its devices hold (of a GGUF file: the rows of a
      column-parallel projection, whole rows of the others).

  A GGUF file's weights are quantised in llama.cpp's formats (Q4_1, Q8_0, ...): they are
  dequantised to `param_dtype` masters (bf16 by default; those are what fp8=False runs), and
  with fp8=True those masters are quantised to FP8 blocks, so the FP8 paths and the bf16 path
  share one set of weights. Its q/k rows are put back into Hugging Face's order
  (`gguf.unpermute_rope`), so one rotate-half RoPE serves both sources.
  Raises CheckpointError subclasses naming the tensor at fault.
  """
  kw = dict(fused=fused, tp_axis=tp_axis, ar_strategy=ar_strategy, dtype=dtype,
            param_dtype=param_dtype, implementation=implementation)
  if os.fspath(path).endswith(".gguf"):
    return from_tensors(*gguf.tensors(path), fp8=bool(fp8), fmt=fmt, mesh=mesh, **kw)
  model = _from_checkpoint(path, fp8=fp8, fmt=fmt, mesh=mesh, **kw)
  check_loaded(model)
  return model
