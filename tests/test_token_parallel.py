"""`moe_ffn`, `route` and `ragged_dot` under `jax.jit` on a mesh of devices, with no shard_map of the caller's
(jax_kittens.token_parallel): each device computes its share of the tokens, nothing is all-gathered, and outputs,
stats and gradients equal the same call on one device. CPU tests on host devices; the `gpu` test needs 2 GPUs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_kittens as jk
from jax_kittens import token_parallel
from moe_oracle import random_layer

GRAD_ARGS = (0, 1, 3, 4, 5, 6)  # x, weights, w_gate, w_up, w_down, shared experts


def device_mesh(shape, names, axis_type=AxisType.Auto, platform="cpu"):
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape),
                       devices=jax.devices(platform)[:int(np.prod(shape))])


@pytest.fixture
def rng():
  seed = int(np.random.SeedSequence().entropy % 2**32)
  print(f"seed {seed}")  # shown when a test fails, to replay it
  return np.random.default_rng(seed)


def bf16_args(layer):
  """(x, weights, ids, w_gate, w_up, w_down, shared experts) of a moe_oracle layer: bf16 but the router's."""
  bf16 = lambda a: jnp.asarray(a, jnp.bfloat16)
  return (bf16(layer["x"]), jnp.asarray(layer["weights"], jnp.float32), jnp.asarray(layer["ids"]),
          bf16(layer["w_gate"]), bf16(layer["w_up"]), bf16(layer["w_down"]),
          tuple(bf16(w) for w in layer["shared_experts"]))


def layer_and_grads(backend, d_y):
  """jit(x, weights, ids, w_gate, w_up, w_down, shared) -> (y, stats, grads of <y, d_y> w.r.t. all but ids)."""

  def loss(x, weights, ids, w_gate, w_up, w_down, shared):
    y, stats = jk.moe_ffn(x, weights, ids, w_gate, w_up, w_down, shared_experts=shared, backend=backend,
                          return_stats=True)
    return jnp.sum(y.astype(jnp.float32) * d_y), (y, stats)

  grad = jax.grad(loss, argnums=(0, 1, 3, 4, 5, 6), has_aux=True)

  def run(*args):
    grads, (y, stats) = grad(*args)
    return y, stats, grads

  return jax.jit(run)


def all_gathers(fn, *args):
  return fn.lower(*args).compile().as_text().count("all-gather(")


def rel_error(got, want):
  got, want = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (got, want))
  return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def check_layer_split(rng, sizes, backend, mesh, x_spec, y_spec, moves_y):
  """The layer (tokens, hidden, intermediate, experts, top_k = sizes; skewed routing, a shared expert) with x,
  weights and ids laid out by x_spec on ``mesh``, against the same on the mesh's first device."""
  tokens, hidden, intermediate, experts, top_k = sizes
  layer = random_layer(rng, tokens, hidden, intermediate, experts, top_k, load="skewed", shared=intermediate)
  args = bf16_args(layer)
  d_y = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.float32)
  fn = layer_and_grads(backend, d_y)
  with jax.default_device(mesh.devices.flat[0]):
    want_y, want_stats, want_grads = fn(*args)

  with jax.set_mesh(mesh):
    token_spec = P(*x_spec, None)
    placed = [jax.device_put(a, NamedSharding(mesh, token_spec if i < 3 else P())) for i, a in enumerate(args[:6])]
    placed.append(tuple(jax.device_put(w, NamedSharding(mesh, P())) for w in args[6]))
    y, stats, grads = fn(*placed)
    if not moves_y:  # run whole on every device, the layer would gather every token there
      assert all_gathers(fn, *placed) == 0

  assert y.sharding.spec[0] == y_spec[0]
  if AxisType.Explicit in mesh.axis_types:
    assert grads[0].sharding.spec[0] == x_spec[0]
  assert jax.tree.map(int, stats) == jax.tree.map(int, want_stats)
  # Per-token work: the kernels (and their twins) give a token the same bits whatever rows share its tiles; XLA's
  # CPU dots may round a token's sums differently at another row count (a bf16 step). The weight gradients are sums
  # over the split (bf16 partials).
  token_bound = 0.0 if backend == "kittens" else 1e-2
  for name, got, want in zip(("y", "x", "weights"), (y, *grads[:2]), (want_y, *want_grads[:2])):
    assert rel_error(got, want) <= token_bound, name
  for got, want in zip(jax.tree.leaves(grads[2:]), jax.tree.leaves(want_grads[2:])):
    assert got.sharding.is_fully_replicated and rel_error(got, want) < 1e-2


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
def test_moe_ffn_splits_tokens_over_the_mesh(rng, backend, mesh_shape, axis_type, x_spec, y_spec, moves_y):
  mesh = device_mesh(mesh_shape, ("a", "b")[:len(mesh_shape)], axis_type)
  check_layer_split(rng, (200, 64, 128, 6, 2), backend, mesh, x_spec, y_spec, moves_y)


