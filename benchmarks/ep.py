"""Expert-parallel benchmark (design.md section 3): our heap dispatch/combine vs the pure-JAX ragged_all_to_all path.

Every GPU holds T = 8192 tokens before routing and E/8 experts (the slice one GPU of an 8-GPU node hosts), so the
per-GPU work is the same on 1, 2, 4 or 8 GPUs; EP = number of GPUs. Per model shape and routing (uniform, skewed):

  dispatch, combine  kittens only: plan + pull dispatch, and push combine + weighted sum, timed apart.
  roundtrip          kittens and xla: the layer with identity experts (dispatch + combine + the permutations).
  fwd, fwd_bwd       the whole layer; TFLOP/s = 6 (18) * T * k * H * I / time, per GPU.

Backends: "kittens" (heap dispatch/combine + our grouped GEMM), "xla" (the pure-JAX reference: ragged_all_to_all +
jax.lax.ragged_dot), "a2a_kittens_gemm" (ragged_all_to_all + our grouped GEMM: isolates the communication).

GB/s per GPU = payload bytes to other GPUs per GPU (rows kept by other ranks' experts, mean over ranks) / time;
``moved_gbps`` counts the rows a rank keeps for itself too (the only figure on 1 GPU). Heap backends:

  python3 benchmarks/ep.py                              # single process, all local GPUs (cudaMalloc + peer access)
  python3 benchmarks/ep.py --heap nvshmem               # one process per local GPU, jax.distributed on localhost
  python3 benchmarks/ep.py --heap all                   # both, into one results file
  python3 benchmarks/ep.py --smoke                      # tiny shapes, any platform (CPU: 8 host devices)

Writes benchmarks/results/ep_<n>xh200.json (+ .png): rows {"shape", "mode", "backend", "heap", "ep", "routing",
"median_ms", "tflops" or "payload_gbps", "vs_xla", ...}; on several processes each row is the slowest rank's.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import subprocess
import sys
import tempfile

os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")  # never NVLink multicast on these machines
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
if "--smoke" in sys.argv and "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import common  # noqa: E402
from jax_kittens import expert_parallel, grouped_matmul, reference, symmetric_heap  # noqa: E402

AXIS = "ep"
MODES = ("dispatch", "combine", "roundtrip", "fwd", "fwd_bwd")


def parse_args() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="tiny shapes and few runs: checks the script anywhere")
  parser.add_argument("--heap", choices=("cuda", "nvshmem", "all"), default="cuda",
                      help="heap backend: single-process GPUs (cuda), one process per GPU (nvshmem), or both")
  common.add_shapes_argument(parser)
  parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
  parser.add_argument("--tokens", type=int, default=None, help="tokens per GPU (default 8192; smoke 192)")
  parser.add_argument("--capacity-factor", type=float, default=2.0,
                      help="receive rows per rank / (T*k), the same for both backends")
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--min-iters", type=int, default=20)  # design.md: the median of >= 20 runs
  parser.add_argument("--budget-s", type=float, default=2.0)
  parser.add_argument("--out-dir", default=None)
  parser.add_argument("--only", default=None, help="comma-separated backends (kittens, xla, a2a_kittens_gemm)")
  # Internal: one worker of the NVSHMEM run.
  parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
  parser.add_argument("--num-workers", type=int, default=None, help=argparse.SUPPRESS)
  parser.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.smoke:
    args.iters, args.min_iters = min(args.iters, 3), 1
    args.out_dir = args.out_dir or os.path.join("/tmp", "jax_kittens_benchmarks")
  args.out_dir = args.out_dir or common.RESULTS_DIR
  args.only = None if args.only is None else set(args.only.split(","))
  args.modes = args.modes.split(",")
  args.model_shapes = common.selected_shapes(parser, args)
  return args


def _sharded(mesh, spec=P(AXIS)):
  return NamedSharding(mesh, spec)


def make_inputs(mesh, shape: common.ModelShape, tokens: int, routing: str, seed: int = 0):
  """Global arrays sharded over the axis: x [n*T, H] bf16, weights/ids [n*T, k], experts [n*E_local, ...] bf16."""
  num_ranks = mesh.shape[AXIS]
  experts_per_rank = max(1, shape.num_experts // common.GPUS_PER_NODE)
  num_experts = experts_per_rank * num_ranks
  top_k = min(shape.top_k, num_experts)
  hidden, inter = shape.hidden, shape.intermediate

  @functools.partial(jax.jit, out_shardings=(_sharded(mesh),) * 7)
  def build(key):
    keys = jax.random.split(key, 6)
    weights, ids = common.routed(keys[0], tokens * num_ranks, num_experts, top_k, routing)
    x = jax.random.normal(keys[1], (tokens * num_ranks, hidden), jnp.bfloat16)
    w_gate = (jax.random.normal(keys[2], (num_experts, hidden, inter)) / np.sqrt(hidden)).astype(jnp.bfloat16)
    w_up = (jax.random.normal(keys[3], (num_experts, hidden, inter)) / np.sqrt(hidden)).astype(jnp.bfloat16)
    w_down = (jax.random.normal(keys[4], (num_experts, inter, hidden)) / np.sqrt(inter)).astype(jnp.bfloat16)
    d_y = jax.random.normal(keys[5], (tokens * num_ranks, hidden), jnp.bfloat16)
    return x, weights, ids, w_gate, w_up, w_down, d_y

  return build(jax.random.key(seed)), experts_per_rank, top_k


def _copy_ragged_dot(lhs, rhs, group_sizes, preferred_element_type=None):
  """A stand-in grouped GEMM that keeps the data flow (each row's first feature, broadcast): experts cost ~nothing."""
  del group_sizes
  return jnp.broadcast_to(lhs[:, :1], lhs.shape[:1] + rhs.shape[-1:]).astype(preferred_element_type)


def _identity_experts(rows, group_sizes, w_gate, w_up, w_down):
  del group_sizes, w_gate, w_up, w_down
  return rows


class Bench:
  """The jitted pieces for one (shape, routing) on one mesh and heap."""

  def __init__(self, mesh, heap, experts_per_rank, capacity_factor):
    self.mesh, self.heap, self.experts_per_rank, self.capacity_factor = mesh, heap, experts_per_rank, capacity_factor

  def _map(self, fn, in_specs, out_specs):
    return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)

  def layer(self, backend, experts=None):
    """(x, weights, ids, w_gate, w_up, w_down) -> y; experts=None runs the real SwiGLU experts."""
    def local(x, weights, ids, w_gate, w_up, w_down):
      if backend == "kittens":
        y, _ = expert_parallel.expert_parallel_moe(
            x, weights, ids, w_gate, w_up, w_down, axis_name=AXIS, capacity_factor=self.capacity_factor,
            heap=self.heap,
            expert_ffn=experts or expert_parallel.local_expert_ffn(None, grouped_matmul.ragged_dot))
      else:
        gemm = jax.lax.ragged_dot if backend == "xla" else grouped_matmul.ragged_dot
        y = reference.moe_ffn(x, weights, ids, w_gate, w_up, w_down, axis_name=AXIS,
                              capacity_factor=self.capacity_factor,
                              ragged_dot=gemm if experts is None else _copy_ragged_dot)
      return y.astype(x.dtype)

    return self._map(local, (P(AXIS),) * 6, P(AXIS))

  def layer_fwd_bwd(self, backend):
    forward = self.layer(backend)

    def loss(x, weights, ids, w_gate, w_up, w_down, d_y):
      y = forward(x, weights, ids, w_gate, w_up, w_down)
      return jnp.sum(y.astype(jnp.float32) * d_y.astype(jnp.float32))

    # The loss comes back with the gradients: dropped, it would let XLA remove the forward work only y needs, which
    # differs between the backends (see layer.forward_backward).
    return jax.value_and_grad(loss, argnums=(0, 1, 3, 4, 5))

  def dispatch(self):
    """(x, ids) -> (recv, Dispatched arrays): the plan and the pull dispatch alone."""
    def local(x, ids):
      recv, d = expert_parallel.dispatch(x, ids, axis_name=AXIS, experts_per_rank=self.experts_per_rank,
                                         capacity_factor=self.capacity_factor, heap=self.heap)
      return recv, (d.rank[None], d.rows, d.blocks, d.send_kept, d.expert_offsets, d.group_sizes)

    return self._map(local, (P(AXIS), P(AXIS)), (P(AXIS), (P(AXIS),) * 6))

  def combine(self, config):
    """(expert_rows, weights, Dispatched arrays) -> y: the push combine and the weighted sum alone."""
    def local(expert_rows, weights, rank, rows, blocks, send_kept, offsets, group_sizes):
      d = expert_parallel.Dispatched(config, rank[0], rows, blocks, send_kept, offsets, group_sizes,
                                     dropped=jnp.zeros((), jnp.int32))
      return expert_parallel.combine(expert_rows, weights, d).astype(expert_rows.dtype)

    return self._map(local, (P(AXIS),) * 8, P(AXIS))

  def payload_rows(self, send_kept_global):
    """Mean rows per rank kept by other ranks' experts, and by all experts (send_kept: [n*E] sharded)."""
    experts_per_rank = self.experts_per_rank

    def local(send_kept):
      owner = jnp.arange(send_kept.shape[0]) // experts_per_rank
      remote = jnp.sum(jnp.where(owner != jax.lax.axis_index(AXIS), send_kept, 0))
      return jax.lax.psum(jnp.stack([remote, jnp.sum(send_kept)]), AXIS)

    totals = jax.jit(self._map(local, P(AXIS), P()))(send_kept_global)
    return np.asarray(totals, np.float64) / self.mesh.shape[AXIS]


