"""One process of the multi-process NVSHMEM expert-parallel check (run by test_expert_parallel.py, one per GPU).

  python3 tests/nvshmem_worker.py COORDINATOR NUM_PROCESSES PROCESS_ID

Every process builds the same global layer from a fixed seed, runs moe_ffn over an NVSHMEM heap with one GPU per
process, and compares its own token rows with the pure-JAX reference of the whole layer on its CPU. Exit code 0: match.
"""

import os
import sys

os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
os.environ["NCCL_NVLS_ENABLE"] = "0"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from jax_kittens import expert_parallel, reference, symmetric_heap  # noqa: E402
from moe_oracle import random_layer  # noqa: E402


def main(coordinator, num_processes, process_id):
  jax.distributed.initialize(coordinator, num_processes, process_id)
  mesh = Mesh(np.array(jax.devices()), ("ep",))
  num_ranks = mesh.shape["ep"]
  layer = random_layer(np.random.default_rng(1234), 96 * num_ranks, 128, 64, 2 * num_ranks, 3, load="skewed")
  names = ("x", "weights", "ids", "w_gate", "w_up", "w_down")
  host = {name: (layer[name] if name in ("ids", "weights") else layer[name].astype(jnp.bfloat16)) for name in names}
  sharding = NamedSharding(mesh, P("ep"))
  args = [jax.make_array_from_callback(host[name].shape, sharding, lambda index, a=host[name]: a[index])
          for name in names]
  heap = symmetric_heap.SymmetricHeap.nvshmem(symmetric_heap.region_bytes_for(1 << 22))

  def local(x, weights, ids, w_gate, w_up, w_down):
    return expert_parallel.moe_ffn(x, weights, ids, w_gate, w_up, w_down, axis_name="ep", heap=heap)

  run = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("ep"),) * 6, out_specs=P("ep")))
  for _ in range(3):  # several steps: the epochs must keep the ranks in step
    y = run(*args)
  jax.block_until_ready(y)
  heap.check()
  with jax.default_device(jax.devices("cpu")[0]):
    want = np.asarray(reference.moe_ffn(*[np.asarray(host[n], np.float32) if n not in ("ids",) else host[n]
                                          for n in names]))
  shard = y.addressable_shards[0]
  got = np.asarray(shard.data, np.float32)
  expected = want[shard.index]
  error = np.abs(got - expected).max() / max(np.abs(expected).max(), 1e-6)
  print(f"process {process_id}: relative error {error:.3g}", flush=True)
  sys.exit(0 if error < 3e-2 else 1)


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
