"""Named model configurations for the `jfusedq run` command and the decode benchmark.

`*-tiny`: CPU-sized, random weights, every code path of the model (MoE, dense layers, MLA or
GDN + attention; Llama's GQA attention and SwiGLU MLP). `*-layers`: the released models' real
layer shapes (hidden sizes, heads, LoRA ranks, expert sizes) with few layers and fewer
experts, for GPUs. `*-deep`: those layers, as many as one H200 holds with the bf16 and FP8
weights side by side (`jfusedq run`'s three paths). `*-moe`: the `*-layers` models with the
released models' full expert counts (DeepSeek-V3 256, Qwen3.5-397B 512), so that a cost growing
with the expert count shows beside the 16-expert `*-layers`.
"""

from __future__ import annotations

DEEPSEEK_V3_TINY = dict(
    model_type="deepseek_v3", vocab_size=512, hidden_size=256, intermediate_size=1024,
    moe_intermediate_size=256, num_hidden_layers=3, first_k_dense_replace=1,
    num_attention_heads=8, num_key_value_heads=8,
    q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64,
    v_head_dim=64, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4,
    topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                         original_max_position_embeddings=1024, beta_fast=32, beta_slow=1,
                         mscale=1.0, mscale_all_dim=1.0))

# SmolLM2's design (GQA with heads of 64, SwiGLU, plain RoPE), small: 4 KV heads of 64 so that TP 2
# splits k_proj into whole 128-row FP8 blocks; its own LM head (a tied one would read the
# N(0, 1) embedding table: logits of std sqrt(hidden)).
LLAMA_TINY = dict(
    model_type="llama", vocab_size=512, hidden_size=512, intermediate_size=1024,
    num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5,
    rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=4096)

# DeepSeek-V3 671B's layer shapes; 4 layers (1 dense + 3 MoE) and 16 of its 256 experts.
DEEPSEEK_V3_LAYERS = dict(
    DEEPSEEK_V3_TINY, vocab_size=129280, hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=4, num_attention_heads=128,
    num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=16, num_experts_per_tok=8, n_group=8,
    topk_group=4, max_position_embeddings=163840,
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0,
                         original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                         mscale=1.0, mscale_all_dim=1.0))

QWEN3_5_TINY = dict(
    model_type="qwen3_5_moe_text", vocab_size=512, hidden_size=256, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=4, head_dim=128, linear_conv_kernel_dim=4,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=4,
    linear_num_value_heads=8, moe_intermediate_size=256, shared_expert_intermediate_size=256,
    num_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-6, tie_word_embeddings=False,
    max_position_embeddings=4096,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25))

# Qwen3.5-397B-A17B's layer shapes (hidden 4096, GDN 16 key / 64 value heads of 128, attention
# 32 heads of 256 with 2 KV heads, experts of 1024); 4 layers (3 GDN + 1 attention) and 16 of
# its 512 experts.
QWEN3_5_LAYERS = dict(
    QWEN3_5_TINY, vocab_size=248320, hidden_size=4096, num_attention_heads=32,
    num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=64,
    moe_intermediate_size=1024, shared_expert_intermediate_size=1024, num_experts=16,
    num_experts_per_tok=10, max_position_embeddings=262144,
    rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25))

# Deep enough that the layers, not the bf16 LM head, dominate a decode step: DeepSeek-V3's layer
# shapes, 24 layers (its 3 dense + 21 MoE) of 16 experts (8 per token). bf16 masters 46.5 GB,
# FP8 weights 25.1 GB (21.4 GB beyond the shared bf16 embedding and head): both 68 GB, one H200.
DEEPSEEK_V3_DEEP = dict(DEEPSEEK_V3_LAYERS, num_hidden_layers=24, first_k_dense_replace=3)

# Qwen3.5-397B-A17B's layer shapes, 48 of its 60 layers (36 GDN + 12 attention) of 16 experts
# (10 per token). bf16 masters 35.6 GB, FP8 weights 19.9 GB (15.8 GB beyond the shared bf16
# embedding and head): both 51 GB, one H200.
QWEN3_5_DEEP = dict(QWEN3_5_LAYERS, num_hidden_layers=48)

# DeepSeek-V3's layers with all 256 routed experts (8 a token, 8 groups of which 4 are kept):
# 4 layers, 1 dense + 3 MoE, as deepseek-v3-layers. bf16 masters 73.9 GB, FP8 weights 38.8 GB
# (35.1 GB beyond the shared bf16 embedding and head): both 109.0 GB, one H200.
DEEPSEEK_V3_MOE = dict(DEEPSEEK_V3_LAYERS, n_routed_experts=256)

# Qwen3.5-397B-A17B's layers with all 512 experts (10 a token): 4 layers (3 GDN + 1 attention),
# as qwen3.5-layers. bf16 masters 56.6 GB, FP8 weights 30.4 GB (26.3 GB beyond the shared bf16
# embedding and head): both 82.9 GB, one H200.
QWEN3_5_MOE = dict(QWEN3_5_LAYERS, num_experts=512)

# Preset name -> a Hugging Face config dict (its `model_type` picks the model package).
PRESETS = {
    "deepseek-v3-tiny": DEEPSEEK_V3_TINY,
    "deepseek-v3-layers": DEEPSEEK_V3_LAYERS,
    "qwen3.5-tiny": QWEN3_5_TINY,
    "qwen3.5-layers": QWEN3_5_LAYERS,
    "deepseek-v3-deep": DEEPSEEK_V3_DEEP,
    "qwen3.5-deep": QWEN3_5_DEEP,
    "deepseek-v3-moe": DEEPSEEK_V3_MOE,
    "qwen3.5-moe": QWEN3_5_MOE,
    "llama-tiny": LLAMA_TINY,
}
