"""Builds the Hugging Face reference the DeepSeek-V3 tests compare against (`make hf-reference`).

Runs under a separate Python 3.11 environment with PyTorch and transformers (`.venv-hf`, made by
the Makefile), never under the JAX test environment. Writes into OUT_DIR:

  hf/            tiny random DeepseekV3ForCausalLM, `save_pretrained` (f32, sharded, with
                 model.safetensors.index.json)
  fp8/           the same weights in DeepSeek's FP8 format: every projection weight float8_e4m3fn
                 in 128 x 128 blocks with `*.weight_scale_inv` f32 scales, everything else bf16
                 (e_score_correction_bias f32), `quantization_config` in config.json, one file
  tokens.npy     int32 [B, T] random token ids
  logits.npy     float32 [B, T, V] HF logits of `tokens` (eager attention, f32)
  meta.json      versions and the config used

Usage: python tests/models/hf_reference.py OUT_DIR
"""

import json
import math
import os
import shutil
import sys
import tempfile

import numpy as np
import safetensors
import torch
import transformers
from safetensors.torch import save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

SEED = 20261130
BATCH, SEQ = 8, 32

# FP8-applied sizes are multiples of 128, and stay so after splitting heads / intermediate over
# 8 tensor-parallel devices (16 heads of 64 + 64 q dims, 64 v dims; intermediate 1024), so a
# 128 x 128 weight block never straddles two devices. q_a + kv_a + rope = 320 is not a multiple
# of 128 on purpose (the fused projection's N). n_group = 4 groups of 3 experts, 2 kept.
CONFIG = dict(
    vocab_size=512, hidden_size=256, intermediate_size=1024, moe_intermediate_size=1024,
    num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=16, num_key_value_heads=16,
    q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
    n_routed_experts=12, n_shared_experts=1, num_experts_per_tok=3, n_group=4, topk_group=2,
    norm_topk_prob=True, routed_scaling_factor=2.5, rms_norm_eps=1e-6, tie_word_embeddings=False,
    max_position_embeddings=1024, rope_interleave=True,
    # YaRN with mscale != mscale_all_dim so both the cos/sin factor and the softmax correction
    # differ from 1.
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                         original_max_position_embeddings=256, beta_fast=32, beta_slow=1,
                         mscale=0.707, mscale_all_dim=1.0),
)

OUT_GAIN = 0.15

# Weights that DeepSeek's FP8 checkpoints keep in high precision.
KEEP = ("embed_tokens", "lm_head", "norm", "mlp.gate.")


def init_weights(model: torch.nn.Module, gen: torch.Generator) -> None:
  """Random weights everywhere (HF's init leaves norms at 1 and the router bias at 0).

  Projections are N(0, 1/fan_in), except the ones that write to the residual stream (o_proj,
  down_proj) at OUT_GAIN times that: as in a trained model, each branch adds a fraction of the
  stream instead of replacing it, so a small change in one layer (FP8 rounding) is not
  amplified into different expert choices downstream. lm_head is 3x, so logits have a clear
  top-1 (std ~3) for the FP8 agreement test.
  """
  with torch.no_grad():
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
      if name.endswith("inv_freq"):
        continue
      if "norm" in name:
        p.copy_(torch.empty_like(p).uniform_(0.5, 1.5, generator=gen))
      elif "e_score_correction_bias" in name:
        p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
      elif "embed_tokens" in name:
        p.copy_(torch.randn(p.shape, generator=gen))
      else:
        gain = 3.0 if "lm_head" in name else OUT_GAIN if ("o_proj" in name
                                                         or "down_proj" in name) else 1.0
        scale = gain / math.sqrt(p.shape[-1])
        p.copy_(torch.randn(p.shape, generator=gen) * scale)


def quantize_block(w: torch.Tensor, block: int = 128):
  """DeepSeek's block quantisation: w [N, K] -> (fp8 [N, K], scale_inv [ceil(N/b), ceil(K/b)])."""
  n, k = w.shape
  nb, kb = -(-n // block), -(-k // block)
  wp = torch.zeros(nb * block, kb * block, dtype=torch.float32)
  wp[:n, :k] = w.float()
  blocks = wp.view(nb, block, kb, block)
  scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-10) / 448.0
  q = (blocks / scale[:, None, :, None]).clamp(-448.0, 448.0)
  q = q.view(nb * block, kb * block)[:n, :k].to(torch.float8_e4m3fn)
  return q.contiguous(), scale.contiguous()


def write_fp8(src_dir: str, dst_dir: str, state: dict) -> None:
  os.makedirs(dst_dir)
  out = {}
  for name, t in state.items():
    if name.endswith(".weight") and t.ndim == 2 and not any(s in name for s in KEEP):
      q, s = quantize_block(t)
      out[name] = q
      out[name + "_scale_inv"] = s
    elif "e_score_correction_bias" in name:
      out[name] = t.float().contiguous()
    else:
      out[name] = t.to(torch.bfloat16).contiguous()
  save_file(out, os.path.join(dst_dir, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(src_dir, "config.json")) as f:
    cfg = json.load(f)
  cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
  cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3",
                                "quant_method": "fp8", "weight_block_size": [128, 128],
                                "modules_to_not_convert": ["lm_head"]}
  with open(os.path.join(dst_dir, "config.json"), "w") as f:
    json.dump(cfg, f, indent=2)


def main(out_dir: str) -> None:
  torch.manual_seed(SEED)
  gen = torch.Generator().manual_seed(SEED)
  config = DeepseekV3Config(**CONFIG)
  config._attn_implementation = "eager"
  model = DeepseekV3ForCausalLM(config).to(torch.float32).eval()
  init_weights(model, gen)
  tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=gen)
  with torch.no_grad():
    logits = model(input_ids=tokens).logits.float()

  parent = os.path.dirname(os.path.abspath(out_dir)) or "."
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".hf_reference.", dir=parent)
  os.chmod(tmp, 0o755)
  # Small shards so the index (model.safetensors.index.json) path is exercised.
  model.save_pretrained(os.path.join(tmp, "hf"), safe_serialization=True, max_shard_size="8MB")
  from safetensors import safe_open
  state = {}
  with open(os.path.join(tmp, "hf", "model.safetensors.index.json")) as f:
    files = sorted(set(json.load(f)["weight_map"].values()))
  for fname in files:
    with safe_open(os.path.join(tmp, "hf", fname), "pt") as f:
      for k in f.keys():
        state[k] = f.get_tensor(k)
  write_fp8(os.path.join(tmp, "hf"), os.path.join(tmp, "fp8"), state)
  np.save(os.path.join(tmp, "tokens.npy"), tokens.numpy().astype(np.int32))
  np.save(os.path.join(tmp, "logits.npy"), logits.numpy().astype(np.float32))
  meta = {"torch": torch.__version__, "transformers": transformers.__version__,
          "safetensors": safetensors.__version__, "seed": SEED, "config": CONFIG,
          "batch": BATCH, "seq": SEQ}
  with open(os.path.join(tmp, "meta.json"), "w") as f:
    json.dump(meta, f, indent=2)
  # Replace the old reference only once the new one is complete.
  if os.path.exists(out_dir):
    shutil.rmtree(out_dir)
  os.rename(tmp, out_dir)
  print(f"wrote {out_dir}: {len(state)} tensors, logits {tuple(logits.shape)}")


if __name__ == "__main__":
  if len(sys.argv) != 2:
    sys.exit(__doc__)
  main(sys.argv[1])
