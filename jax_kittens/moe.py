"""`moe_ffn`: the public MoE feed-forward layer; validates its arguments once and dispatches to a backend.

Backends: "xla" (`jax_kittens.reference`, pure JAX), "kittens" (`jax_kittens.fused_moe`, the fused kernels),
"auto" (kittens where its CUDA kernels are built and JAX runs on a GPU, else xla).
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_kittens import _extension, fused_moe, reference, token_parallel
from jax_kittens._checks import check_array
from jax_kittens.moe_stats import MoEStats

BACKENDS = ("auto", "kittens", "xla")
_FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)

__all__ = ["BACKENDS", "MoEShape", "MoEStats", "check_moe_args", "moe_ffn", "resolve_backend"]


class MoEShape(NamedTuple):
  """Static sizes of one layer call, as `check_moe_args` found them."""

  num_tokens: int  # T, this rank's tokens
  top_k: int
  hidden: int  # H
  intermediate: int  # I
  num_local_experts: int  # E_local
  num_experts: int  # E_local * axis size
  axis_size: int  # 1 without axis_name
  shared_intermediate: int | None  # Is


def _check_float(name, array, dtype=None):
  if dtype is None and array.dtype not in _FLOAT_DTYPES:
    raise TypeError(f"{name} must be bfloat16, float16 or float32, got {array.dtype}")
  if dtype is not None and array.dtype != dtype:
    raise TypeError(f"{name} must have x's dtype {dtype}, got {array.dtype}")


def _check_positive_number(name, value):
  if value is None:
    return
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{name} must be a Python number or None, got {type(value).__name__}")
  if not (np.isfinite(value) and value > 0):
    raise ValueError(f"{name} must be a finite number > 0, got {value}")


def _axis_size(axis_name):
  if axis_name is None:
    return 1
  if not isinstance(axis_name, str):
    raise TypeError(f"axis_name must be a str or None, got {type(axis_name).__name__}")
  try:
    return int(jax.lax.axis_size(axis_name))
  except NameError:
    raise ValueError(f"axis_name={axis_name!r} is not a mesh axis in scope: call moe_ffn with axis_name inside "
                     f"jax.shard_map over a mesh with that axis") from None


def check_moe_args(x, weights, ids, w_gate, w_up, w_down, *, shared_experts=None, swiglu_limit=None,
                   axis_name=None, backend="auto", recompute=False, capacity_factor=None,
                   return_stats=False) -> MoEShape:
  """Checks `moe_ffn`'s arguments at trace time (TypeError / ValueError naming the argument); returns the sizes."""
  num_tokens, hidden = check_array("x", x, 2, shape="[tokens, hidden]")
  _check_float("x", x)
  routed_shape = check_array("weights", weights, 2, shape="[tokens, top_k]")
  if routed_shape[0] != num_tokens:
    raise ValueError(f"weights must have shape [tokens={num_tokens}, top_k], got {routed_shape}")
  _check_float("weights", weights)
  if check_array("ids", ids, 2, shape="[tokens, top_k]") != routed_shape:
    raise ValueError(f"ids must have the shape of weights {routed_shape}, got {tuple(ids.shape)}")
  if ids.dtype != jnp.int32:
    raise TypeError(f"ids must be int32, got {ids.dtype}")
  top_k = routed_shape[1]

  num_local_experts, gate_hidden, intermediate = check_array("w_gate", w_gate, 3,
                                                             shape="[experts, hidden, intermediate]")
  if gate_hidden != hidden:
    raise ValueError(f"w_gate must have shape [experts, hidden={hidden}, intermediate], got {tuple(w_gate.shape)}")
  if num_local_experts < 1 or intermediate < 1:
    raise ValueError(f"w_gate needs at least one expert and intermediate >= 1, got shape {tuple(w_gate.shape)}")
  if check_array("w_up", w_up, 3, shape="[experts, hidden, intermediate]") != tuple(w_gate.shape):
    raise ValueError(f"w_up must have w_gate's shape {tuple(w_gate.shape)}, got {tuple(w_up.shape)}")
  expected_down = (num_local_experts, intermediate, hidden)
  if check_array("w_down", w_down, 3, shape="[experts, intermediate, hidden]") != expected_down:
    raise ValueError(f"w_down must have shape [experts, intermediate, hidden] = {expected_down}, "
                     f"got {tuple(w_down.shape)}")
  for name, array in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
    _check_float(name, array, x.dtype)

  shared_intermediate = None
  if shared_experts is not None:
    if not isinstance(shared_experts, tuple | list) or len(shared_experts) != 3:
      raise TypeError("shared_experts must be a tuple (w_gate [hidden, Is], w_up [hidden, Is], w_down [Is, hidden])")
    s_gate, s_up, s_down = shared_experts
    s_hidden, shared_intermediate = check_array("shared_experts[0] (w_gate)", s_gate, 2,
                                                shape="[hidden, shared_intermediate]")
    if s_hidden != hidden:
      raise ValueError(f"shared_experts[0] (w_gate) must have shape [hidden={hidden}, Is], got {tuple(s_gate.shape)}")
    if check_array("shared_experts[1] (w_up)", s_up, 2, shape="[hidden, shared_intermediate]") != tuple(s_gate.shape):
      raise ValueError(f"shared_experts[1] (w_up) must have shape {tuple(s_gate.shape)}, got {tuple(s_up.shape)}")
    if (check_array("shared_experts[2] (w_down)", s_down, 2, shape="[shared_intermediate, hidden]")
        != (shared_intermediate, hidden)):
      raise ValueError(f"shared_experts[2] (w_down) must have shape [Is={shared_intermediate}, hidden={hidden}], "
                       f"got {tuple(s_down.shape)}")
    for name, array in zip(("shared_experts[0]", "shared_experts[1]", "shared_experts[2]"), shared_experts):
      _check_float(name, array, x.dtype)

  _check_positive_number("swiglu_limit", swiglu_limit)
  _check_positive_number("capacity_factor", capacity_factor)
  if capacity_factor is not None and axis_name is None:
    raise ValueError("capacity_factor bounds the rows each rank receives: it needs axis_name (expert parallelism)")
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  for name, flag in (("recompute", recompute), ("return_stats", return_stats)):
    if not isinstance(flag, bool | np.bool_):
      raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")

  axis_size = _axis_size(axis_name)
  num_experts = num_local_experts * axis_size
  if not 1 <= top_k <= num_experts:
    raise ValueError(f"top_k (weights.shape[1]) must be in [1, experts={num_experts}], got {top_k}")
  return MoEShape(num_tokens, top_k, hidden, intermediate, num_local_experts, num_experts, axis_size,
                  shared_intermediate)


