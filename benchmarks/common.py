"""Shared benchmark machinery: device-synchronised timing, compiled memory, run metadata, JSON + PNG results, tables.

Every measurement goes through `measure` or `measure_interleaved`, which turn a failure into ``{"error": ...}`` for
its row instead of a number. The backends compared in one table are timed in alternation (`time_interleaved`): one
timed call of each in turn, so that they all run at the same clocks and temperature (timed one after another,
single cases moved by up to 20% against each other between two runs of the same code).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import glob
import importlib.metadata
import json
import os
import random
import re
import statistics
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

import jax_kittens

class ModelShape(NamedTuple):
  num_experts: int  # E, all experts of the model
  hidden: int  # H
  intermediate: int  # I
  top_k: int


# design.md section 3 (MoK's shapes); --smoke swaps in tiny ones with the same structure.
MODEL_SHAPES = {
    "kimi-k2": ModelShape(384, 7168, 2048, 8),
    "glm-5": ModelShape(256, 6144, 2048, 8),
    "qwen3.5": ModelShape(512, 4096, 1024, 10),
    "deepseek-v4": ModelShape(384, 7168, 3072, 6),
}
SMOKE_SHAPES = {"smoke-a": ModelShape(16, 128, 64, 2), "smoke-b": ModelShape(24, 192, 128, 3)}
GPUS_PER_NODE = 8  # the single-GPU slice hosts E / 8 experts
# The smoke runs' T * k is a multiple of 64 at both smoke shapes (k = 2, 3): tokamax's GPU kernel takes no other row
# counts (200 tokens, 400 rows, failed there). Their groups stay ragged.
NUM_TOKENS, SMOKE_NUM_TOKENS = 8192, 192
ROUTINGS = ("uniform", "skewed")

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
BACKEND_COLORS = {"kittens": "tab:red", "xla": "tab:blue", "tokamax": "tab:green", "dense": "tab:gray"}


def parse_args(description: str) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--smoke", action="store_true", help="tiny shapes and few runs: checks the script, e.g. on CPU")
  parser.add_argument("--iters", type=int, default=20, help="timed runs per measurement (the median is reported)")
  parser.add_argument("--budget-s", type=float, default=1.0,
                      help="timed seconds per measurement: slow baselines get fewer runs (at least --min-iters)")
  # design.md section 3: the median of >= 20 runs, baselines included (the default budget alone gave the xla
  # reference 5 and tokamax's forward+backward 10-13).
  parser.add_argument("--min-iters", type=int, default=20)
  parser.add_argument("--out-dir", default=None, help=f"where results go (default {RESULTS_DIR}; a temp dir with "
                      "--smoke)")
  parser.add_argument("--only", default=None, help="comma-separated backends to run (default: all)")
  add_shapes_argument(parser)
  args = parser.parse_args()
  if args.smoke:
    args.iters, args.min_iters = min(args.iters, 3), 1
    args.out_dir = args.out_dir or os.path.join("/tmp", "jax_kittens_benchmarks")
  args.out_dir = args.out_dir or RESULTS_DIR
  args.only = None if args.only is None else set(args.only.split(","))
  args.model_shapes = selected_shapes(parser, args)
  return args


def add_shapes_argument(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--shapes", default=None, help="comma-separated model shapes to run (default: all); the "
                      "results then go to a file of their own")


def selected_shapes(parser: argparse.ArgumentParser, args) -> dict[str, ModelShape]:
  """The model shapes to run: all (the smoke ones with --smoke), or those named by --shapes."""
  every = SMOKE_SHAPES if args.smoke else MODEL_SHAPES
  if args.shapes is None:
    return every
  names = args.shapes.split(",")
  if set(names) - set(every):
    parser.error(f"--shapes: unknown {sorted(set(names) - set(every))}; choose from {sorted(every)}")
  return {name: every[name] for name in names}


def gpu_tag() -> str:
  """The GPU's model for results' file names ("h200", "h100"; "cpu" without nvidia-smi), so that a run on another
  card never replaces the H200's files. From nvidia-smi: asking JAX would have this process take the GPU's memory,
  which the profiled children of gemm_counters.py need."""
  try:
    name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                          check=True).stdout.splitlines()[0]
  except (OSError, subprocess.CalledProcessError, IndexError):
    return "cpu"
  model = re.search(r"\b[A-Z]+[0-9]+\b", name)  # "NVIDIA H100 80GB HBM3" -> H100
  return model.group(0).lower() if model else re.sub(r"\W+", "_", name).strip("_").lower()


def results_name(table: str, args, backends: Sequence[str] = ()) -> str:
  """layer_h200, ragged_dot_smoke, ...; a run of some backends or shapes gets its own file (layer_h200_kittens_dense,
  layer_h200_deepseek-v4): it must not replace the full run's."""
  only, subset = getattr(args, "only", None), getattr(args, "shapes", None)
  return (f"{table}_{'smoke' if args.smoke else gpu_tag()}" + ("" if only is None else "_" + "_".join(backends)) +
          ("" if subset is None else "_" + subset.replace(",", "_")))


