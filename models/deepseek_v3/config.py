"""DeepSeek-V3's configuration: the fields of a Hugging Face DeepseekV3Config this model uses."""

from __future__ import annotations

import dataclasses
import os

from jfusedq.checkpoint import ConfigError, read_config
from models.common.loading import require_keys

MODEL_TYPES = ("deepseek_v3",)
# config.json keys that fix the model's sizes: the dataclass defaults are DeepSeek-V3's, and a
# config without them would silently build V3's shapes.
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
            "num_hidden_layers", "num_attention_heads", "n_routed_experts", "kv_lora_rank",
            "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "num_experts_per_tok")

@dataclasses.dataclass(frozen=True)
class YarnScaling:
  """YaRN RoPE scaling (HF `rope_scaling` / `rope_parameters` with type "yarn")."""

  factor: float
  original_max_position_embeddings: int
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float = 1.0
  mscale_all_dim: float = 0.0
  attention_factor: float | None = None
  truncate: bool = True


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config:
  """The fields of a Hugging Face DeepseekV3Config this model uses (defaults: DeepSeek-V3)."""

  vocab_size: int = 129280
  hidden_size: int = 7168
  intermediate_size: int = 18432
  moe_intermediate_size: int = 2048
  num_hidden_layers: int = 61
  num_attention_heads: int = 128
  num_key_value_heads: int = 128
  n_shared_experts: int = 1
  n_routed_experts: int = 256
  routed_scaling_factor: float = 2.5
  kv_lora_rank: int = 512
  q_lora_rank: int = 1536
  qk_rope_head_dim: int = 64
  v_head_dim: int = 128
  qk_nope_head_dim: int = 128
  n_group: int = 8
  topk_group: int = 4
  num_experts_per_tok: int = 8
  first_k_dense_replace: int = 3
  norm_topk_prob: bool = True
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: YarnScaling | None = None
  rope_interleave: bool = True
  max_position_embeddings: int = 4096
  tie_word_embeddings: bool = False
  hidden_act: str = "silu"
  # config.json's quantization_config, as read (compare=False keeps the config hashable).
  quantization_config: dict | None = dataclasses.field(default=None, compare=False)

  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @classmethod
  def from_hf(cls, d: dict) -> DeepseekV3Config:
    """From a Hugging Face config.json dict (transformers 4.x `rope_scaling` + `rope_theta`, or
    5.x `rope_parameters`)."""
    require_keys(d, REQUIRED, "DeepSeek-V3")
    names = {f.name for f in dataclasses.fields(cls)} - {"rope_scaling", "rope_theta"}
    kw = {k: d[k] for k in names if d.get(k) is not None}
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    kw["rope_theta"] = float(rope.get("rope_theta") or d.get("rope_theta") or 10000.0)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "yarn":
      factor = rope.get("factor")
      orig = rope.get("original_max_position_embeddings") or d.get("max_position_embeddings")
      if factor is None:  # HF: the ratio of the context lengths when no factor is given
        factor = d["max_position_embeddings"] / orig
      fields = {f.name for f in dataclasses.fields(YarnScaling)}
      extra = {k: v for k, v in rope.items() if k in fields and v is not None}
      kw["rope_scaling"] = YarnScaling(**{**extra, "factor": float(factor),
                                          "original_max_position_embeddings": int(orig)})
    elif kind not in ("default", None):
      raise NotImplementedError(f"rope type {kind!r}: only 'default' and 'yarn' are supported")
    cfg = cls(**kw)
    if cfg.q_lora_rank is None:
      raise NotImplementedError("q_lora_rank=None (DeepSeek-V2-Lite's direct q_proj) is not "
                                "supported")
    if cfg.hidden_act != "silu":
      raise NotImplementedError(f"hidden_act={cfg.hidden_act!r}: only 'silu' is supported")
    if cfg.num_key_value_heads != cfg.num_attention_heads:
      raise NotImplementedError("MLA expands keys per head: num_key_value_heads must equal "
                                "num_attention_heads")
    if cfg.n_routed_experts % cfg.n_group:
      raise ConfigError(f"n_routed_experts={cfg.n_routed_experts} is not divisible by "
                        f"n_group={cfg.n_group}")
    return cfg

  @classmethod
  def from_json(cls, path: str | os.PathLike) -> DeepseekV3Config:
    if os.path.isdir(path):
      path = os.path.join(path, "config.json")
    return cls.from_hf(read_config(path))
