"""The MoE layer's math, shared by the NNX and Linen modules: router, routed + shared SwiGLU experts, aux losses.

Both modules hold the same parameters (see `MoEConfig.param_shapes`) and call `moe_layer`; neither repeats any of it.
"""

from __future__ import annotations

import dataclasses
from math import inf

import jax
import jax.numpy as jnp

from jax_kittens import routing
from jax_kittens.moe import BACKENDS, moe_ffn

SCORES = routing.SCORES
_COMPUTE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """Static description of one MoE layer.

  hidden: H, model width. intermediate: I, each routed expert's SwiGLU width. num_experts: E, routed experts in all
  (under ``axis_name`` each rank holds E / axis_size of them). top_k: experts per token.
  score: "softmax" (softmax top-k; trained with the load-balancing loss) or "sigmoid" (DeepSeek-V3: sigmoid scores,
  selection with a non-trainable per-expert bias updated by `update_router_bias`).
  renormalize: divide the k chosen weights by their sum.
  shared_intermediate: Is of the always-on shared expert (several shared experts of width Is_i are one of width
  sum Is_i), or None for none.
  swiglu_limit: optional clamp before the SwiGLU (see `jax_kittens.moe.moe_ffn`).
  axis_name: the ``shard_map`` mesh axis the routed experts are split over (expert parallelism), or None.
  backend: `moe_ffn`'s backend, "auto" | "kittens" | "xla".
  dtype: compute dtype of the expert GEMMs (params are cast to it); the router runs in float32.
  """

  hidden: int
  intermediate: int
  num_experts: int
  top_k: int
  score: str = "softmax"
  renormalize: bool = True
  shared_intermediate: int | None = None
  swiglu_limit: float | None = None
  axis_name: str | None = None
  backend: str = "auto"
  dtype: jnp.dtype = jnp.float32

  def __post_init__(self):
    for name in ("hidden", "intermediate", "num_experts", "top_k"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if self.top_k > self.num_experts:
      raise ValueError(f"top_k={self.top_k} must be <= num_experts={self.num_experts}")
    if self.score not in SCORES:
      raise ValueError(f"score must be one of {SCORES}, got {self.score!r}")
    if not isinstance(self.renormalize, bool):
      raise TypeError(f"renormalize must be a bool, got {self.renormalize!r}")
    shared = self.shared_intermediate
    if shared is not None and (not isinstance(shared, int) or isinstance(shared, bool) or shared < 1):
      raise ValueError(f"shared_intermediate must be a positive int or None, got {shared!r}")
    limit = self.swiglu_limit
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int | float) or not 0 < limit < inf):
      raise ValueError(f"swiglu_limit must be a finite number > 0 or None, got {limit!r}")
    if self.axis_name is not None and not isinstance(self.axis_name, str):
      raise TypeError(f"axis_name must be a str or None, got {self.axis_name!r}")
    if self.backend not in BACKENDS:
      raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
    try:
      dtype = jnp.dtype(self.dtype)
    except TypeError:
      dtype = None
    if dtype not in _COMPUTE_DTYPES:
      raise TypeError(f"dtype must be one of {[str(d) for d in _COMPUTE_DTYPES]}, got {self.dtype!r}")

  def param_shapes(self, num_local_experts: int | None = None) -> dict[str, tuple[int, ...]]:
    """Shapes of the trainable parameters (all float32 at rest).

    router: [H, E]; w_gate, w_up: [E_local, H, I]; w_down: [E_local, I, H]; with a shared expert also
    shared_w_gate, shared_w_up: [H, Is] and shared_w_down: [Is, H]. ``num_local_experts`` defaults to E.
    """
    local = self.num_experts if num_local_experts is None else num_local_experts
    h, i = self.hidden, self.intermediate
    shapes = {"router": (h, self.num_experts), "w_gate": (local, h, i), "w_up": (local, h, i),
              "w_down": (local, i, h)}
    if self.shared_intermediate is not None:
      s = self.shared_intermediate
      shapes.update(shared_w_gate=(h, s), shared_w_up=(h, s), shared_w_down=(s, h))
    return shapes


