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


@functools.cache
def cuda_available() -> bool:
  """True when the extension holds the CUDA handlers and JAX's default backend is a CUDA GPU."""
  return bool(_jax_kittens.build_info()["cuda"]) and jax.default_backend() == "gpu"


def kittens_by_default(*, expert_parallel: bool = False) -> bool:
  """Whether backend="auto" of the MoE layer and of ragged_dot picks the kittens kernels.

  Where they run (CUDA build, GPU backend). The single-device kernels pass the GPU test suite (README, "Status");
  expert parallelism over several GPUs has not run yet, so under ``axis_name`` "auto" means xla unless
  JAX_KITTENS_AUTO=kittens. JAX_KITTENS_AUTO=xla makes "auto" mean xla everywhere.
  """
  choice = os.environ.get("JAX_KITTENS_AUTO", "")
  if choice == "xla" or not cuda_available():
    return False
  return choice == "kittens" or not expert_parallel


def varying_axes(value) -> frozenset:
  """The shard_map mesh axes ``value`` varies over (empty outside shard_map, or with check_vma=False)."""
  # jax 0.10 and 0.11 keep them in aval.mat.varying.
  manual_axis_type = getattr(jax.typeof(value), "mat", None)
  return frozenset(getattr(manual_axis_type, "varying", ()))


def varying_like(result: jax.Array, *operands) -> jax.Array:
  """``result`` typed as varying over every shard_map axis one of ``operands`` varies over."""
  axes = frozenset().union(*(varying_axes(x) for x in operands if x is not None)) - varying_axes(result)
  return jax.lax.pcast(result, tuple(sorted(axes)), to="varying") if axes else result


def ffi_call(target: str, out_types, *operands, vmap_method: str | None = None, **attrs):
  """`jax.ffi.ffi_call` whose results vary over the mesh axes its operands vary over.

  Under shard_map an FFI call's results come back typed invariant whatever its operands are; XLA's own ops infer
  varying results, and autodiff (custom_vjp / custom_jvp) checks that tangents and cotangents match, so every
  jax_kittens op calls its targets through here.
  """
  results = jax.ffi.ffi_call(target, out_types, vmap_method=vmap_method)(*operands, **attrs)
  if isinstance(results, (tuple, list)):
    return type(results)(varying_like(r, *operands) for r in results)
  return varying_like(results, *operands)


def build_info() -> dict:
  """What is available: versions, CUDA archs compiled, NVSHMEM linked, and the registered FFI targets."""
  info = dict(_jax_kittens.build_info())
  info["jax"] = jax.__version__
  info["targets"] = sorted({name for name, _ in REGISTERED_TARGETS})
  info["cuda_targets"] = sorted(name for name, platform in REGISTERED_TARGETS if platform == _CUDA_PLATFORM)
  return info
