"""Where one MoE layer call's device time goes: `moe_ffn(backend="kittens")` and the reference with
`tokamax.ragged_dot` (uniform and skewed routing) and the dense chain, forward and forward+backward, on `layer.py`'s
inputs (each model shape's single-GPU slice), under ``jax.profiler``: device time per call, summed per kernel and per
XLA op (`common.traced_device_time`).

Tells the grouped GEMMs from the gather, combine and schedule, and each from its dense counterpart, which
`layer.py`'s wall-clock ratios cannot. Its busy times also give ratios of device time alone: single traced calls,
apart from one another (so not at the power cap that `layer.py`'s back-to-back calls reach), without the host's share
of each call (dispatch and synchronisation) that `layer.py`'s per-call wall times include for every backend.

Per routing it also times the gate/up GEMM alone both ways the kittens kernels can feed it: rows gathered by the
gather kernel and loaded by TMA ("gate_up:rows"), or read straight from the tokens through the row -> token map
("gate_up:gathered", what `moe_ffn` does), in the same process.

  python3 benchmarks/layer_profile.py                   # on the H200: benchmarks/results/layer_profile_h200.json
  python3 benchmarks/layer_profile.py --shapes qwen3.5  # some shapes
  python3 benchmarks/layer_profile.py --smoke           # tiny shapes, any platform
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

import common  # noqa: E402
import layer  # noqa: E402

import jax_kittens  # noqa: E402
from jax_kittens import grouped_matmul, permute  # noqa: E402


def gate_up_alone(shape, gathered):
  """(x, ids, w_gate, w_up) -> act [R, I]: schedule and gate/up GEMM with SwiGLU, its lhs gathered beforehand or in
  the kernel. Everything is an argument: arrays closed over would be baked into the program as constants."""
  num_local_experts = shape.num_experts // common.GPUS_PER_NODE

  def fn(x, ids, w_gate, w_up):
    num_rows = jax_kittens.num_schedule_rows(ids.size, num_local_experts, grouped_matmul.ROW_ALIGN)
    sched = jax_kittens.schedule(ids, num_local_experts, align=grouped_matmul.ROW_ALIGN, backend="kittens")
    if gathered:
      return grouped_matmul.gmm_swiglu(x, w_gate, w_up, sched.expert_offsets, sched.tokens_per_expert,
                                       row_tokens=permute.row_tokens(sched.rows, num_rows))
    return grouped_matmul.gmm_swiglu(permute.gather_rows(x, sched, num_rows), w_gate, w_up, sched.expert_offsets,
                                     sched.tokens_per_expert)

  return fn


def profile_shape(name, shape, num_tokens, *, warmup, calls, top):
  """Rows of one model shape: kittens and tokamax per routing and the dense chain, per mode; the gate/up GEMM both
  ways. tokamax's rows say why it is missing where it cannot be imported."""
  inputs = layer.shape_inputs(jax.random.key(sum(map(ord, name))), shape, num_tokens)
  x = inputs["xs"][0]
  tokamax_ragged_dot, tokamax_unavailable = common.tokamax_ragged_dot()
  routed = {"kittens": layer.routed_layer("kittens", None),
            "tokamax": layer.routed_layer("tokamax", tokamax_ragged_dot) if tokamax_ragged_dot else None}
  # (backend, routing, fn, modes, differentiable, args, d_y)
  cases = [(backend, routing, fn, layer.MODES, layer.ROUTED_DIFFERENTIABLE,
            (x, *inputs["routings"][routing], *inputs["experts"]), inputs["d_y"])
           for backend, fn in routed.items() for routing in common.ROUTINGS]
  cases.append(("dense", "equal", layer.dense_layer, layer.MODES, layer.DENSE_DIFFERENTIABLE,
                (inputs["dense_rows"], *inputs["experts"]), inputs["dense_d_y"]))
  cases += [(f"gate_up:{way}", routing, gate_up_alone(shape, way == "gathered"), ("fwd",), None,
             (x, inputs["routings"][routing][1], *inputs["experts"][:2]), None)
            for routing in common.ROUTINGS for way in ("rows", "gathered")]
  rows = []
  for backend, routing, fn, modes, differentiable, args, d_y in cases:
    for mode in modes:
      row = {"shape": name, "mode": mode, "backend": backend, "routing": routing}
      if fn is None:
        row["error"] = tokamax_unavailable
        print(f"{name} {mode} {backend} {routing}: {tokamax_unavailable}", flush=True)
        rows.append(row)
        continue
      try:
        compiled = jax.jit(fn if mode == "fwd" else layer.forward_backward(fn, differentiable))
        call_args = args if mode == "fwd" else (*args, d_y)
        for _ in range(warmup):
          jax.block_until_ready(compiled(*call_args))
        row.update(common.traced_device_time(lambda: compiled(*call_args), calls, top=top))  # noqa: B023
      except Exception as error:  # noqa: BLE001 (one failing case must not stop the others)
        row["error"] = common.error_message(error)
      common.print_traced(f"{name} {mode} {backend} {routing} (per call)", row)
      rows.append(row)
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, any platform")
  common.add_shapes_argument(parser)
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--calls", type=int, default=5, help="traced calls")
  parser.add_argument("--top", type=int, default=12, help="ops and kernels listed per row")
  parser.add_argument("--out-dir", default=None, help=f"default {common.RESULTS_DIR}; a temp dir with --smoke")
  args = parser.parse_args()
  out_dir = args.out_dir or (os.path.join("/tmp", "jax_kittens_benchmarks") if args.smoke else common.RESULTS_DIR)
  shapes = common.selected_shapes(parser, args)
  num_tokens = common.SMOKE_NUM_TOKENS if args.smoke else common.NUM_TOKENS
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, f"{common.results_name('layer_profile', args)}.json")
  meta = {**common.metadata(), "calls": args.calls}
  rows = []
  for name, shape in shapes.items():
    rows += profile_shape(name, shape, num_tokens, warmup=args.warmup, calls=args.calls, top=args.top)
    with open(path, "w") as f:  # after every shape, so that a run cut short keeps the shapes it finished
      json.dump({**meta, "rows": rows}, f, indent=1)
    print(f"wrote {path} ({name} done)", flush=True)


if __name__ == "__main__":
  main()
