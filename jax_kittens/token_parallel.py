"""Token parallelism for per-token layers under `jax.jit` on a mesh of several devices.

A per-token layer (y[t] depends on x[t], its routing and weights shared by all tokens) left to XLA's partitioner runs
whole on every device when it contains custom calls: XLA gathers every token to every device, since it cannot split
an op it does not know (the fused kernels' FFI calls, and the reference's sort over all entries). `split_tokens`
instead runs the layer inside a `jax.shard_map` that gives each device its share of the tokens and the shared
weights whole. Each device then computes T/n tokens, and the shared weights' gradients are summed over the split
(by the kernels' VJPs, `_extension.cotangent_for`, and by shard_map's transpose for XLA's ops). Beyond the weights'
all-gather where they are sharded (which the whole-layer run needed too), nothing moves but the token arrays, from
the caller's layout to the split.

The tokens are split over every axis of size > 1 that divides what is left of T, in mesh order: a device's share
of a per-token layer is smallest over all of them, and from any layout the caller's token arrays have, the move to
that split is a slice on each device. Under Auto axes the output leaves in that split and XLA moves it on as its users
need; under Explicit axes (`jax.sharding.AxisType.Explicit`), where the layout is part of the type, it goes back to
the first token array's layout. No split where an axis is manual (the caller's own `shard_map`: its layout is the
caller's choice), on one device, or where no axis divides T.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


class TokenSplit(NamedTuple):
  """Where one call's tokens go: the mesh its arrays live on and the axes dim 0 of the token arrays is split over."""

  mesh: jax.sharding.AbstractMesh
  axes: tuple[str, ...]
  caller_spec: P | None  # Explicit axes: the first token array's layout, which the outputs are given back in


def token_split(tokens: jax.Array) -> TokenSplit | None:
  """How `split_tokens` would split ``tokens`` [T, ...] (its dim 0) over its mesh, or None for no split."""
  sharding = jax.typeof(tokens).sharding
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or mesh.empty or mesh.size == 1 or AxisType.Manual in mesh.axis_types:
    return None
  axes, share = [], tokens.shape[0]
  for name, size in zip(mesh.axis_names, mesh.axis_sizes):
    if size > 1 and share % size == 0:
      axes.append(name)
      share //= size
  if not axes:
    return None
  return TokenSplit(mesh, tuple(axes), sharding.spec if AxisType.Explicit in mesh.axis_types else None)


def split_tokens(layer: Callable, split: TokenSplit, token_args: Sequence, shared_args: Sequence, *,
                 summed_outputs: bool = False):
  """``layer(*token_args, *shared_args)`` with the token arrays' dim 0 split over ``split.axes``.

  layer: a per-token function; inside it, the token arrays are this device's share and the shared ones whole.
  token_args: arrays [T, ...] (split along dim 0). shared_args: pytrees of arrays (None allowed), whole on every
    device.
  summed_outputs: layer returns (token_outputs, scalars): the pytree of scalars is summed over the split (e.g. token
    counts); otherwise it returns token outputs only. Token outputs are [T_local, ...] arrays, joined along dim 0.
  """
  token_spec, shared_spec = P(split.axes), P()
  explicit = split.caller_spec is not None
  if explicit:  # shard_map takes explicit arrays only in the layout its specs name
    token_args = [jax.reshard(a, NamedSharding(split.mesh, token_spec)) for a in token_args]
    shared_args = jax.tree.map(lambda a: jax.reshard(a, NamedSharding(split.mesh, shared_spec)), list(shared_args))

  def local(*args):
    out = layer(*args)
    if summed_outputs:
      tokens_out, scalars = out
      return tokens_out, jax.tree.map(lambda s: jax.lax.psum(s, split.axes), scalars)
    return out

  out_specs = (token_spec, shared_spec) if summed_outputs else token_spec
  in_specs = (token_spec,) * len(token_args) + (shared_spec,) * len(shared_args)
  out = jax.shard_map(local, mesh=split.mesh, in_specs=in_specs, out_specs=out_specs)(*token_args, *shared_args)
  if not explicit:
    return out
  tokens_out = out[0] if summed_outputs else out
  caller = NamedSharding(split.mesh, P(split.caller_spec[0] if len(split.caller_spec) else None))
  tokens_out = jax.tree.map(lambda a: jax.reshard(a, caller), tokens_out)
  return (tokens_out, out[1]) if summed_outputs else tokens_out
