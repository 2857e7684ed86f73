"""Hardware counters of single grouped-GEMM launches against cuBLAS's dense GEMMs at the same shape (Nsight Compute).

`layer_profile.py` says how long each kernel takes; this says why: tensor-pipe and issue utilisation, L2 and DRAM
traffic, warp stalls. Each case of a model shape's single-GPU slice (layer.py's sizes and routings; the dense
cases take equal groups, so they run once, beside the uniform routing) is one process that launches its kernel a
few times; `ncu` profiles the last launch only (a kernel-name filter and --launch-skip), with device memory not
preallocated so that its replays save and restore little:

  swiglu_gathered   gmm_swiglu reading its rows from the tokens (cp.async)  x [T, H], row_tokens [R]
  dense_gate        cuBLAS, the dense chain's gate GEMM (half the SwiGLU GEMM's FLOPs)  [G, R/G, H] x [G, H, I]
  swiglu_rows       gmm_swiglu over rows gathered beforehand (TMA loads)    x_rows [R, H] x [G, H, 2I]
  down              gmm                                                     act [R, I] x w_down [G, I, H]
  dense_down        cuBLAS, the dense chain's down GEMM                     [G, R/G, I] x [G, I, H]
  wgrad_down        tgmm, the backward's dW_down                            act [R, I]^T x dy [R, H]
  combine           the forward's weighted sum of rows back to the tokens   rows [R, H] -> y [T, H]
                    (memory-bound: its FLOPs are the sum's multiply-adds; read its time and power)

  python3 benchmarks/gemm_counters.py --shapes kimi-k2,qwen3.5   # on the H200 (ncu on PATH): gemm_counters_h200.json
  python3 benchmarks/gemm_counters.py --shapes kimi-k2 --routings uniform,skewed --cases down,dense_down
  python3 benchmarks/gemm_counters.py --source --shapes kimi-k2 --cases down   # per-instruction: gemm_source_h200.json
  python3 benchmarks/gemm_counters.py --run down --shape smoke-a --smoke   # one case's launches, no ncu
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import common  # noqa: E402
import kloop_sass  # noqa: E402
import layer  # noqa: E402

import jax_kittens  # noqa: E402
from jax_kittens import grouped_matmul, permute  # noqa: E402

# case -> (ncu kernel-name filter, FLOPs as a function of (rows, H, I))
# (in the order profiled: the pairs that answer the open questions first, should a time limit stop the run)
CASES = {
    "swiglu_gathered": ("regex:grouped_gemm_kernel", lambda rows, h, i: 2 * rows * h * 2 * i),
    "dense_gate": ("regex:nvjet|gemm|xmma", lambda rows, h, i: 2 * rows * h * i),
    "swiglu_rows": ("regex:grouped_gemm_kernel", lambda rows, h, i: 2 * rows * h * 2 * i),
    "down": ("regex:grouped_gemm_kernel", lambda rows, h, i: 2 * rows * i * h),
    "dense_down": ("regex:nvjet|gemm|xmma", lambda rows, h, i: 2 * rows * i * h),
    "wgrad_down": ("regex:grouped_gemm_kernel", lambda rows, h, i: 2 * rows * i * h),
    "combine": ("regex:combine_kernel", lambda rows, h, i: 2 * rows * h),
    # The combine's bytes summed by XLA from contiguous rows ([T, k, H] over k): what streaming them costs.
    "dense_combine": ("regex:reduce|fusion", lambda rows, h, i: 2 * rows * h),
    # The backward's GEMMs over rows gathered beforehand, and reading them from the tokens through row_tokens.
    "dgrad_rows": ("regex:grouped_gemm_kernel", lambda rows, h, i: 2 * rows * h * i),
    "dgrad_gathered": ("regex:grouped_gemm_kernel", lambda rows, h, i: 2 * rows * h * i),
    "wgrad_gate": ("regex:grouped_gemm_kernel", lambda rows, h, i: 2 * rows * h * i),
    "wgrad_gate_gathered": ("regex:grouped_gemm_kernel", lambda rows, h, i: 2 * rows * h * i),
    "wgrad_down_gathered": ("regex:grouped_gemm_kernel", lambda rows, h, i: 2 * rows * i * h),
}


def _combine_bytes(num_tokens, top_k, hidden):
  """What a combine moves: T*k bf16 rows read and T rows written (ids and weights left out)."""
  return (num_tokens * top_k + num_tokens) * hidden * 2


# The memory-bound cases: bytes a launch as a function of (T, k, H).
MOVED_BYTES = {"combine": _combine_bytes, "dense_combine": _combine_bytes}

WARMUP_LAUNCHES = 2
SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "WarpStateStats", "SchedulerStats")
EXTRA_METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_sectors_op_read.sum",
                 "lts__t_sectors_op_write.sum")
DENSE_CASES = ("dense_gate", "dense_down", "dense_combine")


def case_call(case, shape, num_tokens, routing):
  """(jitted fn, args) of one case: each call launches exactly one kernel of the case's filter."""
  inputs = layer.shape_inputs(jax.random.key(0), shape, num_tokens)
  num_local_experts = shape.num_experts // common.GPUS_PER_NODE
  w_gate, w_up, w_down = inputs["experts"]
  x = inputs["xs"][0]
  ids = inputs["routings"][routing][1]
  sched = jax_kittens.schedule(ids, num_local_experts, align=grouped_matmul.ROW_ALIGN)
  num_rows = jax_kittens.num_schedule_rows(ids.size, num_local_experts, grouped_matmul.ROW_ALIGN)
  groups = (sched.expert_offsets, sched.tokens_per_expert)

  def random_bf16(seed, dims):
    return jax.random.normal(jax.random.key(seed), dims, jnp.float32).astype(jnp.bfloat16)

  row_tokens = permute.row_tokens(sched.rows, num_rows)
  dy = random_bf16(2, x.shape)  # the layer's output gradient, [T, H] in token order
  if case == "swiglu_rows":
    return jax.jit(grouped_matmul.gmm_swiglu), (permute.gather_rows(x, sched, num_rows), w_gate, w_up, *groups)
  if case == "swiglu_gathered":
    fn = lambda x, row_tokens, *rest: grouped_matmul.gmm_swiglu(x, *rest, row_tokens=row_tokens)  # noqa: E731
    return jax.jit(fn), (x, row_tokens, w_gate, w_up, *groups)
  if case == "down":
    return jax.jit(grouped_matmul.gmm), (random_bf16(1, (num_rows, shape.intermediate)), w_down, *groups)
  if case in ("wgrad_down", "wgrad_down_gathered"):  # the backward's dW_down = act^T dy, contracting the ragged rows
    act = random_bf16(1, (num_rows, shape.intermediate))
    if case == "wgrad_down":
      return jax.jit(grouped_matmul.tgmm), (act, permute.gather_rows(dy, sched, num_rows), *groups)
    def wgrad_down_gathered(act, dy, row_tokens, offsets, sizes):
      return grouped_matmul.tgmm(act, dy, offsets, sizes, rhs_row_tokens=row_tokens)
    return jax.jit(wgrad_down_gathered), (act, dy, row_tokens, *groups)
  if case in ("wgrad_gate", "wgrad_gate_gathered"):  # dW_gate = x^T d_gate
    d_gate = random_bf16(1, (num_rows, shape.intermediate))
    if case == "wgrad_gate":
      return jax.jit(grouped_matmul.tgmm), (permute.gather_rows(x, sched, num_rows), d_gate, *groups)
    def wgrad_gate_gathered(x, d_gate, row_tokens, offsets, sizes):
      return grouped_matmul.tgmm(x, d_gate, offsets, sizes, lhs_row_tokens=row_tokens)
    return jax.jit(wgrad_gate_gathered), (x, d_gate, row_tokens, *groups)
  if case in ("dgrad_rows", "dgrad_gathered"):  # dy @ w_down^T with the SwiGLU backward in the epilogue, as the layer
    gate, up = random_bf16(3, (num_rows, shape.intermediate)), random_bf16(4, (num_rows, shape.intermediate))
    row_weights = jax.random.uniform(jax.random.key(5), (num_rows,), jnp.float32)
    def dgrad(dy, row_tokens, *operands):
      return grouped_matmul.gmm_swiglu_dgrad(dy, *operands, row_tokens=row_tokens, save_weighted_act=True)
    if case == "dgrad_rows":
      return jax.jit(dgrad), (permute.gather_rows(dy, sched, num_rows), None, w_down, gate, up, row_weights, *groups)
    return jax.jit(dgrad), (dy, row_tokens, w_down, gate, up, row_weights, *groups)
  if case == "combine":
    weights = inputs["routings"][routing][0].astype(jnp.float32)
    return jax.jit(permute.combine), (random_bf16(1, (num_rows, shape.hidden)), sched.rows, weights)
  if case == "dense_combine":
    values = random_bf16(1, (*ids.shape, shape.hidden))
    return jax.jit(lambda v: jnp.sum(v.astype(jnp.float32), axis=1).astype(v.dtype)), (values,)
  dense = jax.jit(lambda a, b: jnp.einsum("gmk,gkn->gmn", a, b))
  if case == "dense_gate":
    return dense, (inputs["dense_rows"], w_gate)
  if case == "dense_down":
    return dense, (random_bf16(1, inputs["dense_rows"].shape[:2] + (shape.intermediate,)), w_down)
  raise ValueError(f"unknown case {case!r}; choose from {sorted(CASES)}")


