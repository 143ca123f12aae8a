"""Loading DeepSeek-V3 from a Hugging Face checkpoint directory (config.json + safetensors)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jfusedq.checkpoint import Checkpoint, load_array, load_experts, load_linear
from jfusedq.fp8 import Fp8Format
from jfusedq.nn import Fp8Linear, RMSNorm, StackedLinear
from models.common import check_loaded, checkpoint_quant, set_param
from models.common.layers import Impl
from models.common.loading import open_checkpoint, report_unread
from models.common.moe import Experts
from models.common.sharding import Where, param_shardings
from models.deepseek_v3.config import MODEL_TYPES, DeepseekV3Config
from models.deepseek_v3.layers import MLP
from models.deepseek_v3.model import DeepseekV3ForCausalLM


def _load_proj(layer, ckpt: Checkpoint, names: Sequence[str], fmt, shard: Where) -> None:
  """Fills a Linear / Fp8Linear from HF projection(s) `names` (concatenated along N)."""
  k = layer.weight.get_value().shape[1]
  where = "+".join(ckpt.prefix + n for n in names)
  if isinstance(layer, Fp8Linear):
    w, s = load_linear(ckpt, names, in_features=k, out_features=layer.out_features, fmt=fmt,
                       sharding=shard(layer.weight))
    set_param(layer.weight, w, where + ".weight")
    set_param(layer.weight_scale_inv, s, where + ".weight_scale_inv")
  else:
    n, dt = layer.weight.get_value().shape[0], layer.weight.get_value().dtype
    w, _ = load_linear(ckpt, names, in_features=k, out_features=n, dtype=dt,
                       sharding=shard(layer.weight))
    set_param(layer.weight, w, where + ".weight")


def _load_norm(norm: RMSNorm, ckpt: Checkpoint, name: str, shard: Where) -> None:
  w = norm.weight.get_value()
  set_param(norm.weight, load_array(ckpt, f"{name}.weight", w.shape, w.dtype,
                                    shard(norm.weight)), ckpt.prefix + name)


def _load_mlp(mlp: MLP, ckpt: Checkpoint, fmt, shard: Where) -> None:
  for p in ("gate_proj", "up_proj", "down_proj"):
    _load_proj(getattr(mlp, p), ckpt, [p], fmt, shard)


def _load_experts(experts: Experts, ckpt: Checkpoint, num: int, fmt, shard: Where) -> None:
  for p in ("gate_proj", "up_proj", "down_proj"):
    layer: StackedLinear = getattr(experts, p)
    _, n, k = layer.weight.get_value().shape
    w, s = load_experts(ckpt, [f"{e}.{p}" for e in range(num)], in_features=k, out_features=n,
                        fmt=None if layer.fmt is None else fmt,
                        dtype=layer.weight.get_value().dtype, sharding=shard(layer.weight))
    where = f"{ckpt.prefix}{{0..{num - 1}}}.{p}"
    set_param(layer.weight, w, where + ".weight")
    if s is not None:
      set_param(layer.weight_scale_inv, s, where + ".weight_scale_inv")


def load_weights(model: DeepseekV3ForCausalLM, ckpt: Checkpoint,
                 mesh: Mesh | None = None) -> None:
  """Fills every parameter of `model` from a Hugging Face DeepSeek-V3 checkpoint.

  Projections are taken as stored (FP8 + weight_scale_inv) or quantised / cast to what the
  model holds; q_a_proj and kv_a_proj_with_mqa are concatenated into the fused projection;
  experts are stacked. Errors name the tensor. Tensors the model does not use (DeepSeek-V3's
  multi-token-prediction layer) are ignored. With `mesh`, parameters are placed on it, each
  process reading only the slices its devices hold (as `from_pretrained`).
  """
  cfg, quant = model.cfg, model.opts.quant
  fmt = None if quant is None else quant.fmt
  shard = param_shardings(model, mesh)
  c = ckpt.scope("model.")
  emb = model.embed_tokens.weight
  set_param(emb, load_array(c, "embed_tokens.weight", emb.get_value().shape,
                            emb.get_value().dtype, shard(emb)), "model.embed_tokens.weight")
  for i, layer in enumerate(model.layers):
    lc = c.scope(f"layers.{i}.")
    _load_norm(layer.input_layernorm, lc, "input_layernorm", shard)
    _load_norm(layer.post_attention_layernorm, lc, "post_attention_layernorm", shard)
    a, ac = layer.self_attn, lc.scope("self_attn.")
    _load_proj(a.fused_qkv_a_proj_with_mqa, ac, ["q_a_proj", "kv_a_proj_with_mqa"], fmt, shard)
    for p in ("q_b_proj", "kv_b_proj", "o_proj"):
      _load_proj(getattr(a, p), ac, [p], fmt, shard)
    _load_norm(a.q_a_layernorm, ac, "q_a_layernorm", shard)
    _load_norm(a.kv_a_layernorm, ac, "kv_a_layernorm", shard)
    mc = lc.scope("mlp.")
    if layer.is_moe:
      g = layer.mlp.gate
      e, h = cfg.n_routed_experts, cfg.hidden_size
      set_param(g.weight, load_array(mc, "gate.weight", (e, h), jnp.float32, shard(g.weight)),
                mc.prefix + "gate.weight")
      set_param(g.e_score_correction_bias,
                load_array(mc, "gate.e_score_correction_bias", (e,), jnp.float32,
                           shard(g.e_score_correction_bias)),
                mc.prefix + "gate.e_score_correction_bias")
      _load_experts(layer.mlp.experts, mc.scope("experts."), e, fmt, shard)
      if layer.mlp.shared_experts is not None:
        _load_mlp(layer.mlp.shared_experts, mc.scope("shared_experts."), fmt, shard)
    else:
      _load_mlp(layer.mlp, mc, fmt, shard)
  _load_norm(model.norm, c, "norm", shard)
  head = "lm_head" if "lm_head.weight" in ckpt or not cfg.tie_word_embeddings else None
  if head is None:  # tied: the output projection is the embedding matrix
    model.lm_head.weight.set_value(model.embed_tokens.weight.get_value()
                                   .astype(model.lm_head.weight.get_value().dtype))
  else:
    _load_proj(model.lm_head, ckpt, [head], None, shard)
  check_loaded(model)


def from_pretrained(path: str | os.PathLike, *, fp8: bool | None = None,
                    fmt: Fp8Format | str | None = None, fused: bool | Sequence[bool] = True,
                    tp_axis: str | None = None, ar_strategy: str | Sequence[str] | None = None,
                    dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, implementation: Impl = None,
                    mesh: Mesh | None = None) -> DeepseekV3ForCausalLM:
  """Loads a Hugging Face DeepSeek-V3 checkpoint directory (config.json + safetensors).

  Args:
    fp8: None: FP8 iff config.json has a `quantization_config` (DeepSeek's FP8 release);
      True: FP8, quantising high-precision weights on load (128 x 128 blocks); False: the
      unquantised path (FP8 weights dequantised to param_dtype).
    fmt: FP8 format (default: the device's; e4m3fn checkpoints are converted for e4m3fnuz).
    fused, tp_axis, ar_strategy, dtype, param_dtype, implementation: as for
      `DeepseekV3ForCausalLM`.
    mesh: parameters are placed on it, split over `tp_axis` as `tp_apply` splits them, each
      process reading only the slices its devices hold.
  Raises CheckpointError subclasses naming the tensor at fault.
  """
  ckpt = open_checkpoint(path, MODEL_TYPES, "models.deepseek_v3.from_pretrained")
  cfg = DeepseekV3Config.from_hf(ckpt.config)
  quant = checkpoint_quant(ckpt.config.get("quantization_config"), fp8, fmt)
  model = nnx.eval_shape(lambda: DeepseekV3ForCausalLM(
      cfg, fp8=quant or False, fused=fused, tp_axis=tp_axis, ar_strategy=ar_strategy,
      dtype=dtype, param_dtype=param_dtype, implementation=implementation, rngs=nnx.Rngs(0)))
  load_weights(model, ckpt, mesh)
  report_unread(ckpt)
  return model
