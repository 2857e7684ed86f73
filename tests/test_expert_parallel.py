"""Expert parallelism through the symmetric heap (backend="kittens" with axis_name) against one device.

CPU: the real protocol on the 8 host devices (XLA runs their programs concurrently in threads). GPU (`gpu` marker):
EP = 1 on one GPU through the same kernels, and the NVSHMEM heap initialised in one process.
"""

import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jax_kittens import _extension, expert_parallel, moe, reference, symmetric_heap
from jax_kittens.symmetric_heap import SymmetricHeap
from moe_oracle import kept_under_capacity, moe_forward_backward, random_layer
from sharded import ep_mesh, sharded_forward_backward

TOLERANCE = dict(rtol=2e-4, atol=2e-4)


@pytest.fixture
def rng():
  seed = int(np.random.SeedSequence().entropy % 2**32)
  print(f"seed {seed}")  # shown when a test fails, to replay it
  return np.random.default_rng(seed)


def _run_layer(mesh, layer, d_y, *, capacity_factor=None, swiglu_limit=None, heap=None, backend="kittens",
               recompute=False, steps=1):
  """y, stats and gradients (x, weights, w_gate, w_up, w_down, shared) of moe_ffn split over the "ep" axis, after
  ``steps`` runs of the compiled program."""

  def layer_fn(x, weights, ids, w_gate, w_up, w_down, shared):
    if heap is None:
      return moe.moe_ffn(x, weights, ids, w_gate, w_up, w_down, shared_experts=shared, swiglu_limit=swiglu_limit,
                         axis_name="ep", capacity_factor=capacity_factor, return_stats=True, backend=backend,
                         recompute=recompute)
    return expert_parallel.moe_ffn(x, weights, ids, w_gate, w_up, w_down, shared_experts=shared,
                                   swiglu_limit=swiglu_limit, axis_name="ep", capacity_factor=capacity_factor,
                                   return_stats=True, heap=heap)

  return sharded_forward_backward(mesh, layer_fn, layer, d_y, steps=steps)


def _assert_matches_oracle(y, grads, want_y, want_grads, tolerance=TOLERANCE):
  np.testing.assert_allclose(np.asarray(y, np.float32), want_y, **tolerance)
  for name, got, want in zip(("x", "weights", "w_gate", "w_up", "w_down"), grads, want_grads):
    np.testing.assert_allclose(np.asarray(got, np.float32), want, err_msg=f"d {name}", **tolerance)
  if want_grads.shared is not None:
    for got, want in zip(grads[5], want_grads.shared):
      np.testing.assert_allclose(got, want, err_msg="d shared", **tolerance)


@pytest.mark.parametrize("num_ranks,load,shared,limit", [(2, "skewed", None, None), (4, "uniform", 6, 1.5),
                                                         (4, "one_expert", 5, None), (8, "skewed", None, None),
                                                         (8, "one_expert", 5, None)])
