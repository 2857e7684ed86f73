"""Routing: fused scores + top-k (`route`) and the device-side expert-major schedule (`schedule`).

Both have two implementations with the same semantics: the FFI targets ``jk_route`` / ``jk_schedule`` (CUDA kernels
on GPU, their CPU twins elsewhere; backend ``"kittens"``) and pure JAX (backend ``"xla"``), which is also the
reference the tests hold the targets to.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_kittens import _extension, token_parallel
from jax_kittens._checks import check_array

SCORES = ("softmax", "sigmoid")
_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
BACKENDS = ("auto", "kittens", "xla")
_SCORE_CODE = {"softmax": 0, "sigmoid": 1}
_MAX_GROUPS = 64


class Schedule(NamedTuple):
  """Where each (token, slot) goes in expert-major order.

  tokens_per_expert: [E] int32, entries routed to each expert.
  expert_offsets: [E + 1] int32, first row of each expert, each a multiple of ``align``; ``expert_offsets[E]`` is the
    number of rows in use, at most ``T * k + E * (align - 1)``.
  rows: [T, k] int32, the row of each (token, slot); an expert's entries are in (token, slot) order. -1 for ids
    outside [0, E).
  """

  tokens_per_expert: jax.Array
  expert_offsets: jax.Array
  rows: jax.Array


def num_schedule_rows(num_entries: int, num_experts: int, align: int = 1) -> int:
  """Static bound on the rows a schedule of ``num_entries`` (token, slot) pairs uses: the buffers' leading dim."""
  return num_entries + num_experts * (align - 1)


def _resolve_backend(backend: str, array: jax.Array) -> str:
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  if backend == "auto":
    return "kittens" if _extension.targets_by_default(array) else "xla"
  return backend


def _check_route_args(logits, top_k, score, bias, num_groups, top_groups):
  if len(check_array("logits", logits, None, _FLOAT_DTYPES)) < 2:
    raise ValueError(f"logits must have shape [..., tokens, experts], got shape {logits.shape}")
  num_experts = logits.shape[-1]
  if not isinstance(top_k, int | np.integer) or isinstance(top_k, bool):
    raise TypeError(f"top_k must be a Python int, got {type(top_k).__name__}")
  if not 1 <= top_k <= num_experts:
    raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
  if score not in SCORES:
    raise ValueError(f"score must be one of {SCORES}, got {score!r}")
  if bias is not None:
    if score != "sigmoid":
      raise ValueError("bias is only used with score='sigmoid' (selection bias, DeepSeek-V3 style)")
    check_array("bias", bias, 1, _FLOAT_DTYPES, shape=f"[{num_experts}] (one per expert)")
    if bias.shape != (num_experts,):
      raise ValueError(f"bias must have shape [{num_experts}] (one per expert), got {tuple(bias.shape)}")
  if (num_groups is None) != (top_groups is None):
    raise ValueError("num_groups and top_groups must be given together")
  if num_groups is not None:
    if not 1 <= num_groups <= _MAX_GROUPS or num_experts % num_groups:
      raise ValueError(f"num_groups must divide num_experts={num_experts} and be in [1, {_MAX_GROUPS}], "
                       f"got {num_groups}")
    if not 1 <= top_groups <= num_groups:
      raise ValueError(f"top_groups must be in [1, num_groups={num_groups}], got {top_groups}")
    if top_k > top_groups * (num_experts // num_groups):
      raise ValueError(f"top_k={top_k} exceeds the experts of the top_groups={top_groups} groups "
                       f"({top_groups * (num_experts // num_groups)})")


def routing_weights(logits: jax.Array, ids: jax.Array, score: str, renormalize: bool) -> jax.Array:
  """The router weights of the chosen experts, differentiable in ``logits``.

  logits: [..., T, E]; ids: [..., T, k] int32 -> [..., T, k] float32. Softmax probabilities over all experts (or the
  unbiased sigmoid) gathered at ``ids``, divided by their sum when ``renormalize``. An id outside [0, E) gives NaN.
  """
  if score not in SCORES:
    raise ValueError(f"score must be one of {SCORES}, got {score!r}")
  logits_shape = check_array("logits", logits, None, _FLOAT_DTYPES)
  ids_shape = check_array("ids", ids, len(logits_shape), (jnp.int32,))
  if len(logits_shape) < 2 or ids_shape[:-1] != logits_shape[:-1]:
    raise ValueError(f"logits [..., T, E] and ids [..., T, k] must agree but for the last dim, got shapes "
                     f"{logits_shape} and {ids_shape}")
  logits = logits.astype(jnp.float32)
  scores = jax.nn.softmax(logits, axis=-1) if score == "softmax" else jax.nn.sigmoid(logits)
  weights = jnp.take_along_axis(scores, ids, axis=-1)
  if renormalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return weights


def _selection_keys(logits, bias, score):
  logits = logits.astype(jnp.float32)
  keys = logits if score == "softmax" else jax.nn.sigmoid(logits) + (0.0 if bias is None else bias)
  return jnp.where(jnp.isnan(keys), -jnp.inf, keys)


def _route_ids_xla(logits, top_k, score, bias, num_groups, top_groups):
  keys = _selection_keys(logits, bias, score)
  if num_groups is not None and num_groups > 1:
    *lead, num_experts = keys.shape
    grouped = keys.reshape(*lead, num_groups, num_experts // num_groups)
    group_scores = jnp.sum(jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0], axis=-1)
    _, best_groups = jax.lax.top_k(group_scores, top_groups)
    allowed = jnp.any(best_groups[..., :, None] == jnp.arange(num_groups), axis=-2)
    keys = jnp.where(allowed[..., None], grouped, -jnp.inf).reshape(keys.shape)
  # lax.top_k puts the lower index first among equal values: the same tie rule as the kernels.
  return jax.lax.top_k(keys, top_k)[1].astype(jnp.int32)


def _route_ids_ffi(logits, top_k, score, bias, renormalize, num_groups, top_groups):
  if logits.dtype == jnp.float16:
    logits = logits.astype(jnp.float32)
  has_bias = bias is not None
  bias = jnp.zeros(logits.shape[-1:], jnp.float32) if bias is None else bias.astype(jnp.float32)
  out_types = (jax.ShapeDtypeStruct(logits.shape[:-1] + (top_k,), jnp.float32),
               jax.ShapeDtypeStruct(logits.shape[:-1] + (top_k,), jnp.int32))
  # Leading dims are flattened into tokens by the handler, so batching only has to broadcast.
  weights, ids = _extension.ffi_call(
      "jk_route", out_types, logits, bias, vmap_method="broadcast_all", top_k=np.int32(top_k),
      score=np.int32(_SCORE_CODE[score]), renormalize=bool(renormalize), num_groups=np.int32(num_groups or 1),
      top_groups=np.int32(top_groups or 1), has_bias=has_bias)
  return weights, ids


# The FFI op chooses and weighs in one pass but has no derivative; the weights' derivative is that of
# `routing_weights` at the chosen ids, attached by a custom JVP (so transposition, vmap and shard_map's
# varying-axis types all come from JAX itself).
@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4))
def _with_routing_derivative(weights, logits, ids, score, renormalize):
  del logits, ids
  return weights


