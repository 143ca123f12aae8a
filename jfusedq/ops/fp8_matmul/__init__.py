from jfusedq.ops.fp8_matmul.api import (activation_format, fp8_matmul, grouped_fp8_matmul,
                                        scale_layout)
from jfusedq.ops.fp8_matmul.pallas import Config

__all__ = ["Config", "activation_format", "fp8_matmul", "grouped_fp8_matmul", "scale_layout"]
