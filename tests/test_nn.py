"""jax_kittens.nn: the NNX and Linen MoE modules against float64 numpy oracles, and against each other."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_kittens import nn as kittens_nn


def _config(**overrides):
  base = dict(hidden=24, intermediate=20, num_experts=6, top_k=2, backend="xla")
  return kittens_nn.MoEConfig(**{**base, **overrides})


def _oracle_layer(config, params, bias, x):
  """float64 numpy MoE layer and aux losses: x [T, H] -> (y [T, H], balance, z_loss, load [E])."""
  p = {name: np.asarray(value, np.float64) for name, value in params.items()}
  x = np.asarray(x, np.float64)
  logits = x @ p["router"]
  if config.score == "softmax":
    scores = np.exp(logits - logits.max(-1, keepdims=True))
    scores /= scores.sum(-1, keepdims=True)
    keys = scores
  else:
    scores = 1 / (1 + np.exp(-logits))
    keys = scores + (0 if bias is None else np.asarray(bias, np.float64))
  ids = np.argsort(-keys, axis=-1, kind="stable")[:, :config.top_k]
  weights = np.take_along_axis(scores, ids, -1)
  if config.renormalize:
    weights /= weights.sum(-1, keepdims=True)

  def expert(v, w_gate, w_up, w_down):
    gate, up = v @ w_gate, v @ w_up
    return (gate / (1 + np.exp(-gate)) * up) @ w_down

  y = np.zeros_like(x)
  for t in range(x.shape[0]):
    for j in range(config.top_k):
      e = ids[t, j]
      y[t] += weights[t, j] * expert(x[t], p["w_gate"][e], p["w_up"][e], p["w_down"][e])
  if config.shared_intermediate is not None:
    y += expert(x, p["shared_w_gate"], p["shared_w_up"], p["shared_w_down"])
  load = np.bincount(ids.reshape(-1), minlength=config.num_experts).astype(np.float64)
  probs = scores / scores.sum(-1, keepdims=True)
  balance = config.num_experts * np.sum(load / ids.size * probs.mean(0))
  lse = logits.max(-1) + np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))
  return y, balance, np.mean(lse ** 2), load


@pytest.mark.parametrize("score,shared", [("softmax", None), ("sigmoid", 16)])
def test_nnx_layer_matches_numpy_oracle(score, shared):
  config = _config(score=score, shared_intermediate=shared)
  module = kittens_nn.nnx.MoE(config, rngs=nnx.Rngs(3))
  if score == "sigmoid":
    module.router_bias[...] = jax.random.normal(jax.random.key(7), (config.num_experts,)) * 0.3
  x = jax.random.normal(jax.random.key(1), (37, config.hidden))
  # A GPU's default float32 matmul is TF32 (errors ~1e-3 of the values, seen failing on an H200); the oracle's
  # tolerance is for float32 products.
  with jax.default_matmul_precision("highest"):
    y, aux = module(x)
  bias = None if module.router_bias is None else module.router_bias[...]
  want_y, want_balance, want_z, want_load = _oracle_layer(config, module.params(), bias, x)
  np.testing.assert_allclose(np.asarray(y, np.float64), want_y, rtol=2e-4, atol=2e-5)
  np.testing.assert_allclose(float(aux.load_balancing_loss), want_balance, rtol=1e-5)
  np.testing.assert_allclose(float(aux.router_z_loss), want_z, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(aux.expert_load), want_load)


@pytest.mark.parametrize("score,shared", [("softmax", 64), ("sigmoid", None)])
def test_kittens_backend_in_the_modules(score, shared):
  """The bf16 layer through the kittens kernels (their CPU twins here): the float64 oracle, gradients as xla's."""
  config = _config(hidden=64, intermediate=128, num_experts=4, score=score, shared_intermediate=shared,
                   dtype=jnp.bfloat16, backend="kittens")
  module = kittens_nn.nnx.MoE(config, rngs=nnx.Rngs(4))
  x = jax.random.normal(jax.random.key(6), (2, 19, config.hidden))
  y, aux = module(x)
  assert y.dtype == jnp.bfloat16 and y.shape == x.shape
  bias = None if module.router_bias is None else module.router_bias[...]
  # The oracle in float64 on the bf16-rounded parameters and tokens the kernels see.
  rounded = {name: value.astype(jnp.bfloat16).astype(jnp.float32) for name, value in module.params().items()}
  rounded["router"] = module.params()["router"]
  want_y, _, _, want_load = _oracle_layer(config, rounded, bias, x.reshape(-1, config.hidden))
  scale = np.abs(want_y).max()
  np.testing.assert_allclose(np.asarray(y, np.float64).reshape(want_y.shape), want_y, atol=2e-2 * scale)
  np.testing.assert_array_equal(np.asarray(aux.expert_load), want_load)
  xla_config = dataclasses.replace(config, backend="xla")

  def loss(cfg, params):
    y, aux = kittens_nn.moe_layer(cfg, params, bias, x)
    return jnp.sum(y.astype(jnp.float32) ** 2) + aux.load_balancing_loss

  got, want = jax.grad(loss, argnums=1)(config, module.params()), jax.grad(loss, argnums=1)(xla_config,
                                                                                           module.params())
  for name in want:
    error = np.linalg.norm(np.asarray(got[name] - want[name])) / np.linalg.norm(np.asarray(want[name]))
    assert error < 3e-2, (name, error)


