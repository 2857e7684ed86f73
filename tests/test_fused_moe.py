"""The kittens backend of `moe_ffn` (jax_kittens.fused_moe) and its permute kernels (jax_kittens.permute).

CPU tests run the CPU twins against float64 numpy and the pure-JAX reference on small random layers with uniform,
skewed (empty experts), all-in-one-expert and dropped-id routings, T not a tile multiple; `gpu` tests run the CUDA
kernels at a realistic size. Error measure: relative Frobenius error ||got - want|| / ||want||; for d weights of the
small layers, / the norm of moe_oracle.d_weights_error_scale instead (a few tokens' d weights can cancel far below
their rounding error). Bounds: the kittens path rounds its GEMM outputs (gate, up, hidden, expert rows, dx rows) to
bfloat16 (relative step 2^-8 = 3.9e-3) and accumulates in float32, so each output or gradient lands within a few bf16
steps of the exact value: observed ~4e-3; we allow 1.5e-2.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kittens import fused_moe, grouped_matmul, moe, permute, reference, routing
from moe_oracle import d_weights_error_scale, moe_forward_backward, random_ids, random_layer

REL_ERROR_BOUND = 1.5e-2  # bf16 GEMM chain vs exact (see the module docstring)
GRAD_NAMES = ("x", "weights", "w_gate", "w_up", "w_down")


@pytest.fixture
def rng():
  seed = int(np.random.SeedSequence().entropy % 2**32)
  print(f"seed {seed}")  # shown when a test fails, to replay it
  return np.random.default_rng(seed)


@pytest.fixture
def on_cpu():
  with jax.default_device(jax.devices("cpu")[0]):
    yield


def rel_error(got, want, scale=None):
  """||got - want|| / ||want||, or / ||scale|| where given."""
  got, want = np.asarray(jnp.asarray(got, jnp.float32), np.float64), np.asarray(want, np.float64)
  return np.linalg.norm(got - want) / max(np.linalg.norm(want if scale is None else scale), 1e-30)


def bf16(a):
  return jnp.asarray(a, jnp.bfloat16)


def as_f64(a):
  return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def bf16_layer(layer):
  """The layer's float arrays rounded to bf16 (router weights stay float32)."""
  out = dict(layer)
  for name in ("x", "w_gate", "w_up", "w_down"):
    out[name] = bf16(layer[name])
  out["weights"] = jnp.asarray(layer["weights"], jnp.float32)
  out["ids"] = jnp.asarray(layer["ids"])
  if "shared_experts" in layer:
    out["shared_experts"] = tuple(bf16(w) for w in layer["shared_experts"])
  return out


def grads_fn(layer_fn, ids, d_y, **options):
  """jit(x, weights, w_gate, w_up, w_down, shared) -> (y, grads of <y, d_y> w.r.t. all six)."""
  def loss(x, weights, w_gate, w_up, w_down, shared):
    y = layer_fn(x, weights, ids, w_gate, w_up, w_down, shared_experts=shared, **options)
    return jnp.sum(y.astype(jnp.float32) * d_y), y

  grad = jax.grad(loss, argnums=tuple(range(6)), has_aux=True)
  return jax.jit(lambda *args: grad(*args)[::-1])


def layer_args(layer):
  return (layer["x"], layer["weights"], layer["w_gate"], layer["w_up"], layer["w_down"], layer.get("shared_experts"))


def flat_grads(grads):
  shared = () if grads[5] is None else tuple(grads[5])
  return tuple(grads[:5]) + shared


def errors_against(y, grads, want_y, want_grads, weights_scale=None):
  """Relative Frobenius errors of y and every gradient, by name.

  weights_scale: optional [T, k] (moe_oracle.d_weights_error_scale); the d weights error is then relative to its
  norm, not to the norm of d weights itself, which in a layer of a few tokens can cancel far below its rounding error.
  """
  errors = {"y": rel_error(y, want_y)}
  names = GRAD_NAMES + (("shared w_gate", "shared w_up", "shared w_down") if grads[5] is not None else ())
  for name, got, want in zip(names, flat_grads(grads), flat_grads(want_grads)):
    errors["d " + name] = rel_error(got, want, weights_scale if name == "weights" else None)
  return errors


