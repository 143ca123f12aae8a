"""Which accelerator the code is being built for.

Inside `jax.sharding.use_abstract_mesh` with an `AbstractDevice`, that device is the target
(this is how ROCm lowering is checked on a CPU-only machine); otherwise the first device of
the default backend.
"""

from __future__ import annotations

import dataclasses

import jax


# SMs (CUs on AMD) by device kind, for a device that does not report its count.
_SMS = {"h200": 132, "h100": 132, "mi300": 304, "mi325": 304, "mi355": 256, "mi350": 256,
        "gfx942": 304, "gfx950": 256}
DEFAULT_SMS = 132  # an H100/H200's, where nothing tells: the CPU interpreter
_HOPPER_KINDS = ("h100", "h200", "h800")
# Shared memory one block may use on Hopper (sm90, 227 KiB): Mosaic GPU's bound on the H200.
HOPPER_SMEM_BYTES = 232448


@dataclasses.dataclass(frozen=True)
class Target:
  platform: str  # "cpu", "cuda" or "rocm"
  device_kind: str
  num_cores: int | None = None  # SMs / CUs as the device reports them, where it does

  @property
  def is_gpu(self) -> bool:
    return self.platform in ("cuda", "rocm")

  @property
  def is_hopper(self) -> bool:
    return self.platform == "cuda" and is_hopper(self.device_kind)

  @property
  def sm_count(self) -> int:
    return self.num_cores or sm_count(self.device_kind)


def current() -> Target:
  mesh = jax.sharding.get_abstract_mesh()
  device = getattr(mesh, "abstract_device", None)
  if device is not None:
    return Target(_normalise(device.platform), device.device_kind,
                  getattr(device, "num_cores", None))
  d = jax.devices()[0]
  platform = _normalise(d.platform, d)
  return Target(platform, d.device_kind, getattr(d, "core_count", None) if platform != "cpu"
                else None)


def sm_count(device_kind: str | None = None) -> int:
  """SMs (CUs) to fill on a device of `device_kind`, or on the current target when None."""
  if device_kind is None:
    return current().sm_count
  kind = device_kind.lower()
  return next((n for key, n in _SMS.items() if key in kind), DEFAULT_SMS)


def is_hopper(device_kind: str) -> bool:
  """Whether an NVIDIA device kind is Hopper (sm90): wgmma, 228 KB shared memory per SM."""
  return any(h in device_kind.lower() for h in _HOPPER_KINDS)


def interpret() -> bool:
  """Whether Pallas kernels run in interpret mode: on CPU, where they are correct, not fast."""
  return current().platform == "cpu"


def _normalise(platform: str, device=None) -> str:
  platform = platform.lower()
  if platform == "gpu":
    # Older jaxlibs report "gpu" for both vendors; the client's version string tells them apart.
    version = getattr(getattr(device, "client", None), "platform_version", "") or ""
    return "rocm" if "rocm" in version.lower() else "cuda"
  return platform