@_with_routing_derivative.defjvp
def _with_routing_derivative_jvp(score, renormalize, primals, tangents):
  weights, logits, ids = primals
  _, d_logits, _ = tangents
  _, d_weights = jax.jvp(lambda l: routing_weights(l, ids, score, renormalize), (logits,), (d_logits,))
  return weights, d_weights


def _route(logits, bias, top_k, score, renormalize, num_groups, top_groups, backend):
  # The bias only selects: no derivative flows to it (DeepSeek-V3 updates it outside the loss).
  bias = None if bias is None else jax.lax.stop_gradient(bias)
  if backend == "xla":
    ids = _route_ids_xla(jax.lax.stop_gradient(logits), top_k, score, bias, num_groups, top_groups)
    return routing_weights(logits, ids, score, renormalize), ids
  split = token_parallel.token_split(logits)
  if split is not None:  # rows of a multi-device mesh: each device routes its own (the FFI op would run whole)
    return token_parallel.split_tokens(
        lambda logits, bias: _route(logits, bias, top_k, score, renormalize, num_groups, top_groups, backend), split,
        (logits,), (bias,))
  weights, ids = _route_ids_ffi(jax.lax.stop_gradient(logits), top_k, score, bias, renormalize, num_groups,
                                top_groups)
  return _with_routing_derivative(weights, logits, ids, score, renormalize), ids


