"""Token <-> expert-major row permutations of the fused MoE pipeline: `gather_rows`, `combine`, `row_tokens`,
`rows_of_slots` and `slots_of_rows`.

Row layout: a `jax_kittens.Schedule` sends entry (t, j) of a [T, k] routing to row ``rows[t, j]`` of [R, H]
expert-major buffers (``-1``: nowhere); expert e's data rows are ``[expert_offsets[e], expert_offsets[e] +
tokens_per_expert[e])`` and every other row is padding.

`gather_rows` and `combine` are one FFI target each: ``jk_moe_gather`` and ``jk_moe_combine``, CUDA kernels on GPU
(kernels/moe_permute.cuh) and their CPU twins elsewhere (ffi/moe_permute.cc). Both are deterministic (no atomics) and
not differentiable on their own: `jax_kittens.fused_moe` uses `combine` as the transpose of its row reads in its VJP,
whether the rows were gathered by `gather_rows` or read from the tokens through `row_tokens` by the grouped GEMMs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_kittens import _extension
from jax_kittens._checks import check_array
from jax_kittens.routing import Schedule

_VALUE_DTYPES = (jnp.bfloat16, jnp.float32)


def _check_slots(name, x, slots_shape, dtype):
  check_array(name, x, 2)
  if tuple(x.shape) != tuple(slots_shape):
    raise ValueError(f"{name} must have the routing's shape [T, k] = {tuple(slots_shape)}, got {tuple(x.shape)}")
  if x.dtype != dtype:
    raise TypeError(f"{name} must be {jnp.dtype(dtype)}, got {x.dtype}")


def _check_num_rows(num_rows):
  if not isinstance(num_rows, int | np.integer) or num_rows < 0 or num_rows >= 2**31:
    raise ValueError(f"num_rows must be an int in [0, 2^31), got {num_rows!r}")


def gather_rows(x: jax.Array, schedule: Schedule, num_rows: int, *, weights: jax.Array | None = None):
  """Tokens into expert-major rows: ``x_rows[rows[t, j]] = x[t]``; padding rows are 0.

  Args:
    x: [T, H] tokens, any dtype (copied bit for bit).
    schedule: the routing's `Schedule` (rows [T, k], expert_offsets [E+1], tokens_per_expert [E]).
    num_rows: R, the static row count of the buffers (``jax_kittens.num_schedule_rows``).
    weights: optional [T, k] float32 router weights: also return them scattered to the rows (padding rows 0).

  Returns:
    x_rows [R, H] x.dtype, or (x_rows, row_weights [R] float32) when ``weights`` is given.
  """
  check_array("x", x, 2)
  rows, offsets, counts = schedule.rows, schedule.expert_offsets, schedule.tokens_per_expert
  check_array("schedule.rows", rows, 2)
  if rows.shape[0] != x.shape[0] or rows.dtype != jnp.int32:
    raise ValueError(f"schedule.rows must be [T={x.shape[0]}, k] int32, got {rows.dtype}{tuple(rows.shape)}")
  if counts.ndim != 1 or offsets.shape != (counts.shape[0] + 1,):
    raise ValueError(f"schedule must have tokens_per_expert [E] and expert_offsets [E+1], got "
                     f"{tuple(counts.shape)} and {tuple(offsets.shape)}")
  _check_num_rows(num_rows)
  with_row_weights = weights is not None
  if with_row_weights:
    _check_slots("weights", weights, rows.shape, jnp.float32)
  else:
    weights = jnp.zeros((0,), jnp.float32)
  out_types = (jax.ShapeDtypeStruct((num_rows, x.shape[1]), x.dtype),
               jax.ShapeDtypeStruct((num_rows if with_row_weights else 0,), jnp.float32))
  x_rows, row_weights = _extension.ffi_call("jk_moe_gather", out_types, x, rows, weights, offsets, counts,
                                            vmap_method="sequential")
  return (x_rows, row_weights) if with_row_weights else x_rows


def combine(values: jax.Array, rows: jax.Array, weights: jax.Array | None = None, *,
            addend: jax.Array | None = None) -> jax.Array:
  """Expert-major rows back to tokens: ``y[t] = addend[t] + sum_j weights[t, j] * values[rows[t, j]]``.

  The sum runs in float32 in slot order j = 0..k-1 (a fused multiply-add per slot, the addend last) and is rounded
  once: the same bits on every run. Slots with row -1 contribute nothing. With ``weights=None`` (all 1) it is the
  un-permute sum, the transpose of `gather_rows`.

  Args:
    values: [R, H] bfloat16 or float32 expert-major rows.
    rows: [T, k] int32 schedule rows.
    weights: optional [T, k] float32 per-slot weights (None: 1).
    addend: optional [T, H] values.dtype added to each token's sum (e.g. the shared experts' output).

  Returns:
    y: [T, H] values.dtype.
  """
  check_array("values", values, 2)
  if values.dtype not in _VALUE_DTYPES:
    raise TypeError(f"values must be bfloat16 or float32, got {values.dtype}")
  check_array("rows", rows, 2)
  if rows.dtype != jnp.int32:
    raise TypeError(f"rows must be int32, got {rows.dtype}")
  if values.shape[0] >= 2**31:
    raise ValueError(f"values must have fewer than 2^31 rows, got {values.shape[0]}")
  num_tokens, hidden = rows.shape[0], values.shape[1]
  if weights is None:
    weights = jnp.zeros((0,), jnp.float32)
  else:
    _check_slots("weights", weights, rows.shape, jnp.float32)
  if addend is None:
    addend = jnp.zeros((0, hidden), values.dtype)
  else:
    check_array("addend", addend, 2)
    if tuple(addend.shape) != (num_tokens, hidden) or addend.dtype != values.dtype:
      raise ValueError(f"addend must be [T={num_tokens}, H={hidden}] {values.dtype}, got "
                       f"{addend.dtype}{tuple(addend.shape)}")
  out_type = jax.ShapeDtypeStruct((num_tokens, hidden), values.dtype)
  return _extension.ffi_call("jk_moe_combine", out_type, values, rows, weights, addend, vmap_method="sequential")


def rows_of_slots(slot_values: jax.Array, rows: jax.Array, num_rows: int, *, fill=0) -> jax.Array:
  """Per-slot values to expert-major rows: ``out[rows[t, j]] = slot_values[t, j]``, ``fill`` in the rows no slot is
  placed in (padding). The transpose of `slots_of_rows`.

  slot_values: [T, k]; rows: [T, k] int32 schedule rows; num_rows: R. Returns [R] slot_values.dtype. One XLA scatter
  of T*k values (each row takes at most one slot, so the order of the writes does not matter).
  """
  check_array("rows", rows, 2)
  if rows.dtype != jnp.int32:
    raise TypeError(f"rows must be int32, got {rows.dtype}")
  check_array("slot_values", slot_values, 2)
  if slot_values.shape != rows.shape:
    raise ValueError(f"slot_values must have the routing's shape [T, k] = {tuple(rows.shape)}, got "
                     f"{tuple(slot_values.shape)}")
  _check_num_rows(num_rows)
  # Slots placed nowhere (-1) go past the end, where mode="drop" discards them.
  targets = jnp.where((rows >= 0) & (rows < num_rows), rows, num_rows)
  return jnp.full((num_rows,), fill, slot_values.dtype).at[targets.ravel()].set(slot_values.ravel(), mode="drop")


def row_tokens(rows: jax.Array, num_rows: int) -> jax.Array:
  """The token of each expert-major row: ``out[rows[t, j]] = t``, -1 for padding rows.

  rows: [T, k] int32 schedule rows; num_rows: R. Returns [R] int32, the row -> token map through which the grouped
  GEMMs read rows straight from the tokens (`grouped_matmul`'s ``row_tokens`` arguments).
  """
  check_array("rows", rows, 2)
  num_tokens, top_k = rows.shape
  tokens = jnp.broadcast_to(jnp.arange(num_tokens, dtype=jnp.int32)[:, None], (num_tokens, top_k))
  return rows_of_slots(tokens, rows, num_rows, fill=-1)


def slots_of_rows(row_values: jax.Array, rows: jax.Array) -> jax.Array:
  """Per-row values back to the routing's slots: ``out[t, j] = row_values[rows[t, j]]`` (0 where the row is -1).

  row_values: [R] (e.g. the router-weight gradient of each row); rows: [T, k] int32 -> [T, k] row_values.dtype.
  A [T, k] gather: XLA fuses it into one small kernel.
  """
  placed = (rows >= 0) & (rows < row_values.shape[0])
  return jnp.where(placed, row_values[jnp.where(placed, rows, 0)], jnp.zeros((), row_values.dtype))