def assert_close_to(y, grads, want_y, want_grads, bounds=None, weights_scale=None):
  """Every error below REL_ERROR_BOUND, or below bounds[name] where given."""
  errors = errors_against(y, grads, want_y, want_grads, weights_scale)
  print(errors)
  bounds = {name: REL_ERROR_BOUND for name in errors} | (bounds or {})
  assert all(np.isfinite(e) and e < bounds[name] for name, e in errors.items()), (errors, bounds)


def _oracle_args(layer):
  """The bf16 layer as float64 oracle inputs: (x, ids with dropped entries on expert 0, w_gate, w_up, w_down, kept)."""
  ids = np.asarray(layer["ids"])
  kept = (ids >= 0) & (ids < layer["w_gate"].shape[0])
  return (as_f64(layer["x"]), np.where(kept, ids, 0), as_f64(layer["w_gate"]), as_f64(layer["w_up"]),
          as_f64(layer["w_down"]), kept)


def oracle(layer, d_y, swiglu_limit):
  """float64 numpy forward and backward from the bf16-rounded inputs."""
  shared = layer.get("shared_experts")
  x, ids, w_gate, w_up, w_down, kept = _oracle_args(layer)
  return moe_forward_backward(x, np.asarray(layer["weights"]), ids, w_gate, w_up, w_down, d_y,
                              shared_experts=None if shared is None else tuple(as_f64(w) for w in shared),
                              swiglu_limit=swiglu_limit, kept=kept)


def oracle_d_weights_error_scale(layer, d_y, swiglu_limit):
  """moe_oracle.d_weights_error_scale of the bf16-rounded layer: [T, k]."""
  x, ids, w_gate, w_up, w_down, kept = _oracle_args(layer)
  return d_weights_error_scale(x, ids, w_gate, w_up, w_down, d_y, swiglu_limit=swiglu_limit, kept=kept)


def bf16_rounded_ragged_dot(lhs, rhs, group_sizes):
  """jax.lax.ragged_dot in float32 with its output rounded to bf16, as the kittens GEMMs round gate and up."""
  out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
  return jax.lax.reduce_precision(out, exponent_bits=8, mantissa_bits=7)


def f32_reference(layer, d_y, swiglu_limit):
  """The pure-JAX reference in float32 (full-precision matmuls) from the bf16-rounded inputs.

  With a clamp, the routed GEMM outputs are rounded to bf16 like the kittens pre-activations: the clamp's gradient
  jumps at the limit, and an entry within half a bf16 step of it lands on either side depending on that rounding, off
  by its whole gradient (for a layer this small that alone is a few percent of the gradient's norm). XLA keeps excess
  precision through a plain bf16 reference, so only the explicit rounding gives the same clamp decisions.
  """
  to_f32 = lambda a: None if a is None else jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), a)
  ragged_dot = jax.lax.ragged_dot if swiglu_limit is None else bf16_rounded_ragged_dot
  with jax.default_matmul_precision("highest"):
    fn = grads_fn(functools.partial(reference.moe_ffn, ragged_dot=ragged_dot), layer["ids"], d_y,
                  swiglu_limit=swiglu_limit)
    return fn(*(to_f32(a) for a in layer_args(layer)))


# ---------------------------------------------------------------------------------------------------------------
# Permute kernels.

def numpy_gather(x, rows, weights, num_rows):
  x_rows = np.zeros((num_rows, x.shape[1]), x.dtype)
  row_weights = np.zeros((num_rows,), np.float32)
  for (t, j), r in np.ndenumerate(rows):
    if r >= 0:
      x_rows[r] = x[t]
      row_weights[r] = weights[t, j]
  return x_rows, row_weights


