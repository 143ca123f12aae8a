"""Builds the Hugging Face reference the Qwen3.5 / Qwen3-Next tests compare against.

Runs under the separate Python 3.11 environment with PyTorch and transformers (`.venv-hf`),
never under the JAX test environment:

  .venv-hf/bin/python tests/models/hf_reference_qwen3_5.py build/hf_reference_qwen3_5

Writes into OUT_DIR:

  hf/            tiny random Qwen3_5MoeForCausalLM, `save_pretrained` (f32, sharded with
                 model.safetensors.index.json; experts per expert, as save_pretrained writes)
  fp8/           the same weights in block FP8 (128 x 128, float8_e4m3fn, f32
                 `weight_scale_inv`), text-model names (`model.layers...`), one file, no index;
                 `modules_to_not_convert` lists bf16 modules by text name, including one FP8-slot
                 projection (layer 3's self_attn.o_proj) kept in bf16
  fp8_vlm/       the FP8 weights as the VLM checkpoints store them: config `qwen3_5_moe` with the
                 text config under `text_config`, names `model.language_model.*`, a vision
                 tensor to ignore, scales stored in bf16, `modules_to_not_convert` with the
                 `model.language_model.` prefix
  bf16_vlm/      bf16 (A_log, dt_bias f32), VLM layout, experts fused (`experts.gate_up_proj`
                 [E, 2I, H], `experts.down_proj` [E, H, I]) as the bf16 Qwen3.5 releases store
                 them, no quantization_config (quantised on load)
  next/          tiny random Qwen3NextForCausalLM (`save_pretrained`, f32): interleaved
                 in_proj_qkvz / in_proj_ba, a dense-MLP layer, norm_topk_prob=False
  tokens.npy     int32 [B, T] random token ids (T > 64: the chunked GDN crosses a chunk boundary)
  logits.npy     float32 [B, T, V] HF logits of `tokens`, Qwen3.5 (eager attention, f32)
  logits_next.npy  float32 [B, T, V] the same for the Qwen3-Next model
  meta.json      versions and the configs used
"""

import copy
import json
import math
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import safetensors
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3NextConfig,
                          Qwen3NextForCausalLM)

from hf_reference import quantize_block  # the DeepSeek reference's, from this folder

SEED = 20261201
BATCH, SEQ = 2, 80

# FP8-applied sizes are multiples of 128 and stay so per device at tensor-parallel size 4:
# 4 GDN key-head groups of (q 128, k 128, v 2x128, z 2x128) rows, 8 attention heads of 128
# (q + gate 256 rows each) over 4 KV heads, expert / shared intermediate 512. Hidden 256 gives
# two quantisation groups per row. 8 value heads over 4 key heads exercise grouped value heads.
CONFIG = dict(
    vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, head_dim=128, linear_conv_kernel_dim=4, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8,
    moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=4,
    num_experts_per_tok=2, rms_norm_eps=1e-6, tie_word_embeddings=False,
    max_position_embeddings=4096,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
)
# Qwen3-Next: one GDN + one attention layer; layer 1 uses the dense MLP (mlp_only_layers).
NEXT_CONFIG = dict(
    vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=4, head_dim=128, linear_conv_kernel_dim=4, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8,
    intermediate_size=512, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1],
    layer_types=["linear_attention", "full_attention"], rms_norm_eps=1e-6,
    tie_word_embeddings=False, max_position_embeddings=4096,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
)

# Projections writing into the residual stream, and their init gain (see init_weights).
OUT_PROJ = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")
OUT_GAIN = 0.1

# Modules the FP8 checkpoints keep in high precision (module-name substrings).
KEEP = ("embed_tokens", "lm_head", "norm", "conv1d", "in_proj_a", "in_proj_b", "mlp.gate.",
        "shared_expert_gate", "A_log", "dt_bias")
# One FP8-slot projection left in bf16, as some checkpoints do: it must stay high precision.
BF16_PROJ = "model.layers.3.self_attn.o_proj"


