from jfusedq.ops.rmsnorm.api import RmsNormOutput, rmsnorm

__all__ = ["RmsNormOutput", "rmsnorm"]
