"""Pure-JAX MoE feed-forward layer: the oracle for the kernels and the ``backend="xla"`` path of `moe_ffn`.

Routed experts run as grouped GEMMs (`jax.lax.ragged_dot`) over tokens permuted into expert-major order by
`jax_kittens.routing.schedule`. Under ``shard_map`` with ``axis_name`` the rows travel to the rank that owns their
expert with `jax.lax.ragged_all_to_all` and back the same way. Everything is plain JAX, so `jax.grad` differentiates
it w.r.t. x, router weights and every expert weight.

Precision: every GEMM takes and returns ``x.dtype`` (accumulating in float32 inside), SwiGLU runs in float32 on the
rounded gate and up and is cast back to ``x.dtype`` before the down GEMM; the weighted combine and the shared
expert's sum run in float32 before the final cast to ``x.dtype``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jax_kittens import routing
from jax_kittens.moe_stats import MoEStats

RaggedDot = Callable[..., jax.Array]


def swiglu(gate: jax.Array, up: jax.Array, limit: float | None) -> jax.Array:
  """silu(gate) * up, with gate clamped to <= limit and up to [-limit, limit] first when a limit is given."""
  if limit is not None:
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
  return jax.nn.silu(gate) * up


def grouped_ffn(rows_x, group_sizes, w_gate, w_up, w_down, swiglu_limit, ragged_dot):
  """SwiGLU experts over expert-major rows.

  rows_x: [N, H]; group_sizes: [E_local] int32 (sum <= N; rows past the sum give zeros) -> [N, H] rows_x.dtype.
  The GEMMs keep their operands' dtype (accumulating in float32 inside): a float32 output type would make their
  transposes mixed-dtype GEMMs, which XLA:GPU and tokamax run slowly or reject.
  """
  gate = ragged_dot(rows_x, w_gate, group_sizes)
  up = ragged_dot(rows_x, w_up, group_sizes)
  hidden = swiglu(gate.astype(jnp.float32), up.astype(jnp.float32), swiglu_limit).astype(rows_x.dtype)
  return ragged_dot(hidden, w_down, group_sizes)


def shared_ffn(x, shared_experts, swiglu_limit):
  """x: [T, H]; shared_experts: (w_gate [H, Is], w_up [H, Is], w_down [Is, H]) -> [T, H] x.dtype."""
  w_gate, w_up, w_down = shared_experts
  hidden = swiglu(jnp.dot(x, w_gate).astype(jnp.float32), jnp.dot(x, w_up).astype(jnp.float32), swiglu_limit)
  return jnp.dot(hidden.astype(x.dtype), w_down)


def token_of_row(rows, num_rows):
  """rows: [T, k] schedule rows (-1: unplaced) -> [num_rows] int32 source token of each row (0 for unused rows)."""
  num_tokens, top_k = rows.shape
  token = jnp.arange(num_tokens * top_k, dtype=jnp.int32) // top_k
  # -1 would wrap around; num_rows is out of bounds and dropped.
  targets = jnp.where(rows.reshape(-1) < 0, num_rows, rows.reshape(-1))
  return jnp.zeros((num_rows,), jnp.int32).at[targets].set(token, mode="drop")


def combine(expert_rows, rows, weights):
  """y[t] = sum_j weights[t, j] * expert_rows[rows[t, j]] (entries with row -1 contribute 0).

  expert_rows: [N, H]; rows: [T, k] int32; weights: [T, k] float -> [T, H] float32.
  """
  gathered = expert_rows[jnp.maximum(rows, 0)].astype(jnp.float32)
  weights = jnp.where(rows >= 0, weights.astype(jnp.float32), 0.0)
  return jnp.einsum("tkh,tk->th", gathered, weights)


def _exchange(values, axis_name):
  """values: [R, ...] on every rank -> [R, ...] where entry s is what rank s held at this rank's index."""
  return jax.lax.all_to_all(values, axis_name, 0, 0, tiled=True)


