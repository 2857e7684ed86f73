"""Runs an MoE layer split over a 1-D "ep" mesh of host devices: outputs, stats and gradients, for the tests."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P


def ep_mesh(num_ranks, platform="cpu"):
  return Mesh(np.array(jax.devices(platform)[:num_ranks]), ("ep",))


def sharded_forward_backward(mesh, layer_fn, layer, d_y, *, steps=1):
  """y, stats and gradients (x, weights, w_gate, w_up, w_down, shared) of ``layer_fn`` split over the "ep" axis.

  layer_fn(x, weights, ids, w_gate, w_up, w_down, shared) -> (y, MoEStats) runs per rank inside shard_map: tokens
  and routed experts split over "ep", shared experts replicated. ``steps``: how often the one compiled program runs,
  each run to completion; the last run's results are returned.
  """
  shared = layer.get("shared_experts")

  def local(x, weights, ids, w_gate, w_up, w_down, d_y, shared):
    def loss(x, weights, w_gate, w_up, w_down, shared):
      y, stats = layer_fn(x, weights, ids, w_gate, w_up, w_down, shared)
      return jnp.sum(y.astype(jnp.float32) * d_y), (y, stats)

    grads, (y, stats) = jax.grad(loss, argnums=tuple(range(6)), has_aux=True)(x, weights, w_gate, w_up, w_down,
                                                                             shared)
    # Shared weights are replicated (unvarying): shard_map's transpose already sums their gradient over the ranks.
    return y, jax.tree.map(lambda s: s[None], stats), grads

  tokens = P("ep")
  run = jax.jit(jax.shard_map(local, mesh=mesh,
                              in_specs=(tokens, tokens, tokens, P("ep"), P("ep"), P("ep"), tokens, P()),
                              out_specs=(tokens, P("ep"), (tokens, tokens, P("ep"), P("ep"), P("ep"), P()))))
  args = (layer["x"], layer["weights"], layer["ids"], layer["w_gate"], layer["w_up"], layer["w_down"], d_y, shared)
  for _ in range(steps - 1):
    jax.block_until_ready(run(*args))
  return run(*args)