def num_tokens(args) -> int:
  return SMOKE_NUM_TOKENS if args.smoke else NUM_TOKENS


def routed(key, num_tokens: int, num_experts: int, top_k: int, routing: str) -> tuple[jax.Array, jax.Array]:
  """Router (weights [T, k] f32, ids [T, k] int32): softmax top-k of random normal logits over ``num_experts``.

  "skewed" adds a Zipf-like bias -2 log(1 + e): expert 0 takes several times its share, the last ones little.
  """
  logits = jax.random.normal(key, (num_tokens, num_experts), jnp.float32)
  if routing == "skewed":
    logits = logits - 2.0 * jnp.log1p(jnp.arange(num_experts, dtype=jnp.float32))
  elif routing != "uniform":
    raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
  return jax_kittens.route(logits, top_k, backend="xla")


def _git(*command):
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return subprocess.run(["git", "-C", root, *command], capture_output=True, text=True, check=True).stdout.strip()


def commit() -> str:
  """HEAD's hash, with "-dirty" when tracked files differ from it; "uncommitted" outside a git checkout.

  The device machine gets a copy of the working tree without .git: there JK_COMMIT (set by the caller) names it.
  """
  if os.environ.get("JK_COMMIT"):
    return os.environ["JK_COMMIT"]
  try:
    head = _git("rev-parse", "HEAD")
  except (OSError, subprocess.CalledProcessError):
    return "uncommitted"
  try:
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
  except (OSError, subprocess.CalledProcessError):
    dirty = True
  return head + ("-dirty" if dirty else "")


def _installed_version(package: str) -> str | None:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return None


def metadata() -> dict:
  device = jax.devices()[0]
  return {"commit": commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "gpu": device.device_kind if device.platform == "gpu" else f"none ({device.platform})",
          "jax": jax.__version__, "tokamax": _installed_version("tokamax")}


def compile_fn(fn: Callable, *args) -> jax.stages.Compiled:
  """Compiles ``jax.jit(fn)`` for ``args`` once: the executable is both timed and asked for its memory."""
  return jax.jit(fn).lower(*args).compile()


def peak_memory(compiled: jax.stages.Compiled) -> dict:
  """Device bytes of one executable from XLA's memory analysis: arguments, outputs, temporaries and their peak."""
  analysis = compiled.memory_analysis()
  if analysis is None:
    return {"error": "memory_analysis() returned None on this platform"}
  sizes = {name: int(getattr(analysis, f"{name}_size_in_bytes", 0))
           for name in ("argument", "output", "temp", "alias", "generated_code")}
  # Everything live at once, aliased (donated) outputs counted once; XLA's own peak figure where it gives one.
  sizes["total"] = sizes["argument"] + sizes["output"] + sizes["temp"] - sizes["alias"]
  peak = getattr(analysis, "peak_memory_in_bytes", None)
  if peak is not None:
    sizes["peak"] = int(peak)
  return sizes


def round_order(functions: Sequence[int], round_index: int) -> list[int]:
  """The order of one round of alternating calls: a permutation of ``functions``, fixed by ``round_index``.

  Not the same order every round: a call's time depends on what ran before it. Under the power cap a call right
  after a slow, low-power one (tokamax's, or the xla reference's) starts at higher clocks. In a fixed order the
  dense chain always came right after tokamax: at deepseek-v4 the kittens fwd+bwd then took 23% (uniform) and 38%
  (skewed) more than the dense chain's, against 10% and 17% when those three alternated alone (H100, 2be85b1;
  benchmarks/NOTES.md, the thirty-first session). Shuffled per round, every function meets every predecessor alike.
  """
  order = list(functions)
  random.Random(round_index).shuffle(order)
  return order


