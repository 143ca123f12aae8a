"""Which accelerator the code is being built for.

Inside `jax.sharding.use_abstract_mesh` with an `AbstractDevice`, that device is the target
(this is how ROCm lowering is checked on a CPU-only machine); otherwise the first device of
the default backend.
"""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class Target:
  platform: str  # "cpu", "cuda" or "rocm"
  device_kind: str

  @property
  def is_gpu(self) -> bool:
    return self.platform in ("cuda", "rocm")


def current() -> Target:
  mesh = jax.sharding.get_abstract_mesh()
  device = getattr(mesh, "abstract_device", None)
  if device is not None:
    return Target(_normalise(device.platform), device.device_kind)
  d = jax.devices()[0]
  return Target(_normalise(d.platform, d), d.device_kind)


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
