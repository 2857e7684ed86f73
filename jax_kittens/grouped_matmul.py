"""Grouped (ragged) matrix products over expert-major rows: the GEMMs of the kittens MoE backend.

Row layout: group ``g`` owns rows ``[group_offsets[g], group_offsets[g+1])`` of the row buffers; the first
``group_sizes[g]`` of them hold data and the rest are alignment padding (``jax_kittens.schedule(..., align=ROW_ALIGN)``
produces this layout). Every op writes every output row: data rows get their result, padding rows and the tail
``[group_offsets[G], R)`` get 0. Input padding rows never reach a result.

Each op is one FFI target: ``jk_gmm``, ``jk_gmm_swiglu``, ``jk_gmm_swiglu_dgrad``, ``jk_tgmm``: the sm90 CUDA kernels
on GPU (kernels/sm90/grouped_gemm.cuh) and their CPU twins elsewhere (ffi/grouped_gemm.cc). Operands are bfloat16,
products accumulate in float32. ``K`` and ``N`` (every contracted and every output feature dim) must be multiples of
``FEATURE_ALIGN``; ``R`` and the group sizes are arbitrary.

`ragged_dot` is the public drop-in for `jax.lax.ragged_dot`, with its VJP.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_kittens import _extension, token_parallel
from jax_kittens._checks import check_array

ROW_ALIGN = 128
"""Rows per GEMM tile: ``schedule(..., align=ROW_ALIGN)`` makes every group start on a tile."""

FEATURE_ALIGN = 64
"""Contracted and output feature dims must be multiples of this (the kernels' 64-wide K step / N sub-tile)."""

BACKENDS = ("auto", "kittens", "xla")

_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))  # what the kernels' epilogues store
_BF16 = (jnp.bfloat16,)  # the kernels' operands

# Workspace results of the FFI ops, dropped here: XLA allocates them with the op, so that the CUDA handlers allocate
# nothing and XLA can record them into command buffers (ffi/grouped_gemm_shapes.h).
_TILE_COUNTER = jax.ShapeDtypeStruct((1,), jnp.int32)  # the persistent kernels' tile queue
_TILE_COLS = 256  # output columns of a dgrad tile: its router-weight partials come one per row and 256-column block

# ragged_dot's xla backend, taken at import: a model patched with ``jax.lax.ragged_dot = jax_kittens.ragged_dot``
# must not reach ragged_dot again through it.
_lax_ragged_dot = jax.lax.ragged_dot


# ---------------------------------------------------------------------------------------------------------------
# Argument checks (trace time).

def _check_feature(name, size):
  if size % FEATURE_ALIGN or size == 0:
    raise ValueError(f"{name}={size} must be a positive multiple of {FEATURE_ALIGN}")


def _check_groups(group_offsets, group_sizes, num_groups):
  check_array("group_offsets", group_offsets, 1, (jnp.int32,))
  check_array("group_sizes", group_sizes, 1, (jnp.int32,))
  if group_sizes.shape != (num_groups,):
    raise ValueError(f"group_sizes must have shape [G={num_groups}], got {tuple(group_sizes.shape)}")
  if group_offsets.shape != (num_groups + 1,):
    raise ValueError(f"group_offsets must have shape [G+1={num_groups + 1}], got {tuple(group_offsets.shape)}")


def _check_out_dtype(out_dtype):
  out_dtype = jnp.dtype(out_dtype)
  if out_dtype not in _OUT_DTYPES:
    raise TypeError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
  return out_dtype


def _gathered_rows(name, row_tokens, operand):
  """(the row_tokens operand, R): ``operand`` is [R, C] rows when ``row_tokens`` is None (passed on as an empty [0]
  array), or [T, C] tokens read through ``row_tokens`` [R] int32 (row r is ``operand[row_tokens[r]]``, zeros for a
  token outside [0, T))."""
  if row_tokens is None:
    return jnp.zeros((0,), jnp.int32), operand.shape[0]
  check_array(name, row_tokens, 1, (jnp.int32,))
  if row_tokens.shape[0] == 0:
    raise ValueError(f"{name} must have at least one row (leave it None for no rows)")
  if operand.shape[0] >= 2**31 or operand.size >= 2**35:  # the kernels address tokens in 32-bit counts of 16 bytes
    raise ValueError(f"tokens read through {name} must have T < 2^31 and T * C < 2^35, got shape "
                     f"{tuple(operand.shape)}")
  return row_tokens, row_tokens.shape[0]


