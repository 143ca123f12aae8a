"""Llama-family configuration, from a Hugging Face config.json or GGUF metadata."""

from __future__ import annotations

import dataclasses

from jfusedq.checkpoint import ConfigError
from models.common.loading import require_keys, rope_parameters

MODEL_TYPES = ("llama",)
# config.json keys with no default: the model's sizes.
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Architecture of a Llama-family decoder (`llama`: Llama 2/3 without rope scaling, SmolLM2)."""

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  rms_norm_eps: float = 1e-5
  tie_word_embeddings: bool = False

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_attention_heads={self.num_heads} must be a multiple of "
                       f"num_key_value_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")

  @classmethod
  def from_hf(cls, cfg: dict) -> LlamaConfig:
    """From a Hugging Face config.json dict."""
    if cfg.get("model_type") != "llama":
      raise ConfigError(f"model_type {cfg.get('model_type')!r} is not a Llama model")
    require_keys(cfg, REQUIRED, "model_type 'llama'")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
      raise ValueError("attention_bias / mlp_bias are not supported (SmolLM2 and Llama 2/3 use "
                       "none)")
    rope = rope_parameters(cfg)
    heads = cfg["num_attention_heads"]
    return cls(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))

  @classmethod
  def from_gguf(cls, meta: dict, *, tied: bool) -> LlamaConfig:
    """From GGUF `llama.*` metadata (key without the `llama.` prefix -> value); `tied`: the file
    has no `output.weight` (the LM head is the embedding)."""
    heads = meta["attention.head_count"]
    hidden = meta["embedding_length"]
    return cls(
        vocab_size=meta["vocab_size"], hidden_size=hidden,
        intermediate_size=meta["feed_forward_length"], num_layers=meta["block_count"],
        num_heads=heads, num_kv_heads=meta.get("attention.head_count_kv", heads),
        head_dim=meta.get("attention.key_length", hidden // heads),
        rope_theta=float(meta.get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta["attention.layer_norm_rms_epsilon"]), tie_word_embeddings=tied)
