"""Where a training step's device time goes: the train step of `models.train.Trainer` under ``jax.profiler``, its
device events summed per XLA op, per backend.

For each config (``--configs``, default ``small``) and backend (kittens, xla): ``--warmup`` untraced steps, then
``--steps`` traced ones. The trace's device events (kernels and copies on the GPU's streams; XLA's ops on the host
threads when there is no GPU) are summed per HLO op, and per kernel name, and divided by the step count, so each row says how many ms of
one step that op keeps the device busy. ``busy_ms`` adds them all up; on one stream it is at most the step's wall time,
and the difference is time the device idled (launch gaps, host work).

  python3 benchmarks/step_profile.py           # one GPU: benchmarks/results/step_profile_h200.json
  python3 benchmarks/step_profile.py --smoke   # a micro config, any platform
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import RESULTS_DIR, error_message, metadata  # noqa: E402
from benchmarks.train import BACKENDS, SMOKE, _batches  # noqa: E402
from models.configs import get_config  # noqa: E402
from models.train import Trainer  # noqa: E402


def device_events(xspace_path: str):
  """(op, kernel, duration_ns) of every device event: GPU stream events, or XLA ops on host threads without a GPU."""
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
        yield stats["hlo_op"], event.name, event.duration_ns


def profile_step(config, backend: str, *, warmup: int, steps: int, top: int) -> dict:
  trainer = Trainer(config, backend=backend, devices=jax.devices()[:1])
  state = trainer.init_state()
  batches = [trainer.place_batch(b) for b in _batches(config, 4)]
  for step in range(warmup):
    state, metrics = trainer.train_step(state, batches[step % len(batches)])
  jax.block_until_ready(metrics["loss"])
  trace_dir = tempfile.mkdtemp(prefix="jk_step_profile_")
  began = time.perf_counter()
  with jax.profiler.trace(trace_dir):
    for step in range(steps):
      state, metrics = trainer.train_step(state, batches[step % len(batches)])
    jax.block_until_ready(metrics["loss"])
  wall_ms = (time.perf_counter() - began) * 1e3 / steps
  (xspace,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
  per_op = collections.defaultdict(lambda: [0.0, 0, ""])  # op -> [ns, events, a kernel name]
  per_kernel = collections.defaultdict(float)  # kernel name (its first 80 characters) -> ns
  for op, kernel, duration_ns in device_events(xspace):
    entry = per_op[op]
    entry[0] += duration_ns
    entry[1] += 1
    entry[2] = entry[2] or kernel
    per_kernel[kernel[:80]] += duration_ns
  ops = sorted(per_op.items(), key=lambda item: -item[1][0])
  busy_ms = sum(entry[0] for _, entry in ops) / 1e6 / steps
  return {"traced_wall_ms": wall_ms, "busy_ms": busy_ms, "ops": len(ops),
          "top": [{"op": op, "ms": ns / 1e6 / steps, "share": ns / 1e6 / steps / busy_ms if busy_ms else 0.0,
                   "events_per_step": count / steps, "kernel": kernel[:120]}
                  for op, (ns, count, kernel) in ops[:top]],
          "top_kernels": [{"kernel": kernel, "ms": ns / 1e6 / steps}
                          for kernel, ns in sorted(per_kernel.items(), key=lambda item: -item[1])[:top]]}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--smoke", action="store_true", help="a micro config on any platform")
  parser.add_argument("--configs", default="small", help="comma-separated config names")
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--steps", type=int, default=5, help="traced steps")
  parser.add_argument("--top", type=int, default=25, help="ops listed per row")
  parser.add_argument("--out-dir", default=None, help=f"default {RESULTS_DIR}; a temp dir with --smoke")
  args = parser.parse_args()
  out_dir = args.out_dir or (os.path.join("/tmp", "jax_kittens_benchmarks") if args.smoke else RESULTS_DIR)
  configs = [get_config("tiny", **SMOKE)] if args.smoke else [get_config(n) for n in args.configs.split(",")]
  rows = []
  for config in configs:
    for backend in BACKENDS:
      row = {"config": "smoke" if args.smoke else config.name, "backend": backend}
      try:
        row.update(profile_step(config, backend, warmup=args.warmup, steps=args.steps, top=args.top))
      except Exception as error:  # noqa: BLE001 (one failing backend must not stop the other)
        row["error"] = error_message(error)
      rows.append(row)
      print(f"== {row['config']} {backend}: " + (row.get("error") or
            f"traced {row['traced_wall_ms']:.2f} ms/step, device busy {row['busy_ms']:.2f} ms/step, {row['ops']} ops"))
      for op in row.get("top", []):
        print(f"  {op['ms']:8.3f} ms {100 * op['share']:5.1f}%  x{op['events_per_step']:<5g} {op['op'][:60]:60s} "
              f"{op['kernel'][:60]}")
      print("  by kernel:")
      for kernel in row.get("top_kernels", []):
        print(f"  {kernel['ms']:8.3f} ms  {kernel['kernel']}")
  name = "step_profile_smoke" if args.smoke else "step_profile_h200"
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, f"{name}.json")
  with open(path, "w") as f:
    json.dump({**metadata(), "steps": args.steps, "rows": rows}, f, indent=1)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