def test_output_shapes_and_parameter_shapes():
  config = _config(shared_intermediate=8)
  module = kittens_nn.nnx.MoE(config, rngs=nnx.Rngs(0))
  assert {k: v.shape for k, v in module.params().items()} == config.param_shapes()
  assert module.w_gate[...].shape == (6, 24, 20) and module.w_down[...].shape == (6, 20, 24)
  for shape in [(5, 24), (2, 7, 24), (2, 3, 4, 24)]:
    y, aux = module(jnp.ones(shape))
    assert y.shape == shape and y.dtype == jnp.float32
    assert aux.load_balancing_loss.shape == () and aux.router_z_loss.shape == ()
    assert aux.expert_load.shape == (6,) and float(aux.expert_load.sum()) == np.prod(shape[:-1]) * config.top_k
  with pytest.raises(ValueError, match="hidden=24"):
    module(jnp.ones((3, 25)))


def test_router_aux_by_hand_skewed_and_all_in_one_expert():
  # Every token picks expert 2 (and 0): f = [1/2, 0, 1/2, 0], P = the mean softmax row.
  logits = jnp.array([[1.0, -1.0, 3.0, 0.0]] * 4 + [[0.5, 0.0, 2.0, -2.0]] * 2, jnp.float32)
  ids = jnp.array([[2, 0]] * 6, jnp.int32)
  aux = kittens_nn.router_aux(logits, ids, "softmax")
  p = np.exp(np.asarray(logits, np.float64))
  p /= p.sum(-1, keepdims=True)
  np.testing.assert_allclose(float(aux.load_balancing_loss), 4 * (0.5 * p[:, 2].mean() + 0.5 * p[:, 0].mean()),
                             rtol=1e-6)
  lse = np.log(np.exp(np.asarray(logits, np.float64)).sum(-1))
  np.testing.assert_allclose(float(aux.router_z_loss), np.mean(lse ** 2), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(aux.expert_load), [6, 0, 6, 0])
  # At perfect balance (uniform probabilities, equal load) the loss is 1.
  uniform = kittens_nn.router_aux(jnp.zeros((4, 4)), jnp.array([[0, 1], [2, 3], [1, 0], [3, 2]], jnp.int32),
                                  "softmax")
  np.testing.assert_allclose(float(uniform.load_balancing_loss), 1.0, rtol=1e-6)


def test_balance_loss_gradient_flows_to_the_router_only_through_probabilities():
  config = _config()
  module = kittens_nn.nnx.MoE(config, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(2), (16, config.hidden))

  def balance(params):
    return kittens_nn.moe_layer(config, params, None, x)[1].load_balancing_loss

  grads = jax.grad(balance)(module.params())
  assert float(jnp.abs(grads["router"]).max()) > 0
  assert float(jnp.abs(grads["w_gate"]).max()) == 0


