"""The public `moe_ffn`: argument validation, backend resolution and the "xla" path."""

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jax_kittens import _extension, grouped_matmul, moe, reference, routing
from moe_oracle import random_layer

T, H, I, E, K = 9, 8, 6, 4, 2


@pytest.fixture(autouse=True)
def on_cpu():
  with jax.default_device(jax.devices("cpu")[0]):
    yield


def _layer(**changes):
  layer = random_layer(np.random.default_rng(0), T, H, I, E, K, shared=5)
  layer.update(changes)
  return layer


def _call(layer, **options):
  layer = dict(layer)
  args = [layer.pop(name) for name in ("x", "weights", "ids", "w_gate", "w_up", "w_down")]
  return moe.moe_ffn(*args, **layer, **options)


f32 = np.float32
BAD = [
    # (what changes, error type, words the message must contain)
    (dict(x=np.zeros((T, H, 1), f32)), ValueError, "x must have shape"),
    (dict(x=np.zeros((T, H), np.int32)), TypeError, "x must be"),
    (dict(x=[[0.0] * H] * T), TypeError, "x must be an array"),
    (dict(weights=np.zeros((T + 1, K), f32)), ValueError, "weights must have shape"),
    (dict(weights=np.zeros((T, K), np.int32)), TypeError, "weights must be"),
    (dict(ids=np.zeros((T, K + 1), np.int32)), ValueError, "ids must have the shape of weights"),
    (dict(ids=np.zeros((T, K), np.int64)), TypeError, "ids must be int32"),
    (dict(ids=np.zeros((T, K), f32)), TypeError, "ids must be int32"),
    (dict(w_gate=np.zeros((E, H + 1, I), f32)), ValueError, "w_gate must have shape"),
    (dict(w_gate=np.zeros((H, I), f32)), ValueError, "w_gate must have shape"),
    (dict(w_up=np.zeros((E + 1, H, I), f32)), ValueError, "w_up must have w_gate's shape"),
    (dict(w_down=np.zeros((E, H, I), f32)), ValueError, "w_down must have shape"),
    (dict(w_down=np.zeros((E - 1, I, H), f32)), ValueError, "w_down must have shape"),
    (dict(w_up=np.zeros((E, H, I), np.float16)), TypeError, "w_up must have x's dtype"),
    (dict(weights=np.zeros((T, E + 1), f32), ids=np.zeros((T, E + 1), np.int32)), ValueError, "top_k"),
    (dict(weights=np.zeros((T, 0), f32), ids=np.zeros((T, 0), np.int32)), ValueError, "top_k"),
    (dict(w_gate=np.zeros((0, H, I), f32), w_up=np.zeros((0, H, I), f32), w_down=np.zeros((0, I, H), f32)),
     ValueError, "at least one expert"),
    (dict(w_gate=np.zeros((E, H, 0), f32), w_up=np.zeros((E, H, 0), f32), w_down=np.zeros((E, 0, H), f32)),
     ValueError, "intermediate >= 1"),
    (dict(shared_experts=(np.zeros((H, 5), f32),) * 2), TypeError, "shared_experts must be a tuple"),
    (dict(shared_experts=(np.zeros((H + 1, 5), f32), np.zeros((H + 1, 5), f32), np.zeros((5, H), f32))),
     ValueError, "shared_experts[0] (w_gate)"),
    (dict(shared_experts=(np.zeros((H, 5), f32), np.zeros((H, 4), f32), np.zeros((5, H), f32))),
     ValueError, "shared_experts[1] (w_up)"),
    (dict(shared_experts=(np.zeros((H, 5), f32), np.zeros((H, 5), f32), np.zeros((4, H), f32))),
     ValueError, "shared_experts[2] (w_down)"),
    (dict(shared_experts=(np.zeros((H, 5), f32), np.zeros((H, 5), f32), np.zeros((5, H), np.float16))),
     TypeError, "shared_experts[2] must have x's dtype"),
]


