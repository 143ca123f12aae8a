"""Which model package serves a Hugging Face `model_type`, and the two ways to get a model:
random weights from a config (`build`) or a checkpoint (`from_pretrained`)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from flax import nnx

from jfusedq.checkpoint import ConfigError, read_config
from models import deepseek_v3, llama, qwen3_5


@dataclasses.dataclass(frozen=True)
class Family:
  """One model package: its config (`from_hf(config.json dict)`), its model class (built as
  `model(cfg, *, fp8, fused, tp_axis, ar_strategy, dtype, param_dtype, implementation, rngs)`)
  and its `from_pretrained(path, **same keywords)`."""

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


def build(hf: dict, *, seed: int = 0, **kw) -> nnx.Module:
  """A model with random weights (from `seed`) for a Hugging Face config dict; `kw`: the
  model's keywords (fp8, fused, tp_axis, ...)."""
  f = family(hf.get("model_type"))
  return f.model(f.config.from_hf(hf), rngs=nnx.Rngs(seed), **kw)


def from_pretrained(path: str | os.PathLike, **kw) -> nnx.Module:
  """A model from a Hugging Face checkpoint directory, by its config.json's `model_type`;
  `kw`: the package's `from_pretrained` keywords (fp8, fmt, fused, tp_axis, ...)."""
  model_type = read_config(os.path.join(path, "config.json")).get("model_type")
  try:
    fam = family(model_type)
  except ConfigError as e:
    raise ConfigError(f"{path}: {e}") from None
  return fam.from_pretrained(path, **kw)
