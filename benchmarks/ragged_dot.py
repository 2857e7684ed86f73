"""Grouped GEMM benchmark: `jax_kittens.ragged_dot` vs `jax.lax.ragged_dot` vs `tokamax.ragged_dot` vs dense einsum.

At the MoE layer's two GEMM shapes of each model's single-GPU slice (E/8 local experts, T = 8192 tokens, top-k):
"gate_up" [T*k, H] x [E_local, H, I] (the gate GEMM; up is the same) and "down" [T*k, I] x [E_local, I, H], with the
group sizes of uniform and skewed routing. "dense" is the batched einsum over equal groups of T*k/E_local rows.
Per shape and GEMM the backends' calls alternate (`common.time_interleaved`), each round in its own order.

  python3 benchmarks/ragged_dot.py           # on the H200: benchmarks/results/ragged_dot_h200.json + .png
  python3 benchmarks/ragged_dot.py --smoke   # tiny shapes, any platform
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import jax_kittens  # noqa: E402

BACKENDS = ("kittens", "xla", "tokamax", "dense")
TABLE = ("shape", "gemm", "routing", "backend", "median_ms", "tflops", "vs_dense", "vs_tokamax", "iters", "error")


def kittens_ragged_dot():
  """(jax_kittens.ragged_dot forced onto its kernels, None), or (None, why it is missing)."""
  try:
    from jax_kittens.grouped_matmul import ragged_dot  # noqa: PLC0415
  except ImportError as error:
    return None, f"jax_kittens.grouped_matmul.ragged_dot unavailable: {error}"
  return (lambda lhs, rhs, group_sizes: ragged_dot(lhs, rhs, group_sizes, backend="kittens")), None


def dense_dot(lhs, rhs):
  """lhs: [G, M, K]; rhs: [G, K, N] -> [G, M, N]."""
  return jnp.einsum("gmk,gkn->gmn", lhs, rhs)


def gemm_inputs(key, shape, num_tokens, gemm):
  num_local_experts = shape.num_experts // common.GPUS_PER_NODE
  rows = num_tokens * shape.top_k
  k_dim, n_dim = (shape.hidden, shape.intermediate) if gemm == "gate_up" else (shape.intermediate, shape.hidden)
  keys = jax.random.split(key, 4)
  normal = lambda k, dims, scale: (scale * jax.random.normal(k, dims, jnp.float32)).astype(jnp.bfloat16)
  group_sizes = {}
  for n, routing in enumerate(common.ROUTINGS):
    _, ids = common.routed(jax.random.fold_in(keys[3], n), num_tokens, num_local_experts, shape.top_k, routing)
    group_sizes[routing] = jax_kittens.schedule(ids, num_local_experts, backend="xla").tokens_per_expert
  return dict(lhs=[normal(keys[0], (rows, k_dim), 1.0), normal(keys[1], (rows, k_dim), 1.0)],
              rhs=normal(keys[2], (num_local_experts, k_dim, n_dim), k_dim ** -0.5),
              dense_lhs=normal(keys[0], (num_local_experts, rows // num_local_experts, k_dim), 1.0),
              group_sizes=group_sizes, flops=2 * rows * k_dim * n_dim)


def benchmark_shape(name, shape, num_tokens, backends, implementations, args):
  """Rows of one model shape; per GEMM, every backend and routing timed in alternation."""
  rows = []
  for gemm in ("gate_up", "down"):
    inputs = gemm_inputs(jax.random.key(sum(map(ord, name + gemm))), shape, num_tokens, gemm)
    timings = []
    for backend in backends:
      row = {"shape": name, "gemm": gemm, "mode": "fwd", "backend": backend, "lhs": list(inputs["lhs"][0].shape),
             "rhs": list(inputs["rhs"].shape)}
      if backend == "dense":
        dense_lhs = inputs["dense_lhs"]
        arg_sets = [(dense_lhs, inputs["rhs"])]
        flops = 2 * dense_lhs.shape[0] * dense_lhs.shape[1] * dense_lhs.shape[2] * inputs["rhs"].shape[2]
        timings.append(common.Timing({**row, "routing": "equal"}, common.Executable(dense_dot, arg_sets[0]), arg_sets,
                                     flops))
        continue
      ragged_dot, missing = implementations[backend]
      arg_sets = {routing: [(lhs, inputs["rhs"], inputs["group_sizes"][routing]) for lhs in inputs["lhs"]]
                  for routing in common.ROUTINGS}
      executable = common.Executable(ragged_dot, arg_sets["uniform"][0], unavailable=missing)
      timings += [common.Timing({**row, "routing": routing}, executable, arg_sets[routing], inputs["flops"])
                  for routing in common.ROUTINGS]
    rows += common.measure_interleaved(timings, args)
  return rows


def main():
  args = common.parse_args(__doc__.splitlines()[0])
  meta = common.metadata()
  print(f"ragged_dot benchmark: {meta}", flush=True)
  implementations = {"kittens": kittens_ragged_dot(), "xla": (jax.lax.ragged_dot, None),
                     "tokamax": common.tokamax_ragged_dot()}
  for backend, (_, missing) in implementations.items():
    if missing:
      print(f"{backend}: {missing}", flush=True)
  backends = [b for b in BACKENDS if args.only is None or b in args.only]
  rows = []
  for name, shape in args.model_shapes.items():
    rows += benchmark_shape(name, shape, common.num_tokens(args), backends, implementations, args)
  common.add_ratio(rows, "dense", ("shape", "gemm"))
  common.add_ratio(rows, "tokamax", ("shape", "gemm", "routing"))
  common.write_results(common.results_name("ragged_dot", args, backends), args.out_dir, meta, rows,
                       ("shape", "gemm", "routing"), plot_rows=common.dense_beside_every_routing(rows))
  common.print_table(rows, TABLE)


if __name__ == "__main__":
  main()
