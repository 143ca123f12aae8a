"""A Llama model's tensors by Hugging Face name, and a GGUF file of them written as llama.cpp's
converter writes one (GGUF names, q/k rows permuted for its interleaved RoPE); the GGUF writer
needs the `gguf` package."""

from __future__ import annotations

import os

import numpy as np

from models import llama
from models.llama import gguf

def tensors(m: llama.LlamaForCausalLM) -> dict[str, np.ndarray]:
  """The model's high-precision parameters by Hugging Face name (f32 numpy)."""
  a = lambda v: np.asarray(v[...], np.float32)
  out = {"model.embed_tokens.weight": a(m.embed_tokens.weight),
         "model.norm.weight": a(m.norm.weight)}
  for i, l in enumerate(m.layers):
    b = f"model.layers.{i}."
    out[b + "input_layernorm.weight"] = a(l.input_layernorm.weight)
    out[b + "post_attention_layernorm.weight"] = a(l.post_attention_layernorm.weight)
    for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
      out[b + f"self_attn.{p}.weight"] = a(getattr(l.self_attn, p).weight)
    for p in ("gate_proj", "up_proj", "down_proj"):
      out[b + f"mlp.{p}.weight"] = a(getattr(l.mlp, p).weight)
  if m.lm_head is not None:
    out["lm_head.weight"] = a(m.lm_head.weight)
  return out


def write_gguf(path: str | os.PathLike, cfg: llama.LlamaConfig, w: dict[str, np.ndarray], *,
               arch: str = "llama") -> str:
  """`w` (Hugging Face names and layout) as the GGUF file `path` of architecture `arch`."""
  import gguf as gg
  layer, top = ({v: k for k, v in m.items()} for m in (gguf._LAYER, gguf._TOP))
  out = gg.GGUFWriter(os.fspath(path), arch)
  out.add_block_count(cfg.num_layers)
  out.add_context_length(64)
  out.add_embedding_length(cfg.hidden_size)
  out.add_feed_forward_length(cfg.intermediate_size)
  out.add_head_count(cfg.num_heads)
  out.add_head_count_kv(cfg.num_kv_heads)
  out.add_rope_freq_base(cfg.rope_theta)
  out.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  out.add_vocab_size(cfg.vocab_size)
  for name, a in w.items():
    if name.startswith("model.layers."):
      i, rest = name[len("model.layers."):].split(".", 1)
      part = rest.removesuffix(".weight")
      if part == "self_attn.q_proj":
        a = gguf.permute_rope(a, cfg.num_heads)
      elif part == "self_attn.k_proj":
        a = gguf.permute_rope(a, cfg.num_kv_heads)
      name = f"blk.{i}.{layer[part]}.weight"
    else:
      name = f"{top[name.removesuffix('.weight')]}.weight"
    out.add_tensor(name, a)
  out.write_header_to_file()
  out.write_kv_data_to_file()
  out.write_tensors_to_file()
  out.close()
  return os.fspath(path)
