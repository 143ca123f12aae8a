from jfusedq.ops.group_quant.api import group_quant
from jfusedq.ops.group_quant.pallas import Config

__all__ = ["Config", "group_quant"]
