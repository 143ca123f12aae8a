"""Collectives under `jax.shard_map`: fused all-reduce + RMSNorm + FP8 quant."""

from jfusedq.parallel.allreduce import (DISABLE_ENV, STRATEGIES, allreduce_rmsnorm_quant,
                                        allreduce_rmsnorm_quant_sharded, chosen_strategy,
                                        reduce_scatter_rmsnorm_quant)

__all__ = [
    "DISABLE_ENV",
    "STRATEGIES",
    "allreduce_rmsnorm_quant",
    "allreduce_rmsnorm_quant_sharded",
    "chosen_strategy",
    "reduce_scatter_rmsnorm_quant",
]
