"""DeepSeek-V3 tensor parallelism: which parameters split, and how the cache is laid out.

Heads split over the axis (q_b_proj, kv_b_proj column-parallel: weight `[N, K]` rows and scale
rows alike; o_proj row-parallel: K), MLP and expert intermediate dims split (gate/up column,
down row; stacked experts `[E, N, K]` on their last two axes). fused_qkv_a, router, norms,
embeddings and lm_head are replicated, and so is MLA's latent cache, which has no head axis:
every device holds (and writes) the same one.
"""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from models import common
from models.common import is_fp8
from models.deepseek_v3.layers import KVCache

COLUMN = ("q_b_proj", "kv_b_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


def partition_specs(state, axis: str):
  """PartitionSpecs of an `nnx.split` state for tensor parallelism over `axis`."""
  return common.partition_specs(state, axis, column=COLUMN, row=ROW)


def cache_specs(model) -> tuple[KVCache, ...]:
  return tuple(KVCache(P(), P() if is_fp8(layer.self_attn.kv_b_proj) else None, P())
               for layer in model.layers)


def check_tp(model, n: int) -> None:
  """Raises unless the attention heads split over `n` devices."""
  heads = model.cfg.num_attention_heads
  if heads % n:
    raise ValueError(f"tensor parallelism over {n} devices needs num_attention_heads={heads} "
                     f"divisible by {n}")