def _limit_attr(swiglu_limit):
  if swiglu_limit is None:
    return np.float32(0.0)
  if not isinstance(swiglu_limit, int | float | np.floating | np.integer) or not swiglu_limit > 0:
    raise ValueError(f"swiglu_limit must be a positive number or None, got {swiglu_limit!r}")
  return np.float32(swiglu_limit)


# ---------------------------------------------------------------------------------------------------------------
# The FFI ops.

def gmm(lhs: jax.Array, rhs: jax.Array, group_offsets: jax.Array, group_sizes: jax.Array, *,
        transpose_rhs: bool = False, lhs2: jax.Array | None = None, rhs2: jax.Array | None = None,
        out_dtype=jnp.bfloat16) -> jax.Array:
  """Grouped GEMM over row groups: ``out[r] = lhs[r] @ rhs[g] (+ lhs2[r] @ rhs2[g])`` for the data rows r of group g.

  Args:
    lhs: [R, K1] bf16 rows.
    rhs: [G, K1, N] bf16, or [G, N, K1] when ``transpose_rhs`` (then ``out[r] = lhs[r] @ rhs[g].T``).
    group_offsets: [G+1] int32 first row of each group (nondecreasing; the last entry ends the groups).
    group_sizes: [G] int32 data rows of each group (<= its extent).
    transpose_rhs: rhs (and rhs2) are [G, N, K*] (the dgrad of a forward GEMM with the same weights).
    lhs2, rhs2: optional second product, given together: lhs2 [R, K2] bf16 and rhs2 in rhs's layout, [G, K2, N] or
      [G, N, K2]. Both products accumulate in one float32 sum (``d_gate @ W_gate.T + d_up @ W_up.T`` without
      concatenating either operand).
    out_dtype: bfloat16 (default) or float32.

  Returns:
    [R, N] out_dtype; padding and tail rows are 0.
  """
  check_array("lhs", lhs, 2, _BF16)
  check_array("rhs", rhs, 3, _BF16)
  num_groups = rhs.shape[0]
  n, k1 = (rhs.shape[1], rhs.shape[2]) if transpose_rhs else (rhs.shape[2], rhs.shape[1])
  if (lhs2 is None) != (rhs2 is None):
    raise ValueError("lhs2 and rhs2 must be given together")
  if rhs2 is None:
    lhs2 = jnp.zeros((lhs.shape[0], 0), jnp.bfloat16)
    rhs2 = jnp.zeros((num_groups, n, 0) if transpose_rhs else (num_groups, 0, n), jnp.bfloat16)
  else:
    check_array("lhs2", lhs2, 2, _BF16)
    check_array("rhs2", rhs2, 3, _BF16)
    n2, k2 = (rhs2.shape[1], rhs2.shape[2]) if transpose_rhs else (rhs2.shape[2], rhs2.shape[1])
    if rhs2.shape[0] != num_groups or n2 != n:
      raise ValueError(f"rhs2 must match rhs in groups and output dim ({num_groups}, N={n}), got shape "
                       f"{tuple(rhs2.shape)}")
    _check_feature("rhs2 contraction dim K2", k2)
    if lhs2.shape != (lhs.shape[0], k2):
      raise ValueError(f"lhs2 must be [R={lhs.shape[0]}, K2={k2}], got shape {tuple(lhs2.shape)}")
  _check_feature("rhs contraction dim K1", k1)
  _check_feature("output dim N", n)
  if lhs.shape[1] != k1:
    raise ValueError(f"lhs must have K1 = {k1} columns, got shape {tuple(lhs.shape)}")
  _check_groups(group_offsets, group_sizes, num_groups)
  out_dtype = _check_out_dtype(out_dtype)
  out_type = jax.ShapeDtypeStruct((lhs.shape[0], n), out_dtype)
  out, _ = _extension.ffi_call("jk_gmm", (out_type, _TILE_COUNTER), lhs, lhs2, rhs, rhs2, group_offsets,
                               group_sizes, vmap_method="sequential", transpose_rhs=bool(transpose_rhs))
  return out


