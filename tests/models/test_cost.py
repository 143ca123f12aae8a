"""`models.cost` against counts written out by hand from the presets' configs: the FLOPs of a
prefill, the bytes of a decode step, the floors at given peaks. The models are built abstractly
(`nnx.eval_shape`): the counts need shapes only."""

import jax
import pytest
from flax import nnx

from models import cost, registry
from models.presets import PRESETS

B, T = 2, 24


def abstract(name: str, fp8: bool = False, **change) -> nnx.Module:
  return nnx.eval_shape(lambda: registry.build(dict(PRESETS[name], **change), fp8=fp8))


def per_token(c: dict) -> tuple[int, int, int, int]:
  """(multiply-adds a token spends in the projections below the LM head, the LM head's, the
  full-attention layers, Hq * (Dqk + Dv)) from a preset's config dict."""
  h, layers = c["hidden_size"], c["num_hidden_layers"]
  if c["model_type"] == "deepseek_v3":
    heads, qk = c["num_attention_heads"], c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    attn = ((c["q_lora_rank"] + c["kv_lora_rank"] + c["qk_rope_head_dim"]) * h
            + heads * qk * c["q_lora_rank"]
            + heads * (c["qk_nope_head_dim"] + c["v_head_dim"]) * c["kv_lora_rank"]
            + h * heads * c["v_head_dim"])
    dense = c["first_k_dense_replace"]
    # The routed experts: top_k of them a token; the router (a bare weight) is not counted.
    moe = 3 * c["moe_intermediate_size"] * h * (c["n_shared_experts"] + c["num_experts_per_tok"])
    body = layers * attn + dense * 3 * c["intermediate_size"] * h + (layers - dense) * moe
    return body, c["vocab_size"] * h, layers, heads * (qk + c["v_head_dim"])
  if c["model_type"] == "llama":
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    d = h // heads
    body = layers * (2 * heads * d * h + 2 * kv * d * h + 3 * c["intermediate_size"] * h)
    return body, c["vocab_size"] * h, layers, heads * 2 * d
  # Qwen3.5: every fourth layer full attention (its query doubled by the output gate), the rest
  # Gated DeltaNet; a MoE block in every layer.
  heads, kv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
  kh, vh = c["linear_num_key_heads"], c["linear_num_value_heads"]
  dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
  full = layers // 4
  gdn = (2 * kh * dk + 2 * vh * dv) * h + 2 * vh * h + h * vh * dv
  att = 2 * heads * d * h + 2 * kv * d * h + h * heads * d
  moe = (c["num_experts"] * h + 3 * c["shared_expert_intermediate_size"] * h + h
         + 3 * c["num_experts_per_tok"] * c["moe_intermediate_size"] * h)
  body = (layers - full) * gdn + full * att + layers * moe
  return body, c["vocab_size"] * h, full, heads * 2 * d


@pytest.mark.parametrize("name", ["deepseek-v3-tiny", "qwen3.5-tiny", "llama-tiny",
                                  "deepseek-v3-layers"])
@pytest.mark.parametrize("fp8", [False, True])
def test_prefill_flops(name, fp8):
  body, head, layers, width = per_token(PRESETS[name])
  pairs = B * T * (T + 1) // 2
  attn = 2 * layers * width * pairs
  model = abstract(name, fp8)
  assert cost.prefill_flops(model, B, T, logits="all") == (2 * B * T * (body + head), attn)
  assert cost.prefill_flops(model, B, T, logits="last") == (2 * B * (T * body + head), attn)


def test_mla_heads_at_deepseek_v3_widths():
  assert cost.head_shapes(abstract("deepseek-v3-layers").cfg) == (128, 128, 192, 128)


def test_experts_count_by_top_k():
  """Twice the experts a layer leave a token's FLOPs and a one-token step's bytes as they were
  but for the router's share (E x H; DeepSeek-V3's FLOPs leave it out); top_k sets them."""
  for name, key in (("deepseek-v3-tiny", "n_routed_experts"), ("qwen3.5-tiny", "num_experts")):
    c = PRESETS[name]
    e, h = c[key], c["hidden_size"]
    few, many = abstract(name), abstract(name, **{key: 2 * e})
    ds = name.startswith("deepseek")
    layers = c["num_hidden_layers"] - c.get("first_k_dense_replace", 0)
    router = 0 if ds else 2 * B * T * layers * e * h
    assert (cost.prefill_flops(many, B, T, logits="last")[0]
            - cost.prefill_flops(few, B, T, logits="last")[0]) == router
    # E x H: DeepSeek-V3's in float32 with a float32 bias per expert, Qwen3.5's a bf16 Linear
    router = layers * e * ((h + 1) * 4 if ds else h * 2)
    assert cost.weight_bytes(many, 1) - cost.weight_bytes(few, 1) == router
    more_k = abstract(name, num_experts_per_tok=c["num_experts_per_tok"] + 1)
    assert cost.prefill_flops(more_k, B, T, logits="last")[0] > cost.prefill_flops(
        few, B, T, logits="last")[0]