def run_case(case, shape, num_tokens, routing):
  fn, args = case_call(case, shape, num_tokens, routing)
  for _ in range(WARMUP_LAUNCHES + 1):
    jax.block_until_ready(fn(*args))


def parse_ncu_csv(text: str) -> dict[str, dict]:
  """ncu ``--csv --page details --print-units base`` output -> {"Section / Metric": {"value", "unit"}}."""
  lines = text.splitlines()
  header = next((n for n, line in enumerate(lines) if line.startswith('"ID"')), None)
  if header is None:
    raise RuntimeError("no ncu CSV table in the output (no kernel matched the filter?)")
  metrics = {}
  for record in csv.DictReader(io.StringIO("\n".join(lines[header:]))):
    if record.get("Metric Name") is None:
      continue
    raw = record["Metric Value"]
    try:
      value = float(raw.replace(",", ""))
    except ValueError:
      value = raw
    name = f"{record['Section Name']} / {record['Metric Name']}" if record.get("Section Name") else record["Metric Name"]
    metrics[name] = {"value": value, "unit": record.get("Metric Unit", "")}
  return metrics


def run_ncu(case, shape_name, routing, ncu, collect, timeout_s):
  """ncu's stdout for the profiled launch of one case; collect: the ncu arguments saying what to record and print.

  A run past timeout_s raises, so that one case that does not finish (seen once at 0f47bf1: swiglu_rows under ncu,
  while the same launches finish in seconds without it) costs the others nothing but its timeout.
  """
  kernel_filter, _ = CASES[case]
  command = [ncu, "--clock-control", "none", "--kernel-name", kernel_filter, "--launch-skip", str(WARMUP_LAUNCHES),
             "--launch-count", "1", *collect, sys.executable, os.path.abspath(__file__), "--run", case, "--shape",
             shape_name, "--routing", routing]
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  try:
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout_s)
  except subprocess.TimeoutExpired as error:
    output = error.stderr or error.stdout or b""
    output = output.decode(errors="replace") if isinstance(output, bytes) else output
    raise RuntimeError(f"ncu did not finish in {timeout_s} s; its last output: {output.strip()[-300:]!r}") from None
  if result.returncode != 0:
    raise RuntimeError(f"ncu exit {result.returncode}: {(result.stderr or result.stdout).strip()[-500:]}")
  return result.stdout


