"""The Hugging Face reference files (`make hf-reference`) and shared model runs for the tests.

tests/models has no __init__.py on purpose: as a package it would be importable as `models`
(tests/ is on sys.path, see tests/conftest.py) and shadow the repository's models package.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import deepseek_v3 as ds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REF = os.environ.get("JFUSEDQ_HF_REFERENCE", os.path.join(ROOT, "build", "hf_reference"))


def ref_path(*parts: str) -> str:
  """A path inside the reference directory; fails the test (never skips) when it is missing."""
  if not os.path.exists(os.path.join(REF, "meta.json")):
    pytest.fail(f"the Hugging Face reference is missing ({REF}); run `make hf-reference` "
                f"(builds .venv-hf with PyTorch + transformers and writes it)", pytrace=False)
  return os.path.join(REF, *parts)


@functools.cache
def meta() -> dict:
  with open(ref_path("meta.json")) as f:
    return json.load(f)


def tokens() -> jax.Array:
  return jnp.asarray(np.load(ref_path("tokens.npy")))


def hf_logits() -> np.ndarray:
  return np.load(ref_path("logits.npy"))


def load(which: str, **kw) -> ds.DeepseekV3ForCausalLM:
  """`which`: "hf" (f32 save_pretrained) or "fp8" (DeepSeek FP8 format) checkpoint."""
  return ds.from_pretrained(ref_path(which), **kw)


def jit_logits(model, toks) -> np.ndarray:
  graphdef, state = nnx.split(model)
  f = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t).logits)
  return np.asarray(f(state, toks), np.float32)


@functools.cache
def logits(which: str, fused: bool = True, fp8: bool | None = None,
           dtype: str = "bfloat16", batch: int | None = None, seq: int | None = None
           ) -> np.ndarray:
  """Logits of the reference tokens [:batch, :seq] (all by default), once per test process."""
  dt = jnp.dtype(dtype)
  model = load(which, fp8=fp8, fused=fused, dtype=dt,
               param_dtype=dt if dt == jnp.float32 else jnp.bfloat16)
  return jit_logits(model, tokens()[:batch, :seq])