@pytest.mark.parametrize("changes,error,words", BAD)
def test_bad_arrays_raise(changes, error, words):
  with pytest.raises(error, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
    _call(_layer(**changes), backend="xla")


@pytest.mark.parametrize("options,error,words", [
    (dict(backend="cuda"), ValueError, "backend must be one of"),
    (dict(swiglu_limit=0.0), ValueError, "swiglu_limit must be a finite number > 0"),
    (dict(swiglu_limit=-1.0), ValueError, "swiglu_limit must be a finite number > 0"),
    (dict(swiglu_limit=float("inf")), ValueError, "swiglu_limit must be a finite number > 0"),
    (dict(swiglu_limit=float("nan")), ValueError, "swiglu_limit must be a finite number > 0"),
    (dict(swiglu_limit=jnp.float32(1.0)), TypeError, "swiglu_limit must be a Python number"),
    (dict(capacity_factor=1.0), ValueError, "capacity_factor .* needs axis_name"),
    (dict(capacity_factor=0.0), ValueError, "capacity_factor must be a finite number > 0"),
    (dict(recompute=1), TypeError, "recompute must be a bool"),
    (dict(return_stats="yes"), TypeError, "return_stats must be a bool"),
    (dict(axis_name=3), TypeError, "axis_name must be a str"),
    (dict(axis_name="ep"), ValueError, "inside jax.shard_map"),
])
def test_bad_options_raise(options, error, words):
  with pytest.raises(error, match=words):
    _call(_layer(), backend=options.pop("backend", "xla"), **options)


def test_axis_name_not_in_the_mesh_raises():
  mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("ep",))
  layer = _layer(shared_experts=None)
  layer["w_gate"], layer["w_up"], layer["w_down"] = (w[:2] for w in (layer["w_gate"], layer["w_up"], layer["w_down"]))

  def local(x, weights, ids, w_gate, w_up, w_down):
    return moe.moe_ffn(x, weights, ids, w_gate, w_up, w_down, axis_name="experts", backend="xla")

  with pytest.raises(ValueError, match="axis_name='experts' is not a mesh axis"):
    jax.shard_map(local, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))(
        layer["x"][:8], layer["weights"][:8], layer["ids"][:8], layer["w_gate"], layer["w_up"], layer["w_down"])


def test_top_k_counts_global_experts_under_axis_name():
  """top_k may exceed the local experts as long as it fits the experts of all ranks."""
  num_ranks, local_experts, top_k = 4, 1, 3
  rng = np.random.default_rng()
  layer = random_layer(rng, 8 * num_ranks, H, I, local_experts * num_ranks, top_k)
  mesh = Mesh(np.array(jax.devices("cpu")[:num_ranks]), ("ep",))

  def local(x, weights, ids, w_gate, w_up, w_down):
    return moe.moe_ffn(x, weights, ids, w_gate, w_up, w_down, axis_name="ep", backend="xla")

  y = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(
      layer["x"], layer["weights"], layer["ids"], layer["w_gate"], layer["w_up"], layer["w_down"])
  np.testing.assert_allclose(y, _call(layer, backend="xla"), rtol=2e-5, atol=2e-5)


def test_auto_is_xla_on_cpu():
  if jax.default_backend() == "gpu":
    pytest.skip("JAX runs on a GPU here")
  assert moe.resolve_backend("auto") == "xla"


@pytest.mark.parametrize("choice,single_device,expert_parallel", [
    (None, True, False), ("kittens", True, True), ("xla", False, False)])
def test_auto_on_a_gpu_follows_jax_kittens_auto(monkeypatch, choice, single_device, expert_parallel):
  """Where the kernels run: "auto" is kittens on one device; expert parallelism only with JAX_KITTENS_AUTO=kittens."""
  monkeypatch.setattr(_extension, "cuda_available", lambda *arrays: True)
  if choice is None:
    monkeypatch.delenv("JAX_KITTENS_AUTO", raising=False)
  else:
    monkeypatch.setenv("JAX_KITTENS_AUTO", choice)
  assert _extension.kittens_by_default() == single_device
  assert _extension.kittens_by_default(expert_parallel=True) == expert_parallel


