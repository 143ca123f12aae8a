"""Which model package serves a Hugging Face `model_type` (or a GGUF file: Llama), and the two
ways to get a model: random weights from a config (`build`) or a checkpoint (`from_pretrained`)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from flax import nnx

from jfusedq.checkpoint import ConfigError, read_config
from models import deepseek_v3, llama, qwen3_5
from models.llama import gguf


@dataclasses.dataclass(frozen=True)
class Family:
  """One model package: its config (`from_hf(config.json dict)`), its model class (a
  `models.common.CausalLM`) and its `from_pretrained(path, **kw)` (fp8, fmt and the model's
  build keywords)."""

  config: type
  model: type
  from_pretrained: Callable


_PACKAGES = (deepseek_v3, qwen3_5, llama)
_FAMILIES = {
    deepseek_v3: Family(deepseek_v3.DeepseekV3Config, deepseek_v3.DeepseekV3ForCausalLM,
                        deepseek_v3.from_pretrained),
    qwen3_5: Family(qwen3_5.Qwen35Config, qwen3_5.Qwen35ForCausalLM, qwen3_5.from_pretrained),
    llama: Family(llama.LlamaConfig, llama.LlamaForCausalLM, llama.from_pretrained),
}
MODEL_TYPES = {t: _FAMILIES[p] for p in _PACKAGES for t in p.MODEL_TYPES}


def family(model_type: str | None) -> Family:
  if model_type not in MODEL_TYPES:
    raise ConfigError(f"model_type {model_type!r} is not supported (supported: "
                      f"{sorted(MODEL_TYPES)})")
  return MODEL_TYPES[model_type]


def is_gguf(path: str | os.PathLike) -> bool:
  """Whether `path` names a GGUF file (llama.cpp's format), which the Llama package reads."""
  return os.fspath(path).endswith(".gguf")


def gguf_config(path: str | os.PathLike) -> tuple[Family, llama.LlamaConfig]:
  """The family and config of a GGUF file, from its metadata alone; ValueError for an
  architecture other than Llama's."""
  return _FAMILIES[llama], gguf.config(path)


def build(hf: dict, *, seed: int = 0, **kw) -> nnx.Module:
  """A model with random weights (from `seed`) for a Hugging Face config dict; `kw`: the
  model's keywords (fp8, fused, tp_axis, ...)."""
  f = family(hf.get("model_type"))
  return f.model(f.config.from_hf(hf), rngs=nnx.Rngs(seed), **kw)


def from_pretrained(path: str | os.PathLike, **kw) -> nnx.Module:
  """A model from a Hugging Face checkpoint directory, by its config.json's `model_type`, or
  from a GGUF file (`*.gguf`: Llama); `kw`: the package's `from_pretrained` keywords (fp8, fmt,
  fused, tp_axis, ...)."""
  if is_gguf(path):
    return gguf_config(path)[0].from_pretrained(path, **kw)
  model_type = read_config(os.path.join(path, "config.json")).get("model_type")
  try:
    fam = family(model_type)
  except ConfigError as e:
    raise ConfigError(f"{path}: {e}") from None
  return fam.from_pretrained(path, **kw)