def numpy_combine(values, rows, weights, addend):
  y = np.zeros((rows.shape[0], values.shape[1]), np.float64) if addend is None else addend.astype(np.float64)
  for (t, j), r in np.ndenumerate(rows):
    if r >= 0:
      y[t] += (1.0 if weights is None else weights[t, j]) * values[r].astype(np.float64)
  return y


def check_permutes(rng, num_tokens, hidden, num_experts, top_k, load, dtype):
  ids = np.asarray(random_ids(rng, num_tokens, top_k, num_experts, load))
  ids[rng.random(ids.shape) < 0.1] = num_experts  # some entries routed nowhere
  sched = routing.schedule(jnp.asarray(ids), num_experts, align=grouped_matmul.ROW_ALIGN)
  num_rows = routing.num_schedule_rows(ids.size, num_experts, grouped_matmul.ROW_ALIGN)
  x = rng.standard_normal((num_tokens, hidden)).astype(np.float32)
  weights = rng.random((num_tokens, top_k)).astype(np.float32)
  x_dev = jnp.asarray(x, dtype)
  x_rows, row_weights = permute.gather_rows(x_dev, sched, num_rows, weights=jnp.asarray(weights))
  rows = np.asarray(sched.rows)
  want_rows, want_weights = numpy_gather(np.asarray(x_dev.astype(jnp.float32)), rows, weights, num_rows)
  np.testing.assert_array_equal(np.asarray(x_rows.astype(jnp.float32)), want_rows)
  np.testing.assert_array_equal(np.asarray(row_weights), want_weights)
  np.testing.assert_array_equal(np.asarray(permute.gather_rows(x_dev, sched, num_rows)),
                                np.asarray(x_rows))
  want_tokens = np.full(num_rows, -1, np.int32)
  for (t, _), r in np.ndenumerate(rows):
    if r >= 0:
      want_tokens[r] = t
  np.testing.assert_array_equal(np.asarray(permute.row_tokens(sched.rows, num_rows)), want_tokens)

  values = jnp.asarray(rng.standard_normal((num_rows, hidden)), dtype)
  addend = jnp.asarray(rng.standard_normal((num_tokens, hidden)), dtype)
  values64, addend64 = as_f64(values), as_f64(addend)
  bound = 1e-6 if dtype == jnp.float32 else 2 ** -8  # one rounding of the float32 sum to the output dtype
  for w, a in ((weights, addend), (None, None)):
    y = permute.combine(values, sched.rows, None if w is None else jnp.asarray(w), addend=None if a is None else a)
    assert y.dtype == dtype and y.shape == (num_tokens, hidden)
    want = numpy_combine(values64, rows, w, None if a is None else addend64)
    np.testing.assert_allclose(as_f64(y), want, rtol=bound, atol=bound * np.max(np.abs(want)))
    again = permute.combine(values, sched.rows, None if w is None else jnp.asarray(w), addend=a)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(y))  # deterministic
  slots = permute.slots_of_rows(jnp.arange(num_rows, dtype=jnp.float32), sched.rows)
  np.testing.assert_array_equal(np.asarray(slots), np.where(rows >= 0, rows, 0).astype(np.float32))


@pytest.mark.parametrize("num_tokens,hidden,num_experts,top_k,load,dtype", [
    (37, 64, 5, 2, "uniform", jnp.bfloat16),
    (53, 24, 7, 3, "skewed", jnp.float32),
    (29, 13, 4, 1, "one_expert", jnp.bfloat16),  # odd H: the unvectorized path
    (130, 128, 16, 4, "skewed", jnp.bfloat16),
])
def test_permutes_match_numpy(on_cpu, rng, num_tokens, hidden, num_experts, top_k, load, dtype):
  check_permutes(rng, num_tokens, hidden, num_experts, top_k, load, dtype)


