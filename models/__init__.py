"""Models on jfusedq's fused norm + FP8 path, one package each, in one design:

  deepseek_v3/  DeepSeek-V3 (MLA attention + DeepSeekMoE)
  qwen3_5/      Qwen3.5 MoE / Qwen3-Next (Gated DeltaNet + gated attention, MoE)
  common/       what they share: build options and the projection factory, the embedding,
                the prepare step (all-reduce + add + norm + quant), `tp_apply`, loading helpers
  registry.py   Hugging Face `model_type` -> model package; `build` / `from_pretrained`
  presets.py    named configurations for `jfusedq run` and the decode benchmark
  run.py, cli.py  the `jfusedq` command (`python -m models`)

Each package has config.py, layers.py (the decoder layer: a decode step's data path, norm ->
QuantizedActivation -> FP8 projection, with its equations), model.py, sharding.py and
loading.py; every model is built as `Model(cfg, *, fp8, fused, tp_axis, ar_strategy, dtype,
param_dtype, implementation, rngs)`, called as `model(tokens, *, cache=None, pos=0)` ->
`CausalLMOutput(logits, cache)`, with `init_cache(batch, max_len)`, and loaded by
`from_pretrained(path, *, fp8, fmt, fused, tp_axis, ...)`.
"""