def test_auto_under_axis_name_on_a_gpu_is_the_xla_layer(monkeypatch):
  """On a GPU with the kernels, "auto" under axis_name is the pure-JAX layer until expert parallelism defaults to
  the kernels (it used to reach the single-device kittens layer, which raised)."""
  monkeypatch.setattr(_extension, "kittens_by_default", lambda *arrays, expert_parallel=False: not expert_parallel)
  num_ranks = 2
  layer = random_layer(np.random.default_rng(), 8 * num_ranks, 64, 64, 2 * num_ranks, 2)  # sizes the kernels take
  layer = {name: (jnp.asarray(v, jnp.bfloat16) if name in ("x", "w_gate", "w_up", "w_down") else v)
           for name, v in layer.items()}
  mesh = Mesh(np.array(jax.devices("cpu")[:num_ranks]), ("ep",))

  def local(backend):
    return lambda *args: moe.moe_ffn(*args, axis_name="ep", backend=backend)

  args = (layer["x"], layer["weights"], layer["ids"], layer["w_gate"], layer["w_up"], layer["w_down"])
  y = {backend: jax.jit(jax.shard_map(local(backend), mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(*args)
       for backend in ("auto", "xla")}
  np.testing.assert_array_equal(np.asarray(y["auto"], np.float32), np.asarray(y["xla"], np.float32))


def test_on_a_gpu_machine_cpu_devices_are_cpu(monkeypatch):
  """JAX's default backend "gpu", and a computation on the machine's CPU devices: inside shard_map over them, or on
  arrays laid out over them, "auto" is what it is on a CPU machine (xla for the layer and ragged_dot), and
  backend="kittens" runs the CPU twins even where the CUDA kernels cannot run on the GPU. On a single-device array
  the default platform decides."""
  monkeypatch.setattr(_extension, "default_platform", lambda: "gpu")
  monkeypatch.delenv("JAX_KITTENS_AUTO", raising=False)
  mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("d",))
  lhs = jnp.asarray(np.random.default_rng(2).standard_normal((16, 64)), jnp.bfloat16)
  rhs = jnp.asarray(np.random.default_rng(3).standard_normal((2, 64, 64)), jnp.bfloat16)
  group_sizes = jnp.asarray([3, 5], jnp.int32)
  seen = {}

  def record(name):
    def local(lhs):
      seen[name] = (_extension.mesh_platform(lhs), _extension.kittens_by_default(lhs), moe.resolve_backend("auto", lhs))
      return lhs
    return local

  monkeypatch.setattr(_extension, "cuda_unavailable_reason", lambda: None)  # kernels that run on that GPU
  jax.jit(record("single device"))(lhs)
  jax.jit(jax.shard_map(record("shard_map"), mesh=mesh, in_specs=P("d"), out_specs=P("d")))(lhs)
  jax.jit(record("sharded"))(jax.device_put(lhs, jax.sharding.NamedSharding(mesh, P("d"))))
  assert seen == {"single device": ("gpu", True, "kittens"), "shard_map": ("cpu", False, "xla"),
                  "sharded": ("cpu", False, "xla")}

  reason = "are built for sm_90a, which NVIDIA B200 (GPU 0, compute capability 10.0) cannot run"
  monkeypatch.setattr(_extension, "cuda_unavailable_reason", lambda: reason)
  with pytest.raises(ValueError, match=re.escape(reason)):
    grouped_matmul.ragged_dot(lhs, rhs, group_sizes, backend="kittens")

  def on_cpu_devices(lhs):
    return grouped_matmul.ragged_dot(lhs, rhs, group_sizes, backend="kittens")

  got = jax.jit(jax.shard_map(on_cpu_devices, mesh=Mesh(np.array(jax.devices("cpu")[:1]), ("d",)), in_specs=P(),
                              out_specs=P()))(lhs)
  np.testing.assert_array_equal(got, jax.lax.ragged_dot(lhs, rhs, group_sizes))


@pytest.mark.parametrize("arch,capability,runs", [
    ("sm_90a", (9, 0), True), ("sm_90a", (10, 0), False), ("sm_90a", (8, 0), False), ("sm_100a", (10, 0), True),
    ("sm_80", (8, 6), True), ("sm_86", (8, 0), False), ("sm_80", (9, 0), False), ("compute_90a", (9, 0), False)])
def test_arch_runs_on(arch, capability, runs):
  assert _extension.arch_runs_on(arch, capability) is runs


@pytest.mark.parametrize("cuda,capability,words", [
    (True, "9.0", None),
    (True, "8.0", "are built for sm_90a, which NVIDIA A100-SXM4-80GB (GPU 0, compute capability 8.0) cannot run"),
    (True, "10.0", "compute capability 10.0"),
    (False, "9.0", "are not in this build")])
def test_cuda_unavailable_reason_names_the_gpu(monkeypatch, cuda, capability, words):
  monkeypatch.setattr(_extension._jax_kittens, "build_info", lambda: {"cuda": cuda, "cuda_archs": ["sm_90a"]})
  gpu = types.SimpleNamespace(compute_capability=capability, device_kind="NVIDIA A100-SXM4-80GB", id=0)
  monkeypatch.setattr(jax, "local_devices", lambda backend=None: [gpu])
  reason = _extension.cuda_unavailable_reason.__wrapped__()  # uncached: the real devices stay cached
  assert reason is None if words is None else words in reason


def test_on_a_gpu_without_its_kernels_auto_is_xla_and_kittens_raises(monkeypatch):
  """An A100 or a Blackwell with this sm_90a build, or a GPU machine whose build found no CUDA: "auto" goes to xla
  everywhere (routing included), and an explicit backend="kittens" raises at trace time, naming the GPU."""
  reason = "are built for sm_90a, which NVIDIA B200 (GPU 0, compute capability 10.0) cannot run"
  monkeypatch.setattr(_extension, "default_platform", lambda: "gpu")
  monkeypatch.setattr(_extension, "cuda_available", lambda *arrays: False)
  monkeypatch.setattr(_extension, "cuda_unavailable_reason", lambda: reason)
  monkeypatch.delenv("JAX_KITTENS_AUTO", raising=False)
  assert moe.resolve_backend("auto") == "xla"
  layer = _layer()
  np.testing.assert_array_equal(_call(layer), _call(layer, backend="xla"))
  logits = jnp.asarray(np.random.default_rng(1).standard_normal((T, E)), jnp.float32)
  for got, want in zip(routing.route(logits, K), routing.route(logits, K, backend="xla")):
    np.testing.assert_array_equal(got, want)
  ids = routing.route(logits, K)[1]
  for got, want in zip(routing.schedule(ids, E, align=4), routing.schedule(ids, E, align=4, backend="xla")):
    np.testing.assert_array_equal(got, want)
  lhs, rhs = jnp.ones((8, 64), jnp.bfloat16), jnp.ones((2, 64, 64), jnp.bfloat16)
  np.testing.assert_array_equal(grouped_matmul.ragged_dot(lhs, rhs, jnp.asarray([3, 5], jnp.int32)),
                                jax.lax.ragged_dot(lhs, rhs, jnp.asarray([3, 5], jnp.int32)))
  words = re.escape("the jax_kittens CUDA kernels " + reason)
  with pytest.raises(ValueError, match="jk_route: " + words):
    routing.route(logits, K, backend="kittens")
  with pytest.raises(ValueError, match="jk_gmm: " + words):
    grouped_matmul.ragged_dot(lhs, rhs, jnp.asarray([3, 5], jnp.int32), backend="kittens")
  bf16 = {name: jnp.zeros((T, 64) if name == "x" else (E, 64, 64), jnp.bfloat16) for name in
          ("x", "w_gate", "w_up", "w_down")}
  with pytest.raises(ValueError, match=words):
    moe.moe_ffn(bf16["x"], layer["weights"], layer["ids"], bf16["w_gate"], bf16["w_up"], bf16["w_down"],
                backend="kittens")


def test_on_another_platform_auto_is_xla_and_kittens_raises(monkeypatch):
  monkeypatch.setattr(_extension, "default_platform", lambda: "tpu")
  monkeypatch.delenv("JAX_KITTENS_AUTO", raising=False)
  assert moe.resolve_backend("auto") == "xla"
  logits = jnp.asarray(np.random.default_rng(1).standard_normal((T, E)), jnp.float32)
  for got, want in zip(routing.route(logits, K), routing.route(logits, K, backend="xla")):
    np.testing.assert_array_equal(got, want)
  with pytest.raises(ValueError, match="jk_route: jax_kittens runs on CPUs and NVIDIA GPUs, not on tpu"):
    routing.route(logits, K, backend="kittens")


def test_xla_backend_is_the_reference_and_recompute_keeps_gradients():
  rng = np.random.default_rng()
  layer = random_layer(rng, 23, H, I, E, K, load="skewed", shared=5)
  d_y = rng.standard_normal((23, H)).astype(np.float32)
  differentiable = ("x", "weights", "w_gate", "w_up", "w_down", "shared_experts")

  def grads(fn, **options):
    def loss(params):
      return jnp.sum(fn(**{**layer, **params}, swiglu_limit=2.0, **options) * d_y)
    return jax.jit(jax.grad(loss))({name: layer[name] for name in differentiable})

  want = grads(reference.moe_ffn)
  for recompute in (False, True):
    got = grads(moe.moe_ffn, backend="xla", recompute=recompute)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6), got, want)
  y, stats = _call(layer, backend="xla", return_stats=True)
  np.testing.assert_array_equal(y, reference.moe_ffn(**layer))
  assert stats.dropped_tokens.dtype == jnp.int32 and int(stats.dropped_tokens) == 0
  assert int(stats.received_tokens) == 23 * K
