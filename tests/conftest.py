import os
import sys

# Multi-device tests simulate 8 CPU devices; the flag only affects the CPU backend.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(__file__))
