"""Models on jfusedq's fused norm + FP8 path: DeepSeek-V3 (`models.deepseek_v3`) and
Qwen3.5 MoE / Qwen3-Next (`models.qwen3_5`); presets and the `jfusedq run` job (`models.run`).
"""
