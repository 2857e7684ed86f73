"""The pure-JAX reference MoE against the float64 numpy oracle, and expert parallelism against one device."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kittens import reference
from moe_oracle import kept_under_capacity, moe_forward_backward, random_layer
from sharded import ep_mesh, sharded_forward_backward

# Float32 GEMMs of these sizes against float64: errors are ~1e-6 of the values; 1e-4 still catches any wrong entry.
TOLERANCE = dict(rtol=2e-4, atol=2e-4)


@pytest.fixture(autouse=True)
def on_cpu():
  """The oracle comparisons run on the host devices everywhere (a GPU's default f32 matmul may use TF32)."""
  with jax.default_device(jax.devices("cpu")[0]):
    yield


@pytest.fixture
def rng():
  seed = int(np.random.SeedSequence().entropy % 2**32)
  print(f"seed {seed}")  # shown when a test fails, to replay it
  return np.random.default_rng(seed)


def _loss_and_grads(layer, d_y, **options):
  """Gradients of sum(y * d_y) w.r.t. x, weights, w_gate, w_up, w_down and the shared experts."""
  shared = layer.get("shared_experts")

  def loss(x, weights, w_gate, w_up, w_down, shared):
    y = reference.moe_ffn(x, weights, layer["ids"], w_gate, w_up, w_down, shared_experts=shared, **options)
    return jnp.sum(y * d_y), y

  args = (layer["x"], layer["weights"], layer["w_gate"], layer["w_up"], layer["w_down"], shared)
  grads, y = jax.jit(jax.grad(loss, argnums=tuple(range(6)), has_aux=True))(*args)
  return y, grads


def _assert_grads_close(grads, expected):
  names = ("x", "weights", "w_gate", "w_up", "w_down")
  for name, got, want in zip(names, grads[:5], expected[:5]):
    np.testing.assert_allclose(got, want, err_msg=f"d {name}", **TOLERANCE)
  if expected.shared is None:
    assert grads[5] is None
  else:
    for name, got, want in zip(("gate", "up", "down"), grads[5], expected.shared):
      np.testing.assert_allclose(got, want, err_msg=f"d shared {name}", **TOLERANCE)


CASES = [
    # tokens, hidden, intermediate, experts, top_k, load, shared, swiglu_limit
    (37, 24, 20, 5, 2, "uniform", None, None),
    (53, 16, 12, 7, 3, "skewed", None, None),
    (29, 20, 9, 4, 1, "one_expert", None, None),
    (41, 12, 17, 6, 2, "skewed", 11, 0.8),
    (1, 8, 8, 3, 3, "uniform", 5, None),
    (0, 8, 8, 3, 2, "uniform", 5, None),
]


@pytest.mark.parametrize("tokens,hidden,intermediate,experts,top_k,load,shared,limit", CASES)
def test_matches_oracle(rng, tokens, hidden, intermediate, experts, top_k, load, shared, limit):
  layer = random_layer(rng, tokens, hidden, intermediate, experts, top_k, load=load, shared=shared)
  d_y = rng.standard_normal((tokens, hidden)).astype(np.float32)
  y, grads = _loss_and_grads(layer, d_y, swiglu_limit=limit)
  want_y, want_grads = moe_forward_backward(**layer, d_y=d_y, swiglu_limit=limit)
  if limit is not None:  # the clamp must be active for the test to mean anything: it changes the output
    unclamped_y, _ = moe_forward_backward(**layer, d_y=d_y, swiglu_limit=None)
    assert np.max(np.abs(unclamped_y - want_y)) > 1e-3
  np.testing.assert_allclose(y, want_y, **TOLERANCE)
  _assert_grads_close(grads, want_grads)


def test_swiglu_limit_clamps(rng):
  layer = random_layer(rng, 31, 16, 10, 4, 2)
  layer["x"] = layer["x"] * 8.0  # gate and up far outside the limit
  d_y = rng.standard_normal(layer["x"].shape).astype(np.float32)
  y_clamped, _ = _loss_and_grads(layer, d_y, swiglu_limit=0.5)
  want, want_grads = moe_forward_backward(**layer, d_y=d_y, swiglu_limit=0.5)
  unclamped, _ = moe_forward_backward(**layer, d_y=d_y)
  assert not np.allclose(want, unclamped, rtol=0.1)
  np.testing.assert_allclose(y_clamped, want, **TOLERANCE)


def test_bfloat16_close_to_oracle(rng):
  layer = random_layer(rng, 45, 32, 24, 5, 2, load="skewed", shared=16)
  to_bf16 = lambda a: jnp.asarray(a, jnp.bfloat16)
  bf16 = {**layer, **{k: to_bf16(layer[k]) for k in ("x", "w_gate", "w_up", "w_down")},
          "shared_experts": tuple(map(to_bf16, layer["shared_experts"]))}
  y = reference.moe_ffn(**bf16)
  assert y.dtype == jnp.bfloat16
  # The oracle sees the same bf16-rounded inputs in float64.
  rounded = jax.tree.map(lambda a: np.asarray(a, np.float32) if a.dtype == jnp.bfloat16 else a, bf16)
  want, _ = moe_forward_backward(**rounded, d_y=np.zeros(layer["x"].shape))
  # bf16 hidden and output after float32 accumulation: a few bf16 ulps of the output scale.
  np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=3e-2, atol=3e-2 * np.abs(want).max())


