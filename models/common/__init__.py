"""Building blocks every model here shares: the `CausalLM` base class, build options and the
projection factory, the embedding, RoPE, the SwiGLU MLP, the prepare step (all-reduce + residual
add + norm + quant), the cache write, tensor-parallel application, the routed MoE experts, and
checkpoint-loading helpers."""

from models.common.layers import (MLP, CausalLMOutput, Embedding, Options, fused_flags, is_fp8,
                                  prepare, rotate_half_rope, write_cache)
from models.common.loading import check_loaded, checkpoint_quant, set_param
from models.common.model import PREFILL_CHUNK, CausalLM
from models.common.moe import Experts
from models.common.sharding import check_split, param_names, partition_specs, tp_apply

__all__ = [
    "MLP", "PREFILL_CHUNK", "CausalLM", "CausalLMOutput", "Embedding", "Experts", "Options",
    "check_loaded", "check_split",
    "checkpoint_quant", "fused_flags", "is_fp8", "param_names", "partition_specs", "prepare",
    "rotate_half_rope", "set_param", "tp_apply", "write_cache",
]
