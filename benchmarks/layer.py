"""Single-GPU MoE layer benchmark (design.md section 3): kittens vs the pure-JAX reference vs tokamax vs dense.

Per model shape: the single-GPU slice (E/8 local experts, T = 8192 tokens, all routed to them), uniform and skewed
routing, forward and forward+backward. Backends: "kittens" (`moe_ffn(backend="kittens")`), "xla" (the reference
with `jax.lax.ragged_dot`), "tokamax" (the reference with `tokamax.ragged_dot`), "dense" (the same SwiGLU chain as
batched einsums over equal groups of T*k/E rows: the cuBLAS ceiling). Also the compiled peak memory of the
forward+backward for kittens (recompute off and on) and xla. Per shape and mode the backends' calls alternate
(`common.time_interleaved`), each round in its own order (`common.round_order`), so that the ratios compare runs at
the same clocks and temperature.

  python3 benchmarks/layer.py            # on the H200: benchmarks/results/layer_h200.json + .png
  python3 benchmarks/layer.py --smoke    # tiny shapes, any platform
"""

from __future__ import annotations

import functools
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from jax_kittens import moe, reference  # noqa: E402

BACKENDS = ("kittens", "xla", "tokamax", "dense")
MODES = ("fwd", "fwd_bwd")
FLOPS_PER_MODE = {"fwd": 6, "fwd_bwd": 18}  # x rows*H*I (design.md section 3)
ROUTED_DIFFERENTIABLE = (0, 1, 3, 4, 5)  # x, weights, w_gate, w_up, w_down; not ids
DENSE_DIFFERENTIABLE = (0, 1, 2, 3)
TABLE = ("shape", "routing", "mode", "backend", "median_ms", "tflops", "vs_dense", "vs_tokamax", "iters", "error")


def routed_layer(backend, ragged_dot, recompute=False):
  """f(x, weights, ids, w_gate, w_up, w_down) -> y."""
  if backend == "kittens":
    return functools.partial(moe.moe_ffn, backend="kittens", recompute=recompute)
  return functools.partial(reference.moe_ffn, ragged_dot=ragged_dot)


def dense_layer(rows, w_gate, w_up, w_down):
  """rows: [E, M, H]; w_gate, w_up: [E, H, I]; w_down: [E, I, H] -> [E, M, H]: every expert gets M rows.

  The same arithmetic as the reference's experts: GEMMs in the operands' dtype, SwiGLU in float32.
  """
  gate = jnp.einsum("emh,ehi->emi", rows, w_gate).astype(jnp.float32)
  up = jnp.einsum("emh,ehi->emi", rows, w_up).astype(jnp.float32)
  return jnp.einsum("emi,eih->emh", reference.swiglu(gate, up, None).astype(rows.dtype), w_down)


def forward_backward(layer, differentiable):
  """g(*inputs, d_y) -> (y = layer(*inputs), gradients of <y, d_y> w.r.t. the inputs at positions ``differentiable``).

  y is returned, as a training step uses it. Dropped, it would let XLA remove the forward work that only y needs, and
  that work differs between the backends: the kittens backward takes the router weights' gradient from its dgrad
  epilogue and needs neither the forward's down GEMM nor its combine, the dense chain needs no last einsum, while the
  references keep their down GEMM for d(weights).
  """
  def run(*args):
    *inputs, d_y = args

    def of_differentiable(*values):
      full = list(inputs)
      for position, value in zip(differentiable, values):
        full[position] = value
      return layer(*full)

    y, pullback = jax.vjp(of_differentiable, *(inputs[p] for p in differentiable))
    return y, pullback(d_y)

  return run


def shape_inputs(key, shape, num_tokens):
  """Device inputs of one model shape's single-GPU slice, bf16, weights scaled so activations stay O(1)."""
  num_local_experts = shape.num_experts // common.GPUS_PER_NODE
  keys = jax.random.split(key, 8)
  h, i = shape.hidden, shape.intermediate
  normal = lambda k, dims, scale: (scale * jax.random.normal(k, dims, jnp.float32)).astype(jnp.bfloat16)
  rows_per_expert = num_tokens * shape.top_k // num_local_experts
  return dict(
      xs=[normal(keys[0], (num_tokens, h), 1.0), normal(keys[1], (num_tokens, h), 1.0)],  # alternated between runs
      experts=(normal(keys[2], (num_local_experts, h, i), h ** -0.5),
               normal(keys[3], (num_local_experts, h, i), h ** -0.5),
               normal(keys[4], (num_local_experts, i, h), i ** -0.5)),
      d_y=normal(keys[5], (num_tokens, h), 1.0),
      dense_rows=normal(keys[6], (num_local_experts, rows_per_expert, h), 1.0),
      dense_d_y=normal(keys[7], (num_local_experts, rows_per_expert, h), 1.0),
      routings={routing: common.routed(jax.random.fold_in(key, n), num_tokens, num_local_experts, shape.top_k, routing)
                for n, routing in enumerate(common.ROUTINGS)})