def profile_case(case, shape_name, routing, shape, num_tokens, ncu, timeout_s):
  _, flops_of = CASES[case]
  collect = ["--csv", "--page", "details", "--print-units", "base",
             *(arg for section in SECTIONS for arg in ("--section", section)), "--metrics", ",".join(EXTRA_METRICS)]
  metrics = parse_ncu_csv(run_ncu(case, shape_name, routing, ncu, collect, timeout_s))
  rows = num_tokens * shape.top_k
  flops = flops_of(rows, shape.hidden, shape.intermediate)
  duration_ns = next((m["value"] for name, m in metrics.items() if name.endswith("/ Duration")), None)
  row = {"shape": shape_name, "routing": routing, "case": case, "flops": flops, "metrics": metrics}
  if isinstance(duration_ns, float) and duration_ns > 0:
    row["duration_ms"] = duration_ns * 1e-6
    row["tflops"] = flops / duration_ns * 1e-3
  return row


SOURCE_TOP = 40  # instructions kept per case, by stall samples


def number(text: str) -> float:
  try:
    return float(text.replace(",", ""))
  except ValueError:
    return 0.0


def profile_source(case, shape_name, routing, ncu, raw_dir, timeout_s):
  """Per-SASS-instruction counters of one launch (ncu's source page): where the warps wait and what they issue.

  Keeps the SOURCE_TOP instructions with the most warp-stall samples, and the totals; the whole table goes to
  raw_dir (the GPU logs), not to the results.
  """
  collect = ["--section", "SourceCounters", "--section", "WarpStateStats", "--import-source", "no", "--csv", "--page",
             "source", "--print-source", "sass"]
  stdout = run_ncu(case, shape_name, routing, ncu, collect, timeout_s)
  os.makedirs(raw_dir, exist_ok=True)
  with open(os.path.join(raw_dir, f"source_{shape_name}_{routing}_{case}.csv"), "w") as f:
    f.write(stdout)
  lines = stdout.splitlines()
  header = next((n for n, line in enumerate(lines) if line.startswith('"') and "Source" in line), None)
  if header is None:
    raise RuntimeError("no source table in ncu's output")
  table = list(csv.DictReader(io.StringIO("\n".join(lines[header:]))))
  columns = list(table[0]) if table else []
  def column(*words):
    return next((c for c in columns if all(w.lower() in c.lower() for w in words)), None)
  samples, not_issued = column("Warp Stall Sampling", "All"), column("Warp Stall Sampling", "Not")
  executed = column("Instructions Executed")
  source, address = column("Source"), column("Address")
  rows = [{"address": r.get(address), "sass": (r.get(source) or "").strip(),
           "samples": number(r.get(samples, "0")) if samples else 0.0,
           "not_issued": number(r.get(not_issued, "0")) if not_issued else 0.0,
           "executed": number(r.get(executed, "0")) if executed else 0.0} for r in table]
  top = sorted(rows, key=lambda r: -r["samples"])[:SOURCE_TOP]
  return {"shape": shape_name, "routing": routing, "case": case, "columns": columns,
          "total_samples": sum(r["samples"] for r in rows), "total_executed": sum(r["executed"] for r in rows),
          "instructions": len(rows), "regions": source_regions(rows), "top": top}