def _ragged_all_to_all_dense(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
  """`jax.lax.ragged_all_to_all` with one slice per rank, built from a padded dense all_to_all.

  XLA:CPU has no ragged-all-to-all; this moves [R, max slice rows, H] instead, with the same result.
  """
  num_ranks = input_offsets.shape[0]
  # A slice fits in both the sender's operand and the receiver's output (the same shape on every rank).
  max_slice_rows = min(operand.shape[0], output.shape[0])
  slot = jnp.arange(max_slice_rows, dtype=jnp.int32)
  source_rows = jnp.minimum(input_offsets[:, None] + slot[None, :], operand.shape[0] - 1)
  packed = jnp.where((slot[None, :] < send_sizes[:, None])[..., None], operand[source_rows], 0)
  received = _exchange(packed, axis_name)
  local_offsets = _exchange(output_offsets, axis_name)
  targets = jnp.where(slot[None, :] < recv_sizes[:, None], local_offsets[:, None] + slot[None, :], output.shape[0])
  return output.at[targets.reshape(-1)].set(received.reshape((num_ranks * max_slice_rows,) + operand.shape[1:]),
                                            mode="drop")


def _ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
  """`jax.lax.ragged_all_to_all`, or its dense twin where XLA lacks it (CPU)."""

  def native(*args):
    return jax.lax.ragged_all_to_all(*args, axis_name=axis_name)

  def dense(*args):
    return _ragged_all_to_all_dense(*args, axis_name=axis_name)

  # The buffer is fresh zeros, the same on every rank; what lands in it is not.
  output = jax.lax.pcast(output, axis_name, to="varying")
  return jax.lax.platform_dependent(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                    cpu=dense, default=native)


def _exclusive_cumsum(values, axis=-1):
  return jnp.cumsum(values, axis=axis, dtype=jnp.int32) - values


def _local_moe(x, weights, ids, w_gate, w_up, w_down, swiglu_limit, ragged_dot):
  num_experts = w_gate.shape[0]
  sched = routing.schedule(ids, num_experts, backend="xla")
  num_rows = ids.size
  rows_x = x[token_of_row(sched.rows, num_rows)]
  expert_rows = grouped_ffn(rows_x, sched.tokens_per_expert, w_gate, w_up, w_down, swiglu_limit, ragged_dot)
  y = combine(expert_rows, sched.rows, weights)
  received = jnp.sum(sched.tokens_per_expert, dtype=jnp.int32)
  return y, MoEStats(jnp.int32(num_rows) - received, received)


def receive_capacity(num_tokens: int, top_k: int, axis_size: int, capacity_factor: float | None) -> int:
  """Static rows each rank can receive: the dropless worst case T*k*axis_size, or ceil(capacity_factor * T*k)."""
  dropless = num_tokens * top_k * axis_size
  if capacity_factor is None:
    return dropless
  return max(1, min(dropless, math.ceil(capacity_factor * num_tokens * top_k)))


def _expert_parallel_moe(x, weights, ids, w_gate, w_up, w_down, swiglu_limit, ragged_dot, axis_name,
                         capacity_factor):
  num_local_experts = w_gate.shape[0]
  num_ranks = jax.lax.axis_size(axis_name)
  num_tokens, top_k = ids.shape
  num_rows = num_tokens * top_k
  capacity = receive_capacity(num_tokens, top_k, num_ranks, capacity_factor)

  # Source side: rows in global expert-major order are grouped by destination rank, then by its local expert.
  sched = routing.schedule(ids, num_local_experts * num_ranks, backend="xla")
  send_rows_x = x[token_of_row(sched.rows, num_rows)]
  send_counts = sched.tokens_per_expert.reshape(num_ranks, num_local_experts)
  send_offsets = sched.expert_offsets[:-1].reshape(num_ranks, num_local_experts)[:, 0]

  # Receive side: sources are laid out in rank order, each by local expert; whatever passes the capacity is cut off
  # from the end, so the dropped entries are the last sources' highest local experts.
  recv_counts_wanted = _exchange(send_counts, axis_name)  # [source, local expert]
  recv_totals_wanted = jnp.sum(recv_counts_wanted, axis=1, dtype=jnp.int32)
  recv_offsets = jnp.minimum(_exclusive_cumsum(recv_totals_wanted), capacity)
  recv_totals = jnp.clip(capacity - recv_offsets, 0, recv_totals_wanted)
  recv_counts = jnp.clip(recv_totals[:, None] - _exclusive_cumsum(recv_counts_wanted), 0, recv_counts_wanted)

  # Each source must know how much of its slice fits and where it lands on the owner.
  send_sizes = _exchange(recv_totals, axis_name)
  send_output_offsets = _exchange(recv_offsets, axis_name)
  received_x = _ragged_all_to_all(send_rows_x, jnp.zeros((capacity,) + x.shape[1:], x.dtype), send_offsets,
                                  send_sizes, send_output_offsets, recv_totals, axis_name=axis_name)

  # Regroup (source, local expert) blocks into local-expert-major order: a permutation of the capacity rows.
  group_sizes = jnp.sum(recv_counts, axis=0, dtype=jnp.int32)
  block_counts = recv_counts.reshape(-1)
  block_source_starts = _exclusive_cumsum(block_counts)
  block_expert_starts = (_exclusive_cumsum(group_sizes)[None, :] + _exclusive_cumsum(recv_counts, axis=0)).reshape(-1)
  row = jnp.arange(capacity, dtype=jnp.int32)
  block = jnp.searchsorted(block_source_starts + block_counts, row, side="right").astype(jnp.int32)
  in_use = block < block_counts.shape[0]
  block = jnp.minimum(block, block_counts.shape[0] - 1)
  # Rows past the received total stay where they are: the expert-major rows in use are exactly [0, total) too.
  expert_row_of_row = jnp.where(in_use, block_expert_starts[block] + row - block_source_starts[block], row)
  row_of_expert_row = jnp.zeros((capacity,), jnp.int32).at[expert_row_of_row].set(row, unique_indices=True)

  expert_rows = grouped_ffn(received_x[row_of_expert_row], group_sizes, w_gate, w_up, w_down, swiglu_limit,
                             ragged_dot)
  results = expert_rows[expert_row_of_row]

  # Back to the sources, into the rows their tokens left from; dropped rows stay zero.
  source_offsets = _exchange(send_offsets, axis_name)
  returned = _ragged_all_to_all(results, jnp.zeros((num_rows,) + x.shape[1:], x.dtype), recv_offsets, recv_totals,
                                source_offsets, send_sizes, axis_name=axis_name)
  y = combine(returned, sched.rows, weights)
  received = jnp.sum(recv_totals, dtype=jnp.int32)
  return y, MoEStats(jnp.int32(num_rows) - jnp.sum(send_sizes, dtype=jnp.int32), received)


def moe_ffn(x: jax.Array, weights: jax.Array, ids: jax.Array, w_gate: jax.Array, w_up: jax.Array,
            w_down: jax.Array, *, shared_experts: tuple[jax.Array, jax.Array, jax.Array] | None = None,
            swiglu_limit: float | None = None, axis_name: str | None = None, capacity_factor: float | None = None,
            return_stats: bool = False, ragged_dot: RaggedDot = jax.lax.ragged_dot):
  """Routed SwiGLU experts (plus optional shared experts) in pure JAX; arguments are not validated here.

  Args:
    x: [T, H] tokens (this rank's under ``axis_name``).
    weights: [T, k] float router weights.
    ids: [T, k] int32 expert ids, global under ``axis_name`` (expert e lives on rank e // E_local); ids outside the
      experts are dropped.
    w_gate, w_up: [E_local, H, I]; w_down: [E_local, I, H].
    shared_experts: optional (w_gate [H, Is], w_up [H, Is], w_down [Is, H]) applied to every token, unweighted.
    swiglu_limit: optional clamp of gate (above) and up (both sides) before silu(gate) * up, for all experts.
    axis_name: the ``shard_map`` axis the experts are split over.
    capacity_factor: rows each rank can receive, as a multiple of T*k (``None``: dropless, T*k*axis_size).
    return_stats: also return a `MoEStats`.
    ragged_dot: the grouped GEMM, called as ``ragged_dot(lhs, rhs, group_sizes)`` with the semantics of
      `jax.lax.ragged_dot` (benchmarks substitute other implementations).

  Returns:
    y: [T, H] x.dtype, y[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) + shared(x[t]); with ``return_stats``,
    ``(y, MoEStats)``.
  """
  if axis_name is None:
    y, stats = _local_moe(x, weights, ids, w_gate, w_up, w_down, swiglu_limit, ragged_dot)
  else:
    y, stats = _expert_parallel_moe(x, weights, ids, w_gate, w_up, w_down, swiglu_limit, ragged_dot, axis_name,
                                    capacity_factor)
  if shared_experts is not None:
    y = y + shared_ffn(x, shared_experts, swiglu_limit).astype(jnp.float32)
  y = y.astype(x.dtype)
  return (y, stats) if return_stats else y
