"""Expert parallelism over a `SymmetricHeap`: device-initiated dispatch and combine under ``shard_map``.

One layer call on rank r of the ``axis_name`` axis (EP ranks, E_local experts each, T tokens, top-k):

1. ``schedule``: this rank's (token, slot) entries in global expert-major *positions* 0..T*k-1.
2. ``jk_ep_plan``: publish the per-expert counts in the heap, read every rank's, and derive -- on every rank the same
   way -- what each owner keeps of each source (static receive capacity; overflow is cut in (source, local expert)
   order, like the pure-JAX reference) and where it lands (local-expert-major receive rows starting at 0).
3. ``jk_ep_to_experts`` (dispatch, a pull): stage the rows in our send area chunk by chunk, signalling each chunk to
   every peer; each owner pulls its receive blocks from the sources' send areas as their chunks are signalled.
4. The local grouped SwiGLU experts on the receive rows (group sizes from the plan).
5. ``jk_ep_from_experts`` (combine, a push): each owner writes the expert rows back into the sources' return areas and
   signals; each source copies its positions out (zeros where dropped), and the top-k weighted sum runs locally.

The two transports are each other's transpose, so the backward pass is the same machinery in reverse
(`custom_vjp`): the cotangent of the receive rows goes home with ``from_experts``, the cotangent of the returned rows
goes to the owners with ``to_experts``; weight gradients stay local. Every op has its own flags and epochs (no
barrier between them); waits time out after the heap's timeout and fail the call (CPU) or record the error in the
heap (GPU; `SymmetricHeap.check` and the next call raise it). There is no host synchronisation anywhere in a step.

Ordering. Calls of one channel on one heap must run in the same order on every rank (epochs are counted per call).
Within a layer the ops are chained by data, plus an explicit ``after`` operand that puts the backward's dispatch
after the forward's combine; sequential layers are chained by their activations. XLA:GPU runs a device's ops in its
one compiled order, the same on every rank; XLA:CPU may run independent ops concurrently, so two expert-parallel
calls that do not depend on each other (two layers side by side; `jax.checkpoint` recomputation of one layer beside
another's backward) should use separate heaps there.

Towards a persistent megakernel: the send area is signalled per chunk and receivers wait per piece of rows, so a
kernel whose communication SMs pull pieces and bump per-piece counters that its compute SMs wait on is a change of
scheduling; the layout (`kernels/expert_parallel.h`) and the flags stay.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_kittens import _extension, grouped_matmul, reference, routing
from jax_kittens.moe_stats import MoEStats
from jax_kittens.symmetric_heap import LIMITS, SymmetricHeap, default_heap

# Dropless (receive capacity = the worst case) when the receive rows of the worst case fit this; otherwise the
# capacity is _FALLBACK_CAPACITY_FACTOR * T*k rows and overflow is dropped (and counted) deterministically.
DROPLESS_MEMORY_CAP_BYTES = 2 << 30
_FALLBACK_CAPACITY_FACTOR = 2.0

ExpertFfn = Callable[..., jax.Array]  # (rows, group_sizes, w_gate, w_up, w_down) -> rows


class EpConfig(NamedTuple):
  """Static description of one expert-parallel call (hashable: it is a nondiff argument of the transports)."""

  heap_id: int
  num_ranks: int
  experts_per_rank: int
  capacity: int  # receive rows per rank
  num_positions: int  # T * k send positions per rank
  chunk_rows: int  # send positions per signalled chunk
  axis_name: str


def receive_capacity(num_tokens: int, top_k: int, num_ranks: int, experts_per_rank: int, row_bytes: int,
                     capacity_factor: float | None) -> int:
  """Static receive rows per rank.

  ``capacity_factor`` given: ceil(capacity_factor * T*k), as the reference does. None: dropless -- the worst case,
  every source sending all its entries' min(k, E_local) slots to one rank -- when those rows fit
  DROPLESS_MEMORY_CAP_BYTES, else the fallback factor.
  """
  if capacity_factor is not None:
    return reference.receive_capacity(num_tokens, top_k, num_ranks, capacity_factor)
  worst_case = num_tokens * min(top_k, experts_per_rank) * num_ranks
  if worst_case * row_bytes <= DROPLESS_MEMORY_CAP_BYTES:
    return worst_case
  return reference.receive_capacity(num_tokens, top_k, num_ranks, _FALLBACK_CAPACITY_FACTOR)


def _rank_operand(axis_name) -> jax.Array:
  return jax.lax.axis_index(axis_name).astype(jnp.int32)


def _plan(config: EpConfig, rank, counts):
  """counts: [E] int32 -> blocks [num_ranks * E_local, 3], send_kept [E], group_sizes [E_local], dropped [] int32."""
  num_blocks = config.num_ranks * config.experts_per_rank
  out_types = (jax.ShapeDtypeStruct((num_blocks, 3), jnp.int32),
               jax.ShapeDtypeStruct(counts.shape, jnp.int32),
               jax.ShapeDtypeStruct((config.experts_per_rank,), jnp.int32),
               jax.ShapeDtypeStruct((), jnp.int32))
  return tuple(_extension.ffi_call(
      "jk_ep_plan", out_types, rank, counts, heap_id=np.int64(config.heap_id), num_ranks=np.int32(config.num_ranks),
      experts_per_rank=np.int32(config.experts_per_rank), capacity=np.int32(config.capacity)))


# `after` is an operand the handlers ignore: the call runs once it is computed. XLA keeps no other ordering between
# independent custom calls (it drops optimization barriers before running thunks concurrently).
def _to_experts_call(config, packed, rank, blocks, after):
  out_type = jax.ShapeDtypeStruct((config.capacity,) + packed.shape[1:], packed.dtype)
  return _extension.ffi_call(
      "jk_ep_to_experts", out_type, rank, packed, blocks, after, heap_id=np.int64(config.heap_id),
      num_ranks=np.int32(config.num_ranks), experts_per_rank=np.int32(config.experts_per_rank),
      chunk_rows=np.int32(config.chunk_rows))


def _from_experts_call(config, expert_rows, rank, blocks, send_kept, offsets, after):
  out_type = jax.ShapeDtypeStruct((config.num_positions,) + expert_rows.shape[1:], expert_rows.dtype)
  return _extension.ffi_call(
      "jk_ep_from_experts", out_type, rank, expert_rows, blocks, send_kept, offsets, after,
      heap_id=np.int64(config.heap_id), num_ranks=np.int32(config.num_ranks),
      experts_per_rank=np.int32(config.experts_per_rank))


# The transports are linear and each other's transpose given one plan. Integer operands get no cotangent.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def to_experts(config: EpConfig, packed, rank, blocks, send_kept, offsets):
  """packed: [T*k, ...] this rank's rows in expert-major positions -> [capacity, ...] the rows its experts keep."""
  return _to_experts_call(config, packed, rank, blocks, rank)


