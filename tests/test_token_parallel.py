"""`moe_ffn`, `route` and `ragged_dot` under `jax.jit` on a mesh of host devices, with no shard_map of the caller's
(jax_kittens.token_parallel): each device computes its share of the tokens, nothing is all-gathered, and outputs,
stats and gradients equal the same call on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_kittens as jk
from jax_kittens import token_parallel
from moe_oracle import random_layer

GRAD_ARGS = (0, 1, 3, 4, 5, 6)  # x, weights, w_gate, w_up, w_down, shared experts


def cpu_mesh(shape, names, axis_type=AxisType.Auto):
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape),
                       devices=jax.devices("cpu")[:int(np.prod(shape))])


def bf16_args(layer):
  """(x, weights, ids, w_gate, w_up, w_down, shared experts) of a moe_oracle layer: bf16 but the router's."""
  bf16 = lambda a: jnp.asarray(a, jnp.bfloat16)
  return (bf16(layer["x"]), jnp.asarray(layer["weights"], jnp.float32), jnp.asarray(layer["ids"]),
          bf16(layer["w_gate"]), bf16(layer["w_up"]), bf16(layer["w_down"]),
          tuple(bf16(w) for w in layer["shared_experts"]))


def layer_and_grads(backend, d_y):
  """jit(args) -> (y, stats, grads of <y, d_y> w.r.t. GRAD_ARGS), and the jitted function (for its HLO)."""

  def loss(x, weights, ids, w_gate, w_up, w_down, shared):
    y, stats = jk.moe_ffn(x, weights, ids, w_gate, w_up, w_down, shared_experts=shared, backend=backend,
                          return_stats=True)
    return jnp.sum(y.astype(jnp.float32) * d_y), (y, stats)

  grad = jax.grad(loss, argnums=GRAD_ARGS, has_aux=True)
  return jax.jit(lambda *args: (*grad(*args)[1], grad(*args)[0]))


def all_gathers(fn, *args):
  return fn.lower(*args).compile().as_text().count("all-gather(")


def rel_error(got, want):
  got, want = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (got, want))
  return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


@pytest.mark.parametrize("backend", ["kittens", "xla"])
@pytest.mark.parametrize("mesh_shape,axis_type,x_spec,y_spec,moves_y", [
    ((4,), AxisType.Auto, P("a"), P("a"), False),
    # Every axis that divides what is left of T (200 = 2 * 4 * 25), whatever x's own layout; under Auto axes y
    # leaves in that split.
    ((2, 4), AxisType.Auto, P("a"), P(("a", "b")), False),
    ((2, 4), AxisType.Explicit, P(("a", "b")), P(("a", "b")), False),
    # Explicit axes: y comes back in x's layout (an all-gather over "b" of y, and of dx in the backward).
    ((2, 4), AxisType.Explicit, P("a"), P("a"), True),
])
def test_moe_ffn_splits_tokens_over_the_mesh(backend, mesh_shape, axis_type, x_spec, y_spec, moves_y):
  rng = np.random.default_rng(0)
  tokens, hidden, intermediate, experts, top_k = 200, 64, 128, 6, 2
  layer = random_layer(rng, tokens, hidden, intermediate, experts, top_k, load="skewed", shared=64)
  args = bf16_args(layer)
  d_y = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.float32)
  fn = layer_and_grads(backend, d_y)
  with jax.default_device(jax.devices("cpu")[0]):
    want_y, want_stats, want_grads = fn(*args)

  mesh = cpu_mesh(mesh_shape, ("a", "b")[:len(mesh_shape)], axis_type)
  with jax.set_mesh(mesh):
    token_spec = P(*x_spec, None)
    placed = [jax.device_put(a, NamedSharding(mesh, token_spec if i < 3 else P())) for i, a in enumerate(args[:6])]
    placed.append(tuple(jax.device_put(w, NamedSharding(mesh, P())) for w in args[6]))
    y, stats, grads = fn(*placed)
    if not moves_y:  # run whole on every device, the layer would gather every token there
      assert all_gathers(fn, *placed) == 0

  assert y.sharding.spec[0] == y_spec[0]
  if axis_type == AxisType.Explicit:
    assert grads[0].sharding.spec[0] == x_spec[0]
  assert jax.tree.map(int, stats) == jax.tree.map(int, want_stats)
  # Per-token work: the kernels' twins give the same bits as on one device (XLA's CPU dots may round a token's
  # sums differently at another row count: a bf16 step). The weight gradients are sums over the split (bf16
  # partials).
  token_bound = 0.0 if backend == "kittens" else 1e-2
  for name, got, want in zip(("y", "x", "weights"), (y, *grads[:2]), (want_y, *want_grads[:2])):
    assert rel_error(got, want) <= token_bound, name
  for got, want in zip(jax.tree.leaves(grads[2:]), jax.tree.leaves(want_grads[2:])):
    assert got.sharding.is_fully_replicated and rel_error(got, want) < 1e-2