def _config_of(bench, x, ids):
  """The static EpConfig dispatch traced with (for the stand-alone combine)."""
  seen = {}

  def local(x, ids):
    recv, d = expert_parallel.dispatch(x, ids, axis_name=AXIS, experts_per_rank=bench.experts_per_rank,
                                       capacity_factor=bench.capacity_factor, heap=bench.heap)
    seen["config"] = d.config
    return recv

  jax.eval_shape(bench._map(local, (P(AXIS), P(AXIS)), P(AXIS)), x, ids)
  return seen["config"]


def run_shape(args, mesh, heap, heap_name, shape_name, shape, routing) -> list[dict]:
  tokens = args.tokens or common.num_tokens(args)
  (x, weights, ids, w_gate, w_up, w_down, d_y), experts_per_rank, top_k = make_inputs(mesh, shape, tokens, routing)
  num_ranks = mesh.shape[AXIS]
  bench = Bench(mesh, heap, experts_per_rank, args.capacity_factor)
  row_bytes = shape.hidden * 2
  flops_fwd = 6.0 * tokens * top_k * shape.hidden * shape.intermediate
  base = {"shape": shape_name, "ep": num_ranks, "tokens_per_gpu": tokens, "experts_per_gpu": experts_per_rank,
          "routing": routing, "heap": heap_name}
  rows = []
  timing = dict(iters=args.iters, min_iters=args.min_iters, budget_s=args.budget_s)
  # "a2a_kittens_gemm": the reference's ragged_all_to_all with our grouped GEMM -- isolates the communication.
  backends = [b for b in ("kittens", "xla", "a2a_kittens_gemm") if args.only is None or b in args.only]

  dispatched = None
  payload = None
  if "kittens" in backends:
    try:
      dispatch_fn = jax.jit(bench.dispatch())
      recv, dispatched = dispatch_fn(x, ids)
      payload = bench.payload_rows(dispatched[3])
    except Exception as error:  # noqa: BLE001  (recorded in the rows that need it)
      dispatch_error = common.error_message(error)
    else:
      dispatch_error = None

  def bandwidth(median_ms, directions=1):
    remote, moved = payload * row_bytes * directions / (median_ms * 1e-3) / 1e9
    return {"payload_gbps": remote, "moved_gbps": moved}

  for mode in args.modes:
    for backend in backends:
      row = {**base, "mode": mode, "backend": backend}
      if backend != "kittens":
        row["heap"] = None
      if mode in ("dispatch", "combine") and backend != "kittens":
        continue
      if mode == "roundtrip" and backend == "a2a_kittens_gemm":
        continue  # the same as xla's roundtrip: no GEMMs in it

      def run(mode=mode, backend=backend):
        if backend == "kittens" and dispatch_error:
          raise common.RecordedError(dispatch_error)
        if mode == "dispatch":
          result = common.time_compiled(dispatch_fn, [(x, ids)], **timing)
          return {**result, **bandwidth(result["median_ms"])}
        if mode == "combine":
          combine_fn = jax.jit(bench.combine(_config_of(bench, x, ids)))
          result = common.time_compiled(combine_fn, [(recv, weights, *dispatched)], **timing)
          return {**result, **bandwidth(result["median_ms"])}
        if mode == "roundtrip":
          fn = jax.jit(bench.layer(backend, experts=_identity_experts))
          result = common.time_compiled(fn, [(x, weights, ids, w_gate, w_up, w_down)], **timing)
          return {**result, **(bandwidth(result["median_ms"], 2) if payload is not None else {})}
        if mode == "fwd":
          fn = jax.jit(bench.layer(backend))
          result = common.time_compiled(fn, [(x, weights, ids, w_gate, w_up, w_down)], **timing)
          return {**result, "tflops": common.tflops(flops_fwd, result["median_ms"])}
        fn = jax.jit(bench.layer_fwd_bwd(backend))
        result = common.time_compiled(fn, [(x, weights, ids, w_gate, w_up, w_down, d_y)], **timing)
        return {**result, "tflops": common.tflops(3 * flops_fwd, result["median_ms"])}

      rows.append(common.measure(row, run))
  if heap is not None:
    try:
      heap.check()
    except RuntimeError as error:  # a timeout fired: every kittens row of this run is suspect
      for row in rows:
        if row["backend"] == "kittens":
          row["error"] = f"heap error: {error}"
  return rows


