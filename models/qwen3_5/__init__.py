"""Qwen3.5 MoE / Qwen3-Next hybrid decoder (Gated DeltaNet + gated full attention, MoE) on
jfusedq's fused norm + FP8 path.

  config.py    Qwen35Config (from a Hugging Face config.json)
  layers.py    the decoder layer: prepare steps, GatedDeltaNet, Attention, MoE (a decode
               step's data path)
  model.py     Qwen35ForCausalLM: embedding, layers, final norm, LM head
  sharding.py  tensor-parallel partition and cache specs
  loading.py   from_pretrained
"""

from models.qwen3_5.config import ATTN, GDN, MODEL_TYPES, Qwen35Config
from models.qwen3_5.layers import CHUNK, MLP, Attention, DecoderLayer, GatedDeltaNet, SparseMoe
from models.qwen3_5.loading import from_pretrained
from models.qwen3_5.model import Qwen35ForCausalLM


__all__ = [
    "ATTN", "Attention", "CHUNK", "DecoderLayer", "GDN", "GatedDeltaNet", "MLP", "MODEL_TYPES",
    "Qwen35Config", "Qwen35ForCausalLM", "SparseMoe", "from_pretrained",
]
