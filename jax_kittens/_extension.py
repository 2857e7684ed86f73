"""Loads the compiled extension and registers its FFI targets with JAX."""

from __future__ import annotations

import functools
import os

import jax

from jax_kittens import _jax_kittens

_CUDA_PLATFORM = "CUDA"


def _register_targets() -> frozenset[tuple[str, str]]:
  registered = set()
  for name, platform, capsule in _jax_kittens.ffi_targets():
    try:
      jax.ffi.register_ffi_target(name, capsule, platform=platform)
    except Exception:  # jaxlib without that platform: the target simply stays unavailable there.
      if platform != _CUDA_PLATFORM:
        raise
      continue
    registered.add((name, platform))
  return frozenset(registered)


REGISTERED_TARGETS = _register_targets()


def cuda_built() -> bool:
  """True when the extension holds the CUDA handlers."""
  return bool(_jax_kittens.build_info()["cuda"])


@functools.cache
def cuda_available() -> bool:
  """True when the CUDA handlers are built and JAX's default backend is a CUDA GPU."""
  return cuda_built() and jax.default_backend() == "gpu"


def kittens_by_default() -> bool:
  """Whether backend="auto" of the MoE layer and of ragged_dot picks the kittens kernels.

  Only where they run (CUDA build, GPU backend), and only once they have passed the GPU test suite: routing and the
  grouped GEMM forward have; the fused layer, the GEMM backward and the expert-parallel transport have not yet
  (README, "Status"). Until then "auto" means xla, and JAX_KITTENS_AUTO=kittens opts in.
  """
  return cuda_available() and os.environ.get("JAX_KITTENS_AUTO", "xla") == "kittens"


def has_target(name: str, platform: str) -> bool:
  return (name, platform) in REGISTERED_TARGETS


def build_info() -> dict:
  """What is available: versions, CUDA archs compiled, NVSHMEM linked, and the registered FFI targets."""
  info = dict(_jax_kittens.build_info())
  info["jax"] = jax.__version__
  info["targets"] = sorted({name for name, _ in REGISTERED_TARGETS})
  info["cuda_targets"] = sorted(name for name, platform in REGISTERED_TARGETS if platform == _CUDA_PLATFORM)
  return info