def gmm_swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, group_offsets: jax.Array, group_sizes: jax.Array,
               *, row_tokens: jax.Array | None = None, swiglu_limit: float | None = None,
               save_preactivations: bool = False):
  """Gate and up grouped GEMMs with SwiGLU fused into the epilogue.

  Args:
    x: [R, H] bf16 expert-major rows, or with ``row_tokens`` [T, H] bf16 tokens.
    w_gate, w_up: [G, H, I] bf16.
    group_offsets: [G+1] int32; group_sizes: [G] int32 (see the module docstring).
    row_tokens: optional [R] int32 token of each row: row r's lhs is ``x[row_tokens[r]]`` (zeros for a token outside
      [0, T)), read by the kernel itself, so the gathered [R, H] rows are never written (`permute.row_tokens`).
    swiglu_limit: optional clamp, gate to <= limit and up to [-limit, limit], before ``silu(gate) * up``.
    save_preactivations: also return the unclamped gate and up products (for the backward).

  Returns:
    act [R, I] bf16 = swiglu(x_rows @ w_gate[g], x_rows @ w_up[g]) computed from the float32 products, or
    (act, gate [R, I] bf16, up [R, I] bf16) when ``save_preactivations``. Padding rows are 0.
  """
  check_array("x", x, 2, _BF16)
  check_array("w_gate", w_gate, 3, _BF16)
  check_array("w_up", w_up, 3, _BF16)
  if w_up.shape != w_gate.shape:
    raise ValueError(f"w_up must have w_gate's shape {tuple(w_gate.shape)}, got {tuple(w_up.shape)}")
  num_groups, hidden, inner = w_gate.shape
  if x.shape[1] != hidden:
    raise ValueError(f"x must have H={hidden} columns (w_gate is [G, H, I]), got shape {tuple(x.shape)}")
  _check_feature("H", hidden)
  _check_feature("I", inner)
  _check_groups(group_offsets, group_sizes, num_groups)
  limit = _limit_attr(swiglu_limit)
  row_tokens, rows = _gathered_rows("row_tokens", row_tokens, x)
  saved_rows = rows if save_preactivations else 0
  out_types = (jax.ShapeDtypeStruct((rows, inner), jnp.bfloat16),
               jax.ShapeDtypeStruct((saved_rows, inner), jnp.bfloat16),
               jax.ShapeDtypeStruct((saved_rows, inner), jnp.bfloat16), _TILE_COUNTER)
  act, gate, up, _ = _extension.ffi_call("jk_gmm_swiglu", out_types, x, row_tokens, w_gate, w_up, group_offsets,
                                         group_sizes, vmap_method="sequential", swiglu_limit=limit)
  return (act, gate, up) if save_preactivations else act


