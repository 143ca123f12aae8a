"""Models on jfusedq's fused norm + FP8 path: DeepSeek-V3 (`models.deepseek_v3`)."""
