"""jfusedq: fused RMSNorm + per-group FP8 quantisation (and friends) for FP8 LLM inference."""

from jfusedq.errors import DTypeError, InputError, JfusedqError, debug_checks
from jfusedq.fp8 import Fp8Format, QuantizedActivation, default_format
from jfusedq.ops._dispatch import Unsupported, implementations
from jfusedq.ops.attention import attention
from jfusedq.ops.fp8_matmul import fp8_matmul, grouped_fp8_matmul
from jfusedq.ops.group_quant import group_quant
from jfusedq.ops.mla_decode import mla_decode
from jfusedq.ops.ragged_fp8_matmul import ragged_fp8_matmul, ragged_matmul, ragged_swiglu
from jfusedq.ops.rmsnorm import RmsNormOutput, rmsnorm
from jfusedq.ops.rmsnorm_quant import RmsNormQuantOutput, rmsnorm_quant
from jfusedq.parallel import (allreduce_rmsnorm_quant, allreduce_rmsnorm_quant_sharded,
                              chosen_strategy, reduce_scatter_rmsnorm_quant)

__version__ = "0.1.0"

__all__ = [
    "DTypeError",
    "Fp8Format",
    "InputError",
    "JfusedqError",
    "QuantizedActivation",
    "RmsNormOutput",
    "RmsNormQuantOutput",
    "Unsupported",
    "allreduce_rmsnorm_quant",
    "allreduce_rmsnorm_quant_sharded",
    "attention",
    "chosen_strategy",
    "debug_checks",
    "default_format",
    "fp8_matmul",
    "group_quant",
    "grouped_fp8_matmul",
    "implementations",
    "mla_decode",
    "ragged_fp8_matmul",
    "ragged_matmul",
    "ragged_swiglu",
    "reduce_scatter_rmsnorm_quant",
    "rmsnorm",
    "rmsnorm_quant",
]
