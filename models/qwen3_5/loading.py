"""Loading Qwen3.5 MoE / Qwen3-Next from a Hugging Face checkpoint directory."""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jfusedq.checkpoint import (Checkpoint, MissingTensorError, lazy, load_array, load_experts,
                                load_linear)
from jfusedq.checkpoint.linear import FLOATS
from jfusedq.fp8 import Fp8Format
from jfusedq.nn import Fp8Linear
from models.common import check_loaded, checkpoint_quant, set_param
from models.common.layers import Impl
from models.common.loading import open_checkpoint, report_unread
from models.common.sharding import param_shardings
from models.qwen3_5.config import GDN, MODEL_TYPES, Qwen35Config
from models.qwen3_5.layers import MLP, Attention, GatedDeltaNet, SparseMoe
from models.qwen3_5.model import Qwen35ForCausalLM


def _grouped_rows(cfg: Qwen35Config) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Row permutations from Qwen3.5's layouts to the key-head-grouped one.

  Returns (qkvz, conv, ba): indices into concat(in_proj_qkv, in_proj_z) rows, into the conv
  channels [q_all | k_all | v_all], and into concat(in_proj_b, in_proj_a) rows.
  """
  dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
  hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
  r, kd, vd = hv // hk, hk * dk, hv * dv
  qkvz, conv, ba = [], [], []
  for g in range(hk):
    q = np.arange(g * dk, (g + 1) * dk)
    k = kd + q
    v = 2 * kd + np.arange(g * r * dv, (g + 1) * r * dv)
    z = 2 * kd + vd + np.arange(g * r * dv, (g + 1) * r * dv)
    qkvz += [q, k, v, z]
    conv += [q, k, v]
    ba += [np.arange(g * r, (g + 1) * r), hv + np.arange(g * r, (g + 1) * r)]
  return np.concatenate(qkvz), np.concatenate(conv), np.concatenate(ba)


class _Loader:
  """Fills an abstract model from a checkpoint, naming the tensor in every error."""

  def __init__(self, ckpt: Checkpoint, model: Qwen35ForCausalLM, mesh: Mesh | None):
    self.ckpt, self.model, self.cfg = ckpt, model, model.cfg
    lm = "model.language_model."
    self.p = lm if f"{lm}embed_tokens.weight" in ckpt else "model."
    self.pdt = model.opts.param_dtype
    self.where = param_shardings(model, mesh)

  def array(self, var, name: str, shape):
    set_param(var, load_array(self.ckpt, name, shape, self.pdt, self.where(var)),
              self.ckpt.prefix + name)

  def linear(self, mod, names, k: int, rows: np.ndarray | None = None) -> None:
    """A projection from one or more checkpoint modules (concatenated along N, then `rows`)."""
    fmt = self.model.opts.quant.fmt if isinstance(mod, Fp8Linear) else None
    w, s = load_linear(self.ckpt, names, in_features=k, fmt=fmt, dtype=self.pdt, rows=rows,
                       sharding=self.where(mod.weight))
    label = "+".join(names) if isinstance(names, (list, tuple)) else names
    set_param(mod.weight, w, label)
    if s is not None:
      set_param(mod.weight_scale_inv, s, label + " (weight_scale_inv)")

  def experts(self, moe: SparseMoe, base: str) -> None:
    e, h = self.cfg.num_experts, self.cfg.hidden_size
    inter = self.cfg.moe_intermediate_size
    mods = {"gate_proj": moe.experts.gate_proj, "up_proj": moe.experts.up_proj,
            "down_proj": moe.experts.down_proj}
    fused = f"{base}experts.gate_up_proj"
    if f"{base}experts.0.gate_proj.weight" in self.ckpt:
      for p, mod in mods.items():
        fmt = self.model.opts.quant.fmt if mod.weight_scale_inv is not None else None
        w, s = load_experts(self.ckpt, [f"{base}experts.{i}.{p}" for i in range(e)],
                            in_features=inter if p == "down_proj" else h, fmt=fmt,
                            dtype=self.pdt, sharding=self.where(mod.weight))
        set_param(mod.weight, w, f"{base}experts.*.{p}")
        if s is not None:
          set_param(mod.weight_scale_inv, s, f"{base}experts.*.{p} (weight_scale_inv)")
    elif fused in self.ckpt:
      # HF Qwen3_5MoeExperts: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].
      stored = lambda name, shape: lazy.F32(self.ckpt.tensor(name, shape=shape, dtype=FLOATS))
      gu = stored(fused, (e, 2 * inter, h))
      dn = stored(f"{base}experts.down_proj", (e, h, inter))
      ex = moe.experts
      for mod, w, name in ((ex.gate_proj, lazy.Take(gu, np.arange(inter), 1), fused),
                           (ex.up_proj, lazy.Take(gu, np.arange(inter, 2 * inter), 1), fused),
                           (ex.down_proj, dn, f"{base}experts.down_proj")):
        if mod.weight_scale_inv is None:
          set_param(mod.weight, lazy.place(w, self.pdt, self.where(mod.weight)),
                    self.ckpt.prefix + name)
        else:
          fmt = self.model.opts.quant.fmt
          q, s = lazy.place_fp8(lazy.StackFp8([lazy.Quantized(lazy.Pick(w, i), fmt)
                                               for i in range(e)]), self.where(mod.weight))
          set_param(mod.weight, q, self.ckpt.prefix + name)
          set_param(mod.weight_scale_inv, s, self.ckpt.prefix + name + " (scales)")
    else:
      raise MissingTensorError(
          f"experts of {self.ckpt.prefix}{base[:-1]} are missing from {self.ckpt.path}: neither "
          f"per-expert '{self.ckpt.prefix}{base}experts.0.gate_proj.weight' nor fused "
          f"'{self.ckpt.prefix}{fused}'")

  def gdn(self, m: GatedDeltaNet, base: str) -> None:
    cfg, h = self.cfg, self.cfg.hidden_size
    hv, c = cfg.linear_num_value_heads, m.conv_weight.shape[0]
    qkvz_rows, conv_rows, ba_rows = _grouped_rows(cfg)
    if cfg.model_type == "qwen3_next":  # checkpoint already in the grouped layout
      self.linear(m.in_proj_qkvz, base + "in_proj_qkvz", h)
      self.linear(m.in_proj_ba, base + "in_proj_ba", h)
    else:
      self.linear(m.in_proj_qkvz, [base + "in_proj_qkv", base + "in_proj_z"], h, qkvz_rows)
      self.linear(m.in_proj_ba, [base + "in_proj_b", base + "in_proj_a"], h, ba_rows)
    conv = self.ckpt.tensor(base + "conv1d.weight", shape=(c, 1, cfg.conv_kernel), dtype=FLOATS)
    conv = lazy.Take(lazy.Pick(conv, 0, axis=1), conv_rows)
    set_param(m.conv_weight, lazy.place(conv, self.pdt, self.where(m.conv_weight)),
              self.ckpt.prefix + base + "conv1d.weight")
    # A_log and dt_bias keep f32 (released checkpoints store them so).
    for var, n in ((m.A_log, "A_log"), (m.dt_bias, "dt_bias")):
      set_param(var, load_array(self.ckpt, base + n, (hv,), jnp.float32, self.where(var)),
                self.ckpt.prefix + base + n)
    self.array(m.norm_weight, base + "norm.weight", (cfg.linear_value_head_dim,))
    self.linear(m.out_proj, base + "out_proj", hv * cfg.linear_value_head_dim)

  def attention(self, m: Attention, base: str) -> None:
    cfg, h = self.cfg, self.cfg.hidden_size
    for p in ("q_proj", "k_proj", "v_proj"):
      self.linear(getattr(m, p), base + p, h)
    self.linear(m.o_proj, base + "o_proj", cfg.num_heads * cfg.head_dim)
    self.array(m.q_norm.weight, base + "q_norm.weight", (cfg.head_dim,))
    self.array(m.k_norm.weight, base + "k_norm.weight", (cfg.head_dim,))

  def mlp(self, m: MLP, base: str, inter: int) -> None:
    h = self.cfg.hidden_size
    self.linear(m.gate_proj, base + "gate_proj", h)
    self.linear(m.up_proj, base + "up_proj", h)
    self.linear(m.down_proj, base + "down_proj", inter)

  def load(self) -> None:
    cfg, model, h = self.cfg, self.model, self.cfg.hidden_size
    top, self.ckpt = self.ckpt, self.ckpt.scope(self.p)
    self.array(model.embed_tokens.weight, "embed_tokens.weight", (cfg.vocab_size, h))
    self.array(model.norm.weight, "norm.weight", (h,))
    for i, layer in enumerate(model.layers):
      base = f"layers.{i}."
      self.array(layer.input_layernorm.weight, base + "input_layernorm.weight", (h,))
      self.array(layer.post_attention_layernorm.weight, base + "post_attention_layernorm.weight",
                 (h,))
      if layer.kind == GDN:
        self.gdn(layer.mixer, base + "linear_attn.")
      else:
        self.attention(layer.mixer, base + "self_attn.")
      if isinstance(layer.mlp, SparseMoe):
        moe = layer.mlp
        self.linear(moe.gate, base + "mlp.gate", h)
        self.experts(moe, base + "mlp.")
        self.mlp(moe.shared_expert, base + "mlp.shared_expert.",
                 cfg.shared_expert_intermediate_size)
        self.linear(moe.shared_expert_gate, base + "mlp.shared_expert_gate", h)
      else:
        self.mlp(layer.mlp, base + "mlp.", cfg.intermediate_size)
    self.ckpt = top
    if model.lm_head is not None:
      self.linear(model.lm_head, "lm_head", h)


def _text_name(module: str) -> str:
  """A `modules_to_not_convert` entry in text-model names: the VLM checkpoints name modules
  `model.language_model.layers...`; this model's names are `model.layers...`."""
  for prefix in ("model.language_model.", "language_model."):
    if module.startswith(prefix):
      return "model." + module[len(prefix):]
  return module


