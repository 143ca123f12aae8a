"""Qwen3.5 MoE / Qwen3-Next configuration, from a Hugging Face config.json."""

from __future__ import annotations

import dataclasses

from jfusedq.checkpoint import ConfigError
from models.common.loading import require_keys, rope_parameters

GDN, ATTN = "linear_attention", "full_attention"
MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
# config.json keys with no default: the model's sizes.
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "linear_key_head_dim", "linear_value_head_dim",
            "linear_num_key_heads", "linear_num_value_heads", "num_experts",
            "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")


@dataclasses.dataclass(frozen=True)
class Qwen35Config:
  """Architecture of a Qwen3.5 MoE (`qwen3_5_moe[_text]`) or Qwen3-Next (`qwen3_next`) model."""

  model_type: str
  vocab_size: int
  hidden_size: int
  num_layers: int
  layer_types: tuple[str, ...]
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rotary_dim: int  # head_dim * partial_rotary_factor: rotated leading dims of each head
  rope_theta: float
  conv_kernel: int
  linear_key_head_dim: int
  linear_value_head_dim: int
  linear_num_key_heads: int
  linear_num_value_heads: int
  num_experts: int
  num_experts_per_tok: int
  moe_intermediate_size: int
  shared_expert_intermediate_size: int
  norm_topk_prob: bool = True
  intermediate_size: int = 0  # dense MLP (Qwen3-Next mlp_only_layers)
  mlp_only_layers: tuple[int, ...] = ()
  decoder_sparse_step: int = 1
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False

  def __post_init__(self):
    if len(self.layer_types) != self.num_layers:
      raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} "
                       f"layers")
    bad = sorted(set(self.layer_types) - {GDN, ATTN})
    if bad:
      raise ValueError(f"unknown layer types {bad}; expected {GDN!r} or {ATTN!r}")
    if self.linear_num_value_heads % self.linear_num_key_heads:
      raise ValueError(f"linear_num_value_heads={self.linear_num_value_heads} must be a multiple "
                       f"of linear_num_key_heads={self.linear_num_key_heads}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_attention_heads={self.num_heads} must be a multiple of "
                       f"num_key_value_heads={self.num_kv_heads}")
    if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
      raise ValueError(f"rotary dims {self.rotary_dim} must be even and in (0, {self.head_dim}]")

  @classmethod
  def from_hf(cls, cfg: dict) -> Qwen35Config:
    """From a Hugging Face config.json dict (the VLM `qwen3_5_moe` nests it in `text_config`)."""
    mt = cfg.get("model_type")
    if mt == "qwen3_5_moe":
      if "text_config" not in cfg:
        raise ConfigError("config.json of model_type 'qwen3_5_moe' has no text_config")
      text = dict(cfg["text_config"])
      text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
      return cls.from_hf(dict(text, model_type=text.get("model_type", "qwen3_5_moe_text")))
    if mt not in ("qwen3_5_moe_text", "qwen3_next"):
      raise ConfigError(f"model_type {mt!r} is not a Qwen3.5 MoE / Qwen3-Next model (expected "
                       f"'qwen3_5_moe', 'qwen3_5_moe_text' or 'qwen3_next')")
    require_keys(cfg, REQUIRED, f"model_type {mt!r}")
    if cfg.get("attention_bias"):
      raise ValueError("attention_bias=True is not supported (no released Qwen3.5 uses it)")
    rope = rope_parameters(cfg)
    layers = cfg["num_hidden_layers"]
    interval = cfg.get("full_attention_interval", 4)
    types = cfg.get("layer_types") or [GDN if (i + 1) % interval else ATTN for i in range(layers)]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    return cls(
        model_type=mt, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        num_layers=layers, layer_types=tuple(types), num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"], head_dim=head_dim,
        rotary_dim=int(head_dim * partial),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        conv_kernel=cfg.get("linear_conv_kernel_dim", 4),
        linear_key_head_dim=cfg["linear_key_head_dim"],
        linear_value_head_dim=cfg["linear_value_head_dim"],
        linear_num_key_heads=cfg["linear_num_key_heads"],
        linear_num_value_heads=cfg["linear_num_value_heads"],
        num_experts=cfg["num_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
        moe_intermediate_size=cfg["moe_intermediate_size"],
        shared_expert_intermediate_size=cfg["shared_expert_intermediate_size"],
        # Qwen3.5's router always renormalises the top-k weights; Qwen3-Next reads the flag.
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)) if mt == "qwen3_next" else True,
        intermediate_size=cfg.get("intermediate_size") or 0,
        mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))

  def is_moe(self, i: int) -> bool:
    """Layer i ends in the sparse MoE block (else the dense MLP), as HF decides it."""
    return (i not in self.mlp_only_layers and self.num_experts > 0
            and (i + 1) % self.decoder_sparse_step == 0)
