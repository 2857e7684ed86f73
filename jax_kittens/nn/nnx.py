"""`MoE`: the Flax NNX Mixture-of-Experts layer (math in `jax_kittens.nn.moe_math`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_kittens.nn.moe_math import MoEAux, MoEConfig, moe_layer, param_initializer, update_router_bias


class RouterBias(nnx.Variable):
  """The non-trainable [E] f32 selection bias of sigmoid routing; `nnx.Param` filters leave it out of the optimizer."""


class MoE(nnx.Module):
  """Routed SwiGLU experts with a softmax / sigmoid top-k router and optional shared expert.

  ``y, aux = moe(x)`` with x: [..., H] and aux a `MoEAux` (load-balancing loss, router z-loss, per-expert load).

  Parameters (`nnx.Param`, float32; shapes from `MoEConfig.param_shapes`, initialisers from `param_initializer`):
    router [H, E]; w_gate, w_up [E_local, H, I]; w_down [E_local, I, H]; with shared_intermediate also
    shared_w_gate, shared_w_up [H, Is] and shared_w_down [Is, H]. With score "sigmoid": ``router_bias`` [E] f32
    zeros, a `RouterBias` (not trained; see `apply_bias_update`).

  ``num_local_experts`` (default E) is the experts this module instance holds: under expert parallelism build the
  module with E and shard the routed weights' leading axis over ``config.axis_name`` instead.
  """

  def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs):
    self.config = config
    for name, shape in config.param_shapes().items():
      setattr(self, name, nnx.Param(param_initializer(name)(rngs.params(), shape, jnp.float32)))
    self.router_bias = RouterBias(jnp.zeros((config.num_experts,), jnp.float32)) if config.score == "sigmoid" else None

  def params(self) -> dict[str, jax.Array]:
    """The trainable arrays by name (the dict `moe_layer` and the Linen module take)."""
    return {name: getattr(self, name)[...] for name in self.config.param_shapes()}

  def __call__(self, x: jax.Array) -> tuple[jax.Array, MoEAux]:
    bias = None if self.router_bias is None else self.router_bias[...]
    return moe_layer(self.config, self.params(), bias, x)

  def apply_bias_update(self, expert_load: jax.Array, rate: float) -> None:
    """Moves ``router_bias`` by `update_router_bias` (call after the optimizer step; no-op for softmax routing)."""
    if self.router_bias is not None:
      self.router_bias[...] = update_router_bias(self.router_bias[...], expert_load, rate)