def from_pretrained(path: str | os.PathLike, *, fp8: bool | None = None,
                    fmt: Fp8Format | str | None = None, fused: bool | Sequence[bool] = True,
                    tp_axis: str | None = None, ar_strategy: str | Sequence[str] | None = None,
                    dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, implementation: Impl = None,
                    mesh: Mesh | None = None) -> Qwen35ForCausalLM:
  """A model from a Hugging Face checkpoint directory (config.json + safetensors, with or
  without model.safetensors.index.json; text `model.*` or VLM `model.language_model.*` names).

  Args:
    fp8: None: FP8 iff config.json (or its text config) has a `quantization_config`; True:
      FP8 (`fmt`, default the device's): FP8 checkpoint weights with their `weight_scale_inv`
      (f32 or bf16) are kept, high-precision ones quantised on load; modules in
      `quantization_config.modules_to_not_convert` (with or without the VLM prefix) stay high
      precision. False: the unquantised path, every weight dequantised to `param_dtype` (with
      f32 dtypes: the exact comparison with HF).
    fused, tp_axis, ar_strategy, dtype, param_dtype, implementation: as for
      `Qwen35ForCausalLM`.
    mesh: parameters are placed on it, split over `tp_axis` as `tp_apply` splits them, each
      process reading only the slices its devices hold.
  Experts may be stored per expert (`experts.{e}.{gate,up,down}_proj.weight`, as save_pretrained
  and the FP8 releases write) or fused (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`,
  high precision, as the bf16 releases store them).
  Raises CheckpointError subclasses naming the tensor at fault.
  """
  ckpt = open_checkpoint(path, MODEL_TYPES, "models.qwen3_5.from_pretrained")
  cfg = Qwen35Config.from_hf(ckpt.config)
  hf = ckpt.config
  qc = hf.get("quantization_config") or (hf.get("text_config") or {}).get("quantization_config")
  quant = checkpoint_quant(qc, fp8, fmt, rename=_text_name)
  model = nnx.eval_shape(lambda: Qwen35ForCausalLM(
      cfg, fp8=quant or False, fused=fused, tp_axis=tp_axis, ar_strategy=ar_strategy,
      dtype=dtype, param_dtype=param_dtype, implementation=implementation, rngs=nnx.Rngs(0)))
  _Loader(ckpt, model, mesh).load()
  check_loaded(model)
  report_unread(ckpt)
  return model