def _to_experts_fwd(config, packed, rank, blocks, send_kept, offsets):
  return _to_experts_call(config, packed, rank, blocks, rank), (rank, blocks, send_kept, offsets)


def _to_experts_bwd(config, residuals, d_recv):
  # d_recv comes out of the experts' backward, which consumed the backward's dispatch: already ordered after it.
  rank, blocks, send_kept, offsets = residuals
  return (_from_experts_call(config, d_recv, rank, blocks, send_kept, offsets, rank), None, None, None, None)


to_experts.defvjp(_to_experts_fwd, _to_experts_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def from_experts(config: EpConfig, expert_rows, rank, blocks, send_kept, offsets):
  """expert_rows: [capacity, ...] results of this rank's experts -> [T*k, ...] this rank's positions (0: dropped)."""
  return _from_experts_call(config, expert_rows, rank, blocks, send_kept, offsets, rank)


def _from_experts_fwd(config, expert_rows, rank, blocks, send_kept, offsets):
  returned = _from_experts_call(config, expert_rows, rank, blocks, send_kept, offsets, rank)
  # One row of the result orders the backward's dispatch after this combine (see _from_experts_bwd).
  return returned, (rank, blocks, send_kept, offsets, returned[:1])


def _from_experts_bwd(config, residuals, d_returned):
  rank, blocks, send_kept, offsets, forward_done = residuals
  # d_returned need not depend on the forward's transports (d_y is often an input): without the edge XLA may run
  # this dispatch before or beside the forward's, in a different order on different ranks, swapping their epochs.
  return (_to_experts_call(config, d_returned, rank, blocks, forward_done), None, None, None, None)


from_experts.defvjp(_from_experts_fwd, _from_experts_bwd)


def local_expert_ffn(swiglu_limit, ragged_dot=jax.lax.ragged_dot) -> ExpertFfn:
  """The local grouped SwiGLU of the pure-JAX reference, over ``ragged_dot``."""
  def expert_ffn(rows, group_sizes, w_gate, w_up, w_down):
    return reference.grouped_ffn(rows, group_sizes, w_gate, w_up, w_down, swiglu_limit, ragged_dot)
  return expert_ffn


def check_axis(axis_name) -> int:
  """The size of the expert-parallel axis ``axis_name``; ValueError when it is not a mesh axis in scope."""
  if not isinstance(axis_name, str):
    raise TypeError(f"axis_name must be a str naming a shard_map mesh axis, got {type(axis_name).__name__}")
  try:
    num_ranks = jax.lax.axis_size(axis_name)
  except (NameError, KeyError, ValueError) as error:
    raise ValueError(f"axis_name={axis_name!r} is not a mesh axis in scope: call moe_ffn inside shard_map over a "
                     f"mesh with that axis") from error
  if not 1 <= num_ranks <= LIMITS["max_ranks"]:
    raise ValueError(f"the expert-parallel axis {axis_name!r} has {num_ranks} ranks; supported: "
                     f"1..{LIMITS['max_ranks']}")
  mesh = jax.sharding.get_abstract_mesh()
  others = {name: size for name, size in zip(mesh.axis_names, mesh.axis_sizes) if name != axis_name and size > 1}
  if others:
    # A heap's ranks are one group; several groups (a data axis beside the expert axis) would share them.
    raise ValueError(f"the kittens expert-parallel path needs {axis_name!r} to be the only mesh axis with more than "
                     f"one device; other mesh axes {others} would run several groups over one heap")
  return int(num_ranks)


class Dispatched(NamedTuple):
  """What `dispatch` leaves for `combine` (arrays of this rank; ``config`` is static)."""

  config: EpConfig
  rank: jax.Array  # [] int32 axis index
  rows: jax.Array  # [T, k] int32 schedule positions of this rank's entries (-1: id outside the experts)
  blocks: jax.Array  # [EP * E_local, 3] int32 receive blocks of this rank
  send_kept: jax.Array  # [E] int32 kept entries of this rank per global expert
  expert_offsets: jax.Array  # [E + 1] int32 first position of each global expert here
  group_sizes: jax.Array  # [E_local] int32 received rows per local expert
  dropped: jax.Array  # [] int32 this rank's entries over capacity or outside the experts


def dispatch(x: jax.Array, ids: jax.Array, *, axis_name: str, experts_per_rank: int,
             capacity_factor: float | None = None, heap: SymmetricHeap | None = None
             ) -> tuple[jax.Array, Dispatched]:
  """Moves each (token, slot) entry's row of x to its expert's rank; call inside ``shard_map``.

  x: [T, H] this rank's tokens; ids: [T, k] int32 global expert ids (expert e on rank e // experts_per_rank).
  Returns recv [capacity, H] x.dtype -- this rank's received rows, local-expert-major from row 0, group sizes in
  ``Dispatched.group_sizes``, zeros past them -- and the `Dispatched` state `combine` needs.
  """
  num_ranks = check_axis(axis_name)
  num_tokens, top_k = ids.shape
  num_experts = experts_per_rank * num_ranks
  if num_experts > LIMITS["max_experts"]:
    raise ValueError(f"E_local * EP = {num_experts} experts exceed the heap's count area ({LIMITS['max_experts']})")
  row_bytes = math.prod(x.shape[1:]) * x.dtype.itemsize
  if row_bytes % 4:
    raise ValueError(f"a token row must be a multiple of 4 bytes to travel, got hidden={x.shape[1:]} of {x.dtype}")
  num_positions = num_tokens * top_k
  capacity = receive_capacity(num_tokens, top_k, num_ranks, experts_per_rank, row_bytes, capacity_factor)
  if heap is None:
    heap = default_heap(num_ranks, num_positions * row_bytes, _extension.mesh_platform())
  elif not isinstance(heap, SymmetricHeap):
    raise TypeError(f"heap must be a SymmetricHeap, got {type(heap).__name__}")
  if heap.num_ranks != num_ranks:
    raise ValueError(f"heap has {heap.num_ranks} ranks but the axis {axis_name!r} has {num_ranks}")
  if heap.area_bytes < num_positions * row_bytes:
    raise ValueError(f"heap areas hold {heap.area_bytes} bytes, this call stages {num_positions * row_bytes}: "
                     f"create the SymmetricHeap with region_bytes >= "
                     f"{heap.region_bytes - 2 * heap.area_bytes + 2 * num_positions * row_bytes}")
  chunk_rows = max(1, -(-num_positions // LIMITS["max_chunks"]))
  config = EpConfig(heap.id, num_ranks, experts_per_rank, capacity, num_positions, chunk_rows, axis_name)

  rank = _rank_operand(axis_name)
  sched = routing.schedule(ids, num_experts)
  counts = sched.tokens_per_expert
  blocks, send_kept, group_sizes, dropped = _plan(config, rank, counts)
  packed = x[reference.token_of_row(sched.rows, num_positions)]
  recv = to_experts(config, packed, rank, blocks, send_kept, sched.expert_offsets)
  invalid = jnp.int32(num_positions) - jnp.sum(counts, dtype=jnp.int32)
  return recv, Dispatched(config, rank, sched.rows, blocks, send_kept, sched.expert_offsets, group_sizes,
                          dropped + invalid)


def combine(expert_rows: jax.Array, weights: jax.Array, dispatched: Dispatched) -> jax.Array:
  """Returns the expert rows to their tokens' ranks and sums them with the router weights.

  expert_rows: [capacity, H] this rank's experts' results for `dispatch`'s recv rows; weights: [T, k] float.
  Returns y [T, H] float32: y[t] = sum_j weights[t, j] * (result of entry (t, j), 0 where it was dropped).
  """
  d = dispatched
  returned = from_experts(d.config, expert_rows, d.rank, d.blocks, d.send_kept, d.expert_offsets)
  return reference.combine(returned, d.rows, weights)


def expert_parallel_moe(x: jax.Array, weights: jax.Array, ids: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                        w_down: jax.Array, *, axis_name: str, swiglu_limit: float | None = None,
                        capacity_factor: float | None = None, heap: SymmetricHeap | None = None,
                        expert_ffn: ExpertFfn | None = None) -> tuple[jax.Array, MoEStats]:
  """Routed experts split over ``axis_name``, communicating through a symmetric heap; call inside ``shard_map``.

  Args:
    x: [T, H] this rank's tokens; weights: [T, k] float router weights; ids: [T, k] int32 global expert ids
      (expert e lives on rank e // E_local; ids outside [0, E_local * EP) are dropped).
    w_gate, w_up: [E_local, H, I]; w_down: [E_local, I, H]: this rank's experts.
    capacity_factor: receive rows per rank as a multiple of T*k; None: dropless when it fits (`receive_capacity`).
    heap: the `SymmetricHeap` to communicate through; None: `default_heap` of the axis size.
    expert_ffn: ``(rows [N, H], group_sizes [E_local], w_gate, w_up, w_down) -> [N, H]``, the local grouped SwiGLU
      (rows past sum(group_sizes) are zeros and may give anything); default: the pure-JAX reference's.

  Returns:
    y: [T, H] float32 routed-expert sum (no shared experts), and `MoEStats` of this rank.
  """
  recv, dispatched = dispatch(x, ids, axis_name=axis_name, experts_per_rank=w_gate.shape[0],
                              capacity_factor=capacity_factor, heap=heap)
  expert_ffn = expert_ffn or local_expert_ffn(swiglu_limit)
  expert_rows = expert_ffn(recv, dispatched.group_sizes, w_gate, w_up, w_down)
  y = combine(expert_rows, weights, dispatched)
  return y, MoEStats(dispatched.dropped, jnp.sum(dispatched.group_sizes, dtype=jnp.int32))


def moe_ffn(x, weights, ids, w_gate, w_up, w_down, *, axis_name: str, shared_experts=None, swiglu_limit=None,
            recompute: bool = False, capacity_factor=None, return_stats: bool = False,
            heap: SymmetricHeap | None = None):
  """`jax_kittens.moe_ffn` with ``backend="kittens"`` and ``axis_name``: arguments as there (checked by it).

  Routed experts go through `expert_parallel_moe`, the local ones with `grouped_matmul.ragged_dot` (the kittens
  grouped GEMM where it takes the operands, else XLA's); the shared experts run locally. Returns y [T, H] x.dtype,
  or ``(y, MoEStats)`` with ``return_stats``.
  """
  def layer(x, weights, ids, w_gate, w_up, w_down, shared_experts):
    y, stats = expert_parallel_moe(x, weights, ids, w_gate, w_up, w_down, axis_name=axis_name,
                                   swiglu_limit=swiglu_limit, capacity_factor=capacity_factor, heap=heap,
                                   expert_ffn=local_expert_ffn(swiglu_limit, grouped_matmul.ragged_dot))
    if shared_experts is not None:
      y = y + reference.shared_ffn(x, shared_experts, swiglu_limit)
    return y.astype(x.dtype), stats

  y, stats = (jax.checkpoint(layer) if recompute else layer)(x, weights, ids, w_gate, w_up, w_down, shared_experts)
  return (y, stats) if return_stats else y