def init_weights(model: torch.nn.Module, gen: torch.Generator) -> None:
  """Random weights everywhere (HF's init leaves norms at 0 / 1 and dt_bias at 1).

  Zero-centred norms (weight w, applied as 1 + w) get U(-0.5, 0.5); the GDN gated norm (applied
  as w) U(0.5, 1.5). Projections N(0, 1/fan_in) keep activations at unit scale, except the
  projections that write into the residual stream (o_proj, out_proj, down projections): OUT_GAIN
  times that, so each branch adds a few percent to the residual as in trained models. At unit
  gain a random model is chaotic: FP8's ~4% error per GEMM grows layer over layer and decides
  the top-1 of near-tied logits (~80% agreement with bf16); at 0.1 FP8 agrees with bf16 on ~98%
  of tokens while each branch still moves the logits by far more than the 1e-4 the f32
  comparison resolves.
  lm_head is 3x so logits spread (std ~3); the router 2x so routing is decisive.
  A = exp(A_log) in U(0.05, 4) and dt_bias N(0, 0.5) give heads that forget within a few tokens
  next to heads that keep their state across the 64-token chunk boundary.
  """
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("linear_attn.norm.weight"):
        p.copy_(torch.empty_like(p).uniform_(0.5, 1.5, generator=gen))
      elif "norm" in name:
        p.copy_(torch.empty_like(p).uniform_(-0.5, 0.5, generator=gen))
      elif name.endswith("A_log"):
        p.copy_(torch.empty_like(p).uniform_(0.05, 4.0, generator=gen).log())
      elif name.endswith("dt_bias"):
        p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
      elif "conv1d" in name:
        p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
      elif "embed_tokens" in name:
        p.copy_(torch.randn(p.shape, generator=gen))
      else:
        gain = (3.0 if "lm_head" in name else 2.0 if name.endswith("mlp.gate.weight")
                else OUT_GAIN if name.endswith(OUT_PROJ) else 1.0)
        p.copy_(torch.randn(p.shape, generator=gen) * gain / math.sqrt(p.shape[-1]))


def read_dir(path: str) -> dict:
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
  else:
    files = ["model.safetensors"]
  state = {}
  for fname in files:
    with safe_open(os.path.join(path, fname), "pt") as f:
      for k in f.keys():
        state[k] = f.get_tensor(k)
  return state


def write(dst: str, tensors: dict, cfg: dict) -> None:
  os.makedirs(dst)
  save_file({k: v.contiguous() for k, v in tensors.items()},
            os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(dst, "config.json"), "w") as f:
    json.dump(cfg, f, indent=2)


def fp8_state(state: dict, scale_dtype) -> dict:
  out = {}
  for name, t in state.items():
    module = name.rsplit(".", 1)[0]
    if (name.endswith(".weight") and t.ndim == 2 and not any(s in name for s in KEEP)
        and module != BF16_PROJ):
      q, s = quantize_block(t)
      out[name] = q
      out[name + "_scale_inv"] = s.to(scale_dtype)
    elif name.endswith(("A_log", "dt_bias")):
      out[name] = t.float()  # the GDN decay parameters stay f32, as in the released checkpoints
    else:
      out[name] = t.to(torch.bfloat16)
  return out


def not_converted(prefix: str) -> list:
  mods = ["lm_head", BF16_PROJ.replace("model.", prefix, 1)]
  for i, kind in enumerate(["linear_attention"] * 3 + ["full_attention"]):
    p = f"{prefix}layers.{i}."
    if kind == "linear_attention":
      mods += [p + "linear_attn.in_proj_a", p + "linear_attn.in_proj_b"]
    mods += [p + "mlp.gate", p + "mlp.shared_expert_gate"]
  return mods


def vlm_config(text_cfg: dict) -> dict:
  text = dict(text_cfg, model_type="qwen3_5_moe_text")
  text.pop("architectures", None)
  return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
          "text_config": text, "vision_config": {"model_type": "qwen3_5_moe_vision", "depth": 1},
          "tie_word_embeddings": False, "transformers_version": text_cfg.get(
              "transformers_version")}


def to_vlm(state: dict) -> dict:
  out = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
         for k, v in state.items()}
  out["model.visual.patch_embed.proj.bias"] = torch.randn(8)  # to be ignored by the loader
  return out


