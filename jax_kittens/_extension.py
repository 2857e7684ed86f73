"""Loads the compiled extension, registers its FFI targets with JAX, and says where they run (what "auto" picks)."""

from __future__ import annotations

import functools
import os
import re

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


def arch_runs_on(arch: str, capability: tuple[int, int]) -> bool:
  """Whether machine code built for ``arch`` ("sm_90a", "sm_80") runs on a GPU of compute ``capability`` (9, 0).

  Arch-specific code ("a": wgmma, setmaxnreg) runs only on its own capability; plain code on its major, from its
  minor up. The build embeds no PTX, so nothing is compiled for other GPUs at load time.
  """
  match = re.fullmatch(r"sm_(\d+)(\d)(a?)", arch)
  if match is None:
    return False
  built = (int(match[1]), int(match[2]))
  return capability == built if match[3] else capability[0] == built[0] and capability[1] >= built[1]


@functools.cache
def cuda_unavailable_reason() -> str | None:
  """None where the CUDA handlers run on every local GPU, else why not (completing "the CUDA kernels ...")."""
  info = _jax_kittens.build_info()
  if not info["cuda"]:
    return "are not in this build (it found no CUDA toolkit; reinstall with JK_CUDA=ON)"
  archs = list(info["cuda_archs"])
  for device in jax.local_devices(backend="gpu"):
    capability = getattr(device, "compute_capability", "")
    match = re.fullmatch(r"(\d+)\.(\d+)", str(capability))
    if match is None or not any(arch_runs_on(arch, (int(match[1]), int(match[2]))) for arch in archs):
      return (f"are built for {', '.join(archs)}, which {device.device_kind} (GPU {device.id}, compute capability "
              f"{capability or 'unknown'}) cannot run")
  return None


def _platform_kind(platform: str) -> str:
  """A device platform as JAX's backends name it: "cuda" and "rocm" devices are "gpu"."""
  return "gpu" if platform in ("cuda", "rocm") else platform


def mesh_platform(*arrays) -> str:
  """The platform a traced computation runs on, as far as tracing tells: the devices of the mesh the first of
  ``arrays`` that lives on one is laid out over, else those of the mesh in scope (inside ``shard_map``: the devices
  the call runs on), else `default_platform`. A GPU machine's CPU devices are "cpu" here while JAX's default backend
  is "gpu". A single-device array tells nothing under `jax.jit`: its computation is taken to run on the default."""
  in_scope = jax.sharding.get_abstract_mesh()
  meshes = [getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None) for a in arrays if a is not None]
  for mesh in [*meshes, in_scope]:
    device = getattr(mesh, "abstract_device", None)
    if device is not None:
      return _platform_kind(device.platform)
  return default_platform()


def default_platform() -> str:
  """The platform that computations go to by default: `jax.default_device`'s where one is set, else JAX's default
  backend ("cpu", "gpu", "tpu")."""
  device = jax.config.jax_default_device
  if device is None:
    return jax.default_backend()
  return _platform_kind(device if isinstance(device, str) else device.platform)


def cuda_available(*arrays) -> bool:
  """True when a computation on ``arrays`` runs on a GPU (`mesh_platform`) and the extension holds CUDA handlers that
  run on it."""
  return mesh_platform(*arrays) == "gpu" and cuda_unavailable_reason() is None


def targets_unavailable_reason(*arrays) -> str | None:
  """None where the FFI targets run on the platform of a computation on ``arrays`` (the CPU twins on CPU, the CUDA
  handlers on the GPUs they were built for), else why not."""
  platform = mesh_platform(*arrays)
  if platform == "gpu":
    reason = cuda_unavailable_reason()
    return None if reason is None else f"the jax_kittens CUDA kernels {reason}"
  return None if platform == "cpu" else f"jax_kittens runs on CPUs and NVIDIA GPUs, not on {platform}"


def targets_by_default(*arrays) -> bool:
  """Whether backend="auto" of `route` and `schedule` on ``arrays`` picks their FFI targets: wherever they run,
  unless JAX_KITTENS_AUTO=xla."""
  return targets_unavailable_reason(*arrays) is None and os.environ.get("JAX_KITTENS_AUTO", "") != "xla"


def kittens_by_default(*arrays, expert_parallel: bool = False) -> bool:
  """Whether backend="auto" of the MoE layer and of ragged_dot on ``arrays`` picks the kittens kernels.

  Where they run (a GPU the CUDA handlers were built for; on CPU devices, a GPU machine's included, "auto" is the
  pure-JAX path, which XLA compiles, and the CPU twins run for backend="kittens"). The single-device kernels pass
  the GPU test suite (README, "Status"); expert parallelism over several GPUs has not run yet, so under
  ``axis_name`` "auto" means xla unless JAX_KITTENS_AUTO=kittens. JAX_KITTENS_AUTO=xla makes "auto" mean xla
  everywhere.
  """
  choice = os.environ.get("JAX_KITTENS_AUTO", "")
  if choice == "xla" or not cuda_available(*arrays):
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


def cotangent_for(cotangent: jax.Array, primal: jax.Array) -> jax.Array:
  """A custom VJP's cotangent summed over the shard_map axes it varies over and its primal does not (what XLA's own
  VJPs do for, say, weights replicated over a data axis), so that it has its primal's type."""
  extra = varying_axes(cotangent) - varying_axes(primal)
  return jax.lax.psum(cotangent, tuple(sorted(extra))) if extra else cotangent


def ffi_call(target: str, out_types, *operands, vmap_method: str | None = None, **attrs):
  """`jax.ffi.ffi_call` whose results vary over the mesh axes its operands vary over.

  Under shard_map an FFI call's results come back typed invariant whatever its operands are; XLA's own ops infer
  varying results, and autodiff (custom_vjp / custom_jvp) checks that tangents and cotangents match, so every
  jax_kittens op calls its targets through here. Where its targets do not run (a GPU the CUDA handlers were not
  built for, a platform other than CPU and GPU), it raises at trace time instead of failing at the launch.
  """
  if (reason := targets_unavailable_reason(*operands)) is not None:
    raise ValueError(f"{target}: {reason}; use backend='xla' (or 'auto', which picks it there)")
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
