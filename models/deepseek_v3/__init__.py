"""DeepSeek-V3 (MLA attention + DeepSeekMoE) on jfusedq's fused norm + FP8 path.

  config.py    DeepseekV3Config (from a Hugging Face config.json)
  rope.py      default / YaRN rotary embedding
  layers.py    the decoder layer: prepare steps, MLA, MoE (a decode step's data path)
  model.py     DeepseekV3ForCausalLM: embedding, layers, final norm, LM head
  sharding.py  tensor-parallel partition specs
  loading.py   from_pretrained
"""

from models.deepseek_v3.config import MODEL_TYPES, DeepseekV3Config, YarnScaling
from models.deepseek_v3.layers import MLA, MLP, DecoderLayer, KVCache, MoE, Router
from models.deepseek_v3.loading import from_pretrained, load_weights
from models.deepseek_v3.model import DeepseekV3ForCausalLM

__all__ = [
    "MLA", "MLP", "MODEL_TYPES", "DecoderLayer", "DeepseekV3Config", "DeepseekV3ForCausalLM",
    "KVCache", "MoE", "Router", "YarnScaling", "from_pretrained", "load_weights",
]