def benchmark_shape(name, shape, num_tokens, backends, tokamax, args):
  """Rows (timings) and memory rows of one model shape; per mode, every backend and routing timed in alternation."""
  inputs = shape_inputs(jax.random.key(sum(map(ord, name))), shape, num_tokens)
  rows, memory = [], []
  for mode in MODES:
    timings = []
    d_y = (inputs["d_y"],) if mode == "fwd_bwd" else ()
    for backend in backends:
      row = {"shape": name, "mode": mode, "backend": backend, "tokens": num_tokens,
             "local_experts": shape.num_experts // common.GPUS_PER_NODE}
      if backend == "dense":
        rows_in = inputs["dense_rows"]
        arg_sets = [(rows_in, *inputs["experts"]) + ((inputs["dense_d_y"],) if d_y else ())]
        fn = dense_layer if mode == "fwd" else forward_backward(dense_layer, DENSE_DIFFERENTIABLE)
        flops = FLOPS_PER_MODE[mode] * rows_in.shape[0] * rows_in.shape[1] * shape.hidden * shape.intermediate
        timings.append(common.Timing({**row, "routing": "equal"}, common.Executable(fn, arg_sets[0]), arg_sets, flops))
        continue
      ragged_dot = {"xla": jax.lax.ragged_dot, "tokamax": tokamax[0]}.get(backend)
      layer = routed_layer(backend, ragged_dot)
      fn = layer if mode == "fwd" else forward_backward(layer, ROUTED_DIFFERENTIABLE)
      flops = FLOPS_PER_MODE[mode] * num_tokens * shape.top_k * shape.hidden * shape.intermediate
      arg_sets = {routing: [(x, *inputs["routings"][routing], *inputs["experts"], *d_y) for x in inputs["xs"]]
                  for routing in common.ROUTINGS}
      # Routing changes values only: one executable serves both.
      executable = common.Executable(fn, arg_sets["uniform"][0],
                                     unavailable=tokamax[1] if backend == "tokamax" else None)
      timings += [common.Timing({**row, "routing": routing}, executable, arg_sets[routing], flops)
                  for routing in common.ROUTINGS]
      if mode == "fwd_bwd" and backend in ("kittens", "xla"):
        memory.append(common.measure({"shape": name, "backend": backend, "recompute": False}, executable.memory))
    rows += common.measure_interleaved(timings, args)
  if "kittens" in backends:  # recompute=True is compiled for its memory only
    weights, ids = inputs["routings"]["uniform"]
    layer = routed_layer("kittens", None, recompute=True)
    executable = common.Executable(forward_backward(layer, ROUTED_DIFFERENTIABLE),
                                   (inputs["xs"][0], weights, ids, *inputs["experts"], inputs["d_y"]))
    memory.append(common.measure({"shape": name, "backend": "kittens", "recompute": True}, executable.memory))
  return rows, memory


def main():
  args = common.parse_args(__doc__.splitlines()[0])
  meta = common.metadata()
  print(f"layer benchmark: {meta}", flush=True)
  backends = [b for b in BACKENDS if args.only is None or b in args.only]
  tokamax = common.tokamax_ragged_dot()
  if tokamax[1]:
    print(tokamax[1], flush=True)
  rows, memory = [], []
  start = time.perf_counter()
  for name, shape in args.model_shapes.items():
    shape_rows, shape_memory = benchmark_shape(name, shape, common.num_tokens(args), backends, tokamax, args)
    rows += shape_rows
    memory += shape_memory
    print(f"{name} done after {time.perf_counter() - start:.0f} s", flush=True)
  common.add_ratio(rows, "dense", ("shape", "mode"))  # dense has equal groups: one row per shape and mode
  common.add_ratio(rows, "tokamax", ("shape", "mode", "routing"))
  common.write_results(common.results_name("layer", args, backends), args.out_dir, meta, rows,
                       ("shape", "mode", "routing"), extra={"memory": memory},
                       plot_rows=common.dense_beside_every_routing(rows))
  common.print_table(rows, TABLE)
  print()
  common.print_table(memory, ("shape", "backend", "recompute", "peak_bytes", "total_bytes", "temp_bytes", "error"))


if __name__ == "__main__":
  main()
