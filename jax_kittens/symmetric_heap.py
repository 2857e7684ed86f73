"""Symmetric heaps: the same-size region on every device of an expert-parallel axis, with signal pads and peer tables.

A `SymmetricHeap` is a process-global object created before the computation that uses it is traced; expert-parallel
FFI calls name it by ``heap.id`` (the attribute ``heap_id``), so it survives recompiles and every executable traced
against it keeps working. All heaps are freed at interpreter exit (atexit). Memory does not grow per call: a call only
flips flags and reuses the two staging areas of its region.

Backends:
  "cpu": one host region per rank, shared by the CPU devices of this process (XLA:CPU runs the device programs of a
    shard_map concurrently in threads, so CI runs the real protocol). The CPU handlers are asynchronous: a call waits
    for its peers on a thread of its own, never on one of XLA's (csrc/ffi/expert_parallel.cc says why).
  "cuda": all local GPUs of one process; cudaMalloc per device and peer access between every pair (no multicast).
  "nvshmem": one GPU per process (jax.distributed); regions come from nvshmem_malloc, peers from nvshmem_ptr, and the
    NVSHMEM unique id travels through jax.distributed's key-value store. Loaded only when used
    (the separate module ``_jk_nvshmem``).

Region layout (csrc/kernels/symmetric_heap.h): ``[signal pad | send area | return area]``; the two areas are equal.
"""

from __future__ import annotations

import atexit
import ctypes
import glob
import os
import threading

import jax

from jax_kittens import _jax_kittens

BACKENDS = ("cpu", "cuda", "nvshmem")
# Long enough for a peer process still compiling its first step; only a hang should ever reach it.
DEFAULT_TIMEOUT_S = float(os.environ.get("JAX_KITTENS_EP_TIMEOUT_S", "120"))
# The default heap never shrinks below this, so small layers share one heap.
_MIN_DEFAULT_REGION_BYTES = 8 << 20
# Never NVLink multicast on these machines: it can take a shared host's GPUs out of service.
_SAFETY_ENV = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0"}


def _load_extension() -> ctypes.CDLL:
  lib = ctypes.CDLL(_jax_kittens.__file__)
  lib.jk_heap_last_error.restype = ctypes.c_char_p
  lib.jk_heap_create_cpu.restype = ctypes.c_int64
  lib.jk_heap_create_cpu.argtypes = [ctypes.c_int32, ctypes.c_int64, ctypes.c_int64]
  lib.jk_heap_create_cuda.restype = ctypes.c_int64
  lib.jk_heap_create_cuda.argtypes = [ctypes.c_int32, ctypes.POINTER(ctypes.c_int32), ctypes.c_int64, ctypes.c_int64]
  lib.jk_heap_create_cuda_external.restype = ctypes.c_int64
  lib.jk_heap_create_cuda_external.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
                                               ctypes.POINTER(ctypes.c_uint64), ctypes.c_int64, ctypes.c_int64]
  lib.jk_heap_destroy.restype = ctypes.c_int32
  lib.jk_heap_destroy.argtypes = [ctypes.c_int64]
  lib.jk_heap_stats.argtypes = [ctypes.POINTER(ctypes.c_int64)]
  lib.jk_heap_limits.argtypes = [ctypes.POINTER(ctypes.c_int64)]
  lib.jk_heap_error.restype = ctypes.c_int32
  lib.jk_heap_error.argtypes = [ctypes.c_int64, ctypes.c_char_p, ctypes.c_int64]
  lib.jk_heap_set_skip_signal_rank.restype = ctypes.c_int32
  lib.jk_heap_set_skip_signal_rank.argtypes = [ctypes.c_int64, ctypes.c_int32]
  return lib


_LIB = _load_extension()


def _limits() -> dict[str, int]:
  out = (ctypes.c_int64 * 5)()
  _LIB.jk_heap_limits(out)
  return dict(zip(("pad_bytes", "max_ranks", "max_chunks", "max_experts", "alignment"), out))


LIMITS = _limits()