def _add_speedups(rows):
  """vs_xla: the xla row's time of the same case over this row's (kittens and a2a_kittens_gemm rows)."""
  key = lambda r: (r.get("shape"), r.get("routing"), r.get("mode"), r.get("ep"))
  baseline = {key(r): r["median_ms"] for r in rows if r["backend"] == "xla" and "median_ms" in r}
  for row in rows:
    if row["backend"] != "xla" and "median_ms" in row and key(row) in baseline:
      row["vs_xla"] = round(baseline[key(row)] / row["median_ms"], 3)


def measure_all(args, mesh, heap, heap_name) -> list[dict]:
  shapes = args.model_shapes
  rows = []
  for name, shape in shapes.items():
    for routing in common.ROUTINGS:
      rows += run_shape(args, mesh, heap, heap_name, name, shape, routing)
  return rows


def heap_bytes(args) -> int:
  """Region size for the largest shape: two areas of T*k rows of H bf16 values."""
  shapes = args.model_shapes
  tokens = args.tokens or common.num_tokens(args)
  area = max(tokens * s.top_k * s.hidden * 2 for s in shapes.values())
  return symmetric_heap.region_bytes_for(area)


def single_process(args) -> list[dict]:
  devices = jax.devices()
  mesh = Mesh(np.array(devices), (AXIS,))
  heap = symmetric_heap.SymmetricHeap.create(devices, heap_bytes(args))
  return measure_all(args, mesh, heap, heap.backend)