def test_permute_argument_errors():
  x = jnp.zeros((4, 8), jnp.bfloat16)
  sched = routing.schedule(jnp.zeros((4, 2), jnp.int32), 3, align=4)
  with pytest.raises(ValueError, match="weights"):
    permute.gather_rows(x, sched, 20, weights=jnp.zeros((4, 3), jnp.float32))
  with pytest.raises(ValueError, match="num_rows"):
    permute.gather_rows(x, sched, -1)
  with pytest.raises(ValueError, match="num_rows"):
    permute.row_tokens(sched.rows, 2.5)
  with pytest.raises(TypeError, match="values"):
    permute.combine(jnp.zeros((20, 8), jnp.float16), sched.rows)
  with pytest.raises(ValueError, match="addend"):
    permute.combine(jnp.zeros((20, 8), jnp.bfloat16), sched.rows, addend=jnp.zeros((4, 9), jnp.bfloat16))


# ---------------------------------------------------------------------------------------------------------------
# The layer on the CPU twins.

CASES = [
    # tokens, hidden, intermediate, experts, top_k, load, shared, swiglu_limit, dropped ids
    (37, 64, 128, 5, 2, "uniform", None, None, False),
    (53, 128, 64, 7, 3, "skewed", None, None, False),
    (29, 64, 64, 4, 1, "one_expert", None, None, False),
    (41, 64, 128, 6, 2, "skewed", None, 0.8, False),
    (43, 128, 64, 5, 2, "uniform", 64, None, False),
    (1, 64, 64, 3, 3, "uniform", 64, None, False),
    (33, 64, 64, 4, 2, "uniform", None, None, True),
    # enough tokens that the shared experts' weight gradients are contracted in row slices
    (2100, 64, 64, 4, 1, "skewed", 64, None, False),
]


def make_layer(rng, tokens, hidden, intermediate, experts, top_k, load, shared, dropped):
  layer = random_layer(rng, tokens, hidden, intermediate, experts, top_k, load=load, shared=shared)
  if dropped:
    ids = layer["ids"].copy()
    ids[rng.random(ids.shape) < 0.2] = experts  # routed to no expert of this layer
    ids[0, 0] = -1
    layer["ids"] = ids
  return bf16_layer(layer)


@pytest.mark.parametrize("tokens,hidden,intermediate,experts,top_k,load,shared,limit,dropped", CASES)
def test_matches_oracle_and_reference(on_cpu, rng, tokens, hidden, intermediate, experts, top_k, load, shared, limit,
                                      dropped):
  layer = make_layer(rng, tokens, hidden, intermediate, experts, top_k, load, shared, dropped)
  d_y = rng.standard_normal((tokens, hidden)).astype(np.float32)
  y, grads = grads_fn(fused_moe.moe_ffn, layer["ids"], d_y, swiglu_limit=limit)(*layer_args(layer))
  assert y.dtype == jnp.bfloat16 and y.shape == (tokens, hidden)
  for grad, arg in zip(flat_grads(grads), flat_grads(layer_args(layer))):
    assert grad.dtype == arg.dtype and grad.shape == arg.shape
  want_y, want_grads = oracle(layer, d_y, limit)
  weights_scale = oracle_d_weights_error_scale(layer, d_y, limit)
  if limit is None:
    assert_close_to(y, grads, want_y, want_grads, weights_scale=weights_scale)
  else:
    gate = np.einsum("th,thi->ti", as_f64(layer["x"]), as_f64(layer["w_gate"])[np.asarray(layer["ids"])[:, 0]])
    assert np.mean(gate > limit) > 0.1  # the clamp must be active for the case to mean anything
    assert rel_error(y, want_y) < REL_ERROR_BOUND  # the gradients: see f32_reference
  ref_y, ref_grads = f32_reference(layer, d_y, limit)
  assert_close_to(y, grads, ref_y, ref_grads, weights_scale=weights_scale)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("tokens,every_id_elsewhere", [(0, False), (9, True)])
