from jfusedq.nn.linear import Fp8Linear, Linear, StackedLinear, high_precision
from jfusedq.nn.norm import RMSNorm
from jfusedq.nn.weights import e4m3fn_to_e4m3fnuz, quantize_weight

__all__ = ["Fp8Linear", "Linear", "RMSNorm", "StackedLinear", "e4m3fn_to_e4m3fnuz", "high_precision",
           "quantize_weight"]
