"""Llama tensor parallelism: which parameters split, and how the cache is laid out.

Heads split over the axis: q/k/v_proj and gate/up_proj column-parallel (weight `[N, K]` rows
and their block-scale rows), o_proj and down_proj row-parallel (K). Norms, the embedding and
lm_head are replicated. The KV cache splits over its kv heads.
"""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from models import common

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


def partition_specs(state, axis: str):
  """PartitionSpecs of an `nnx.split` state for tensor parallelism over `axis`."""
  return common.partition_specs(state, axis, column=COLUMN, row=ROW)


def cache_specs(model) -> tuple[dict, ...]:
  spec = P(None, None, model.opts.tp_axis)
  return tuple({"k": spec, "v": spec} for _ in model.layers)


def check_tp(model, n: int) -> None:
  """Raises unless the attention heads and the KV heads split over `n` devices (KV heads are
  not replicated across devices)."""
  cfg = model.cfg
  for what, v in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads",
                                                           cfg.num_kv_heads)):
    if v % n:
      raise ValueError(f"tensor parallelism over {n} devices needs {what}={v} divisible by {n}")