def source_regions(rows) -> dict[str, float | bool] | None:
  """Shares of one of our grouped GEMM kernels' warp-stall samples by where the warps were, found at SASS landmarks
  (None for other kernels, cuBLAS's among them). rows: the source table in address order, {"address", "sass",
  "samples"}.

  - idle: warps parked at the kernel's closing cluster barrier (UCGABAR_WAIT): the producer warpgroup's spare warps,
    which issue nothing;
  - main_loop: the consumers' k loop, from the target of the first branch back across the last HGMMA through the
    wait for the last wgmma (DEPBAR.LE gsb0, 0x0);
  - tile_head: consumer code before it (the tile ring, and since 58b4d7d the k steps unrolled ahead of the loop
    that store the previous tile's held chunks: `head_k_steps` says whether it has HGMMAs); epilogue: consumer code
    after it;
  - producer: from the TMA descriptor prefetch (UTMACCTL.PF) on, where ptxas puts the producer's code.
  The shares are of the busy warps' samples (all but idle): how much of a consumer's time goes between tiles.
  """
  sass = [r["sass"] for r in rows]
  samples = [r["samples"] for r in rows]
  hgmma = [i for i, text in enumerate(sass) if "HGMMA" in text]
  producer = next((i for i, text in enumerate(sass) if "UTMACCTL.PF" in text), None)
  if not hgmma or producer is None or producer < hgmma[-1]:
    return None
  addresses = [int(r["address"], 16) if r.get("address") else -1 for r in rows]  # -1: where no branch goes
  loop = kloop_sass.consumer_k_loop(sass, addresses, stop=producer)
  begin = end = None
  if loop is not None:
    begin = loop[0]
    end = next((j + 1 for j in range(loop[1], producer) if "DEPBAR.LE gsb0, 0x0" in sass[j]), None)
  idle = {i for i, text in enumerate(sass) if "UCGABAR_WAIT" in text}
  total = sum(samples)
  busy = total - sum(samples[i] for i in idle)
  if begin is None or end is None or busy <= 0:
    return None

  def share(lo, hi):
    return sum(samples[i] for i in range(lo, hi) if i not in idle) / busy

  return {"idle_of_all": 1 - busy / total, "tile_head": share(0, begin), "main_loop": share(begin, end),
          "epilogue": share(end, producer), "producer": share(producer, len(rows)), "head_k_steps": hgmma[0] < begin}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--smoke", action="store_true", help="tiny shapes (with --run: any platform)")
  parser.add_argument("--shapes", default=None, help="comma-separated model shapes (default: all)")
  parser.add_argument("--cases", default=",".join(CASES), help="comma-separated cases (default: all)")
  parser.add_argument("--routings", default="uniform", help=f"comma-separated, of {common.ROUTINGS}")
  parser.add_argument("--source", action="store_true",
                      help="per-instruction counters instead (gemm_source_h200.json; raw tables to --raw-dir)")
  parser.add_argument("--raw-dir", default="/tmp/jk-logs")
  parser.add_argument("--run", default=None, help="internal: launch one case's kernels (what ncu profiles)")
  parser.add_argument("--shape", default=None, help="with --run: the model shape")
  parser.add_argument("--routing", default="uniform", help="with --run: the routing")
  parser.add_argument("--ncu", default="ncu")
  parser.add_argument("--case-timeout-s", type=float, default=180.0,
                      help="per profiled case; a case past it is recorded as an error and the next one runs")
  parser.add_argument("--out-dir", default=common.RESULTS_DIR)
  args = parser.parse_args()
  shapes = common.SMOKE_SHAPES if args.smoke else common.MODEL_SHAPES
  num_tokens = common.SMOKE_NUM_TOKENS if args.smoke else common.NUM_TOKENS
  if args.run is not None:
    run_case(args.run, shapes[args.shape], num_tokens, args.routing)
    return
  names = list(shapes) if args.shapes is None else args.shapes.split(",")
  runs = [(name, routing, case) for name in names for routing in args.routings.split(",")
          for case in args.cases.split(",") if routing == "uniform" or case not in DENSE_CASES]
  os.makedirs(args.out_dir, exist_ok=True)
  if args.source:
    profile = lambda case, name, routing: profile_source(case, name, routing, args.ncu, args.raw_dir,  # noqa: E731
                                                         args.case_timeout_s)
    profile_all(runs, profile, report_source, os.path.join(args.out_dir, f"gemm_source_{common.gpu_tag()}.json"))
  else:
    profile = lambda case, name, routing: profile_case(case, name, routing, shapes[name], num_tokens,  # noqa: E731
                                                       args.ncu, args.case_timeout_s)
    profile_all(runs, profile, report_counters, os.path.join(args.out_dir, f"gemm_counters_{common.gpu_tag()}.json"))


