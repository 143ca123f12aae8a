from jfusedq.ops.ragged_fp8_matmul.api import ragged_fp8_matmul, ragged_matmul, ragged_swiglu

__all__ = ["ragged_fp8_matmul", "ragged_matmul", "ragged_swiglu"]