def test_matches_single_device(rng, num_ranks, load, shared, limit):
  # 13 tokens and 2 experts per rank, top-3: sizes off any tile; "skewed" leaves about a third of the experts empty.
  local_tokens, local_experts, top_k = 13, 2, 3
  layer = random_layer(rng, local_tokens * num_ranks, 16, 12, local_experts * num_ranks, top_k, load=load,
                       shared=shared)
  d_y = rng.standard_normal(layer["x"].shape).astype(np.float32)
  y, stats, grads = _run_layer(ep_mesh(num_ranks), layer, d_y, swiglu_limit=limit)
  want_y, want_grads = moe_forward_backward(**layer, d_y=d_y, swiglu_limit=limit)
  _assert_matches_oracle(y, grads, want_y, want_grads)
  np.testing.assert_array_equal(stats.dropped_tokens, 0)
  counts = np.bincount(layer["ids"].reshape(-1) // local_experts, minlength=num_ranks)
  np.testing.assert_array_equal(stats.received_tokens, counts)


def test_shared_expert_psum_beside_the_transports_for_many_steps(rng):
  # Issue 5. With a shared expert, shard_map's transpose adds an XLA psum of its replicated weights' gradient that
  # depends on no transport. While the CPU handlers waited for their peers on XLA's threads, 8 ranks on 2 cores
  # deadlocked (XLA aborts the process) within 5 to 17 steps of one executable in every run; see
  # csrc/ffi/expert_parallel.cc.
  num_ranks = 8
  layer = random_layer(rng, 13 * num_ranks, 16, 12, 2 * num_ranks, 3, load="one_expert", shared=5)
  d_y = rng.standard_normal(layer["x"].shape).astype(np.float32)
  y, _, grads = _run_layer(ep_mesh(num_ranks), layer, d_y, steps=40)
  want_y, want_grads = moe_forward_backward(**layer, d_y=d_y)
  _assert_matches_oracle(y, grads, want_y, want_grads)


def test_expert_without_tokens_idle_rank_and_invalid_ids(rng):
  # Rank 1's experts get nothing at all, expert 0 nothing either: empty blocks and empty groups everywhere. Two ids
  # outside the experts are dropped and counted on their source rank (0).
  num_ranks, local_tokens, local_experts, top_k = 4, 9, 2, 2
  layer = random_layer(rng, local_tokens * num_ranks, 8, 8, local_experts * num_ranks, top_k)
  allowed = np.array([1, 4, 5, 6, 7])
  layer["ids"] = np.stack([rng.choice(allowed, top_k, replace=False) for _ in range(local_tokens * num_ranks)])
  layer["ids"] = layer["ids"].astype(np.int32)
  layer["ids"][2, 1] = -1
  layer["ids"][5, 0] = local_experts * num_ranks
  kept = (layer["ids"] >= 0) & (layer["ids"] < local_experts * num_ranks)
  d_y = rng.standard_normal(layer["x"].shape).astype(np.float32)
  y, stats, grads = _run_layer(ep_mesh(num_ranks), layer, d_y)
  want_y, want_grads = moe_forward_backward(**{**layer, "ids": np.where(kept, layer["ids"], 0)}, d_y=d_y, kept=kept)
  _assert_matches_oracle(y, grads, want_y, want_grads)
  assert int(stats.received_tokens[1]) == 0
  np.testing.assert_array_equal(stats.dropped_tokens, [2, 0, 0, 0])


@pytest.mark.parametrize("num_ranks,capacity_factor", [(4, 0.75), (8, 0.4)])
def test_capacity_drops_deterministically_and_counts(rng, num_ranks, capacity_factor):
  local_tokens, local_experts, top_k = 16, 2, 2
  layer = random_layer(rng, local_tokens * num_ranks, 8, 8, local_experts * num_ranks, top_k, load="skewed")
  d_y = rng.standard_normal(layer["x"].shape).astype(np.float32)
  y, stats, grads = _run_layer(ep_mesh(num_ranks), layer, d_y, capacity_factor=capacity_factor)
  capacity = reference.receive_capacity(local_tokens, top_k, num_ranks, capacity_factor)
  kept = kept_under_capacity(layer["ids"], num_ranks, local_experts, capacity)
  assert (~kept).sum() > 0
  want_y, want_grads = moe_forward_backward(**layer, d_y=d_y, kept=kept)
  _assert_matches_oracle(y, grads, want_y, want_grads)
  np.testing.assert_array_equal(stats.dropped_tokens, (~kept).reshape(num_ranks, -1).sum(axis=1))
  np.testing.assert_array_equal(stats.received_tokens,
                                np.bincount((layer["ids"] // local_experts)[kept], minlength=num_ranks))
  # The same drops as the pure-JAX ragged_all_to_all path, to the bit of its statistics.
  _, xla_stats, _ = _run_layer(ep_mesh(num_ranks), layer, d_y, capacity_factor=capacity_factor, backend="xla")
  np.testing.assert_array_equal(stats.dropped_tokens, xla_stats.dropped_tokens)


def test_bfloat16_and_recompute(rng):
  num_ranks = 4
  layer = random_layer(rng, 10 * num_ranks, 16, 8, 2 * num_ranks, 2, load="skewed")
  bf16 = {name: (jnp.asarray(value, jnp.bfloat16) if name not in ("ids", "weights") else value)
          for name, value in layer.items()}
  d_y = rng.standard_normal(layer["x"].shape).astype(np.float32)
  y, _, grads = _run_layer(ep_mesh(num_ranks), bf16, d_y, recompute=True)
  want_y, want_grads = moe_forward_backward(**{k: np.asarray(v, np.float32) for k, v in bf16.items() if k != "ids"},
                                            ids=layer["ids"], d_y=d_y)
  scale = np.abs(want_y).max()
  np.testing.assert_allclose(np.asarray(y, np.float32), want_y, rtol=3e-2, atol=3e-2 * scale)
  np.testing.assert_allclose(np.asarray(grads[0], np.float32), want_grads.x, rtol=5e-2,
                             atol=5e-2 * np.abs(want_grads.x).max())
  for name, got, want in zip(("weights", "w_gate", "w_up", "w_down"), grads[1:5], want_grads[1:5]):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 3e-2, name


def _forward(mesh, heap, capacity_factor=None):
  def local(x, weights, ids, w_gate, w_up, w_down):
    y, stats = expert_parallel.moe_ffn(x, weights, ids, w_gate, w_up, w_down, axis_name="ep", heap=heap,
                                       capacity_factor=capacity_factor, return_stats=True)
    return y, stats.dropped_tokens[None]

  return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("ep"),) * 6, out_specs=(P("ep"), P("ep"))))


def _layer_args(layer):
  return tuple(layer[name] for name in ("x", "weights", "ids", "w_gate", "w_up", "w_down"))


def test_heap_does_not_grow_over_1000_calls(rng):
  num_ranks = 4
  layer = random_layer(rng, 4 * num_ranks, 8, 8, 2 * num_ranks, 2, load="skewed")
  heap = SymmetricHeap.create(jax.devices("cpu")[:num_ranks], symmetric_heap.region_bytes_for(1 << 16))
  run = _forward(ep_mesh(num_ranks), heap)
  args = _layer_args(layer)
  first, _ = run(*args)
  stats_before = symmetric_heap.heap_stats()
  for _ in range(1000):
    y, _ = run(*args)
  y.block_until_ready()
  assert symmetric_heap.heap_stats() == stats_before
  np.testing.assert_array_equal(y, first)
  heap.check()
  heap.close()


def test_default_heap_survives_recompiles(rng):
  layer = random_layer(rng, 8, 8, 8, 4, 2)
  mesh = ep_mesh(2)
  y_first, _ = _forward(mesh, None)(*_layer_args(layer))
  live = symmetric_heap.heap_stats()
  jax.clear_caches()
  y_again, _ = _forward(mesh, None)(*_layer_args(layer))
  assert symmetric_heap.heap_stats() == live
  np.testing.assert_array_equal(y_first, y_again)


def test_default_heap_is_on_the_meshs_devices(rng, monkeypatch):
  """On a GPU machine (JAX's default backend "gpu"), a layer over a mesh of CPU devices stages through a CPU heap:
  the default heap follows the devices the call runs on (it used to take JAX's default backend, and failed there)."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(_extension, "cuda_unavailable_reason", lambda: None)  # kernels that run on that GPU
  layer = random_layer(rng, 8 * 2, 8, 8, 4, 2)
  y, _ = _forward(ep_mesh(2), None)(*_layer_args(layer))
  np.testing.assert_allclose(np.asarray(y, np.float32), moe_forward_backward(**layer, d_y=np.zeros((16, 8)))[0],
                             **TOLERANCE)


def test_peer_that_never_signals_times_out(rng):
  num_ranks = 4
  layer = random_layer(rng, 4 * num_ranks, 8, 8, 2 * num_ranks, 2)
  heap = SymmetricHeap.create(jax.devices("cpu")[:num_ranks], symmetric_heap.region_bytes_for(1 << 16),
                              timeout_s=0.3)
  heap._set_skip_signal_rank(0)
  with pytest.raises(Exception, match="timed out"):
    jax.block_until_ready(_forward(ep_mesh(num_ranks), heap)(*_layer_args(layer)))
  with pytest.raises(RuntimeError, match="rank 0 never signalled"):
    heap.check()
  heap.close()


def test_bad_axis_mesh_and_heap_raise(rng):
  layer = random_layer(rng, 8, 8, 8, 4, 2)
  args = _layer_args(layer)

  def call(axis_name, heap=None):
    def local(x, weights, ids, w_gate, w_up, w_down):
      return expert_parallel.moe_ffn(x, weights, ids, w_gate, w_up, w_down, axis_name=axis_name, heap=heap)
    return jax.shard_map(local, mesh=ep_mesh(2), in_specs=(P("ep"),) * 6, out_specs=P("ep"))(*args)

  with pytest.raises(ValueError, match="axis_name='nope'"):
    call("nope")
  with pytest.raises(TypeError, match="axis_name"):
    call(3)
  four_ranks = SymmetricHeap.create(jax.devices("cpu")[:4], symmetric_heap.region_bytes_for(1 << 12))
  with pytest.raises(ValueError, match="heap has 4 ranks"):
    call("ep", four_ranks)
  four_ranks.close()
  # 2 x 64 positions of 16 floats per rank: 8 KiB to stage, over the 4 KiB areas of the smallest heap.
  big = random_layer(rng, 128, 16, 8, 4, 2)
  tiny = SymmetricHeap.create(jax.devices("cpu")[:2], symmetric_heap.region_bytes_for(64))

  def local_tiny(x, weights, ids, w_gate, w_up, w_down):
    return expert_parallel.moe_ffn(x, weights, ids, w_gate, w_up, w_down, axis_name="ep", heap=tiny)

  with pytest.raises(ValueError, match="region_bytes >="):
    jax.shard_map(local_tiny, mesh=ep_mesh(2), in_specs=(P("ep"),) * 6, out_specs=P("ep"))(*_layer_args(big))
  tiny.close()

  # Two expert-parallel groups (a data axis beside "ep") would share one heap's ranks.
  grid = Mesh(np.array(jax.devices("cpu")[:4]).reshape(2, 2), ("data", "ep"))

  def local(x, weights, ids, w_gate, w_up, w_down):
    return expert_parallel.moe_ffn(x, weights, ids, w_gate, w_up, w_down, axis_name="ep")

  with pytest.raises(ValueError, match="other mesh axes"):
    jax.shard_map(local, mesh=grid, in_specs=(P(("data", "ep")),) * 3 + (P("ep"),) * 3,
                  out_specs=P(("data", "ep")))(*args)

  with pytest.raises(ValueError, match="devices must be distinct"):
    SymmetricHeap.create([jax.devices("cpu")[0]] * 2, 1 << 20)
  with pytest.raises(ValueError, match="region_bytes must be at least"):
    SymmetricHeap.create(jax.devices("cpu")[:2], 4096)


# ---------------------------------------------------------------------------------------------------------------
# GPU: the CUDA kernels with EP = 1 (every peer is this GPU), and the NVSHMEM heap in one process.

def _gpu_layer(rng, load="skewed"):
  layer = random_layer(rng, 300, 128, 64, 6, 2, load=load)
  return {name: (jnp.asarray(value, jnp.bfloat16) if name not in ("ids", "weights") else value)
          for name, value in layer.items()}


def _assert_close_to_reference(y, layer):
  with jax.default_device(jax.devices("cpu")[0]):
    want = reference.moe_ffn(*[np.asarray(jnp.asarray(a, jnp.float32)) if a.dtype != np.int32 else a
                               for a in _layer_args(layer)])
  scale = float(np.abs(want).max())
  np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=3e-2, atol=3e-2 * scale)


@pytest.mark.gpu
def test_gpu_single_rank_through_the_kernels(rng):
  layer = _gpu_layer(rng)
  d_y = rng.standard_normal(layer["x"].shape).astype(np.float32)
  y, stats, grads = _run_layer(ep_mesh(1, "gpu"), layer, d_y)
  _assert_close_to_reference(y, layer)
  assert int(stats.dropped_tokens[0]) == 0
  _, _, xla_grads = _run_layer(ep_mesh(1, "gpu"), layer, d_y, backend="xla")
  for got, want in zip(grads[:5], xla_grads[:5]):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, rtol=5e-2, atol=5e-2 * np.abs(want).max())
  y, _ = _forward(ep_mesh(1, "gpu"), None, capacity_factor=0.5)(*_layer_args(layer))
  jax.block_until_ready(y)
  symmetric_heap.default_heap(1, 0, "gpu").check()


@pytest.mark.gpu
def test_gpu_timeout_is_recorded_not_a_hang(rng):
  layer = _gpu_layer(rng)
  heap = SymmetricHeap.create(jax.devices("gpu")[:1], symmetric_heap.region_bytes_for(1 << 20), timeout_s=0.2)
  heap._set_skip_signal_rank(0)
  try:
    # A kernel cannot fail its XLA execution: the call completes (its output is garbage) unless a later call on the
    # heap already saw the recorded error and failed.
    jax.block_until_ready(_forward(ep_mesh(1, "gpu"), heap)(*_layer_args(layer)))
  except Exception as error:  # noqa: BLE001
    assert "timed out" in str(error)
  with pytest.raises(RuntimeError, match="never signalled"):
    heap.check()
  heap.close()


@pytest.mark.gpu
@pytest.mark.skipif(not symmetric_heap.nvshmem_available(), reason="needs the nvidia-nvshmem wheel and _jk_nvshmem")
def test_gpu_nvshmem_heap_in_one_process(rng):
  if jax.process_count() != 1 or len(jax.local_devices()) != 1:
    pytest.skip("the one-process NVSHMEM test needs exactly one visible GPU (CUDA_VISIBLE_DEVICES=0)")
  layer = _gpu_layer(rng, load="uniform")
  heap = SymmetricHeap.nvshmem(symmetric_heap.region_bytes_for(1 << 22))
  y, _ = _forward(ep_mesh(1, "gpu"), heap)(*_layer_args(layer))
  _assert_close_to_reference(y, layer)
  heap.check()


@pytest.mark.gpu
def test_gpu_all_local_gpus_single_process_heap(rng):
  num_gpus = min(len(jax.devices("gpu")), 8)
  if num_gpus < 2:
    pytest.skip("needs at least 2 GPUs")
  layer = random_layer(rng, 96 * num_gpus, 128, 64, 2 * num_gpus, 3, load="skewed")
  layer = {name: (jnp.asarray(value, jnp.bfloat16) if name not in ("ids", "weights") else value)
           for name, value in layer.items()}
  for _ in range(3):  # several steps on one heap: the epochs must keep the ranks in step
    y, _ = _forward(ep_mesh(num_gpus, "gpu"), None)(*_layer_args(layer))
  _assert_close_to_reference(y, layer)
  symmetric_heap.default_heap(num_gpus, 0, "gpu").check()


@pytest.mark.gpu
@pytest.mark.skipif(not symmetric_heap.nvshmem_available(), reason="needs the nvidia-nvshmem wheel and _jk_nvshmem")
def test_gpu_nvshmem_one_process_per_gpu():
  num_gpus = min(len(jax.devices("gpu")), 8)
  if num_gpus < 2:
    pytest.skip("needs at least 2 GPUs")
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nvshmem_worker.py")
  procs = [subprocess.Popen([sys.executable, worker, f"localhost:{port}", str(num_gpus), str(rank)],
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": str(rank),
                                 "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
           for rank in range(num_gpus)]
  outputs = [p.communicate(timeout=600)[0] for p in procs]
  for rank, (p, output) in enumerate(zip(procs, outputs)):
    assert p.returncode == 0, f"worker {rank} failed:\n{output[-3000:]}"
