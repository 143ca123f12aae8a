from jfusedq.nn.linear import Fp8Linear, Linear
from jfusedq.nn.norm import RMSNorm
from jfusedq.nn.weights import e4m3fn_to_e4m3fnuz, quantize_weight

__all__ = ["Fp8Linear", "Linear", "RMSNorm", "e4m3fn_to_e4m3fnuz", "quantize_weight"]
