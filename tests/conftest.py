"""Test configuration: 8 host devices for the expert-parallel tests, poisoned kernel outputs, GPU memory on demand,
and the `gpu` marker."""

import os

# Must precede the first jax import: the CPU expert-parallel tests shard over 8 host devices.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
# The CUDA handlers fill their outputs with NaN before their kernels run (csrc/ffi/ffi_util.h), so a missed element
# fails the tests. Read once, at the first kernel call or build_info().
os.environ["JAX_KITTENS_POISON_OUTPUTS"] = "1"
# On a GPU, XLA would take 75% of its memory for this process at the first GPU call (the report header's), leaving the
# benchmark scripts that tests/test_benchmarks.py runs as children too little: one saw its allocations and the
# profiler fail (an H100, 5722278). Memory on demand instead, for this process and its children.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

import jax_kittens  # noqa: E402


def _gpu_ready() -> bool:
  return jax_kittens.build_info()["cuda"] and jax.default_backend() == "gpu"


def pytest_collection_modifyitems(config, items):
  if _gpu_ready():
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU and the CUDA handlers")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


def pytest_report_header(config):
  info = jax_kittens.build_info()
  return (f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.device_count()}, "
          f"jax_kittens cuda={info['cuda']} archs={info['cuda_archs']} nvshmem={info['nvshmem']} "
          f"poison_outputs={info['poison_outputs']}")

