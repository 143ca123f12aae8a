from jfusedq.ops.gated_delta_rule.api import gated_delta_rule, l2norm

__all__ = ["gated_delta_rule", "l2norm"]