def state_bytes(model) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model)))


@pytest.mark.parametrize("name", ["deepseek-v3-tiny", "qwen3.5-tiny", "llama-tiny"])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_weight_bytes(name, fp8, batch):
  """Every weight but the embedding's unread rows and the experts no token is routed to."""
  c = PRESETS[name]
  h, v = c["hidden_size"], c["vocab_size"]
  unread = (v - batch) * h * 2  # bf16 rows
  if name != "llama-tiny":
    e = c.get("n_routed_experts", c.get("num_experts"))
    i = c["moe_intermediate_size"]
    layers = c["num_hidden_layers"] - c.get("first_k_dense_replace", 0)
    # gate, up and down: FP8 codes and a float32 scale per 128 x 128 block, or bf16
    expert = 3 * (i * h + (i // 128) * (h // 128) * 4) if fp8 else 3 * i * h * 2
    unread += layers * (e - min(e, batch * c["num_experts_per_tok"])) * expert
  model = abstract(name, fp8)
  assert cost.weight_bytes(model, batch) == state_bytes(model) - unread


def test_tied_head_reads_the_whole_table():
  """A tied LM head is the embedding matrix: the step reads it whole, once, and the prefill
  computes the head as an untied one does."""
  tied, untied = abstract("llama-tiny", tie_word_embeddings=True), abstract("llama-tiny")
  assert tied.lm_head is None
  h = PRESETS["llama-tiny"]["hidden_size"]
  for batch in (1, 4):
    assert cost.weight_bytes(tied, batch) == cost.weight_bytes(untied, batch) - batch * h * 2
  for logits in ("all", "last"):
    assert (cost.prefill_flops(tied, B, T, logits=logits)
            == cost.prefill_flops(untied, B, T, logits=logits))


@pytest.mark.parametrize("name", ["deepseek-v3-tiny", "qwen3.5-tiny", "llama-tiny"])
def test_cache_bytes_grow_with_context(name):
  """bf16 caches: keys and values (MLA: the latent and the rotary key) per slot of every
  attention layer; Qwen3.5's Gated DeltaNet layers hold a state of fixed size."""
  c = PRESETS[name]
  layers = c["num_hidden_layers"]
  if name == "deepseek-v3-tiny":
    slot, fixed = layers * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 2, 0
  elif name == "llama-tiny":
    slot = layers * 2 * c["num_key_value_heads"] * c["hidden_size"] // c[
        "num_attention_heads"] * 2
    fixed = 0
  else:
    full = layers // 4
    slot = full * 2 * c["num_key_value_heads"] * c["head_dim"] * 2
    kh, vh = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    conv = (c["linear_conv_kernel_dim"] - 1) * (2 * kh * dk + vh * dv) * 2
    fixed = (layers - full) * (conv + vh * dk * dv * 4)  # the recurrent state in float32
  model = abstract(name)
  for length in (16, 40):
    cache = jax.eval_shape(lambda n=length: model.init_cache(B, n))
    assert cost.cache_bytes(cache) == B * (length * slot + fixed)


def test_fp8_cache_reads_fewer_bytes():
  bf16, fp8 = abstract("deepseek-v3-tiny"), abstract("deepseek-v3-tiny", fp8=True)
  size = lambda m: cost.cache_bytes(jax.eval_shape(lambda: m.init_cache(B, 32)))
  assert size(fp8) < size(bf16)


def test_floors():
  # Projections at the FP8 peak (twice the bf16 dot's), attention at the bf16 peak.
  assert cost.FP8_PER_BF16 == 2
  assert cost.prefill_floor(4e12, 1e12, 500.0) == pytest.approx(4e12 / 1e15 + 1e12 / 5e14)
  assert cost.prefill_floor(0.0, 1e12, 500.0) == pytest.approx(2e-3)
  assert cost.step_floor(8.6e9, 4.3) == pytest.approx(2e-3)


def test_logits_must_be_all_or_last():
  with pytest.raises(ValueError, match="logits"):
    cost.prefill_flops(abstract("llama-tiny"), B, T, logits="first")