def time_interleaved(calls: Sequence[Callable[[int], object]], *, iters: int, min_iters: int,
                     budget_s: float) -> list[dict | Exception]:
  """Median, min and every run's wall time of several functions, timed in alternation; each synchronised on its
  outputs per run.

  ``calls[j](i)`` makes function j's call i (cycling through its own inputs). One warm-up call of each, then rounds
  of one timed call of each, in the order `round_order` gives: function j stops after ``iters`` timed calls, or
  fewer (not below ``min_iters``) when they would take more than ``budget_s`` (its first timed call sets its count),
  so slow functions drop out early and the fast ones keep alternating. A function that raises is dropped; its
  exception takes its place in the result.
  """
  results: list[dict | Exception | None] = [None] * len(calls)
  times: list[list[float]] = [[] for _ in calls]
  runs = [0] * len(calls)
  live = []
  for j, call in enumerate(calls):
    try:
      jax.block_until_ready(call(0))
      live.append(j)
    except Exception as error:  # noqa: BLE001 (recorded for this function; the others go on)
      results[j] = error
  call_index = 1
  while live:
    for j in round_order(live, call_index):
      start = time.perf_counter()
      try:
        jax.block_until_ready(calls[j](call_index))
      except Exception as error:  # noqa: BLE001
        results[j] = error
        live.remove(j)
        continue
      times[j].append(time.perf_counter() - start)
      if len(times[j]) == 1:
        runs[j] = max(min_iters, min(iters, int(budget_s / max(times[j][0], 1e-9))))
      if len(times[j]) >= runs[j]:
        live.remove(j)
    call_index += 1
  for j, measured in enumerate(times):
    if results[j] is None:
      # The runs in order too: a spread between median and min (the kittens fwd+bwd's reached 16%) reads
      # differently as a drift, a warm-up or two modes.
      results[j] = {"median_ms": 1e3 * statistics.median(measured), "min_ms": 1e3 * min(measured),
                    "iters": len(measured), "times_ms": [round(1e3 * t, 3) for t in measured]}
  return results


def time_compiled(compiled: Callable, arg_sets: Sequence[tuple], *, iters: int, min_iters: int,
                  budget_s: float) -> dict:
  """`time_interleaved` of one function: ``compiled(*args)`` cycling through ``arg_sets``."""
  (result,) = time_interleaved([lambda i: compiled(*arg_sets[i % len(arg_sets)])], iters=iters, min_iters=min_iters,
                               budget_s=budget_s)
  if isinstance(result, Exception):
    raise result
  return result


class RecordedError(Exception):
  """A failure recorded earlier (e.g. at compile time), re-raised for each row it affects."""


def error_message(error: BaseException) -> str:
  message = str(error) if isinstance(error, RecordedError) else f"{type(error).__name__}: {error}"
  return message.strip().splitlines()[0][:500] if message.strip() else traceback.format_exc(limit=1)


def measure(row: dict, run: Callable[[], dict]) -> dict:
  """``row`` updated with what ``run()`` returns, or with ``{"error": ...}`` when it raises."""
  try:
    row.update(run())
  except Exception as error:  # noqa: BLE001  (one failing backend must not stop the others)
    row["error"] = error_message(error)
  print(format_row(row), flush=True)
  return row


class DeviceEvent(NamedTuple):
  op: str  # the XLA op (hlo_op)
  kernel: str
  module: str  # the XLA module (hlo_module): which jitted function
  start_ns: float
  duration_ns: float


def device_events(xspace_path: str):
  """Every device event (`DeviceEvent`): GPU stream events, or XLA ops on host threads without a GPU."""
  profile = jax.profiler.ProfileData.from_file(xspace_path)
  gpu_planes = [plane for plane in profile.planes if plane.name.startswith("/device:GPU")]
  for plane in gpu_planes or [plane for plane in profile.planes if plane.name == "/host:CPU"]:
    for line in plane.lines:
      if gpu_planes and not line.name.startswith("Stream"):
        continue  # derived lines ("XLA Ops", "XLA Modules") repeat the stream events
      for event in line.events:
        stats = dict(event.stats)
        if "hlo_op" not in stats:
          continue  # not an XLA op's work (profiler bookkeeping, Python frames)
        yield DeviceEvent(stats["hlo_op"], event.name, str(stats.get("hlo_module", "")), event.start_ns,
                          event.duration_ns)