def param_initializer(name: str) -> jax.nn.initializers.Initializer:
  """Initialiser of each parameter: truncated-normal fan-in scaling (LeCun), per expert for the [E, in, out] ones.

  router: std 1/sqrt(H) over the H inputs; w_gate / w_up: 1/sqrt(H); w_down: 1/sqrt(I); shared ones alike.
  """
  if name in ("w_gate", "w_up", "w_down"):
    return jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1,
                                                batch_axis=(0,))
  return jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MoEAux:
  """What an MoE layer returns beside y (a pytree of arrays).

  load_balancing_loss: f32 scalar, E * sum_e f_e * P_e (Switch / GShard); f_e = fraction of the T*k (token, slot)
    assignments that chose expert e, P_e = mean router probability of e (softmax probs; for sigmoid scores each
    token's scores normalised to sum 1). 1.0 at perfect balance; gradient flows through P only.
  router_z_loss: f32 scalar, mean over tokens of logsumexp(logits)^2 (ST-MoE).
  expert_load: [E] f32, assignments per expert (counts over this call's tokens; ``psum`` them across data shards
    before `update_router_bias`).
  """

  load_balancing_loss: jax.Array
  router_z_loss: jax.Array
  expert_load: jax.Array


def router_aux(logits: jax.Array, ids: jax.Array, score: str) -> MoEAux:
  """Aux losses and load of one routing decision. logits: [T, E] f32; ids: [T, k] int32 (ids outside [0, E) are not
  counted in the load)."""
  if score not in SCORES:
    raise ValueError(f"score must be one of {SCORES}, got {score!r}")
  num_experts = logits.shape[-1]
  load = jnp.zeros((num_experts,), jnp.float32).at[ids.reshape(-1)].add(1.0)
  fraction = jax.lax.stop_gradient(load / ids.size)
  if score == "softmax":
    probs = jax.nn.softmax(logits, axis=-1)
  else:
    scores = jax.nn.sigmoid(logits)
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
  balance = num_experts * jnp.sum(fraction * jnp.mean(probs, axis=0))
  z_loss = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
  return MoEAux(balance, z_loss, load)


def update_router_bias(bias: jax.Array, expert_load: jax.Array, rate: float) -> jax.Array:
  """DeepSeek-V3 aux-loss-free balancing: bias + rate * sign(mean(load) - load).

  bias: [E] f32 selection bias (sigmoid routing); expert_load: [E] assignments per expert over the step's global
  batch (sum `MoEAux.expert_load` over micro-batches and data shards first). Underloaded experts move up, overloaded
  down. Applied after each optimizer step, outside the gradient (the bias is not a trainable parameter).
  """
  expert_load = expert_load.astype(jnp.float32)
  return bias + rate * jnp.sign(jnp.mean(expert_load) - expert_load)


def moe_layer(config: MoEConfig, params: dict[str, jax.Array], router_bias: jax.Array | None,
              x: jax.Array) -> tuple[jax.Array, MoEAux]:
  """One MoE layer.

  Args:
    config: the layer's `MoEConfig`.
    params: the arrays named by `MoEConfig.param_shapes` (routed experts local to this rank under ``axis_name``).
    router_bias: [E] f32 selection bias for score "sigmoid", or None.
    x: [..., H] tokens (e.g. [B, S, H]); flattened to [T, H] inside.

  Returns:
    y: x's shape, ``config.dtype``; and a `MoEAux`.
  """
  if x.shape[-1] != config.hidden:
    raise ValueError(f"x must have shape [..., hidden={config.hidden}], got {x.shape}")
  lead_shape = x.shape[:-1]
  tokens = x.reshape(-1, config.hidden).astype(config.dtype)
  logits = jnp.dot(tokens.astype(jnp.float32), params["router"].astype(jnp.float32))
  # The router follows the layer's backend, so that backend="xla" is pure JAX end to end.
  bias = router_bias if config.score == "sigmoid" else None
  weights, ids = routing.route(logits, config.top_k, score=config.score, bias=bias,
                               renormalize=config.renormalize, backend=config.backend)
  shared = None
  if config.shared_intermediate is not None:
    shared = tuple(params[name].astype(config.dtype) for name in ("shared_w_gate", "shared_w_up", "shared_w_down"))
  y = moe_ffn(tokens, weights, ids, params["w_gate"].astype(config.dtype), params["w_up"].astype(config.dtype),
              params["w_down"].astype(config.dtype), shared_experts=shared, swiglu_limit=config.swiglu_limit,
              axis_name=config.axis_name, backend=config.backend)
  return y.reshape(*lead_shape, config.hidden), router_aux(logits, ids, config.score)
