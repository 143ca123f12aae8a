from jfusedq.ops.rmsnorm_quant.api import rmsnorm_quant
from jfusedq.ops.rmsnorm_quant.reference import RmsNormQuantOutput

__all__ = ["RmsNormQuantOutput", "rmsnorm_quant"]