def fuse_experts(state: dict, num_experts: int) -> dict:
  """Per-expert gate/up/down [I, H] / [H, I] -> experts.gate_up_proj [E, 2I, H] (gate rows
  first), experts.down_proj [E, H, I]: the layout of HF's Qwen3_5MoeExperts."""
  out = {k: v for k, v in state.items() if ".mlp.experts." not in k}
  layers = sorted({k.split(".mlp.experts.")[0] for k in state if ".mlp.experts." in k})
  for lay in layers:
    e = lambda i, m: state[f"{lay}.mlp.experts.{i}.{m}.weight"]
    out[f"{lay}.mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([e(i, "gate_proj"), e(i, "up_proj")], 0) for i in range(num_experts)])
    out[f"{lay}.mlp.experts.down_proj"] = torch.stack(
        [e(i, "down_proj") for i in range(num_experts)])
  return out


def build(cls, config, gen, tokens, path):
  config._attn_implementation = "eager"
  model = cls(config).to(torch.float32).eval()
  init_weights(model, gen)
  with torch.no_grad():
    logits = model(input_ids=tokens).logits.float()
  # Small shards so the index (model.safetensors.index.json) path is exercised.
  model.save_pretrained(path, safe_serialization=True, max_shard_size="8MB")
  return logits


def main(out_dir: str) -> None:
  start = time.time()
  torch.manual_seed(SEED)
  gen = torch.Generator().manual_seed(SEED)
  tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=gen)

  parent = os.path.dirname(os.path.abspath(out_dir)) or "."
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".hf_reference_qwen3_5.", dir=parent)
  os.chmod(tmp, 0o755)
  logits = build(Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig(**copy.deepcopy(CONFIG)), gen,
                 tokens, os.path.join(tmp, "hf"))
  logits_next = build(Qwen3NextForCausalLM, Qwen3NextConfig(**copy.deepcopy(NEXT_CONFIG)), gen,
                      tokens, os.path.join(tmp, "next"))

  state = read_dir(os.path.join(tmp, "hf"))
  with open(os.path.join(tmp, "hf", "config.json")) as f:
    cfg = json.load(f)
  qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
        "weight_block_size": [128, 128]}
  fp8_cfg = dict(cfg, dtype="bfloat16",
                 quantization_config=dict(qc, modules_to_not_convert=not_converted("model.")))
  write(os.path.join(tmp, "fp8"), fp8_state(state, torch.float32), fp8_cfg)
  vlm = vlm_config(dict(cfg, dtype="bfloat16"))
  vlm["quantization_config"] = dict(
      qc, modules_to_not_convert=not_converted("model.language_model.") + ["model.visual"])
  write(os.path.join(tmp, "fp8_vlm"), to_vlm(fp8_state(state, torch.bfloat16)), vlm)
  # The GDN decay parameters stay f32 in the bf16 releases too.
  bf16 = {k: v if k.endswith(("A_log", "dt_bias")) else v.to(torch.bfloat16)
          for k, v in fuse_experts(state, CONFIG["num_experts"]).items()}
  write(os.path.join(tmp, "bf16_vlm"), to_vlm(bf16), vlm_config(dict(cfg, dtype="bfloat16")))

  np.save(os.path.join(tmp, "tokens.npy"), tokens.numpy().astype(np.int32))
  np.save(os.path.join(tmp, "logits.npy"), logits.numpy().astype(np.float32))
  np.save(os.path.join(tmp, "logits_next.npy"), logits_next.numpy().astype(np.float32))
  meta = {"torch": torch.__version__, "transformers": transformers.__version__,
          "safetensors": safetensors.__version__, "seed": SEED, "config": CONFIG,
          "next_config": NEXT_CONFIG, "batch": BATCH, "seq": SEQ, "bf16_projection": BF16_PROJ}
  with open(os.path.join(tmp, "meta.json"), "w") as f:
    json.dump(meta, f, indent=2)
  # Replace the old reference only once the new one is complete.
  if os.path.exists(out_dir):
    shutil.rmtree(out_dir)
  os.rename(tmp, out_dir)
  print(f"wrote {out_dir}: {len(state)} tensors, logits {tuple(logits.shape)}, "
        f"{time.time() - start:.1f} s")


if __name__ == "__main__":
  if len(sys.argv) != 2:
    sys.exit(__doc__)
  main(sys.argv[1])
