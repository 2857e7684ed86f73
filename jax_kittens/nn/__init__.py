"""Flax Mixture-of-Experts layers: `jax_kittens.nn.nnx.MoE` (NNX) and `jax_kittens.nn.linen.MoE` (Linen).

Both share `moe_math.moe_layer`; `MoEConfig` describes a layer, `MoEAux` is what it returns beside y, and
`update_router_bias` is the aux-loss-free balancing step for sigmoid routing.
"""

from jax_kittens.nn import linen, nnx
from jax_kittens.nn.moe_math import MoEAux, MoEConfig, moe_layer, param_initializer, router_aux, update_router_bias

__all__ = ["MoEAux", "MoEConfig", "linen", "moe_layer", "nnx", "param_initializer", "router_aux",
           "update_router_bias"]
