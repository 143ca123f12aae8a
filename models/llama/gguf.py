"""GGUF files (llama.cpp's format) of Llama models: metadata, tensors in Hugging Face names and
layout, and the tokenizer. Needs the `gguf` package (and `tokenizers` for the tokenizer)."""

from __future__ import annotations

import os

import numpy as np

from jfusedq.checkpoint import lazy
from models.llama.config import LlamaConfig

_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(name: str) -> str:
  """A GGUF tensor name (`blk.3.attn_q.weight`) -> its Hugging Face name
  (`model.layers.3.self_attn.q_proj.weight`)."""
  base, leaf = name.rsplit(".", 1)
  if base.startswith("blk."):
    _, i, part = base.split(".", 2)
    return f"model.layers.{i}.{_LAYER[part]}.{leaf}"
  return f"{_TOP[base]}.{leaf}"


def unpermute_rope(w: np.ndarray, heads: int) -> np.ndarray:
  """Undo llama.cpp's q/k row permutation: its converter stores each head's rows `[D, K]` of
  Hugging Face's q_proj / k_proj as `w.reshape(heads, 2, D/2, K).swapaxes(1, 2)`, pairing the
  two rotate-half halves (i, i + D/2) as adjacent rows for its interleaved RoPE; this returns
  the Hugging Face row order, for rotate-half RoPE."""
  n, k = w.shape
  return w.reshape(heads, n // heads // 2, 2, k).swapaxes(1, 2).reshape(n, k)


def permute_rope(w: np.ndarray, heads: int) -> np.ndarray:
  """llama.cpp's converter permutation (Hugging Face -> GGUF rows), the inverse of
  `unpermute_rope`."""
  n, k = w.shape
  return w.reshape(heads, 2, n // heads // 2, k).swapaxes(1, 2).reshape(n, k)


def _reader(path: str | os.PathLike):
  import gguf  # optional dependency: only GGUF loading needs it
  return gguf.GGUFReader(os.fspath(path))


def _metadata(reader) -> dict:
  meta = {}
  for key, field in reader.fields.items():
    if key.startswith("llama."):
      meta[key[len("llama."):]] = field.contents()
  return meta


def _config(reader, path) -> LlamaConfig:
  arch = reader.fields.get("general.architecture")
  if arch is None or arch.contents() != "llama":
    raise ValueError(f"{path}: general.architecture is "
                     f"{None if arch is None else arch.contents()!r}, not 'llama'")
  meta = _metadata(reader)
  if "vocab_size" not in meta:
    meta["vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
  return LlamaConfig.from_gguf(meta, tied="output.weight" not in {t.name for t in reader.tensors})


def config(path: str | os.PathLike) -> LlamaConfig:
  """A GGUF Llama file's config, from its metadata (no tensor is read); ValueError for another
  architecture."""
  return _config(_reader(path), path)


class _Tensor(lazy.Lazy):
  """A GGUF tensor in Hugging Face layout, dequantised (`gguf.quants.dequantize`) only at the
  rows read (a quantised block never spans two rows); `rows`: Hugging Face row -> file row."""

  def __init__(self, t, rows: np.ndarray | None = None):
    self.t, self.rows, self.dtype = t, rows, np.dtype(np.float32)
    self.shape = tuple(int(n) for n in reversed(t.shape.tolist()))

  def read(self, idx: lazy.Index) -> np.ndarray:
    from gguf import quants  # optional dependency: only GGUF loading needs it
    rows = idx[0] if self.rows is None else self.rows[idx[0]]
    w = np.asarray(quants.dequantize(self.t.data[rows], self.t.tensor_type), np.float32)
    return w if w.ndim == 1 else w[:, idx[1]]


def tensors(path: str | os.PathLike) -> tuple[LlamaConfig, dict[str, lazy.Lazy]]:
  """A GGUF Llama file -> (config, {Hugging Face name: f32 tensor in Hugging Face layout, read
  by slices}). Quantised tensors (Q4_1, Q8_0, ...) are dequantised to f32 by
  `gguf.quants.dequantize`; q/k rows are put back into Hugging Face's order
  (`unpermute_rope`)."""
  reader = _reader(path)
  cfg = _config(reader, path)
  out = {}
  for t in reader.tensors:
    name, heads = hf_name(t.name), None
    if name.endswith("q_proj.weight"):
      heads = cfg.num_heads
    elif name.endswith("k_proj.weight"):
      heads = cfg.num_kv_heads
    n = int(t.shape[-1]) if len(t.shape) > 1 else None
    out[name] = _Tensor(t, None if heads is None else unpermute_rope(np.arange(n)[:, None],
                                                                     heads)[:, 0])
  return cfg, out


def read(path: str | os.PathLike) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
  """`tensors(path)` read whole: (config, {Hugging Face name: f32 array})."""
  cfg, ts = tensors(path)
  return cfg, {name: t.read(lazy.whole(t.shape)) for name, t in ts.items()}


def tokenizer(path: str | os.PathLike):
  """The byte-level BPE tokenizer a GGUF file carries (`tokenizer.ggml.tokens` / `merges`, model
  "gpt2"), as a `tokenizers.Tokenizer`. Pre-tokenisation: single digits, then GPT-2's byte-level
  regex (llama.cpp's "smollm" / "llama-bpe" split)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  reader = _reader(path)
  kind = reader.fields["tokenizer.ggml.model"].contents()
  if kind != "gpt2":
    raise ValueError(f"{path}: tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2')")
  tokens = reader.fields["tokenizer.ggml.tokens"].contents()
  merges = [tuple(m.split(" ", 1)) for m in reader.fields["tokenizer.ggml.merges"].contents()]
  tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Digits(individual_digits=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  tok.decoder = decoders.ByteLevel()
  return tok
