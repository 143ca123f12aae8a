"""The models' cost model: the FLOPs a prefill must compute and the bytes a decode step must
read, and the floors they set at a device's peaks. `jfusedq run` (`models.run`) and the model
benchmarks (`benchmarks/prefill.py`, `benchmarks/decode.py`) hold their times to these floors;
the peaks are measured (`models.run.peaks`), not taken from a spec sheet.

Prefill, B sequences of T tokens from an empty cache (`prefill_flops`):
  projection FLOPs: 2 * B * T * the N * K of every projection a token passes (the model's
    Linear and Fp8Linear modules; of the routed experts top_k of E, as the MoE layer computes
    only those, `models.common.moe`). The LM head (the embedding matrix when tied) runs at
    every position with logits="all", once a sequence with logits="last" (the model call's
    argument). DeepSeek-V3's router (a bare E x H weight, under 1% of a MoE layer's FLOPs) is
    left out.
  attention FLOPs: 2 * B * Hq * (Dqk + Dv) * T (T + 1) / 2 per full-attention layer (the causal
    (query, key) pairs; MLA per head: Dqk = 192, Dv = 128 at DeepSeek-V3's widths). Qwen3.5's
    gated delta rule (its linear-attention layers' recurrence, ~1% of such a layer's FLOPs) is
    left out.
  floor (`prefill_floor`): projection FLOPs / FP8 peak + attention FLOPs / bf16 peak, the FP8
    peak taken as FP8_PER_BF16 x the bf16 dot's. One floor whatever the path (bf16 included),
    so the paths' fractions of it compare as their speeds do.

Decode step of B tokens, per device (`weight_bytes` + `cache_bytes`): every weight read once,
except
  embedding table   B rows (unless it is the LM head, which reads it whole)
  routed experts    at most min(E, B * top_k) of each MoE layer's E experts (exact at B = 1,
                    where a token's top_k experts are distinct; an upper bound above)
plus the cache the step attends over (every allocated slot, as the masked attention reads them;
the recurrent state of Qwen3.5's linear-attention layers counts once although it is also
rewritten). Activations are left out.
  floor (`step_floor`): those bytes / copy bandwidth.
"""

from __future__ import annotations

import math

import jax
from flax import nnx

from jfusedq.nn import Fp8Linear, Linear, StackedLinear
from models.qwen3_5.config import ATTN

# Hopper's dense FP8 tensor-core rate is twice its bf16 rate.
FP8_PER_BF16 = 2


def head_shapes(cfg) -> tuple[int, int, int, int]:
  """(Hq, Hkv, Dqk, Dv) of the model's prefill attention."""
  if hasattr(cfg, "kv_lora_rank"):  # DeepSeek-V3's MLA, per head
    h = cfg.num_attention_heads
    return h, h, cfg.qk_head_dim, cfg.v_head_dim
  return cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim


def prefill_flops(model: nnx.Module, batch: int, tokens: int, *,
                  logits: str) -> tuple[float, float]:
  """(projection FLOPs, attention FLOPs) of one prefill of `batch` x `tokens` whose LM head
  runs at every position (`logits="all"`) or the last (`"last"`) (module docstring)."""
  if logits not in ("all", "last"):
    raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
  cfg = model.cfg
  rows = batch * tokens
  head_rows = rows if logits == "all" else batch
  proj = 0.0
  for path, node in nnx.iter_graph(model):
    if isinstance(node, (Linear, Fp8Linear)):
      n, k = node.weight.shape
      proj += 2.0 * (head_rows if path[-1:] == ("lm_head",) else rows) * n * k
    elif isinstance(node, StackedLinear):
      _, n, k = node.weight.shape
      proj += 2.0 * rows * cfg.num_experts_per_tok * n * k
  if model.lm_head is None:
    proj += 2.0 * head_rows * cfg.vocab_size * cfg.hidden_size
  types = getattr(cfg, "layer_types", None)
  layers = len(model.layers) if types is None else sum(t == ATTN for t in types)
  hq, _, dqk, dv = head_shapes(cfg)
  return proj, 2.0 * hq * (dqk + dv) * rows * (tokens + 1) / 2 * layers


def device_bytes(tree) -> int:
  """Bytes of `tree`'s arrays (or shape structs) one device holds: a tensor-parallel shard, or
  the whole."""
  def size(x):
    sharding = getattr(x, "sharding", None)
    shape = x.shape if sharding is None else sharding.shard_shape(x.shape)
    return math.prod(shape) * x.dtype.itemsize

  return sum(size(x) for x in jax.tree.leaves(tree))


def weight_bytes(model: nnx.Module, batch: int) -> int:
  """Weight bytes one decode step of `batch` tokens reads on one device (module docstring)."""
  total = device_bytes(nnx.state(model))
  for path, node in nnx.iter_graph(model):
    if isinstance(node, StackedLinear):
      e = node.weight.shape[0]
      stacked = device_bytes(nnx.state(node))
      total -= stacked - stacked * min(e, batch * model.cfg.num_experts_per_tok) // e
    elif path[-1:] == ("embed_tokens",) and model.lm_head is not None:
      table = device_bytes(nnx.state(node))
      total -= table - table * batch // node.weight.shape[0]
  return total


def cache_bytes(cache) -> int:
  """Bytes of the cache a decode step attends over, on one device: every allocated slot."""
  return device_bytes(cache)


def prefill_floor(proj: float, attn: float, bf16_tflops: float) -> float:
  """Seconds a prefill of `proj` projection and `attn` attention FLOPs takes at a bf16 dot
  peak of `bf16_tflops` (module docstring)."""
  return (proj / FP8_PER_BF16 + attn) / (bf16_tflops * 1e12)


def step_floor(nbytes: int, copy_tbps: float) -> float:
  """Seconds a decode step reading `nbytes` takes at a copy bandwidth of `copy_tbps`."""
  return nbytes / (copy_tbps * 1e12)
