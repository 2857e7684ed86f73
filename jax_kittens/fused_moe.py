"""The kittens backend of `moe_ffn`: the routed-expert MoE layer as a pipeline of fused kernels, with a custom VJP.

Forward (kernels in order; a jk_* target each):
  schedule (jk_schedule, align = grouped_matmul.ROW_ALIGN) -> the token of each expert-major row (an XLA scatter)
  -> gate/up grouped GEMM reading its rows straight from the tokens, SwiGLU in the epilogue (jk_gmm_swiglu)
  -> down grouped GEMM (jk_gmm)
  -> weighted top-k combine back to tokens (jk_moe_combine: float32, fixed slot order, no atomics).
Shared experts run beside the routed ones as one-group GEMMs over the tokens themselves (every token is routed to
them with weight 1 in token order, so they need no gather): jk_gmm_swiglu + jk_gmm, and their output enters the
combine as its addend (no extra pass over y).

Backward (`jax.custom_vjp`):
  recompute=False: gather x and dy into rows, with the router weights scattered to rows (jk_moe_gather x2)
  recompute=True: x and dy stay in token order, and every GEMM that contracts or multiplies them reads its rows through
    the row -> token map, so no [R, H] copy of either is written; the router weights are scattered to rows (an XLA
    scatter of T*k values); gate/up again with jk_gmm_swiglu
  -> down dgrad with the SwiGLU backward and the router-weight gradient in its epilogue (jk_gmm_swiglu_dgrad)
  -> dx rows = d_gate @ W_gate^T + d_up @ W_up^T in one grouped GEMM (jk_gmm with lhs2, rhs2; nothing concatenated)
  -> un-permute sum to tokens, shared experts' dx as the addend (jk_moe_combine)
  weight gradients as grouped GEMMs over the ragged rows (jk_tgmm x3; dW_down's hidden rows scaled by the router
  weights, stored by the dgrad epilogue), and d(router weights) gathered from the rows back to [T, k]. The shared
  experts' weight gradients contract one group of T rows: when that gives few output tiles, the rows are cut into
  slices contracted as separate groups (float32 partials, summed in slice order).
``recompute=False`` keeps the gate/up pre-activations from the forward ([R, I] bf16 each, R =
``num_schedule_rows(T*k, E, ROW_ALIGN)``) and is the faster; ``recompute=True`` keeps only the inputs and the schedule,
and spends GEMM time for memory twice: the gate/up GEMM again, and the backward's GEMMs reading their rows through the
map (a gathered tgmm operand cost 10-28% more a launch than rows gathered beforehand on the H200) in place of the two
[R, H] row copies.

All operands are bfloat16 with float32 accumulation; H, I (and the shared experts' Is) must be multiples of
``grouped_matmul.FEATURE_ALIGN``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_kittens import _extension, grouped_matmul, permute, routing
from jax_kittens.moe_stats import MoEStats


def unsupported_reason(x, w_gate, shared_experts=None) -> str | None:
  """Why the kittens kernels cannot run this layer (dtype, feature sizes), or None when they can."""
  if x.dtype != jnp.bfloat16:
    return f"the kittens backend needs bfloat16 x and expert weights, got {x.dtype}"
  align = grouped_matmul.FEATURE_ALIGN
  sizes = {"hidden (x.shape[1])": x.shape[1], "intermediate (w_gate.shape[2])": w_gate.shape[2]}
  if shared_experts is not None:
    sizes["shared intermediate (shared_experts[0].shape[1])"] = shared_experts[0].shape[1]
  for name, size in sizes.items():
    if size % align:
      return f"the kittens backend needs {name} to be a multiple of {align}, got {size}"
  return None


# A weight gradient of one row group has ceil(K/128) * ceil(N/256) output tiles, one CTA each: 8 for the `small`
# config's 512 x 512 shared expert, which left 124 of the H200's 132 SMs idle through 16384 rows of contraction.
# Such a group's rows are cut into slices of at least _MIN_SLICE_ROWS, enough for about _TARGET_TILES tiles.
_TGMM_TILE = (128, 256)
_TARGET_TILES = 256  # two waves over 132 SMs
_MIN_SLICE_ROWS = 1024


def _contraction_slices(num_rows: int, k: int, n: int) -> int:
  """How many row slices a one-group weight gradient lhs [num_rows, k]^T @ rhs [num_rows, n] is cut into."""
  tiles = -(-k // _TGMM_TILE[0]) * -(-n // _TGMM_TILE[1])
  return max(1, min(-(-_TARGET_TILES // tiles), num_rows // _MIN_SLICE_ROWS))


class _Layout:
  """Row groups of one grouped-GEMM call: group_offsets [G+1] int32, group_sizes [G] int32.

  num_rows: for a one-group layout over rows [0, num_rows), which tgmm may cut into slices; None otherwise.
  """

  def __init__(self, offsets, sizes, num_rows=None):
    self.offsets, self.sizes, self.num_rows = offsets, sizes, num_rows

  @classmethod
  def of_schedule(cls, schedule):
    return cls(schedule.expert_offsets, schedule.tokens_per_expert)

  @classmethod
  def one_group(cls, num_rows):
    return cls(jnp.array([0, num_rows], jnp.int32), jnp.array([num_rows], jnp.int32), num_rows)

  def gmm_swiglu(self, x, w_gate, w_up, limit, save, row_tokens=None):
    return grouped_matmul.gmm_swiglu(x, w_gate, w_up, self.offsets, self.sizes, row_tokens=row_tokens,
                                     swiglu_limit=limit, save_preactivations=save)

  def gmm(self, lhs, rhs, **kwargs):
    return grouped_matmul.gmm(lhs, rhs, self.offsets, self.sizes, **kwargs)

  def tgmm(self, lhs, rhs, out_dtype, **row_tokens):
    slices = 1 if self.num_rows is None else _contraction_slices(self.num_rows, lhs.shape[1], rhs.shape[1])
    if slices == 1:
      return grouped_matmul.tgmm(lhs, rhs, self.offsets, self.sizes, out_dtype=out_dtype, **row_tokens)
    # Slices of whole k steps (FEATURE_ALIGN rows); the last takes the rest.
    step = -(-self.num_rows // slices // grouped_matmul.FEATURE_ALIGN) * grouped_matmul.FEATURE_ALIGN
    bounds = np.minimum(np.arange(slices + 1) * step, self.num_rows)
    partials = grouped_matmul.tgmm(lhs, rhs, jnp.asarray(bounds, jnp.int32), jnp.asarray(np.diff(bounds), jnp.int32),
                                   out_dtype=jnp.float32, **row_tokens)
    # A chain of adds fixes the order of the sum (a reduce may be split differently by the compiler).
    return functools.reduce(jnp.add, list(partials)).astype(out_dtype)[None]

  def dgrad(self, dy, w_down, gate, up, row_weights, limit, row_tokens=None):
    return grouped_matmul.gmm_swiglu_dgrad(dy, w_down, gate, up, row_weights, self.offsets, self.sizes,
                                           row_tokens=row_tokens, swiglu_limit=limit, save_weighted_act=True)


def _num_rows(ids, num_experts):
  return routing.num_schedule_rows(ids.size, num_experts, grouped_matmul.ROW_ALIGN)


def _experts_forward(layout, x, w_gate, w_up, w_down, limit, save, row_tokens=None):
  """SwiGLU experts over rows -> (out_rows [R, H] bf16, (gate, up) [R, I] bf16 each when ``save``, else None).

  x: [R, H] rows, or [T, H] tokens with row_tokens [R] (the row -> token map the gate/up GEMM reads through).
  """
  hidden = layout.gmm_swiglu(x, w_gate, w_up, limit, save, row_tokens)
  act, preactivations = (hidden[0], hidden[1:]) if save else (hidden, None)
  return layout.gmm(act, w_down), preactivations


def _experts_backward(layout, x, dy, row_weights, w_gate, w_up, w_down, preactivations, limit, row_tokens=None):
  """Gradients of the experts over rows: (d_x_rows [R, H], d_row_weights [R] f32, (dW_gate, dW_up, dW_down)).

  x, dy: [R, H] rows, or [T, H] tokens with row_tokens [R] (every GEMM reads its rows through the map). dy is the
  unweighted gradient of each row's token; row_weights [R] f32 scales it (the router weight of the row), or None for
  weight 1 (the shared experts).
  preactivations: the forward's (gate, up), or None to recompute them.
  """
  if preactivations is None:
    preactivations = layout.gmm_swiglu(x, w_gate, w_up, limit, True, row_tokens)[1:]
  gate, up = preactivations
  # dW_down contracts the hidden rows scaled by the router weights: bf16(w * act), with act from the bf16
  # pre-activations, stored by the dgrad epilogue, which has act anyway. An XLA pass costs another trip over [R, I];
  # tgmm scaling each stage in shared memory cost a third more than the GEMM (fbbec6a profile).
  dgrad_weights = jnp.ones(gate.shape[:1], jnp.float32) if row_weights is None else row_weights
  d_gate, d_up, d_row_weights, weighted_act = layout.dgrad(dy, w_down, gate, up, dgrad_weights, limit, row_tokens)
  d_x_rows = layout.gmm(d_gate, w_gate, transpose_rhs=True, lhs2=d_up, rhs2=w_up)
  d_w_gate = layout.tgmm(x, d_gate, w_gate.dtype, lhs_row_tokens=row_tokens)
  d_w_up = layout.tgmm(x, d_up, w_up.dtype, lhs_row_tokens=row_tokens)
  d_w_down = layout.tgmm(weighted_act, dy, w_down.dtype, rhs_row_tokens=row_tokens)
  return d_x_rows, d_row_weights, (d_w_gate, d_w_up, d_w_down)


def _stacked(shared_experts):
  """(w_gate [H, Is], w_up [H, Is], w_down [Is, H]) -> the same as one-group grouped-GEMM weights [1, ...]."""
  return tuple(w[None] for w in shared_experts)


def _forward(x, weights, ids, w_gate, w_up, w_down, shared_experts, limit, save):
  """y [T, H] and what the backward keeps: (schedule, routed (gate, up) or None, shared (gate, up) or None)."""
  sched = routing.schedule(ids, w_gate.shape[0], align=grouped_matmul.ROW_ALIGN, backend="kittens")
  layout = _Layout.of_schedule(sched)
  row_tokens = permute.row_tokens(sched.rows, _num_rows(ids, w_gate.shape[0]))
  out_rows, preactivations = _experts_forward(layout, x, w_gate, w_up, w_down, limit, save, row_tokens)
  shared_y, shared_preactivations = None, None
  if shared_experts is not None:
    shared_y, shared_preactivations = _experts_forward(_Layout.one_group(x.shape[0]), x, *_stacked(shared_experts),
                                                       limit, save)
  y = permute.combine(out_rows, sched.rows, weights.astype(jnp.float32), addend=shared_y)
  return y, (sched, preactivations, shared_preactivations)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _moe(x, weights, ids, w_gate, w_up, w_down, shared_experts, limit, recompute):
  del recompute
  return _forward(x, weights, ids, w_gate, w_up, w_down, shared_experts, limit, save=False)[0]


def _moe_fwd(x, weights, ids, w_gate, w_up, w_down, shared_experts, limit, recompute):
  y, saved = _forward(x, weights, ids, w_gate, w_up, w_down, shared_experts, limit, save=not recompute)
  return y, (x, weights, w_gate, w_up, w_down, shared_experts, *saved)


def _moe_bwd(limit, recompute, residuals, d_y):
  del recompute  # the residuals say what was kept
  x, weights, w_gate, w_up, w_down, shared_experts, sched, preactivations, shared_preactivations = residuals
  # Nothing of the backward may start before the cotangent arrives: otherwise XLA hoists the gathers and the
  # recomputed gate/up next to the forward, and they stay alive through the other layers' work.
  x, d_y = jax.lax.optimization_barrier((x, d_y.astype(x.dtype)))
  num_rows = _num_rows(sched.rows, w_gate.shape[0])
  layout = _Layout.of_schedule(sched)
  if preactivations is None:  # recompute=True: the GEMMs read x and dy through the row -> token map, no [R, H] copies
    row_tokens = permute.row_tokens(sched.rows, num_rows)
    row_weights = permute.rows_of_slots(weights.astype(jnp.float32), sched.rows, num_rows)
    routed = _experts_backward(layout, x, d_y, row_weights, w_gate, w_up, w_down, None, limit, row_tokens)
  else:
    x_rows, row_weights = permute.gather_rows(x, sched, num_rows, weights=weights.astype(jnp.float32))
    dy_rows = permute.gather_rows(d_y, sched, num_rows)
    routed = _experts_backward(layout, x_rows, dy_rows, row_weights, w_gate, w_up, w_down, preactivations, limit)
  d_x_rows, d_row_weights, d_routed = routed
  d_shared, d_x_shared = None, None
  if shared_experts is not None:
    d_x_shared, _, d_stacked = _experts_backward(_Layout.one_group(x.shape[0]), x, d_y, None,
                                                 *_stacked(shared_experts), shared_preactivations, limit)
    d_shared = tuple(d[0] for d in d_stacked)
  d_x = permute.combine(d_x_rows, sched.rows, addend=d_x_shared)
  d_weights = permute.slots_of_rows(d_row_weights, sched.rows).astype(weights.dtype)
  d_ids = np.zeros(sched.rows.shape, jax.dtypes.float0)
  # Under shard_map, expert weights shared by the devices whose tokens vary get the sum of their gradients.
  d_routed, d_shared = jax.tree.map(_extension.cotangent_for, (d_routed, d_shared), (
      (w_gate, w_up, w_down), shared_experts))
  return (d_x, d_weights, d_ids, *d_routed, d_shared)


_moe.defvjp(_moe_fwd, _moe_bwd)


def moe_ffn(x: jax.Array, weights: jax.Array, ids: jax.Array, w_gate: jax.Array, w_up: jax.Array,
            w_down: jax.Array, *, shared_experts: tuple[jax.Array, jax.Array, jax.Array] | None = None,
            swiglu_limit: float | None = None, axis_name: str | None = None, recompute: bool = False,
            capacity_factor: float | None = None, return_stats: bool = False):
  """The MoE SwiGLU layer on the kittens kernels (one device; see `jax_kittens.moe.moe_ffn` for the contract).

  Args:
    x: [T, H] bfloat16 tokens.
    weights: [T, k] float router weights (used in float32).
    ids: [T, k] int32 expert ids; ids outside [0, E) are dropped (counted in the stats).
    w_gate, w_up: [E, H, I] bfloat16; w_down: [E, I, H] bfloat16. H and I multiples of FEATURE_ALIGN.
    shared_experts: optional (w_gate [H, Is], w_up [H, Is], w_down [Is, H]) bfloat16, Is a multiple of FEATURE_ALIGN.
    swiglu_limit: optional clamp (gate <= limit, up in [-limit, limit]) before silu(gate) * up.
    axis_name: must be None here (expert parallelism is `jax_kittens.expert_parallel`).
    recompute: keep only the inputs for the backward, recompute gate/up there and read x and dy through the row ->
      token map instead of copying them into rows (lower peak memory, more GEMM time).
    capacity_factor: must be None (it bounds expert-parallel receives).
    return_stats: also return a `MoEStats`.

  Returns:
    y: [T, H] bfloat16, or ``(y, MoEStats)`` with ``return_stats``.
  """
  from jax_kittens import moe  # noqa: PLC0415 (moe imports this module; the validation lives there)

  shared_experts = None if shared_experts is None else tuple(shared_experts)
  moe.check_moe_args(x, weights, ids, w_gate, w_up, w_down, shared_experts=shared_experts, swiglu_limit=swiglu_limit,
                     axis_name=axis_name, backend="kittens", recompute=recompute, capacity_factor=capacity_factor,
                     return_stats=return_stats)
  if axis_name is not None:
    raise ValueError("jax_kittens.fused_moe.moe_ffn runs on one device: for axis_name use jax_kittens.moe_ffn, which "
                     "routes expert parallelism to jax_kittens.expert_parallel")
  reason = unsupported_reason(x, w_gate, shared_experts)
  if reason is not None:
    raise ValueError(f"{reason}; use backend='xla' for other layers")
  limit = None if swiglu_limit is None else float(swiglu_limit)
  y = _moe(x, weights, ids, w_gate, w_up, w_down, shared_experts, limit, bool(recompute))
  if not return_stats:
    return y
  received = jnp.sum((ids >= 0) & (ids < w_gate.shape[0]), dtype=jnp.int32)
  return y, MoEStats(jnp.int32(ids.size) - received, received)
