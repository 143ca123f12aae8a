"""Qwen3.5 tensor parallelism: which parameters split, and how the cache is laid out.

Column-parallel (output rows split): in_proj_qkvz, in_proj_ba, q/k/v_proj, gate/up projections
(experts: their intermediate rows), with their block scales; the GDN conv channels and per-head
A_log / dt_bias follow. Row-parallel (input columns split): o_proj, out_proj, down
projections. Everything else (norms, router, shared-expert gate, embedding, lm_head) is
replicated. The cache splits with its heads: attention k, v over kv heads, GDN conv over
channels, the recurrent state over value heads.
"""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from models import common
from models.qwen3_5.config import GDN

COLUMN = {"in_proj_qkvz", "in_proj_ba", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
ROW = {"o_proj", "out_proj", "down_proj"}
HEADS = {"conv_weight", "A_log", "dt_bias"}


def partition_specs(state, axis: str):
  """PartitionSpecs of an `nnx.split` state for tensor parallelism over `axis`."""
  return common.partition_specs(state, axis, column=COLUMN, row=ROW, heads=HEADS)


def cache_specs(model) -> tuple[dict, ...]:
  axis = model.opts.tp_axis
  return tuple({"conv": P(None, None, axis), "state": P(None, axis)} if l.kind == GDN
               else {"k": P(None, None, axis), "v": P(None, None, axis)} for l in model.layers)


def check_tp(model, n: int) -> None:
  """Raises unless the GDN key heads, the attention heads and the KV heads split over `n`."""
  cfg = model.cfg
  need = {"linear_num_key_heads": cfg.linear_num_key_heads, "num_key_value_heads":
          cfg.num_kv_heads, "num_attention_heads": cfg.num_heads}
  for what, v in need.items():
    if v % n:
      raise ValueError(f"tensor parallelism over {n} devices needs {what}={v} divisible by {n}")