@pytest.mark.parametrize("score,shared", [("softmax", 8), ("sigmoid", None)])
def test_nnx_and_linen_agree(score, shared):
  config = _config(score=score, shared_intermediate=shared)
  x = jax.random.normal(jax.random.key(5), (3, 11, config.hidden))
  module = kittens_nn.nnx.MoE(config, rngs=nnx.Rngs(9))
  variables = {"params": module.params()}
  if score == "sigmoid":
    module.router_bias[...] = jnp.linspace(-0.5, 0.5, config.num_experts)
    variables["router_state"] = {"bias": module.router_bias[...]}
  y_nnx, aux_nnx = module(x)
  y_linen, aux_linen = kittens_nn.linen.MoE(config).apply(variables, x)
  np.testing.assert_array_equal(np.asarray(y_nnx), np.asarray(y_linen))
  for a, b in zip(jax.tree.leaves(aux_nnx), jax.tree.leaves(aux_linen)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Linen init creates the same parameter names and shapes, and the bias in its own collection.
  init = kittens_nn.linen.MoE(config).init(jax.random.key(0), x)
  assert jax.tree.map(jnp.shape, init["params"]) == config.param_shapes()
  assert ("router_state" in init) == (score == "sigmoid")


def test_router_bias_update_rule():
  bias = jnp.array([0.1, -0.2, 0.0, 0.3], jnp.float32)
  load = jnp.array([10.0, 2.0, 6.0, 6.0])  # mean 6: expert 0 over, 1 under, 2 and 3 at the mean
  new = kittens_nn.update_router_bias(bias, load, 0.01)
  np.testing.assert_allclose(np.asarray(new), [0.09, -0.19, 0.0, 0.3], rtol=1e-6)

  config = _config(score="sigmoid", num_experts=4, top_k=1)
  module = kittens_nn.nnx.MoE(config, rngs=nnx.Rngs(0))
  module.apply_bias_update(load, 0.01)
  np.testing.assert_allclose(np.asarray(module.router_bias[...]), [-0.01, 0.01, 0.0, 0.0], rtol=1e-6)
  # The bias only selects: a large bias on expert 3 sends every token there, with the unbiased sigmoid weight.
  module.router_bias[...] = jnp.array([0.0, 0.0, 0.0, 10.0])
  x = jax.random.normal(jax.random.key(0), (9, config.hidden))
  _, aux = module(x)
  np.testing.assert_array_equal(np.asarray(aux.expert_load), [0, 0, 0, 9])
  # Softmax routing has no bias; the update is a no-op.
  softmax = kittens_nn.nnx.MoE(_config(), rngs=nnx.Rngs(0))
  softmax.apply_bias_update(load, 0.01)
  assert softmax.router_bias is None
  assert not nnx.state(softmax, kittens_nn.nnx.RouterBias)


def test_router_bias_is_not_a_trainable_param():
  module = kittens_nn.nnx.MoE(_config(score="sigmoid"), rngs=nnx.Rngs(0))
  params = nnx.to_pure_dict(nnx.state(module, nnx.Param))
  assert "router_bias" not in params and set(params) == set(_config().param_shapes())


@pytest.mark.parametrize("bad,match", [
    (dict(top_k=7), "top_k=7 must be <= num_experts=6"),
    (dict(num_experts=0), "num_experts must be a positive int"),
    (dict(score="relu"), "score must be one of"),
    (dict(backend="cuda"), "backend must be one of"),
    (dict(shared_intermediate=0), "shared_intermediate"),
    (dict(shared_intermediate=True), "shared_intermediate"),
    (dict(renormalize="no"), "renormalize must be a bool"),
    (dict(swiglu_limit=-1.0), "swiglu_limit must be a finite number > 0"),
    (dict(swiglu_limit=float("nan")), "swiglu_limit must be a finite number > 0"),
    (dict(axis_name=3), "axis_name must be a str"),
    (dict(dtype=jnp.int32), "dtype must be one of"),
    (dict(dtype="not a dtype"), "dtype must be one of"),
])
def test_bad_config_raises(bad, match):
  with pytest.raises((ValueError, TypeError), match=match):
    _config(**bad)


def test_router_aux_rejects_an_unknown_score():
  with pytest.raises(ValueError, match="score must be one of"):
    kittens_nn.router_aux(jnp.zeros((4, 6)), jnp.zeros((4, 2), jnp.int32), "relu")