def test_ids_outside_experts_are_dropped(rng):
  layer = random_layer(rng, 19, 8, 6, 4, 2)
  layer["ids"][3, 1] = -1
  layer["ids"][7, 0] = 4
  y, stats = reference.moe_ffn(**layer, return_stats=True)
  kept = (layer["ids"] >= 0) & (layer["ids"] < 4)
  safe_ids = np.where(kept, layer["ids"], 0)
  want, _ = moe_forward_backward(**{**layer, "ids": safe_ids}, d_y=np.zeros(layer["x"].shape), kept=kept)
  np.testing.assert_allclose(y, want, **TOLERANCE)
  assert int(stats.dropped_tokens) == 2
  assert int(stats.received_tokens) == 19 * 2 - 2


def _expert_parallel(mesh, layer, d_y, capacity_factor=None, swiglu_limit=None):
  """y, stats and gradients of the expert-parallel reference: tokens and experts split over the "ep" axis."""

  def layer_fn(x, weights, ids, w_gate, w_up, w_down, shared):
    return reference.moe_ffn(x, weights, ids, w_gate, w_up, w_down, shared_experts=shared, swiglu_limit=swiglu_limit,
                             axis_name="ep", capacity_factor=capacity_factor, return_stats=True)

  return sharded_forward_backward(mesh, layer_fn, layer, d_y)


@pytest.mark.parametrize("num_ranks,load,shared", [(2, "skewed", None), (4, "uniform", 6), (8, "skewed", None),
                                                   (8, "one_expert", 5)])
def test_expert_parallel_matches_single_device(rng, num_ranks, load, shared):
  local_tokens, local_experts, top_k = 11, 2, 3
  layer = random_layer(rng, local_tokens * num_ranks, 16, 12, local_experts * num_ranks, top_k, load=load,
                       shared=shared)
  d_y = rng.standard_normal(layer["x"].shape).astype(np.float32)
  y, stats, grads = _expert_parallel(ep_mesh(num_ranks), layer, d_y, swiglu_limit=1.5)
  want_y, want_grads = _loss_and_grads(layer, d_y, swiglu_limit=1.5)
  np.testing.assert_allclose(y, want_y, **TOLERANCE)
  for name, got, want in zip(("x", "weights", "w_gate", "w_up", "w_down"), grads, want_grads):
    np.testing.assert_allclose(got, want, err_msg=f"d {name}", **TOLERANCE)
  if shared is not None:
    for got, want in zip(grads[5], want_grads[5]):
      np.testing.assert_allclose(got, want, **TOLERANCE)
  np.testing.assert_array_equal(stats.dropped_tokens, 0)
  counts = np.bincount(layer["ids"].reshape(-1) // local_experts, minlength=num_ranks)
  np.testing.assert_array_equal(stats.received_tokens, counts)


def test_expert_parallel_capacity_drops_and_counts(rng):
  num_ranks, local_tokens, local_experts, top_k, capacity_factor = 4, 16, 2, 2, 0.75
  layer = random_layer(rng, local_tokens * num_ranks, 8, 8, local_experts * num_ranks, top_k, load="skewed")
  d_y = rng.standard_normal(layer["x"].shape).astype(np.float32)
  y, stats, grads = _expert_parallel(ep_mesh(num_ranks), layer, d_y, capacity_factor=capacity_factor)
  capacity = reference.receive_capacity(local_tokens, top_k, num_ranks, capacity_factor)
  kept = kept_under_capacity(layer["ids"], num_ranks, local_experts, capacity)
  assert 0 < (~kept).sum()
  want_y, want_grads = moe_forward_backward(**layer, d_y=d_y, kept=kept)
  np.testing.assert_allclose(y, want_y, **TOLERANCE)
  for name, got, want in zip(("x", "weights", "w_gate", "w_up", "w_down"), grads, want_grads):
    np.testing.assert_allclose(got, want, err_msg=f"d {name}", **TOLERANCE)
  dropped_per_source = (~kept).reshape(num_ranks, -1).sum(axis=1)
  np.testing.assert_array_equal(stats.dropped_tokens, dropped_per_source)
  received = np.bincount((layer["ids"] // local_experts)[kept], minlength=num_ranks)
  np.testing.assert_array_equal(stats.received_tokens, received)
