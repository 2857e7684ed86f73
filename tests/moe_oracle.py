"""Float64 numpy oracle of the MoE layer, forward and a hand-written backward, one (token, slot) entry at a time.

Shared by the reference and kernel tests; also builds the routings they use (uniform, skewed, empty experts).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class MoEGrads(NamedTuple):
  x: np.ndarray
  weights: np.ndarray
  w_gate: np.ndarray
  w_up: np.ndarray
  w_down: np.ndarray
  shared: tuple[np.ndarray, np.ndarray, np.ndarray] | None


def _sigmoid(z):
  return 1.0 / (1.0 + np.exp(-z))


def _swiglu_forward(x_rows, w_gate, w_up, limit):
  """x_rows: [N, H]; w_gate, w_up: [N, H, I] (each row's expert) -> activations and what the backward needs."""
  gate = np.einsum("nh,nhi->ni", x_rows, w_gate)
  up = np.einsum("nh,nhi->ni", x_rows, w_up)
  gate_clamped = gate if limit is None else np.minimum(gate, limit)
  up_clamped = up if limit is None else np.clip(up, -limit, limit)
  activation = gate_clamped * _sigmoid(gate_clamped) * up_clamped
  return activation, (gate, up, gate_clamped, up_clamped)


def _swiglu_backward(d_activation, saved, limit):
  gate, up, gate_clamped, up_clamped = saved
  s = _sigmoid(gate_clamped)
  d_gate = d_activation * up_clamped * s * (1.0 + gate_clamped * (1.0 - s))
  d_up = d_activation * gate_clamped * s
  if limit is not None:
    d_gate = d_gate * (gate < limit)
    d_up = d_up * (np.abs(up) < limit)
  return d_gate, d_up


def _routed_forward(x, ids, w_gate, w_up, w_down, swiglu_limit, kept):
  """Every kept (token, slot) entry through its expert: (token [N], slot [N], expert [N], activation [N, I],
  what the SwiGLU backward needs, expert_out [N, H])."""
  ids = np.asarray(ids)
  kept = np.ones(ids.shape, bool) if kept is None else np.asarray(kept, bool)
  token, slot = np.nonzero(kept)
  expert = ids[token, slot]
  activation, saved = _swiglu_forward(x[token], w_gate[expert], w_up[expert], swiglu_limit)
  return token, slot, expert, activation, saved, np.einsum("ni,nih->nh", activation, w_down[expert])


def moe_forward_backward(x, weights, ids, w_gate, w_up, w_down, d_y, *, shared_experts=None, swiglu_limit=None,
                         kept=None):
  """The layer and its gradients in float64.

  x: [T, H]; weights, ids: [T, k]; w_gate, w_up: [E, H, I]; w_down: [E, I, H]; d_y: [T, H] cotangent of y;
  shared_experts: optional (w_gate [H, Is], w_up [H, Is], w_down [Is, H]); kept: optional [T, k] bool, entries that
  were not dropped. Returns (y [T, H], MoEGrads).
  """
  x, weights, w_gate, w_up, w_down, d_y = (np.asarray(a, np.float64) for a in (x, weights, w_gate, w_up, w_down, d_y))
  ids = np.asarray(ids)
  num_tokens = ids.shape[0]
  token, slot, expert, activation, saved, expert_out = _routed_forward(x, ids, w_gate, w_up, w_down, swiglu_limit, kept)
  x_rows = x[token]
  y = np.zeros_like(x)
  np.add.at(y, token, weights[token, slot, None] * expert_out)

  d_weights = np.zeros_like(weights)
  d_weights[token, slot] = np.sum(d_y[token] * expert_out, axis=1)
  d_expert_out = weights[token, slot, None] * d_y[token]
  d_w_down = np.zeros_like(w_down)
  np.add.at(d_w_down, expert, np.einsum("ni,nh->nih", activation, d_expert_out))
  d_activation = np.einsum("nih,nh->ni", w_down[expert], d_expert_out)
  d_gate, d_up = _swiglu_backward(d_activation, saved, swiglu_limit)
  d_w_gate = np.zeros_like(w_gate)
  d_w_up = np.zeros_like(w_up)
  np.add.at(d_w_gate, expert, np.einsum("nh,ni->nhi", x_rows, d_gate))
  np.add.at(d_w_up, expert, np.einsum("nh,ni->nhi", x_rows, d_up))
  d_x = np.zeros_like(x)
  np.add.at(d_x, token, np.einsum("nhi,ni->nh", w_gate[expert], d_gate) + np.einsum("nhi,ni->nh", w_up[expert], d_up))

  d_shared = None
  if shared_experts is not None:
    s_gate, s_up, s_down = (np.asarray(a, np.float64) for a in shared_experts)
    s_activation, s_saved = _swiglu_forward(x, np.broadcast_to(s_gate, (num_tokens,) + s_gate.shape),
                                            np.broadcast_to(s_up, (num_tokens,) + s_up.shape), swiglu_limit)
    y = y + s_activation @ s_down
    d_s_down = s_activation.T @ d_y
    ds_gate, ds_up = _swiglu_backward(d_y @ s_down.T, s_saved, swiglu_limit)
    d_x = d_x + ds_gate @ s_gate.T + ds_up @ s_up.T
    d_shared = (x.T @ ds_gate, x.T @ ds_up, d_s_down)
  return y, MoEGrads(d_x, d_weights, d_w_gate, d_w_up, d_w_down, d_shared)


def d_weights_error_scale(x, ids, w_gate, w_up, w_down, d_y, *, swiglu_limit=None, kept=None):
  """[T, k] float64: the scale of a bf16 chain's rounding error in each d_weights entry (zero where not kept).

  d_weights[t, k] = sum_h d_y[t, h] expert_out[t, k, h], and expert_out[t, k, h] = sum_i activation[i] w_down[i, h].
  Rounding errors enter through both dot products and grow with the root-sum-square of their terms, not with the sum,
  which can cancel far below them: with a few entries (one token), an error relative to d_weights itself is noise.
  This is the hypot of the two root-sum-squares: d_y * expert_out over H, and activation * (w_down @ d_y) over I.
  """
  x, w_gate, w_up, w_down, d_y = (np.asarray(a, np.float64) for a in (x, w_gate, w_up, w_down, d_y))
  token, slot, expert, activation, _, expert_out = _routed_forward(x, ids, w_gate, w_up, w_down, swiglu_limit, kept)
  over_hidden = np.sum((d_y[token] * expert_out) ** 2, axis=1)
  over_intermediate = np.sum((activation * np.einsum("nih,nh->ni", w_down[expert], d_y[token])) ** 2, axis=1)
  scale = np.zeros(np.shape(ids))
  scale[token, slot] = np.sqrt(over_hidden + over_intermediate)
  return scale


def random_ids(rng, num_tokens, top_k, num_experts, load="uniform"):
  """[T, k] int32 ids, distinct within a token.

  load: "uniform"; "skewed" (expert 0 draws most tokens, about a third of the experts get none: needs k <= E - that
  third); "one_expert" (every token's first slot goes to expert E - 1).
  """
  if load == "uniform":
    preference = rng.random((num_tokens, num_experts))
  elif load == "skewed":
    popularity = rng.random(num_experts) ** 4
    popularity[0] = 10.0
    popularity[rng.permutation(np.arange(1, num_experts))[: num_experts // 3]] = -np.inf
    preference = popularity + 0.3 * rng.random((num_tokens, num_experts))
  elif load == "one_expert":
    preference = rng.random((num_tokens, num_experts))
    preference[:, num_experts - 1] = 2.0
  else:
    raise ValueError(f"unknown load {load!r}")
  return np.argsort(-preference, axis=1)[:, :top_k].astype(np.int32)


def random_layer(rng, num_tokens, hidden, intermediate, num_experts, top_k, *, load="uniform", shared=None):
  """Random float32 inputs of a layer: dict of x, weights, ids, w_gate, w_up, w_down (and shared_experts)."""
  scale_in, scale_mid = 1.0 / np.sqrt(hidden), 1.0 / np.sqrt(intermediate)
  weights = rng.random((num_tokens, top_k)).astype(np.float32) + 0.1
  layer = dict(
      x=rng.standard_normal((num_tokens, hidden)).astype(np.float32),
      weights=weights / weights.sum(axis=1, keepdims=True),
      ids=random_ids(rng, num_tokens, top_k, num_experts, load),
      w_gate=(scale_in * rng.standard_normal((num_experts, hidden, intermediate))).astype(np.float32),
      w_up=(scale_in * rng.standard_normal((num_experts, hidden, intermediate))).astype(np.float32),
      w_down=(scale_mid * rng.standard_normal((num_experts, intermediate, hidden))).astype(np.float32))
  if shared is not None:
    layer["shared_experts"] = (
        (scale_in * rng.standard_normal((hidden, shared))).astype(np.float32),
        (scale_in * rng.standard_normal((hidden, shared))).astype(np.float32),
        ((1.0 / np.sqrt(shared)) * rng.standard_normal((shared, hidden))).astype(np.float32))
  return layer


def kept_under_capacity(ids, num_ranks, local_experts, capacity):
  """[T, k] bool: entries that fit their owner's receive buffer of ``capacity`` rows.

  The buffer holds sources in rank order, each source's rows by local expert, then in (token, slot) order.
  """
  num_tokens = ids.shape[0]
  local_tokens = num_tokens // num_ranks
  source = np.repeat(np.arange(num_tokens) // local_tokens, ids.shape[1]).reshape(ids.shape)
  owner = ids // local_experts
  order = np.lexsort((np.arange(ids.size), ids.reshape(-1), source.reshape(-1), owner.reshape(-1)))
  position = np.empty(ids.size, np.int64)
  sorted_owner = owner.reshape(-1)[order]
  starts = np.searchsorted(sorted_owner, sorted_owner, side="left")
  position[order] = np.arange(ids.size) - starts
  return (position < capacity).reshape(ids.shape)
