from jfusedq.ops.mla_decode.api import mla_decode

__all__ = ["mla_decode"]
