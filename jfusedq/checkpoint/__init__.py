"""Hugging Face checkpoint loading: safetensors by name, FP8 block-scaled projections."""

from jfusedq.checkpoint.checkpoint import (Checkpoint, CheckpointError, ConfigError,
                                           MissingTensorError, TensorMismatchError, read_config)
from jfusedq.checkpoint.linear import (QuantConfig, load_array, load_experts, load_linear,
                                       projection)
from jfusedq.checkpoint.safetensors import SafetensorsError, SafetensorsFile, load_file, save_file

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "ConfigError",
    "MissingTensorError",
    "QuantConfig",
    "SafetensorsError",
    "SafetensorsFile",
    "TensorMismatchError",
    "load_array",
    "load_experts",
    "load_file",
    "load_linear",
    "projection",
    "read_config",
    "save_file",
]
