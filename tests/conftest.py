import os
import sys

# Multi-device tests simulate 8 CPU devices; the flag only affects the CPU backend.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
  # Lowering tests compile for abstract targets (sm90, gfx942, gfx950) on the CPU backend; on a
  # GPU machine jax lowers against the real device (a ROCm target on CUDA fails with "Not a HIP
  # GPU"), so they are CPU-only, as the marker says.
  import jax
  import pytest
  if jax.default_backend() == "cpu":
    return
  skip = pytest.mark.skip(reason="lowering tests run on the CPU backend only")
  for item in items:
    if "lowering" in item.keywords:
      item.add_marker(skip)
