from jfusedq.ops.attention.api import BLOCK, SEGMENT, Prefix, attention

__all__ = ["BLOCK", "SEGMENT", "Prefix", "attention"]
