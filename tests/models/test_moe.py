"""The shared MoE layer at scale: a model's cost grows with tokens x top_k, not with its expert
count; the sorted and gathered formulations agree, also on expert ids outside [0, E)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jfusedq import Fp8Format
from models import registry
from models.common.moe import Experts
from models.presets import DEEPSEEK_V3_TINY, QWEN3_5_TINY

# (preset, its expert-count key): the tiny presets with 8 experts and with 16x as many.
MODELS = {"deepseek_v3": (DEEPSEEK_V3_TINY, "n_routed_experts"),
          "qwen3_5": (QWEN3_5_TINY, "num_experts")}


def prefill_flops(hf: dict, fp8: bool, tokens: int) -> float:
  model = nnx.eval_shape(lambda: registry.build(hf, fp8=fp8))
  graphdef, state = nnx.split(model)
  toks = jax.ShapeDtypeStruct((1, tokens), jnp.int32)
  f = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t).logits)
  return f.lower(state, toks).compile().cost_analysis()["flops"]


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_prefill_cost_independent_of_expert_count(name, fp8):
  """A 256-token prefill's compiled FLOPs at 128 experts within 1.5x those at 8 (the same
  top-k, so the same routed work). Computing every expert on every token, as the models did,
  gave 16x the expert FLOPs."""
  hf, key = MODELS[name]
  few, many = (prefill_flops(dict(hf, **{key: e}), fp8, 256) for e in (8, 128))
  assert many <= 1.5 * few, (few, many)


def experts(fp8: bool, e: int = 6) -> Experts:
  return Experts(e, 256, 128, fmt=Fp8Format.e4m3fn() if fp8 else None, ue8m0=False,
                 dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, act="silu_mul",
                 rngs=nnx.Rngs(3))


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_sorted_equals_gathered_and_drops_bad_ids(fp8):
  layer = experts(fp8)
  r = np.random.default_rng(4)
  x = jnp.asarray(r.standard_normal((2, 5, 256)), jnp.bfloat16)
  w = jnp.asarray(r.uniform(0.1, 1.0, (2, 5, 3)), jnp.float32)
  idx = jnp.asarray(np.stack([r.permutation(6)[:3] for _ in range(10)]).reshape(2, 5, 3),
                    jnp.int32)
  run = jax.jit(lambda i, g: layer(x, w, i, gathered=g), static_argnums=1)
  # Per (token, expert) the same products; the sum over a token's k experts in f32 in another
  # order: below a bf16 ulp of the output.
  sorted_, gathered = np.asarray(run(idx, False), np.float32), np.asarray(run(idx, True),
                                                                          np.float32)
  np.testing.assert_allclose(sorted_, gathered, rtol=2.0**-7, atol=1e-6)
  # An id outside [0, E) (traced) contributes nothing in either formulation.
  bad = idx.at[0, 1, 2].set(6).at[1, 3, 0].set(-1)
  w_zero = w.at[0, 1, 2].set(0.0).at[1, 3, 0].set(0.0)
  want = np.asarray(jax.jit(lambda: layer(x, w_zero, idx))(), np.float32)
  for g in (False, True):
    np.testing.assert_allclose(np.asarray(run(bad, g), np.float32), want, rtol=2.0**-7,
                               atol=1e-6)


@pytest.mark.parametrize("experts,tokens,want", [
    (16, 1, "gathered"), (16, 3, "gathered"), (16, 4, "sorted"), (4, 1, "gathered"),
    (4, 2, "sorted")])
def test_default_formulation_by_pairs_per_expert(monkeypatch, experts, tokens, want):
  # Top 2: FP8 per-pair products below half a pair an expert (16 experts: 8 pairs, 4 tokens)
  # and for one token at any expert count, the sorted ragged products otherwise.
  layer = Experts(experts, 256, 128, fmt=Fp8Format.e4m3fn(), ue8m0=False, dtype=jnp.bfloat16,
                  param_dtype=jnp.bfloat16, act="silu_mul", rngs=nnx.Rngs(3))
  took = []

  def recorded(name):
    real = getattr(Experts, "_" + name)

    def run(self, *args):
      took.append(name)
      return real(self, *args)
    return run

  for name in ("gathered", "sorted"):
    monkeypatch.setattr(Experts, "_" + name, recorded(name))
  r = np.random.default_rng(5)
  x = jnp.asarray(r.standard_normal((tokens, 256)), jnp.bfloat16)
  idx = jnp.asarray(np.stack([r.permutation(experts)[:2] for _ in range(tokens)]), jnp.int32)
  jax.eval_shape(lambda: layer(x, jnp.full((tokens, 2), 0.5, jnp.float32), idx))
  assert took == [want]