def nvshmem_worker(args) -> None:
  jax.distributed.initialize(args.coordinator, args.num_workers, args.worker)
  mesh = Mesh(np.array(jax.devices()), (AXIS,))
  heap = symmetric_heap.SymmetricHeap.nvshmem(heap_bytes(args))
  rows = measure_all(args, mesh, heap, "nvshmem")
  with open(os.path.join(args.out_dir, f"ep_worker_{args.worker}.json"), "w") as f:
    json.dump(rows, f)


def nvshmem_run(args) -> list[dict]:
  """One process per local GPU (CUDA_VISIBLE_DEVICES), jax.distributed on localhost; the slowest rank per row."""
  num_gpus = len(jax.devices())
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  work_dir = tempfile.mkdtemp(prefix="jk_ep_")
  passthrough = [a for a in sys.argv[1:] if not a.startswith("--heap") and a not in ("nvshmem", "all", "cuda")]
  procs = []
  for rank in range(num_gpus):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(rank), "NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0",
           "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo"}  # all workers on this host
    command = [sys.executable, os.path.abspath(__file__), *passthrough, "--out-dir", work_dir, "--worker", str(rank),
               "--num-workers", str(num_gpus), "--coordinator", f"localhost:{port}"]
    procs.append(subprocess.Popen(command, env=env))
  codes = [p.wait() for p in procs]
  if any(codes):
    return [{"mode": "all", "backend": "kittens", "heap": "nvshmem", "ep": num_gpus,
             "error": f"NVSHMEM workers exited with {codes}"}]
  per_rank = []
  for rank in range(num_gpus):
    with open(os.path.join(work_dir, f"ep_worker_{rank}.json")) as f:
      per_rank.append(json.load(f))
  slowest = []
  for rank_rows in zip(*per_rank):
    timed = [r for r in rank_rows if "median_ms" in r]
    slowest.append(max(timed, key=lambda r: r["median_ms"]) if len(timed) == len(rank_rows) else rank_rows[0])
  return slowest


def main():
  args = parse_args()
  if args.worker is not None:
    nvshmem_worker(args)
    return
  rows = []
  if args.heap in ("cuda", "all") or jax.default_backend() == "cpu":
    rows += single_process(args)
  if args.heap in ("nvshmem", "all") and jax.default_backend() != "cpu":
    rows += nvshmem_run(args)
  _add_speedups(rows)
  num_gpus = len(jax.devices())
  name = f"ep_{num_gpus}x{common.gpu_tag()}" if not args.smoke else f"ep_{num_gpus}x_smoke"
  common.print_table(rows, ["shape", "routing", "mode", "backend", "heap", "ep", "median_ms", "tflops",
                            "payload_gbps", "moved_gbps", "vs_xla", "error"])
  plot_rows = [r for r in rows if r.get("mode") in ("fwd", "fwd_bwd")]
  common.write_results(name, args.out_dir, common.metadata(), rows, ("shape", "routing", "mode", "heap"),
                       plot_rows=plot_rows)


if __name__ == "__main__":
  main()
