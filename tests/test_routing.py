"""route and schedule: the FFI targets (CPU twin here, CUDA on the GPU) against pure JAX and a float64 oracle."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_kittens as jk


def _oracle_route(logits, top_k, score, bias, renormalize, num_groups, top_groups, near_tie=1e-5):
  """float64 numpy routing with the documented rules (group = sum of its two best keys; ties to the lower id).

  Returns weights, ids, the keys the ids were picked by (-inf outside the chosen groups), and the keys under the other
  group choice float32 rounding may make: where the last chosen group's score lies within `near_tie` of the best
  unchosen one's, those two swapped (elsewhere the same keys).
  """
  logits = np.asarray(logits, np.float64)
  tokens, num_experts = logits.shape
  sig = 1.0 / (1.0 + np.exp(-logits))
  keys = logits.copy() if score == "softmax" else sig + (0.0 if bias is None else np.asarray(bias, np.float64))
  alternative_keys = keys
  if num_groups:
    grouped = keys.reshape(tokens, num_groups, -1)
    group_scores = -np.sort(-grouped, axis=-1)[..., : min(2, grouped.shape[-1])].sum(-1)
    order = np.argsort(-group_scores, axis=-1, kind="stable")

    def in_groups(chosen):
      allowed = np.zeros((tokens, num_groups), bool)
      np.put_along_axis(allowed, chosen, True, axis=-1)
      return np.where(np.repeat(allowed, num_experts // num_groups, axis=-1), keys, -np.inf)

    chosen = order[:, :top_groups]
    swapped = chosen.copy()
    if top_groups < num_groups:
      swapped[:, -1] = order[:, top_groups]
    tied = (np.take_along_axis(group_scores, chosen[:, -1:], -1) -
            np.take_along_axis(group_scores, swapped[:, -1:], -1)) < near_tie
    keys, alternative_keys = in_groups(chosen), in_groups(swapped)
    alternative_keys = np.where(tied, alternative_keys, keys)
  ids = np.argsort(-keys, axis=-1, kind="stable")[:, :top_k]
  if score == "softmax":
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
  else:
    probs = sig
  weights = np.take_along_axis(probs, ids, -1)
  if renormalize:
    weights /= weights.sum(-1, keepdims=True)
  return weights, ids, keys, alternative_keys


def _assert_same_choice(ids, oracle_ids, oracle_keys, alternative_keys, seed, gap=1e-5):
  """At every rank the chosen expert's key equals the oracle's pick's key, up to float32 rounding of near-ties (of
  experts, or of groups: then the pick under the other group choice counts too)."""
  ids = np.asarray(ids)

  def off(keys, picks):
    return (np.abs(np.take_along_axis(keys, ids, -1) - np.take_along_axis(keys, picks, -1)) >= gap).any(-1)

  alternative_ids = np.argsort(-alternative_keys, axis=-1, kind="stable")[:, : ids.shape[1]]
  wrong = off(oracle_keys, np.asarray(oracle_ids)) & off(alternative_keys, alternative_ids)
  assert not wrong.any(), f"seed {seed}: {wrong.sum()} tokens chose other experts than the oracle"
  assert np.mean(np.any(ids != np.asarray(oracle_ids), axis=-1)) < 1e-3, f"seed {seed}"


CONFIGS = [
    dict(score="softmax"),
    dict(score="softmax", renormalize=False),
    dict(score="sigmoid"),
    dict(score="sigmoid", bias=True),
    dict(score="softmax", num_groups=8, top_groups=3),
    dict(score="sigmoid", bias=True, num_groups=4, top_groups=2, renormalize=False),
]


@pytest.mark.parametrize("backend", ["kittens", "xla"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_route_matches_float64_oracle(backend, config, dtype):
  seed = np.random.default_rng().integers(1 << 30)
  key_logits, key_bias = jax.random.split(jax.random.key(seed))
  tokens, num_experts, top_k = 203, 64, 6
  logits = jax.random.normal(key_logits, (tokens, num_experts)).astype(dtype)
  config = dict(config)
  bias = jax.random.normal(key_bias, (num_experts,)) * 0.1 if config.pop("bias", False) else None
  weights, ids = jk.route(logits, top_k, bias=bias, backend=backend, **config)
  assert weights.shape == (tokens, top_k) and weights.dtype == jnp.float32
  assert ids.shape == (tokens, top_k) and ids.dtype == jnp.int32
  oracle_weights, oracle_ids, oracle_keys, alternative_keys = _oracle_route(
      np.asarray(logits.astype(jnp.float32)), top_k, config.get("score"), bias, config.get("renormalize", True),
      config.get("num_groups"), config.get("top_groups"))
  _assert_same_choice(ids, oracle_ids, oracle_keys, alternative_keys, seed)
  same = np.all(np.asarray(ids) == oracle_ids, axis=-1)
  np.testing.assert_allclose(np.asarray(weights)[same], oracle_weights[same], rtol=2e-6, atol=2e-7)


def test_route_ties_go_to_the_lower_expert():
  logits = jnp.zeros((5, 16), jnp.float32).at[:, 7].set(1.0)
  for backend in ("kittens", "xla"):
    weights, ids = jk.route(logits, 4, backend=backend)
    np.testing.assert_array_equal(ids, np.tile([7, 0, 1, 2], (5, 1)))
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)


def test_route_is_deterministic_and_jits():
  logits = jax.random.normal(jax.random.key(3), (1000, 32))
  f = jax.jit(functools.partial(jk.route, top_k=4, score="sigmoid", num_groups=4, top_groups=2))
  first, second = f(logits), f(logits)
  np.testing.assert_array_equal(first[1], second[1])
  np.testing.assert_array_equal(first[0], second[0])


@pytest.mark.parametrize("config", CONFIGS[:5], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_route_gradient_matches_float64_differences_and_pure_jax(config):
  logits = jax.random.normal(jax.random.key(np.random.default_rng().integers(1 << 30)), (37, 24))
  config = {k: v for k, v in config.items() if k != "bias"}
  probe = jax.random.normal(jax.random.key(9), (37, 3))

  def loss(l, backend):
    weights, _ = jk.route(l, 3, backend=backend, **config)
    return jnp.sum(weights * probe)

  grad_kittens = jax.grad(loss)(logits, "kittens")
  grad_xla = jax.grad(loss)(logits, "xla")
  np.testing.assert_allclose(grad_kittens, grad_xla, rtol=1e-5, atol=1e-7)
  assert float(jnp.abs(grad_kittens).max()) > 0

  # Central differences of the float64 oracle's weights (random normal logits: no choice flips within 1e-6).
  logits64, probe64, eps = np.asarray(logits, np.float64), np.asarray(probe, np.float64), 1e-6
  oracle_args = (3, config["score"], None, config.get("renormalize", True), config.get("num_groups"),
                 config.get("top_groups"))
  oracle_loss = lambda l: np.sum(_oracle_route(l, *oracle_args)[0] * probe64)  # noqa: E731
  differences = np.zeros_like(logits64)
  for index in np.ndindex(*logits64.shape):
    step = np.zeros_like(logits64)
    step[index] = eps
    differences[index] = (oracle_loss(logits64 + step) - oracle_loss(logits64 - step)) / (2 * eps)
  np.testing.assert_allclose(grad_kittens, differences, rtol=1e-4, atol=1e-6)


def test_route_bias_gets_no_gradient():
  logits = jax.random.normal(jax.random.key(4), (9, 8))
  bias = jnp.full((8,), 0.1)
  grad = jax.grad(lambda b: jk.route(logits, 2, score="sigmoid", bias=b)[0].sum())(bias)
  np.testing.assert_array_equal(grad, 0.0)


def test_route_vmap_with_and_without_batched_bias():
  logits = jax.random.normal(jax.random.key(5), (3, 11, 16))
  bias = jax.random.normal(jax.random.key(6), (3, 16)) * 0.2
  route = lambda l, b, backend: jk.route(l, 2, score="sigmoid", bias=b, backend=backend)[1]
  np.testing.assert_array_equal(jax.vmap(functools.partial(route, backend="kittens"))(logits, bias),
                                jax.vmap(functools.partial(route, backend="xla"))(logits, bias))
  np.testing.assert_array_equal(
      jax.vmap(functools.partial(route, backend="kittens"), in_axes=(0, None))(logits, bias[1]),
      jax.vmap(functools.partial(route, backend="xla"), in_axes=(0, None))(logits, bias[1]))


def test_route_under_shard_map():
  mesh = jax.make_mesh((8,), ("data",), devices=jax.devices("cpu")[:8])
  logits = jax.device_put(jax.random.normal(jax.random.key(7), (8 * 13, 32)), jax.devices("cpu")[0])
  sharded = jax.device_put(logits, NamedSharding(mesh, P("data")))
  f = jax.jit(jax.shard_map(lambda l: jk.route(l, 4), mesh=mesh, in_specs=P("data"), out_specs=P("data")))
  weights, ids = f(sharded)
  expected_weights, expected_ids = jk.route(logits, 4, backend="xla")
  np.testing.assert_array_equal(ids, expected_ids)
  np.testing.assert_allclose(weights, expected_weights, rtol=1e-6)


@pytest.mark.parametrize("backend", ["kittens", "xla"])
def test_route_gradient_under_shard_map(backend):
  mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("data",))
  logits = jax.device_put(jax.random.normal(jax.random.key(8), (4 * 9, 16)), NamedSharding(mesh, P("data")))
  probe = jax.random.normal(jax.random.key(10), (4 * 9, 3))

  def loss(l, p):
    return jax.lax.psum(jnp.sum(jk.route(l, 3, backend=backend)[0] * p), "data")

  sharded = jax.jit(jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data")))
  expected = jax.grad(lambda l: jnp.sum(jk.route(l, 3, backend="xla")[0] * probe))(logits)
  np.testing.assert_allclose(sharded(logits, probe), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kwargs, match", [
    (dict(top_k=0), "top_k"),
    (dict(top_k=33), "top_k"),
    (dict(top_k=2, score="relu"), "score"),
    (dict(top_k=2, bias=jnp.zeros(32)), "bias"),
    (dict(top_k=2, score="sigmoid", bias=jnp.zeros(31)), "bias"),
    (dict(top_k=2, score="sigmoid", bias=jnp.zeros((4, 32))), r"bias must have shape \[32\]"),
    (dict(top_k=2, score="sigmoid", bias=[0.0] * 32), "bias must be an array"),
    (dict(top_k=2, score="sigmoid", bias=jnp.zeros(32, jnp.int32)), "bias must be"),
    (dict(top_k=2, num_groups=5, top_groups=1), "num_groups"),
    (dict(top_k=2, num_groups=4), "together"),
    (dict(top_k=2, num_groups=4, top_groups=5), "top_groups"),
    (dict(top_k=9, num_groups=4, top_groups=1), "top_k"),
    (dict(top_k=2, backend="cuda"), "backend"),
])
def test_route_rejects_bad_arguments(kwargs, match):
  with pytest.raises((ValueError, TypeError), match=match):
    jk.route(jnp.zeros((4, 32)), **kwargs)


def test_route_rejects_bad_logits():
  with pytest.raises(ValueError, match="logits"):
    jk.route(jnp.zeros((32,)), 2)
  with pytest.raises(TypeError, match="logits"):
    jk.route(jnp.zeros((4, 32), jnp.int32), 2)


# ---- schedule ------------------------------------------------------------------------------------------------


def _oracle_schedule(ids, num_experts, align):
  flat = np.asarray(ids).reshape(-1)
  counts = np.array([(flat == e).sum() for e in range(num_experts)], np.int32)
  offsets = np.zeros(num_experts + 1, np.int32)
  offsets[1:] = np.cumsum(-(-counts // align) * align)
  rows = np.full(flat.shape, -1, np.int32)
  seen = np.zeros(num_experts, np.int32)
  for i, e in enumerate(flat):
    if 0 <= e < num_experts:
      rows[i] = offsets[e] + seen[e]
      seen[e] += 1
  return counts, offsets, rows.reshape(np.shape(ids))


def _loads(rng, tokens, top_k, num_experts):
  uniform = rng.integers(0, num_experts, (tokens, top_k))
  skewed = np.minimum(rng.geometric(0.35, (tokens, top_k)) - 1, num_experts - 1)
  one_expert = np.full((tokens, top_k), num_experts - 1)
  with_gaps = rng.choice([0, 3, num_experts - 1], (tokens, top_k))  # most experts empty
  invalid = np.where(rng.random((tokens, top_k)) < 0.1, num_experts + 2, uniform)
  invalid[0, 0] = -1
  return {"uniform": uniform, "skewed": skewed, "one_expert": one_expert, "with_gaps": with_gaps,
          "invalid": invalid}


@pytest.mark.parametrize("backend", ["kittens", "xla"])
@pytest.mark.parametrize("align", [1, 8, 128])
@pytest.mark.parametrize("load", ["uniform", "skewed", "one_expert", "with_gaps", "invalid"])
def test_schedule_matches_oracle(backend, align, load):
  rng = np.random.default_rng()
  tokens, top_k, num_experts = 301, 3, 12
  ids = _loads(rng, tokens, top_k, num_experts)[load].astype(np.int32)
  result = jk.schedule(jnp.asarray(ids), num_experts, align=align, backend=backend)
  counts, offsets, rows = _oracle_schedule(ids, num_experts, align)
  np.testing.assert_array_equal(result.tokens_per_expert, counts)
  np.testing.assert_array_equal(result.expert_offsets, offsets)
  np.testing.assert_array_equal(result.rows, rows)
  assert int(offsets[-1]) <= jk.num_schedule_rows(ids.size, num_experts, align)


def test_schedule_of_no_tokens():
  result = jk.schedule(jnp.zeros((0, 2), jnp.int32), 4, align=16)
  np.testing.assert_array_equal(result.tokens_per_expert, 0)
  np.testing.assert_array_equal(result.expert_offsets, 0)


@pytest.mark.parametrize("logits, ids, score, match", [
    (jnp.zeros((4, 8)), jnp.zeros((4, 2), jnp.int32), "relu", "score must be one of"),
    (jnp.zeros((4, 8)), jnp.zeros((5, 2), jnp.int32), "softmax", "must agree but for the last dim"),
    (jnp.zeros((8,)), jnp.zeros((2,), jnp.int32), "softmax", "must agree but for the last dim"),
    (jnp.zeros((4, 8)), jnp.zeros((4, 2), jnp.float32), "softmax", "ids must be int32"),
    (jnp.zeros((4, 8), jnp.int32), jnp.zeros((4, 2), jnp.int32), "softmax", "logits must be"),
    ([[0.0] * 8] * 4, jnp.zeros((4, 2), jnp.int32), "softmax", "logits must be an array"),
])
def test_routing_weights_rejects_bad_arguments(logits, ids, score, match):
  with pytest.raises((ValueError, TypeError), match=match):
    jk.routing_weights(logits, ids, score, True)


def test_schedule_rejects_bad_arguments():
  with pytest.raises(TypeError, match="ids"):
    jk.schedule(jnp.zeros((4, 2), jnp.float32), 4)
  with pytest.raises(TypeError, match="ids must be an array"):
    jk.schedule([[0, 1]] * 4, 4)
  with pytest.raises(ValueError, match="num_experts"):
    jk.schedule(jnp.zeros((4, 2), jnp.int32), 0)
  with pytest.raises(ValueError, match="align"):
    jk.schedule(jnp.zeros((4, 2), jnp.int32), 4, align=0)


# ---- GPU -----------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_route_cuda_large(config):
  tokens, num_experts, top_k = 65536 + 77, 384, 8
  seed = np.random.default_rng().integers(1 << 30)
  key_logits, key_bias = jax.random.split(jax.random.key(seed))
  logits = jax.random.normal(key_logits, (tokens, num_experts)).astype(jnp.bfloat16)
  config = dict(config)
  bias = jax.random.normal(key_bias, (num_experts,)) * 0.1 if config.pop("bias", False) else None
  weights, ids = jax.jit(lambda l: jk.route(l, top_k, bias=bias, backend="kittens", **config))(logits)
  oracle_weights, oracle_ids, oracle_keys, alternative_keys = _oracle_route(
      np.asarray(logits.astype(jnp.float32)), top_k, config.get("score"), bias, config.get("renormalize", True),
      config.get("num_groups"), config.get("top_groups"))
  _assert_same_choice(ids, oracle_ids, oracle_keys, alternative_keys, seed)
  same = np.all(np.asarray(ids) == oracle_ids, axis=-1)
  np.testing.assert_allclose(np.asarray(weights)[same], oracle_weights[same], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("num_experts", [48, 1100])  # 1100: more experts than the scan's warps and lanes
@pytest.mark.parametrize("load", ["uniform", "skewed", "one_expert", "with_gaps", "invalid"])
def test_schedule_cuda_large(load, num_experts):
  rng = np.random.default_rng()
  tokens, top_k = 8192 + 5, 8
  ids = _loads(rng, tokens, top_k, num_experts)[load].astype(np.int32)
  result = jax.jit(lambda i: jk.schedule(i, num_experts, align=128, backend="kittens"))(jnp.asarray(ids))
  counts, offsets, rows = _oracle_schedule(ids, num_experts, 128)
  np.testing.assert_array_equal(result.tokens_per_expert, counts)
  np.testing.assert_array_equal(result.expert_offsets, offsets)
  np.testing.assert_array_equal(result.rows, rows)
