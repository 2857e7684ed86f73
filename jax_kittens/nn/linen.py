"""`MoE`: the Flax Linen Mixture-of-Experts layer (math in `jax_kittens.nn.moe_math`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from jax_kittens.nn.moe_math import MoEAux, MoEConfig, moe_layer, param_initializer

ROUTER_STATE = "router_state"


class MoE(nn.Module):
  """Routed SwiGLU experts with a softmax / sigmoid top-k router and optional shared expert (Linen).

  ``y, aux = moe.apply(variables, x)`` with x: [..., H] and aux a `MoEAux`.

  Variables: collection "params" holds the arrays of `MoEConfig.param_shapes` under the same names and
  initialisers as the NNX module (float32); with score "sigmoid" collection "router_state" holds ``bias`` [E] f32
  zeros, not trained: replace it with `jax_kittens.nn.update_router_bias(bias, aux.expert_load, rate)` after each
  optimizer step.
  """

  config: MoEConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> tuple[jax.Array, MoEAux]:
    params = {name: self.param(name, param_initializer(name), shape, jnp.float32)
              for name, shape in self.config.param_shapes().items()}
    bias = None
    if self.config.score == "sigmoid":
      bias = self.variable(ROUTER_STATE, "bias", jnp.zeros, (self.config.num_experts,), jnp.float32).value
    return moe_layer(self.config, params, bias, x)