def test_no_tokens_or_no_routed_rows(on_cpu, rng, tokens, every_id_elsewhere, recompute):
  """T = 0, and ids that all miss this layer's experts (no routed row at all): the shared expert alone, and zero
  gradients for the routed experts and the router weights."""
  layer = make_layer(rng, tokens, 64, 64, 4, 2, "uniform", 64, False)
  if every_id_elsewhere:
    layer["ids"] = np.broadcast_to(np.array([4, -1], np.int32), np.shape(layer["ids"])).copy()
  d_y = rng.standard_normal((tokens, 64)).astype(np.float32)
  y, grads = grads_fn(fused_moe.moe_ffn, layer["ids"], d_y, recompute=recompute)(*layer_args(layer))
  assert y.shape == (tokens, 64) and y.dtype == jnp.bfloat16
  for grad, arg in zip(flat_grads(grads), flat_grads(layer_args(layer))):
    assert grad.dtype == arg.dtype and grad.shape == arg.shape
  for routed in grads[1:5]:  # d_weights, dW_gate, dW_up, dW_down
    np.testing.assert_array_equal(np.asarray(routed, np.float32), 0.0)
  want_y, want_grads = oracle(layer, d_y, None)
  assert_close_to(y, grads, want_y, want_grads)


@pytest.mark.parametrize("rows,k,n", [(2100, 64, 128), (4096, 192, 64)])
def test_one_group_weight_gradient_in_row_slices(on_cpu, rng, rows, k, n):
  """A one-group tgmm with few output tiles runs as row slices with f32 partials: still lhs^T @ rhs."""
  assert fused_moe._contraction_slices(rows, k, n) > 1  # the sliced path is the one under test
  lhs, rhs = bf16(rng.standard_normal((rows, k))), bf16(rng.standard_normal((rows, n)))
  for out_dtype in (jnp.float32, jnp.bfloat16):
    out = jax.jit(lambda a, b: fused_moe._Layout.one_group(rows).tgmm(a, b, out_dtype))(lhs, rhs)
    assert out.shape == (1, k, n) and out.dtype == out_dtype
    # f32 sums of exact bf16 products: far below bf16 rounding unless a slice's rows were lost or counted twice.
    assert rel_error(out[0], as_f64(lhs).T @ as_f64(rhs)) < (1e-5 if out_dtype == jnp.float32 else 4e-3)


def test_recompute_agrees_and_runs_are_bit_identical(on_cpu, rng):
  layer = make_layer(rng, 45, 64, 128, 6, 2, "skewed", 64, False)
  d_y = rng.standard_normal((45, 64)).astype(np.float32)
  saved = grads_fn(fused_moe.moe_ffn, layer["ids"], d_y, swiglu_limit=0.9, recompute=False)
  recomputed = grads_fn(fused_moe.moe_ffn, layer["ids"], d_y, swiglu_limit=0.9, recompute=True)
  (y0, g0), (y1, g1) = saved(*layer_args(layer)), recomputed(*layer_args(layer))
  (y2, g2) = saved(*layer_args(layer))
  # Determinism: the same executable twice gives the same bits.
  for a, b in zip((y0,) + flat_grads(g0), (y2,) + flat_grads(g2)):
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
  # recompute re-derives the same bf16 gate/up: everything but dW_down (whose hidden comes from float32 pre-activations
  # when recomputed, from the saved bf16 ones otherwise) is bit-identical.
  np.testing.assert_array_equal(np.asarray(y0.astype(jnp.float32)), np.asarray(y1.astype(jnp.float32)))
  routed_down, shared_down = 4, 7
  for i, (a, b) in enumerate(zip(flat_grads(g0), flat_grads(g1))):
    if i in (routed_down, shared_down):
      assert rel_error(b, a) < 1e-2
    else:
      np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


