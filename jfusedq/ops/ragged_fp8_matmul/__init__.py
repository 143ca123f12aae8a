from jfusedq.ops.ragged_fp8_matmul.api import ragged_fp8_matmul, ragged_matmul

__all__ = ["ragged_fp8_matmul", "ragged_matmul"]