def resolve_backend(backend: str, x: jax.Array | None = None) -> str:
  """"auto" -> "kittens" where `_extension.kittens_by_default(x)` (for a layer on tokens ``x``), else "xla"."""
  if backend != "auto":
    return backend
  return "kittens" if _extension.kittens_by_default(x) else "xla"


def moe_ffn(x: jax.Array, weights: jax.Array, ids: jax.Array, w_gate: jax.Array, w_up: jax.Array,
            w_down: jax.Array, *, shared_experts: tuple[jax.Array, jax.Array, jax.Array] | None = None,
            swiglu_limit: float | None = None, axis_name: str | None = None, backend: str = "auto",
            recompute: bool = False, capacity_factor: float | None = None, return_stats: bool = False):
  """Mixture-of-Experts SwiGLU feed-forward layer.

  y[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) + shared(x[t]), expert_e(v) = (silu(v W_gate[e]) *
  (v W_up[e])) W_down[e].

  Args:
    x: [T, H] bfloat16 / float16 / float32 tokens (this rank's tokens under ``axis_name``).
    weights: [T, k] float router weights (e.g. from `jax_kittens.route`).
    ids: [T, k] int32 expert ids; under ``axis_name`` global ids in [0, E_local * axis_size), expert e on rank
      e // E_local.
    w_gate, w_up: [E_local, H, I] x.dtype; w_down: [E_local, I, H] x.dtype.
    shared_experts: optional (w_gate [H, Is], w_up [H, Is], w_down [Is, H]) x.dtype, added to every token unweighted.
    swiglu_limit: optional float > 0: gate is clamped to <= limit and up to [-limit, limit] before the SwiGLU (all
      experts, shared included).
    axis_name: the ``jax.shard_map`` mesh axis the experts are split over (expert parallelism), or None. With None,
      arrays on a mesh of several devices outside shard_map split their tokens over it (`jax_kittens.token_parallel`).
    backend: "xla", "kittens" or "auto".
    recompute: re-derive forward intermediates in the backward pass instead of saving them (lower peak memory for
      more time; the kittens backward also reads x and dy from the tokens instead of from [R, H] row copies).
    capacity_factor: with ``axis_name``: rows each rank can receive as a multiple of T*k (None: dropless); entries
      over capacity are dropped deterministically and counted.
    return_stats: also return a `MoEStats`.

  Returns:
    y: [T, H] x.dtype, or ``(y, MoEStats)`` with ``return_stats``.
  """
  shared_experts = None if shared_experts is None else tuple(shared_experts)
  options = dict(swiglu_limit=swiglu_limit, axis_name=axis_name, capacity_factor=capacity_factor,
                 return_stats=return_stats)
  check_moe_args(x, weights, ids, w_gate, w_up, w_down, shared_experts=shared_experts, backend=backend,
                 recompute=recompute, **options)
  split = None if axis_name is not None else token_parallel.token_split(x)
  if split is not None:  # the tokens of a multi-device mesh: each device runs the layer on its share

    def local_layer(x, weights, ids, w_gate, w_up, w_down, shared_experts):
      return moe_ffn(x, weights, ids, w_gate, w_up, w_down, shared_experts=shared_experts, backend=backend,
                     recompute=recompute, **options)

    return token_parallel.split_tokens(local_layer, split, (x, weights, ids),
                                       (w_gate, w_up, w_down, shared_experts), summed_outputs=return_stats)
  # Expert parallelism has its own kittens path (jax_kittens.expert_parallel).
  expert_parallel_kittens = backend == "kittens" or (backend == "auto" and
                                                    _extension.kittens_by_default(x, expert_parallel=True))
  if axis_name is not None and expert_parallel_kittens:
    from jax_kittens import expert_parallel  # noqa: PLC0415 (loads the heap machinery only when used)

    return expert_parallel.moe_ffn(x, weights, ids, w_gate, w_up, w_down, shared_experts=shared_experts,
                                   recompute=recompute, **options)
  # "auto" falls back to xla for the layers the fused kernels do not take (dtype, feature sizes), and under axis_name
  # wherever expert parallelism does not default to the kernels.
  if axis_name is None and resolve_backend(backend, x) == "kittens" and (
      backend == "kittens" or fused_moe.unsupported_reason(x, w_gate, shared_experts) is None):
    return fused_moe.moe_ffn(x, weights, ids, w_gate, w_up, w_down, shared_experts=shared_experts,
                             recompute=recompute, **options)

  def layer(x, weights, ids, w_gate, w_up, w_down, shared_experts):
    return reference.moe_ffn(x, weights, ids, w_gate, w_up, w_down, shared_experts=shared_experts, **options)

  return (jax.checkpoint(layer) if recompute else layer)(x, weights, ids, w_gate, w_up, w_down, shared_experts)