def test_dispatch_stats_and_errors(on_cpu, rng, monkeypatch):
  layer = make_layer(rng, 20, 64, 64, 4, 2, "uniform", None, True)
  args = (layer["x"], layer["weights"], layer["ids"], layer["w_gate"], layer["w_up"], layer["w_down"])
  y, stats = moe.moe_ffn(*args, backend="kittens", return_stats=True)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(fused_moe.moe_ffn(*args)))
  ids = np.asarray(layer["ids"])
  dropped = int(np.sum((ids < 0) | (ids >= 4)))
  assert int(stats.dropped_tokens) == dropped and int(stats.received_tokens) == ids.size - dropped
  with pytest.raises(ValueError, match="bfloat16"):
    fused_moe.moe_ffn(*(jnp.asarray(a, jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args))
  with pytest.raises(ValueError, match="multiple of 64"):
    fused_moe.moe_ffn(args[0][:, :48], args[1], args[2], args[3][:, :48], args[4][:, :48], args[5][:, :, :48])
  with pytest.raises(ValueError, match=r"intermediate \(w_gate.shape\[2\]\) to be a multiple of 64"):
    fused_moe.moe_ffn(*args[:3], args[3][:, :, :48], args[4][:, :, :48], args[5][:, :48])
  narrow_shared = (jnp.zeros((64, 48), jnp.bfloat16),) * 2 + (jnp.zeros((48, 64), jnp.bfloat16),)
  with pytest.raises(ValueError, match=r"shared intermediate .* to be a multiple of 64"):
    fused_moe.moe_ffn(*args, shared_experts=narrow_shared)
  with pytest.raises(ValueError, match="w_up"):
    fused_moe.moe_ffn(*args[:4], args[4][:, :, :32], args[5])
  # Where "auto" picks the kernels (as on a GPU), it falls back to the reference for the layers they do not take.
  monkeypatch.setattr(moe._extension, "kittens_by_default", lambda *arrays, **_: True)
  np.testing.assert_array_equal(np.asarray(moe.moe_ffn(*args, backend="auto")), np.asarray(y))
  f32_args = tuple(jnp.asarray(a, jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args)
  np.testing.assert_array_equal(np.asarray(moe.moe_ffn(*f32_args, backend="auto")),
                                np.asarray(moe.moe_ffn(*f32_args, backend="xla")))
  narrow_args = (*args[:3], args[3][:, :, :48], args[4][:, :, :48], args[5][:, :48])
  np.testing.assert_array_equal(np.asarray(moe.moe_ffn(*narrow_args, backend="auto")),
                                np.asarray(moe.moe_ffn(*narrow_args, backend="xla")))


def stacked_fwd_bwd_memory(layer, d_y, layer_fn, num_layers=2, **options):
  """Compiled memory analysis of jit(fwd+bwd) of ``num_layers`` stacked layers (x -> layer -> layer ...).

  Within one layer the peak sits in the backward, where recompute=True saves the [R, H] row copies of x and dy (its
  GEMMs read the tokens); across layers it also saves the residuals that stay alive while the other layers run.
  """
  def stack(x, weights, w_gate, w_up, w_down):
    for _ in range(num_layers):
      x = layer_fn(x, weights, layer["ids"], w_gate, w_up, w_down, **options)
    return x

  def fwd_bwd(x, weights, w_gate, w_up, w_down, d_y):  # y too, as a training step uses it (layer.forward_backward)
    y, pullback = jax.vjp(stack, x, weights, w_gate, w_up, w_down)
    return y, pullback(d_y)

  args = (layer["x"], layer["weights"], layer["w_gate"], layer["w_up"], layer["w_down"], d_y)
  return jax.jit(fwd_bwd).lower(*args).compile().memory_analysis()


def test_memory_below_reference(on_cpu, rng):
  """XLA:CPU temporaries: kittens far below the reference, and lower with recompute=True, whose backward writes no
  [R, H] row copies of x and dy.

  XLA:CPU's temp size does not track the live peak closely (its peak_memory_in_bytes is not the live peak at all);
  test_gpu_peak_memory checks the peak on the GPU.
  """
  layer = make_layer(rng, 256, 128, 128, 8, 4, "uniform", None, False)
  d_y = bf16(rng.standard_normal((256, 128)))
  xla, saved, recomputed = (stacked_fwd_bwd_memory(layer, d_y, fn, **options).temp_size_in_bytes for fn, options in (
      (reference.moe_ffn, {}), (fused_moe.moe_ffn, dict(recompute=False)), (fused_moe.moe_ffn, dict(recompute=True))))
  print(f"temp bytes: xla {xla}, kittens {saved}, kittens recompute {recomputed}")
  assert recomputed < saved < xla


# ---------------------------------------------------------------------------------------------------------------
# CUDA kernels at a realistic size (T = 2048, H = 1024, I = 512, E = 16, k = 4).

def _gpu():
  return jax.devices("gpu")[0]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_permutes_match_numpy(rng, dtype):
  with jax.default_device(_gpu()):
    check_permutes(rng, 2048, 1024, 16, 4, "skewed", dtype)
    check_permutes(rng, 301, 1001, 8, 2, "one_expert", dtype)  # H odd: one element a vector (no 16-byte copies)
    check_permutes(rng, 300, 512, 32, 17, "uniform", dtype)  # k = 17: three batches of the combine's 8 slots


@pytest.mark.gpu
@pytest.mark.parametrize("top_k", [4, 10])
def test_gpu_permutes_equal_cpu_twin(rng, top_k):
  """The CUDA kernels and the CPU twin compute the same bits (same element math, fused multiply-adds in slot order),
  with k above the combine's batch of slots loaded at once and a tenth of the slots dropped (id -1)."""
  ids = random_ids(rng, 2048, top_k, 16, "skewed")
  ids = jnp.asarray(np.where(rng.random(ids.shape) < 0.1, -1, ids).astype(np.int32))
  x = jnp.asarray(rng.standard_normal((2048, 1024)), jnp.bfloat16)
  weights = jnp.asarray(rng.random((2048, top_k)), jnp.float32)
  num_rows = routing.num_schedule_rows(ids.size, 16, grouped_matmul.ROW_ALIGN)
  values = jnp.asarray(rng.standard_normal((num_rows, 1024)), jnp.bfloat16)

  def run(device):
    with jax.default_device(device):
      sched = routing.schedule(jax.device_put(ids, device), 16, align=grouped_matmul.ROW_ALIGN)
      args = [jax.device_put(a, device) for a in (x, weights, values)]
      x_rows, row_weights = permute.gather_rows(args[0], sched, num_rows, weights=args[1])
      y = permute.combine(args[2], sched.rows, args[1], addend=args[0])
      return [np.asarray(a.astype(jnp.float32)) for a in (x_rows, row_weights, y)]

  for got, want in zip(run(_gpu()), run(jax.devices("cpu")[0])):
    np.testing.assert_array_equal(got, want)


GPU_CASES = [
    # load, shared, swiglu_limit
    ("uniform", 512, None),
    ("skewed", None, 1.0),
    ("one_expert", None, None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("load,shared,limit", GPU_CASES)
def test_gpu_layer_matches_reference(rng, load, shared, limit):
  """bf16 kittens on the GPU vs the float32 reference (highest-precision matmuls): relative Frobenius error of y and
  every gradient below REL_ERROR_BOUND; the same bits on a second run; recompute=True agrees."""
  tokens, hidden = 2048, 1024
  with jax.default_device(_gpu()):
    layer = make_layer(rng, tokens, hidden, 512, 16, 4, load, shared, False)
    d_y = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.float32)
    fn = grads_fn(fused_moe.moe_ffn, layer["ids"], d_y, swiglu_limit=limit)
    y, grads = fn(*layer_args(layer))
    ref_y, ref_grads = f32_reference(layer, d_y, limit)
    assert_close_to(y, grads, ref_y, ref_grads)
    # Token by token too: one lost or misrouted (token, slot) moves its token's row by ~1/k, and the whole array's
    # error by ~1/(k sqrt(T)), under the bound above. (dx only without the clamp, whose gradient jumps at the limit.)
    for got, want in ((y, ref_y),) + (((grads[0], ref_grads[0]),) if limit is None else ()):
      got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
      assert np.max(np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)) < 0.1
    y2, grads2 = fn(*layer_args(layer))
    for a, b in zip((y,) + flat_grads(grads), (y2,) + flat_grads(grads2)):
      np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    y3, grads3 = grads_fn(fused_moe.moe_ffn, layer["ids"], d_y, swiglu_limit=limit, recompute=True)(
        *layer_args(layer))
    assert_close_to(y3, grads3, ref_y, ref_grads)


@pytest.mark.gpu
def test_gpu_layer_recorded_into_command_buffers(rng, tmp_path):
  """XLA records every FFI call of the layer's forward and backward into its command buffers (CUDA graphs) with the
  fusions around them: the CUDA handlers take their workspace as results (the schedule's chunk counts, the GEMMs'
  tile counter, the dgrad's partials) and allocate nothing, which a recorded call must not do. Read from XLA's dump of
  the executable's thunks, where a command buffer's thunks are indented under it."""
  with jax.default_device(_gpu()):
    layer = make_layer(rng, 2048, 1024, 512, 16, 4, "uniform", None, False)
    d_y = jnp.asarray(rng.standard_normal((2048, 1024)), jnp.float32)
    lowered = grads_fn(fused_moe.moe_ffn, layer["ids"], d_y).lower(*layer_args(layer))
    lowered.compile(compiler_options={"xla_dump_to": str(tmp_path)})
  [dump] = tmp_path.glob("*thunk_sequence_after_thunk_passes.txt")
  print(dump.read_text())
  calls = [line for line in dump.read_text().splitlines() if "kCustomCall" in line]
  # The schedule, the two forward GEMMs and the combine; the dgrad, the dx GEMM and its combine, three tgmm.
  assert len(calls) >= 10
  assert all(line.startswith(" ") for line in calls), "an FFI call runs outside the command buffers"


@pytest.mark.gpu
@pytest.mark.parametrize("num_layers", [1, 2])
def test_gpu_peak_memory(rng, num_layers):
  """Compiled peak device memory of fwd+bwd (one layer, two stacked layers): kittens no higher than the reference,
  and lower with recompute=True.

  Many tokens for small experts: the saved [R, I] pre-activations (17 MB each here) must outweigh the weight
  gradients (6 MB), which the second layer's backward holds while the first runs. With the weights the larger
  (2048 tokens for 16 experts of [1024, 512]), the two peaks of two layers came out equal on the H200 at c72ce96:
  the peak then sat where neither variant kept residuals. layer.py and layer_memory.py measure the model shapes.
  """
  cases = (("xla", reference.moe_ffn, {}), ("kittens", fused_moe.moe_ffn, dict(recompute=False)),
           ("kittens recompute", fused_moe.moe_ffn, dict(recompute=True)))
  with jax.default_device(_gpu()):
    layer = make_layer(rng, 8192, 512, 256, 8, 4, "uniform", None, False)
    d_y = bf16(rng.standard_normal((8192, 512)))
    peaks = {name: stacked_fwd_bwd_memory(layer, d_y, fn, num_layers, **options).peak_memory_in_bytes
             for name, fn, options in cases}
  print(f"peak bytes: {peaks}")
  assert peaks["kittens recompute"] < peaks["kittens"] <= peaks["xla"]