@pytest.mark.gpu
def test_gpu_layer_splits_tokens_over_the_gpus(rng):
  num_gpus = min(len(jax.devices("gpu")), 8)
  if num_gpus < 2:
    pytest.skip("needs at least 2 GPUs")
  mesh = device_mesh((num_gpus,), ("a",), platform="gpu")
  check_layer_split(rng, (1000 * num_gpus, 1024, 512, 16, 4), "kittens", mesh, P("a"), P("a"), False)


def test_kittens_layer_in_the_callers_shard_map_sums_the_shared_weights_gradients(rng):
  """The split done by hand: the kittens layer inside a shard_map over the tokens, expert weights replicated (what
  models/train.py does where the experts do not divide over the devices). Their gradients come back summed."""
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
  by_hand = jax.jit(jax.shard_map(grads, mesh=device_mesh((4,), ("a",)),
                                  in_specs=(tokens,) * 3 + (whole,) * 4 + (tokens,),
                                  out_specs=(tokens, tokens, whole, whole, whole, whole)))
  got = by_hand(*args, d_y)
  for name, g, w in zip(("x", "weights"), got[:2], want[:2]):
    assert rel_error(g, w) == 0.0, name
  for g, w in zip(jax.tree.leaves(got[2:]), jax.tree.leaves(want[2:])):
    assert rel_error(g, w) < 1e-2


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_route_splits_rows_over_the_mesh(rng, score):
  mesh = device_mesh((4,), ("a",))
  logits = jnp.asarray(rng.standard_normal((4 * 13, 16)), jnp.float32)
  bias = jnp.linspace(0.0, 0.5, 16) if score == "sigmoid" else None
  probe = jnp.asarray(rng.standard_normal((4 * 13, 3)), jnp.float32)
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
def test_ragged_dot_splits_rows_over_the_mesh(rng, axis_type):
  """Groups that cross the devices' row blocks, an empty one, and rows past the last group (zeros)."""
  rows, k, n = 200, 128, 64
  lhs = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((5, k, n)), jnp.bfloat16)
  group_sizes = jnp.array([30, 0, 91, 50, 20], jnp.int32)
  probe = jnp.asarray(rng.standard_normal((rows, n)), jnp.float32)
  product = jax.jit(lambda l, r: jk.ragged_dot(l, r, group_sizes, preferred_element_type=jnp.float32,
                                               backend="kittens"))
  grad = jax.jit(jax.grad(lambda l, r: jnp.sum(jk.ragged_dot(l, r, group_sizes, backend="kittens") * probe),
                          argnums=(0, 1)))
  with jax.default_device(jax.devices("cpu")[0]):
    want, (want_d_lhs, want_d_rhs) = product(lhs, rhs), grad(lhs, rhs)
  mesh = device_mesh((2, 4), ("a", "b"), axis_type)
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
  mesh = device_mesh((4,), ("a",))
  jax.jit(probe)(jax.device_put(jnp.ones((6, 4)), NamedSharding(mesh, P())))  # 6 tokens: 4 does not divide
  jax.jit(jax.shard_map(probe, mesh=mesh, in_specs=P("a"), out_specs=P("a")))(jnp.ones((8, 4)))  # manual axis
  assert seen == [None, None, None]
  split = jax.jit(lambda v: (seen.append(token_parallel.token_split(v)), v)[1])
  split(jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P())))
  assert seen[-1].axes == ("a",) and seen[-1].caller_spec is None