def route(logits: jax.Array, top_k: int, *, score: str = "softmax", bias: jax.Array | None = None,
          renormalize: bool = True, num_groups: int | None = None, top_groups: int | None = None,
          backend: str = "auto") -> tuple[jax.Array, jax.Array]:
  """Router scores and top-k in one fused op.

  Args:
    logits: [..., T, E] float32 or bfloat16 router logits. On a mesh of several devices outside shard_map, the kernel
      runs on each device's share of dim 0 (`jax_kittens.token_parallel`).
    top_k: experts per token, 1 <= top_k <= E.
    score: "softmax" (probabilities over all E experts) or "sigmoid" (independent per expert).
    bias: optional [E] float32 selection bias (sigmoid only): added to the scores to choose experts, never to the
      weights (DeepSeek-V3's aux-loss-free balancing). No gradient flows to it.
    renormalize: divide the k chosen weights by their sum.
    num_groups, top_groups: group-limited routing: experts form ``num_groups`` contiguous groups, each scored by the sum
      of its two best selection scores, and only the ``top_groups`` best groups can be chosen.
    backend: "kittens" (FFI: CUDA kernel on GPU, CPU twin on CPU), "xla" (pure JAX) or "auto" (kittens where its
      targets run: on CPU, or on a GPU the CUDA kernels were built for; else, or with JAX_KITTENS_AUTO=xla, xla).

  Returns:
    weights: [..., T, top_k] float32, best expert first; differentiable w.r.t. ``logits``.
    ids: [..., T, top_k] int32. Ties go to the higher score, then the lower expert id.
  """
  _check_route_args(logits, top_k, score, bias, num_groups, top_groups)
  backend = _resolve_backend(backend, logits)
  return _route(logits, bias, int(top_k), score, bool(renormalize), num_groups, top_groups, backend)


def _schedule_xla(ids, num_experts, align):
  flat = ids.reshape(-1)
  valid = (flat >= 0) & (flat < num_experts)
  expert = jnp.where(valid, flat, num_experts)
  tokens_per_expert = jnp.bincount(expert, length=num_experts + 1)[:num_experts].astype(jnp.int32)
  padded = (tokens_per_expert + align - 1) // align * align
  expert_offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(padded, dtype=jnp.int32)])
  # Rank among earlier entries of the same expert; the stable sort keeps (token, slot) order within an expert.
  order = jnp.argsort(expert, stable=True)
  sorted_expert = expert[order]
  unpadded_starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(tokens_per_expert, dtype=jnp.int32)])
  rank_sorted = jnp.arange(flat.shape[0], dtype=jnp.int32) - unpadded_starts[jnp.minimum(sorted_expert, num_experts)]
  rank = jnp.zeros_like(rank_sorted).at[order].set(rank_sorted)
  rows = jnp.where(valid, expert_offsets[jnp.minimum(expert, num_experts - 1)] + rank, -1)
  return Schedule(tokens_per_expert, expert_offsets, rows.reshape(ids.shape).astype(jnp.int32))


_SCHEDULE_CHUNK = 256  # entries per chunk of the CUDA schedule (kernels/routing.h kChunk)


def _schedule_ffi(ids, num_experts, align):
  # The last result is the CUDA kernels' workspace (per-chunk counts), dropped: XLA allocates it with the op, so that
  # the handler allocates nothing and XLA can record it into a command buffer.
  chunk_counts = jax.ShapeDtypeStruct((-(-ids.size // _SCHEDULE_CHUNK) * num_experts,), jnp.int32)
  out_types = (jax.ShapeDtypeStruct((num_experts,), jnp.int32),
               jax.ShapeDtypeStruct((num_experts + 1,), jnp.int32),
               jax.ShapeDtypeStruct(ids.shape, jnp.int32), chunk_counts)
  return Schedule(*_extension.ffi_call("jk_schedule", out_types, ids, vmap_method="sequential",
                                       num_experts=np.int32(num_experts), align=np.int32(align))[:3])


def schedule(ids: jax.Array, num_experts: int, *, align: int = 1, backend: str = "auto") -> Schedule:
  """The expert-major schedule of routed ids, built on the device without a sort or a host sync.

  Args:
    ids: [T, k] int32 expert ids (any shape; entries are taken in row-major (token, slot) order).
    num_experts: E, the experts scheduled; ids outside [0, E) are not placed (row -1).
    align: each expert's first row is a multiple of this (pad groups to the GEMM tile).
    backend: "kittens" (FFI), "xla" (pure JAX) or "auto" (as `route`'s).

  Returns:
    A `Schedule`; the rows it uses are bounded by ``num_schedule_rows(ids.size, num_experts, align)``.
  """
  check_array("ids", ids, None, (jnp.int32,))
  if not isinstance(num_experts, int | np.integer) or num_experts < 1:
    raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
  if not isinstance(align, int | np.integer) or align < 1:
    raise ValueError(f"align must be a positive int, got {align!r}")
  if num_schedule_rows(ids.size, num_experts, align) >= 2**31:
    raise ValueError(f"ids.size={ids.size} with num_experts={num_experts}, align={align} overflows int32 rows")
  backend = _resolve_backend(backend, ids)
  if backend == "xla":
    return _schedule_xla(ids, int(num_experts), int(align))
  return _schedule_ffi(ids, int(num_experts), int(align))