def test_kittens_layer_in_the_callers_shard_map_sums_the_shared_weights_gradients():
  """The split done by hand: the kittens layer inside a shard_map over the tokens, expert weights replicated (what
  models/train.py does where the experts do not divide over the devices). Their gradients come back summed."""
  rng = np.random.default_rng(1)
  layer = random_layer(rng, 96, 64, 64, 4, 2, load="uniform", shared=64)
  args = bf16_args(layer)
  d_y = jnp.asarray(rng.standard_normal((96, 64)), jnp.float32)

  def grads(x, weights, ids, w_gate, w_up, w_down, shared, d_y):
    def loss(x, weights, w_gate, w_up, w_down, shared):
      y = jk.moe_ffn(x, weights, ids, w_gate, w_up, w_down, shared_experts=shared, backend="kittens")
      return jnp.sum(y.astype(jnp.float32) * d_y)
    return jax.grad(loss, argnums=tuple(range(6)))(x, weights, w_gate, w_up, w_down, shared)

  with jax.default_device(jax.devices("cpu")[0]):
    want = jax.jit(grads)(*args, d_y)
  tokens, whole = P("a"), P()
  by_hand = jax.jit(jax.shard_map(grads, mesh=cpu_mesh((4,), ("a",)), in_specs=(tokens,) * 3 + (whole,) * 4 + (tokens,),
                                  out_specs=(tokens, tokens, whole, whole, whole, whole)))
  got = by_hand(*args, d_y)
  for name, g, w in zip(("x", "weights"), got[:2], want[:2]):
    assert rel_error(g, w) == 0.0, name
  for g, w in zip(jax.tree.leaves(got[2:]), jax.tree.leaves(want[2:])):
    assert rel_error(g, w) < 1e-2


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_route_splits_rows_over_the_mesh(score):
  mesh = cpu_mesh((4,), ("a",))
  logits = jax.random.normal(jax.random.key(3), (4 * 13, 16))
  bias = jnp.linspace(0.0, 0.5, 16) if score == "sigmoid" else None
  probe = jax.random.normal(jax.random.key(4), (4 * 13, 3))
  route = jax.jit(lambda l: jk.route(l, 3, score=score, bias=bias, backend="kittens"))
  grad = jax.jit(jax.grad(lambda l: jnp.sum(jk.route(l, 3, score=score, bias=bias, backend="kittens")[0] * probe)))
  with jax.default_device(jax.devices("cpu")[0]):
    (want_weights, want_ids), want_grad = route(logits), grad(logits)
  sharded = jax.device_put(logits, NamedSharding(mesh, P("a")))
  (weights, ids), d_logits = route(sharded), grad(sharded)
  assert all_gathers(route, sharded) == 0 and weights.sharding.spec[0] == "a"
  np.testing.assert_array_equal(ids, want_ids)
  np.testing.assert_array_equal(weights, want_weights)
  np.testing.assert_array_equal(d_logits, want_grad)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_ragged_dot_splits_rows_over_the_mesh(axis_type):
  """Groups that cross the devices' row blocks, an empty one, and rows past the last group (zeros)."""
  rows, k, n = 200, 128, 64
  keys = jax.random.split(jax.random.key(5), 3)
  lhs = jax.random.normal(keys[0], (rows, k), jnp.bfloat16)
  rhs = jax.random.normal(keys[1], (5, k, n), jnp.bfloat16)
  group_sizes = jnp.array([30, 0, 91, 50, 20], jnp.int32)
  probe = jax.random.normal(keys[2], (rows, n))
  product = jax.jit(lambda l, r: jk.ragged_dot(l, r, group_sizes, preferred_element_type=jnp.float32,
                                               backend="kittens"))
  grad = jax.jit(jax.grad(lambda l, r: jnp.sum(jk.ragged_dot(l, r, group_sizes, backend="kittens") * probe),
                          argnums=(0, 1)))
  with jax.default_device(jax.devices("cpu")[0]):
    want, (want_d_lhs, want_d_rhs) = product(lhs, rhs), grad(lhs, rhs)
  mesh = cpu_mesh((2, 4), ("a", "b"), axis_type)
  sharded = jax.device_put(lhs, NamedSharding(mesh, P(("a", "b"))))
  got, (d_lhs, d_rhs) = product(sharded, rhs), grad(sharded, rhs)
  assert all_gathers(product, sharded, rhs) == 0 and got.sharding.spec[0] == ("a", "b")
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(np.asarray(d_lhs, np.float32), np.asarray(want_d_lhs, np.float32))
  assert rel_error(d_rhs, want_d_rhs) < 1e-2  # bf16 partials summed over the devices


def test_no_split_on_one_device_in_a_shard_map_or_when_no_axis_divides():
  seen = []
  probe = lambda v: (seen.append(token_parallel.token_split(v)), v)[1]
  jax.jit(probe)(jnp.ones((8, 4)))  # one device
  mesh = cpu_mesh((4,), ("a",))
  jax.jit(probe)(jax.device_put(jnp.ones((6, 4)), NamedSharding(mesh, P())))  # 6 tokens: 4 does not divide
  jax.jit(jax.shard_map(probe, mesh=mesh, in_specs=P("a"), out_specs=P("a")))(jnp.ones((8, 4)))  # manual axis
  assert seen == [None, None, None]
  split = jax.jit(lambda v: (seen.append(token_parallel.token_split(v)), v)[1])
  split(jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P())))
  assert seen[-1].axes == ("a",) and seen[-1].caller_spec is None