def gmm_swiglu_dgrad(dy: jax.Array, w_down: jax.Array, gate: jax.Array, up: jax.Array, row_weights: jax.Array,
                     group_offsets: jax.Array, group_sizes: jax.Array, *, row_tokens: jax.Array | None = None,
                     swiglu_limit: float | None = None, save_weighted_act: bool = False):
  """Down-projection dgrad with the SwiGLU backward and the router-weight gradient fused into the epilogue.

  With ``g = dy_rows[r] @ w_down[grp].T`` (float32) and ``act = bf16(swiglu(gate, up))`` (the forward's hidden):
  ``d_row_weights[r] = sum_i g[i] * act[i]`` (a deterministic reduction), ``d_act = row_weights[r] * g``, and
  d_gate, d_up the SwiGLU backward of d_act (zero where the clamp was active, 1/2 on its bound, as JAX's min/max).
  The epilogue can also store ``weighted_act = bf16(row_weights[r] * act)``, the lhs of dW_down's `tgmm`.

  Args:
    dy: [R, H] bf16 gradient of the (unweighted) expert outputs' rows ``dy_rows``, or with ``row_tokens`` [T, H] bf16
      gradient of the tokens.
    w_down: [G, I, H] bf16.
    gate, up: [R, I] bf16 forward pre-activations (from ``gmm_swiglu(..., save_preactivations=True)``).
    row_weights: [R] float32 router weight of each row.
    group_offsets: [G+1] int32; group_sizes: [G] int32.
    row_tokens: optional [R] int32 token of each row: ``dy_rows[r] = dy[row_tokens[r]]`` (zeros for a token outside
      [0, T)), read by the kernel itself, as in `gmm_swiglu`.
    swiglu_limit: the forward's clamp.
    save_weighted_act: also return weighted_act.

  Returns:
    (d_gate [R, I] bf16, d_up [R, I] bf16, d_row_weights [R] float32), then weighted_act [R, I] bf16 with
    ``save_weighted_act``; padding rows are 0.
  """
  check_array("dy", dy, 2, _BF16)
  check_array("w_down", w_down, 3, _BF16)
  check_array("gate", gate, 2, _BF16)
  check_array("up", up, 2, _BF16)
  check_array("row_weights", row_weights, 1, (jnp.float32,))
  num_groups, inner, hidden = w_down.shape
  row_tokens, rows = _gathered_rows("row_tokens", row_tokens, dy)
  if dy.shape[1] != hidden:
    raise ValueError(f"dy must have H={hidden} columns (w_down is [G, I, H]), got shape {tuple(dy.shape)}")
  for name, x in (("gate", gate), ("up", up)):
    if x.shape != (rows, inner):
      raise ValueError(f"{name} must have shape [R={rows}, I={inner}], got {tuple(x.shape)}")
  if row_weights.shape != (rows,):
    raise ValueError(f"row_weights must have shape [R={rows}], got {tuple(row_weights.shape)}")
  _check_feature("H", hidden)
  _check_feature("I", inner)
  _check_groups(group_offsets, group_sizes, num_groups)
  out_types = (jax.ShapeDtypeStruct((rows, inner), jnp.bfloat16),
               jax.ShapeDtypeStruct((rows, inner), jnp.bfloat16),
               jax.ShapeDtypeStruct((rows,), jnp.float32),
               jax.ShapeDtypeStruct((rows if save_weighted_act else 0, inner), jnp.bfloat16),
               jax.ShapeDtypeStruct((-(-inner // _TILE_COLS), rows), jnp.float32), _TILE_COUNTER)
  outs = _extension.ffi_call("jk_gmm_swiglu_dgrad", out_types, dy, row_tokens, w_down, gate, up, row_weights,
                             group_offsets, group_sizes, vmap_method="sequential",
                             swiglu_limit=_limit_attr(swiglu_limit))
  return tuple(outs[:4]) if save_weighted_act else tuple(outs[:3])


def tgmm(lhs: jax.Array, rhs: jax.Array, group_offsets: jax.Array, group_sizes: jax.Array, *,
         out_dtype=jnp.float32, lhs_row_tokens: jax.Array | None = None,
         rhs_row_tokens: jax.Array | None = None) -> jax.Array:
  """Grouped GEMM contracting the ragged row dim (weight gradients): ``out[g] = sum_r lhs_rows[r]^T rhs_rows[r]``.

  Args:
    lhs: [R, K] bf16 rows ``lhs_rows``, or with ``lhs_row_tokens`` [T, K] bf16 tokens.
    rhs: [R, N] bf16 rows ``rhs_rows``, or with ``rhs_row_tokens`` [T, N] bf16 tokens.
    group_offsets: [G+1] int32; group_sizes: [G] int32; the sum runs over the data rows of group g.
    out_dtype: float32 (default) or bfloat16.
    lhs_row_tokens, rhs_row_tokens: optional [R] int32 token of each row of one operand (not both):
      ``lhs_rows[r] = lhs[lhs_row_tokens[r]]`` (zeros for a token outside [0, T)), read by the kernel itself.

  Returns:
    [G, K, N] out_dtype; groups without data rows give 0.
  """
  check_array("lhs", lhs, 2, _BF16)
  check_array("rhs", rhs, 2, _BF16)
  if lhs_row_tokens is not None and rhs_row_tokens is not None:
    raise ValueError("tgmm gathers at most one operand: pass lhs_row_tokens or rhs_row_tokens, not both")
  lhs_row_tokens, rows = _gathered_rows("lhs_row_tokens", lhs_row_tokens, lhs)
  rhs_row_tokens, rhs_rows = _gathered_rows("rhs_row_tokens", rhs_row_tokens, rhs)
  if rhs_rows != rows:
    raise ValueError(f"rhs must give R={rows} rows (as lhs), got {rhs_rows} (rhs shape {tuple(rhs.shape)})")
  k = lhs.shape[1]
  _check_feature("lhs dim K", k)
  _check_feature("rhs dim N", rhs.shape[1])
  check_array("group_sizes", group_sizes, 1, (jnp.int32,))
  num_groups = group_sizes.shape[0]
  _check_groups(group_offsets, group_sizes, num_groups)
  out_dtype = _check_out_dtype(out_dtype)
  out_type = jax.ShapeDtypeStruct((num_groups, k, rhs.shape[1]), out_dtype)
  out, _ = _extension.ffi_call("jk_tgmm", (out_type, _TILE_COUNTER), lhs, lhs_row_tokens, rhs, rhs_row_tokens,
                               group_offsets, group_sizes, vmap_method="sequential")
  return out


# ---------------------------------------------------------------------------------------------------------------
# ragged_dot: the public drop-in.

def _offsets_of(group_sizes):
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes, dtype=jnp.int32)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ragged_dot_kittens(lhs, rhs, group_sizes, out_dtype):
  return gmm(lhs, rhs, _offsets_of(group_sizes), group_sizes, out_dtype=out_dtype)


def _ragged_dot_fwd(lhs, rhs, group_sizes, out_dtype):
  return _ragged_dot_kittens(lhs, rhs, group_sizes, out_dtype), (lhs, rhs, group_sizes)


def _ragged_dot_bwd(out_dtype, residuals, d_out):
  del out_dtype
  lhs, rhs, group_sizes = residuals
  offsets = _offsets_of(group_sizes)
  d_out = d_out.astype(jnp.bfloat16)
  d_lhs = _extension.cotangent_for(gmm(d_out, rhs, offsets, group_sizes, transpose_rhs=True), lhs)
  d_rhs = tgmm(lhs, d_out, offsets, group_sizes, out_dtype=jnp.float32).astype(rhs.dtype)
  d_rhs = _extension.cotangent_for(d_rhs, rhs)
  return d_lhs, d_rhs, np.zeros(group_sizes.shape, jax.dtypes.float0)


def _precision_supported(precision) -> bool:
  """Whether ``precision`` (jax.lax.dot's argument) asks for what the kernels compute: bf16 products, f32 sums.

  For bf16 operands every `jax.lax.Precision` (a name, a member or a pair of them) computes exactly that; a
  `jax.lax.DotAlgorithm` or preset names its own algorithm, which the kernels do not take.
  """
  for part in precision if isinstance(precision, (tuple, list)) else (precision,):
    if part is None:
      continue
    try:
      jax.lax.Precision(part)
    except (TypeError, ValueError):
      return False
  return True


def _kittens_unsupported(lhs, rhs, group_sizes, precision, out_dtype, group_offset, out_sharding) -> str | None:
  """What of a ragged_dot call the kernels do not take (completing "backend='kittens' ..."), or None."""
  if not (lhs.dtype == jnp.bfloat16 and rhs.dtype == jnp.bfloat16 and group_sizes.dtype == jnp.int32
          and lhs.shape[1] % FEATURE_ALIGN == 0 and rhs.shape[2] % FEATURE_ALIGN == 0 and lhs.shape[1] > 0
          and rhs.shape[2] > 0):
    return (f"needs bf16 lhs and rhs, int32 group_sizes, and K, N positive multiples of {FEATURE_ALIGN}; got lhs "
            f"{lhs.dtype}{tuple(lhs.shape)}, rhs {rhs.dtype}{tuple(rhs.shape)}, group_sizes {group_sizes.dtype}")
  if out_dtype not in _OUT_DTYPES:
    return f"needs preferred_element_type bfloat16 or float32, got {out_dtype}"
  if not _precision_supported(precision):
    return f"needs precision None or a jax.lax.Precision, got {precision!r}"
  if group_offset is not None or out_sharding is not None:
    return "needs group_offset and out_sharding None"
  return None


def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, precision=None, preferred_element_type=None,
               group_offset: jax.Array | None = None, out_sharding=None, *, backend: str = "auto") -> jax.Array:
  """Drop-in for `jax.lax.ragged_dot` (same arguments, semantics and VJP): ``out[r] = lhs[r] @ rhs[g]`` for the rows
  of group g.

  Args:
    lhs: [M, K]; rhs: [G, K, N]; group_sizes: [G] int32, consecutive row groups from row 0 (any sizes, 0 included;
      rows past ``sum(group_sizes)`` give 0, groups past row M are cut there). Negative sizes are invalid, as for
      `jax.lax.ragged_dot`: the result is then unspecified, but the kernels never read or write outside the buffers.
      On a mesh of several devices outside shard_map, the kernels run on each device's block of lhs rows, the groups
      cut to it (`jax_kittens.token_parallel`).
    precision: as for `jax.lax.dot`. The kernels take None or any `jax.lax.Precision` (for bf16 operands each
      means bf16 products summed in float32); a `jax.lax.DotAlgorithm` or preset goes to xla.
    preferred_element_type: output dtype (default lhs.dtype).
    group_offset, out_sharding: passed to `jax.lax.ragged_dot`; the kernels take only None.
    backend: "kittens" (the grouped GEMM kernels: bf16 operands, K and N multiples of FEATURE_ALIGN; anything else
      raises), "xla" (`jax.lax.ragged_dot`) or "auto" (kittens where `_extension.kittens_by_default(lhs)` and the
      arguments are supported, else xla).

  Returns:
    [M, N] preferred_element_type.
  """
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  check_array("lhs", lhs, 2)
  check_array("rhs", rhs, 3)
  check_array("group_sizes", group_sizes, 1)
  if rhs.shape[1] != lhs.shape[1]:
    raise ValueError(f"rhs must be [G, K={lhs.shape[1]}, N] to match lhs [M, K], got shape {tuple(rhs.shape)}")
  if group_sizes.shape != rhs.shape[:1]:
    raise ValueError(f"group_sizes must have shape [G={rhs.shape[0]}], got {tuple(group_sizes.shape)}")
  out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
  unsupported = _kittens_unsupported(lhs, rhs, group_sizes, precision, out_dtype, group_offset, out_sharding)
  if backend == "auto":
    backend = "kittens" if unsupported is None and _extension.kittens_by_default(lhs) else "xla"
  if backend == "xla":
    return _lax_ragged_dot(lhs, rhs, group_sizes, precision, preferred_element_type, group_offset=group_offset,
                           out_sharding=out_sharding)
  if unsupported is not None:
    raise ValueError(f"backend='kittens' {unsupported}")
  split = token_parallel.token_split(lhs)
  if split is not None:  # rows of a multi-device mesh: each device multiplies its own (the FFI op would run whole)
    return token_parallel.split_tokens(functools.partial(_ragged_dot_rows, axes=split.axes, out_dtype=out_dtype),
                                       split, (lhs,), (rhs, group_sizes))
  return _ragged_dot_kittens(lhs, rhs, group_sizes, out_dtype)


def _ragged_dot_rows(lhs, rhs, group_sizes, *, axes, out_dtype):
  """ragged_dot of this device's rows ``lhs`` [M_local, K], block ``axis_index(axes)`` of the M rows: the groups cut
  to the block."""
  first_row = jax.lax.axis_index(axes) * lhs.shape[0]
  local_offsets = jnp.clip(_offsets_of(group_sizes) - first_row, 0, lhs.shape[0])
  return _ragged_dot_kittens(lhs, rhs, jnp.diff(local_offsets), out_dtype)


_ragged_dot_kittens.defvjp(_ragged_dot_fwd, _ragged_dot_bwd)