def trace(run: Callable[[], object]) -> list[DeviceEvent]:
  """The device events of ``run()`` (which blocks on its own outputs) under ``jax.profiler``, by start time."""
  trace_dir = tempfile.mkdtemp(prefix="jk_trace_")
  with jax.profiler.trace(trace_dir):
    run()
  (xspace,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
  return sorted(device_events(xspace), key=lambda event: event.start_ns)


def traced_device_time(run: Callable[[], object], calls: int, *, top: int) -> dict:
  """``run()`` ``calls`` times under ``jax.profiler``: device time per call, summed per XLA op and per kernel name.

  ``run`` returns what to block on. ``busy_ms`` adds every device event up; on one stream it is at most the wall time
  per call, and the difference is time the device idled (launch gaps, host work).
  """
  def run_all():
    for _ in range(calls):
      out = run()  # only the last call's outputs are held: each may be gigabytes
    jax.block_until_ready(out)

  began = time.perf_counter()
  events = trace(run_all)
  wall_ms = (time.perf_counter() - began) * 1e3 / calls
  per_op = collections.defaultdict(lambda: [0.0, 0, ""])  # op -> [ns, events, a kernel name]
  per_kernel = collections.defaultdict(lambda: [0.0, 0])  # kernel name (its first 80 characters) -> [ns, events]
  for event in events:
    entry = per_op[event.op]
    entry[0] += event.duration_ns
    entry[1] += 1
    entry[2] = entry[2] or event.kernel
    per_kernel[event.kernel[:80]][0] += event.duration_ns
    per_kernel[event.kernel[:80]][1] += 1
  ops = sorted(per_op.items(), key=lambda item: -item[1][0])
  busy_ms = sum(entry[0] for _, entry in ops) / 1e6 / calls
  return {"traced_wall_ms": wall_ms, "busy_ms": busy_ms, "ops": len(ops),
          "top": [{"op": op, "ms": ns / 1e6 / calls, "share": ns / 1e6 / calls / busy_ms if busy_ms else 0.0,
                   "events_per_call": count / calls, "kernel": kernel[:120]}
                  for op, (ns, count, kernel) in ops[:top]],
          "top_kernels": [{"kernel": kernel, "ms": ns / 1e6 / calls, "events_per_call": count / calls}
                          for kernel, (ns, count) in sorted(per_kernel.items(), key=lambda item: -item[1][0])[:top]]}


def print_traced(title: str, row: dict):
  """A traced row (`traced_device_time`'s fields, or its ``error``) as text: the ops, then the kernels."""
  print(f"== {title}: " + (row.get("error") or f"traced {row['traced_wall_ms']:.2f} ms/call, device busy "
                                                f"{row['busy_ms']:.2f} ms/call, {row['ops']} ops"), flush=True)
  for op in row.get("top", []):
    print(f"  {op['ms']:8.3f} ms {100 * op['share']:5.1f}%  x{op['events_per_call']:<5g} {op['op'][:60]:60s} "
          f"{op['kernel'][:60]}")
  if row.get("top_kernels"):
    print("  by kernel:")
  for kernel in row.get("top_kernels", []):
    print(f"  {kernel['ms']:8.3f} ms  x{kernel['events_per_call']:<5g} {kernel['kernel']}")


def tflops(flops: float, median_ms: float) -> float:
  return flops / (median_ms * 1e-3) / 1e12


def tokamax_ragged_dot():
  """(tokamax.ragged_dot, None), or (None, why it cannot be used)."""
  try:
    import tokamax  # noqa: PLC0415

    return tokamax.ragged_dot, None
  except Exception as error:  # noqa: BLE001  (any import failure is recorded, not fatal)
    return None, f"tokamax unavailable: {type(error).__name__}: {error}"


class Executable:
  """One compiled function, or why there is none (``unavailable``, or the compile error); rows that use it time it
  or report that error."""

  def __init__(self, fn, args, unavailable: str | None = None):
    self.compiled, self.error = None, unavailable
    if unavailable is None:
      try:
        self.compiled = compile_fn(fn, *args)
      except Exception as error:  # noqa: BLE001  (recorded in every row that needs it)
        self.error = error_message(error)

  def _ready(self):
    if self.error:
      raise RecordedError(self.error)
    return self.compiled

  def call(self, arg_sets):
    """i -> the compiled function's call on arg_sets[i % len(arg_sets)] (raises the recorded error if none)."""
    compiled = self._ready()
    return lambda i: compiled(*arg_sets[i % len(arg_sets)])

  def memory(self):
    return {f"{name}_bytes": size for name, size in peak_memory(self._ready()).items()}


class Timing(NamedTuple):
  """One row to time: ``executable`` called on ``arg_sets`` in turn, ``flops`` per call."""
  row: dict
  executable: Executable
  arg_sets: Sequence[tuple]
  flops: float


def measure_interleaved(timings: Sequence[Timing], args) -> list[dict]:
  """The rows of ``timings`` with median_ms, min_ms, iters, times_ms and tflops, their executables timed in alternation
  (`time_interleaved`), or with ``{"error": ...}`` (no executable, or its calls raised); each printed."""
  rows = [dict(t.row) for t in timings]
  calls, timed = [], []
  for n, t in enumerate(timings):
    try:
      calls.append(t.executable.call(t.arg_sets))
      timed.append(n)
    except Exception as error:  # noqa: BLE001  (recorded in its row)
      rows[n]["error"] = error_message(error)
  results = time_interleaved(calls, iters=args.iters, min_iters=args.min_iters, budget_s=args.budget_s)
  for n, result in zip(timed, results):
    if isinstance(result, Exception):
      rows[n]["error"] = error_message(result)
    else:
      rows[n].update(result, tflops=tflops(timings[n].flops, result["median_ms"]))
  for row in rows:
    print(format_row(row), flush=True)
  return rows


def dense_beside_every_routing(rows: list[dict]) -> list[dict]:
  """For plots: each "dense" row (equal groups, routing "equal") repeated once per routing."""
  return [{**r, "routing": routing} if r["backend"] == "dense" else r
          for r in rows for routing in (ROUTINGS if r["backend"] == "dense" else (None,))]


def add_ratio(rows: list[dict], baseline: str, key_fields: Sequence[str]):
  """Adds ``vs_<baseline>`` = tflops / tflops of the ``baseline`` row with the same ``key_fields``.

  A dense row (routing "equal") is compared with the baseline's uniform row: what the cuBLAS ceiling itself reaches
  against that baseline, in the same run.
  """
  key = lambda row: tuple("uniform" if f == "routing" and row.get(f) == "equal" else row.get(f) for f in key_fields)
  base = {key(r): r["tflops"] for r in rows if r["backend"] == baseline and "tflops" in r}
  for row in rows:
    if row["backend"] != baseline and "tflops" in row and key(row) in base:
      row[f"vs_{baseline}"] = round(row["tflops"] / base[key(row)], 3)


def format_row(row: dict) -> str:
  return "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                   if not isinstance(v, list))  # times_ms goes to the results file only


def print_table(rows: list[dict], columns: Sequence[str]):
  """A compact text table of ``columns`` (missing entries blank; errors shortened)."""
  def cell(row, column):
    value = row.get(column, "")
    if column == "error" and value:
      return value[:60]
    return f"{value:.3g}" if isinstance(value, float) else str(value)

  cells = [[cell(row, c) for c in columns] for row in rows]
  widths = [max([len(c)] + [len(line[i]) for line in cells]) for i, c in enumerate(columns)]
  print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
  for line in cells:
    print("  ".join(v.ljust(w) for v, w in zip(line, widths)))


def write_results(name: str, out_dir: str, meta: dict, rows: list[dict], group_fields: Sequence[str],
                  extra: dict | None = None, plot_rows: list[dict] | None = None) -> str:
  """Writes ``<out_dir>/<name>.json`` ({commit, date, gpu, jax, rows, **extra}) and a TFLOP/s bar plot beside it.

  The plot has one group of bars per distinct ``group_fields`` value, one bar per backend, from ``plot_rows``
  (default ``rows``); failed rows show an "x".
  """
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, f"{name}.json")
  with open(path, "w") as f:
    json.dump({**meta, "rows": rows, **(extra or {})}, f, indent=1)
  _plot(os.path.join(out_dir, f"{name}.png"), meta, rows if plot_rows is None else plot_rows, group_fields)
  print(f"wrote {path} and {name}.png")
  return path


