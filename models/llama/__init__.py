"""Llama-family decoder (Llama 2/3 without rope scaling, SmolLM2) on jfusedq's fused norm + FP8
path.

  config.py    LlamaConfig (from a Hugging Face config.json or GGUF metadata)
  layers.py    the decoder layer: prepare steps, GQA attention with RoPE, SwiGLU MLP (a decode
               step's data path)
  model.py     LlamaForCausalLM: embedding, layers, final norm, LM head (or the tied embedding)
  sharding.py  tensor-parallel partition and cache specs
  loading.py   from_pretrained: Hugging Face safetensors checkpoints and GGUF files
  gguf.py      GGUF tensors in Hugging Face names and layout, and the GGUF's BPE tokenizer
"""

from models.llama.config import MODEL_TYPES, LlamaConfig
from models.llama.layers import Attention, DecoderLayer
from models.llama.loading import from_pretrained, from_tensors
from models.llama.model import LlamaForCausalLM

__all__ = ["MODEL_TYPES", "Attention", "DecoderLayer", "LlamaConfig", "LlamaForCausalLM",
           "from_pretrained", "from_tensors"]