def region_bytes_for(area_bytes: int) -> int:
  """Region size whose send and return areas each hold ``area_bytes``."""
  alignment = LIMITS["alignment"]
  area = -(-area_bytes // alignment) * alignment
  return LIMITS["pad_bytes"] + 2 * max(area, alignment)


def _check_created(heap_id: int) -> int:
  if heap_id < 0:
    raise RuntimeError(f"creating the symmetric heap failed: {_LIB.jk_heap_last_error().decode()}")
  return heap_id


class SymmetricHeap:
  """One region of ``region_bytes`` on each of ``num_ranks`` devices; see the module docstring.

  Build with `SymmetricHeap.create` (cpu / cuda, single process) or `SymmetricHeap.nvshmem` (one GPU per process).
  Rank r of the heap must be the device at position r of the expert-parallel mesh axis; the GPU kernels check it.
  """

  def __init__(self, heap_id: int, backend: str, num_ranks: int, region_bytes: int, timeout_s: float, devices):
    self.id = heap_id
    self.backend = backend
    self.num_ranks = num_ranks
    self.region_bytes = region_bytes
    self.timeout_s = timeout_s
    self.devices = tuple(devices)
    self._closed = False
    with _LOCK:
      _LIVE[heap_id] = self

  @property
  def area_bytes(self) -> int:
    """Bytes of each staging area (send, return): the most row bytes one transport call may move per rank."""
    alignment = LIMITS["alignment"]
    return (self.region_bytes - LIMITS["pad_bytes"]) // 2 // alignment * alignment

  @classmethod
  def create(cls, devices, region_bytes: int, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> "SymmetricHeap":
    """A heap over ``devices`` (in expert-parallel rank order) of this process: CPU devices or local GPUs."""
    devices = list(devices)
    if not devices:
      raise ValueError("devices must name at least one device")
    platforms = {d.platform for d in devices}
    if len(platforms) != 1:
      raise ValueError(f"devices must share one platform, got {sorted(platforms)}")
    if any(d.process_index != jax.process_index() for d in devices):
      raise ValueError("SymmetricHeap.create takes devices of this process; use SymmetricHeap.nvshmem across "
                       "processes")
    if len({d.id for d in devices}) != len(devices):
      raise ValueError("devices must be distinct")
    region_bytes = _check_region_bytes(region_bytes)
    timeout_ns = _timeout_ns(timeout_s)
    platform = platforms.pop()
    if platform == "cpu":
      heap_id = _check_created(_LIB.jk_heap_create_cpu(len(devices), region_bytes, timeout_ns))
      return cls(heap_id, "cpu", len(devices), region_bytes, timeout_s, devices)
    if platform == "gpu" or platform == "cuda":
      ordinals = (ctypes.c_int32 * len(devices))(*[d.local_hardware_id for d in devices])
      heap_id = _check_created(_LIB.jk_heap_create_cuda(len(devices), ordinals, region_bytes, timeout_ns))
      return cls(heap_id, "cuda", len(devices), region_bytes, timeout_s, devices)
    raise ValueError(f"no symmetric heap backend for platform {platform!r}")

  @classmethod
  def nvshmem(cls, region_bytes: int, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> "SymmetricHeap":
    """A heap with one member per process (rank = jax.process_index()), each on its process's only local GPU.

    With several processes, call jax.distributed.initialize first: the NVSHMEM unique id goes through its key-value
    store. Every process must create the same heaps in the same order (nvshmem_malloc is collective).
    """
    local = jax.local_devices()
    if len(local) != 1 or local[0].platform not in ("gpu", "cuda"):
      raise ValueError(f"the NVSHMEM heap needs exactly one local GPU per process, found {local}")
    region_bytes = _check_region_bytes(region_bytes)
    nvshmem = _nvshmem_runtime(local[0].local_hardware_id, region_bytes)
    rank, num_ranks = jax.process_index(), jax.process_count()
    base = nvshmem.malloc(region_bytes)
    peers = (ctypes.c_uint64 * num_ranks)(*[nvshmem.peer_pointer(base, pe) for pe in range(num_ranks)])
    heap_id = _check_created(_LIB.jk_heap_create_cuda_external(num_ranks, rank, local[0].local_hardware_id, peers,
                                                               region_bytes, _timeout_ns(timeout_s)))
    heap = cls(heap_id, "nvshmem", num_ranks, region_bytes, timeout_s, jax.devices())
    heap._nvshmem_base = base
    return heap

  def check(self) -> None:
    """Raises RuntimeError when a call on this heap failed (a peer timed out, a device order mismatch).

    GPU kernels cannot fail an XLA execution, so they record the error where the host reads it without a sync; the
    next expert-parallel call on the heap fails with it, and so does this check.
    """
    message = ctypes.create_string_buffer(1024)
    code = _LIB.jk_heap_error(self.id, message, len(message))
    if code != 0:
      raise RuntimeError(message.value.decode())

  def close(self) -> None:
    """Frees the regions. Only once nothing in flight uses the heap (block_until_ready first)."""
    with _LOCK:
      if self._closed:
        return
      self._closed = True
      _LIVE.pop(self.id, None)
      for key, heap in list(_DEFAULTS.items()):
        if heap is self:
          del _DEFAULTS[key]
    _LIB.jk_heap_destroy(self.id)
    if self.backend == "nvshmem":
      _NVSHMEM.free(self._nvshmem_base)

  def _set_skip_signal_rank(self, rank: int) -> None:
    """Test hook: ``rank`` stops signalling its staged dispatch rows (-1: nobody), so its peers time out."""
    _LIB.jk_heap_set_skip_signal_rank(self.id, rank)

  def __repr__(self):
    return (f"SymmetricHeap(id={self.id}, backend={self.backend!r}, num_ranks={self.num_ranks}, "
            f"region_bytes={self.region_bytes})")


def _check_region_bytes(region_bytes) -> int:
  if not isinstance(region_bytes, int) or isinstance(region_bytes, bool):
    raise TypeError(f"region_bytes must be an int, got {type(region_bytes).__name__}")
  alignment = LIMITS["alignment"]
  minimum = LIMITS["pad_bytes"] + 2 * alignment
  if region_bytes < minimum:
    raise ValueError(f"region_bytes must be at least {minimum} (signal pad + two areas), got {region_bytes}")
  return -(-region_bytes // alignment) * alignment


def _timeout_ns(timeout_s) -> int:
  if not timeout_s > 0:
    raise ValueError(f"timeout_s must be positive, got {timeout_s}")
  return int(timeout_s * 1e9)


_LOCK = threading.Lock()
_LIVE: dict[int, SymmetricHeap] = {}
_DEFAULTS: dict[tuple, SymmetricHeap] = {}


def default_heap(num_ranks: int, area_bytes: int, platform: str | None = None) -> SymmetricHeap:
  """The lazily created heap for ``num_ranks`` ranks of ``platform`` ("cpu" or "gpu"; default: JAX's default
  backend; expert-parallel calls pass their mesh's).

  CPU and single-process GPU: the first ``num_ranks`` devices of the platform in this process, which is rank order
  for ``Mesh(jax.devices()[:n], ...)``; build a `SymmetricHeap` yourself for other device orders. Several processes
  (one GPU each): NVSHMEM. When a call needs bigger staging areas than the current default heap has, a bigger heap
  replaces it as the default; the old one stays alive for the executables traced against it.
  """
  platform = platform or jax.default_backend()
  key = (platform, num_ranks)
  with _LOCK:
    heap = _DEFAULTS.get(key)
  if heap is not None and heap.area_bytes >= area_bytes:
    return heap
  region_bytes = max(region_bytes_for(area_bytes), _MIN_DEFAULT_REGION_BYTES,
                     0 if heap is None else 2 * heap.region_bytes)
  if platform != "cpu" and jax.process_count() > 1:
    if num_ranks != jax.process_count():
      raise ValueError(f"the expert-parallel axis has {num_ranks} ranks, but a multi-process default heap spans all "
                       f"{jax.process_count()} processes (one GPU each); create a SymmetricHeap and pass heap=")
    heap = SymmetricHeap.nvshmem(region_bytes)
  else:
    devices = [d for d in jax.local_devices(backend=platform)][:num_ranks]
    if len(devices) < num_ranks:
      raise ValueError(f"the expert-parallel axis has {num_ranks} ranks but this process has only {len(devices)} "
                       f"{platform} devices")
    heap = SymmetricHeap.create(devices, region_bytes)
  with _LOCK:
    _DEFAULTS[key] = heap
  return heap


def heap_stats() -> tuple[int, int]:
  """(live heaps, bytes of their regions in this process): what tests watch for growth."""
  out = (ctypes.c_int64 * 2)()
  _LIB.jk_heap_stats(out)
  return int(out[0]), int(out[1])


# ---------------------------------------------------------------------------------------------------------------
# NVSHMEM: a separate module over NVSHMEM's host library, loaded on first use. Only host calls are needed
# (nvshmem_malloc, nvshmem_ptr): the kernels address peers through the peer table like the "cuda" backend does.

class _NvshmemRuntime:
  def __init__(self, lib: ctypes.CDLL):
    self._lib = lib

  def malloc(self, region_bytes: int) -> int:
    base = self._lib.jk_nvshmem_malloc(region_bytes)
    if not base:
      raise RuntimeError(f"nvshmem_malloc of {region_bytes} bytes failed (NVSHMEM_SYMMETRIC_SIZE too small?)")
    return base

  def peer_pointer(self, base: int, pe: int) -> int:
    pointer = self._lib.jk_nvshmem_ptr(ctypes.c_void_p(base), pe)
    if not pointer:
      raise RuntimeError(f"nvshmem_ptr gives no load/store address for PE {pe}: it is not reachable over NVLink")
    return pointer

  def free(self, base: int) -> None:
    self._lib.jk_nvshmem_free(ctypes.c_void_p(base))

  def finalize(self) -> None:
    self._lib.jk_nvshmem_finalize()


_NVSHMEM: _NvshmemRuntime | None = None
_UID_KEY = "jax_kittens/nvshmem_unique_id"


def nvshmem_library_dir() -> str | None:
  """The lib/ directory of the nvidia-nvshmem wheel, or None when it is not installed."""
  try:
    import nvidia.nvshmem as package  # noqa: PLC0415 (optional dependency)
  except ImportError:
    return None
  for root in package.__path__:
    if glob.glob(os.path.join(root, "lib", "libnvshmem_host.so*")):
      return os.path.join(root, "lib")
  return None


def _nvshmem_module_path() -> str:
  # Installed beside the extension module (an editable install keeps that apart from this file).
  return os.path.join(os.path.dirname(_jax_kittens.__file__), "_jk_nvshmem.so")


def nvshmem_available() -> bool:
  """True when the NVSHMEM module was built and the NVSHMEM wheel's host library is installed."""
  return os.path.exists(_nvshmem_module_path()) and nvshmem_library_dir() is not None


def _nvshmem_runtime(device_ordinal: int, region_bytes: int) -> _NvshmemRuntime:
  global _NVSHMEM
  if _NVSHMEM is not None:
    return _NVSHMEM
  library_dir = nvshmem_library_dir()
  module = _nvshmem_module_path()
  if library_dir is None or not os.path.exists(module):
    raise RuntimeError("the NVSHMEM heap needs the nvidia-nvshmem-cu13 wheel and jax_kittens built with it "
                       "(the _jk_nvshmem module)")
  for name, value in _SAFETY_ENV.items():
    os.environ[name] = value
  os.environ.setdefault("NVSHMEM_BOOTSTRAP_UID_PLUGIN", os.path.join(library_dir, "nvshmem_bootstrap_uid.so.3"))
  # One node: peers over NVLink only; no network transport to probe.
  os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
  if jax.process_count() == 1:  # the bootstrap's socket never leaves this host (set it to a NIC across hosts)
    os.environ.setdefault("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo")
  os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(max(2 * region_bytes, 1 << 30)))
  ctypes.CDLL(os.path.join(library_dir, "libnvshmem_host.so.3"), mode=ctypes.RTLD_GLOBAL)
  lib = ctypes.CDLL(module)
  lib.jk_nvshmem_last_error.restype = ctypes.c_char_p
  lib.jk_nvshmem_unique_id_size.restype = ctypes.c_int64
  lib.jk_nvshmem_get_unique_id.argtypes = [ctypes.c_char_p]
  lib.jk_nvshmem_get_unique_id.restype = ctypes.c_int32
  lib.jk_nvshmem_init.argtypes = [ctypes.c_char_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32]
  lib.jk_nvshmem_init.restype = ctypes.c_int32
  lib.jk_nvshmem_malloc.argtypes = [ctypes.c_int64]
  lib.jk_nvshmem_malloc.restype = ctypes.c_uint64
  lib.jk_nvshmem_ptr.argtypes = [ctypes.c_void_p, ctypes.c_int32]
  lib.jk_nvshmem_ptr.restype = ctypes.c_uint64
  lib.jk_nvshmem_free.argtypes = [ctypes.c_void_p]

  size = lib.jk_nvshmem_unique_id_size()
  rank, num_ranks = jax.process_index(), jax.process_count()
  unique_id = ctypes.create_string_buffer(size)
  if rank == 0:
    if lib.jk_nvshmem_get_unique_id(unique_id) != 0:
      raise RuntimeError(f"nvshmemx_get_uniqueid failed: {lib.jk_nvshmem_last_error().decode()}")
  if num_ranks > 1:
    from jax._src import distributed  # noqa: PLC0415 (the key-value store has no public API)

    client = distributed.global_state.client
    if client is None:
      raise RuntimeError("several processes but jax.distributed is not initialized: call "
                         "jax.distributed.initialize() before creating an NVSHMEM heap")
    if rank == 0:
      client.key_value_set_bytes(_UID_KEY, unique_id.raw)
    else:
      unique_id = ctypes.create_string_buffer(client.blocking_key_value_get_bytes(_UID_KEY, 120_000), size)
  if lib.jk_nvshmem_init(unique_id, rank, num_ranks, device_ordinal) != 0:
    raise RuntimeError(f"NVSHMEM initialisation failed: {lib.jk_nvshmem_last_error().decode()}")
  _NVSHMEM = _NvshmemRuntime(lib)
  return _NVSHMEM


@atexit.register
def _free_all_heaps() -> None:
  # Heaps first, NVSHMEM last: its finalize frees every nvshmem_malloc region.
  for heap in list(_LIVE.values()):
    heap.close()
  if _NVSHMEM is not None:
    _NVSHMEM.finalize()