def profile_all(runs, profile, report, path) -> None:
  """profile(case, shape name, routing) -> row for every (shape name, routing, case) of runs; a failing case is
  recorded and the next one runs."""
  rows = []
  for name, routing, case in runs:
    try:
      row = profile(case, name, routing)
    except Exception as error:  # noqa: BLE001 (one failing case must not stop the others)
      row = {"shape": name, "routing": routing, "case": case, "error": common.error_message(error)}
    print(f"{name:12s} {routing:8s} {case:16s} " + (row["error"] if "error" in row else report(row)), flush=True)
    rows.append(row)
    # After every case: a caller's time limit may stop the run before the last.
    with open(path, "w") as f:
      json.dump({**common.metadata(), "rows": rows}, f, indent=1)
  print(f"wrote {path}")


def report_counters(row) -> str:
  head = f"{row['duration_ms']:.3f} ms {row['tflops']:.0f} TFLOP/s" if "tflops" in row else "no duration"
  return "\n".join([head, *(f"    {metric}: {value}" for metric, value in summary(row["metrics"]))])


def report_source(row) -> str:
  head = (f"{row['instructions']} instructions, {row['total_samples']:.0f} samples, "
          f"{row['total_executed']:.3g} warp instructions executed")
  if row.get("regions"):
    head += "\n    shares: " + ", ".join(f"{name} {value:.3f}" for name, value in row["regions"].items())
  return "\n".join([head, *(f"    {r['samples']:8.0f} {r['not_issued']:8.0f} {r['executed']:10.0f}  {r['address']}  "
                             f"{r['sass']}" for r in row["top"][:15])])


SUMMARY_KEYS = ("Duration", "SM Frequency", "Compute (SM) Throughput", "Memory Throughput", "L2 Hit Rate",
                "DRAM Throughput", "Executed Ipc Active", "Issue Slots Busy", "dram__bytes_read.sum",
                "dram__bytes_write.sum", "lts__t_sectors", "Stall")


def summary(metrics):
  """(name, value with unit) of the metrics worth reading in a log, in ncu's order."""
  return [(name, f"{m['value']} {m['unit']}".strip()) for name, m in metrics.items()
          if any(key in name for key in SUMMARY_KEYS)]


if __name__ == "__main__":
  main()