def _plot(path, meta, rows, group_fields):
  import matplotlib  # noqa: PLC0415  (only the writer needs it)

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  groups = list(dict.fromkeys(tuple(r.get(f) for f in group_fields) for r in rows))
  backends = list(dict.fromkeys(r["backend"] for r in rows))
  values = {(tuple(r.get(f) for f in group_fields), r["backend"]): r.get("tflops") for r in rows}
  width = 0.8 / max(1, len(backends))
  fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(groups) + 2), 4.5))
  for i, backend in enumerate(backends):
    xs = [g + (i - (len(backends) - 1) / 2) * width for g in range(len(groups))]
    heights = [values.get((group, backend)) or 0.0 for group in groups]
    ax.bar(xs, heights, width, label=backend, color=BACKEND_COLORS.get(backend))
    for x, group in zip(xs, groups):
      if values.get((group, backend)) is None and (group, backend) in values:
        ax.text(x, 0, "x", ha="center", va="bottom", color="black", fontsize=7)  # failed: see the JSON's "error"
  ax.set_xticks(range(len(groups)))
  ax.set_xticklabels(["\n".join(str(v) for v in g) for g in groups], fontsize=7)
  ax.set_ylabel("TFLOP/s")
  ax.set_title(f"{os.path.basename(path)[:-4]} — {meta['gpu']}, jax {meta['jax']}, {meta['commit'][:12]}", fontsize=9)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
