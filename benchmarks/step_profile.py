"""Where a training step's device time goes: the train step of `models.train.Trainer` under ``jax.profiler``, its
device events summed per XLA op and per kernel, per backend (`common.traced_device_time`).

For each config (``--configs``, default ``small``) and backend (kittens, xla): ``--warmup`` untraced steps, then
``--steps`` traced ones; each row says how many ms of one step an op or kernel keeps the device busy.

  python3 benchmarks/step_profile.py           # one GPU: benchmarks/results/step_profile_h200.json
  python3 benchmarks/step_profile.py --smoke   # a micro config, any platform
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from benchmarks.common import (RESULTS_DIR, error_message, metadata, print_traced, results_name,  # noqa: E402
                               traced_device_time)
from benchmarks.train import BACKENDS, SMOKE, _batches  # noqa: E402
from models.configs import get_config  # noqa: E402
from models.train import Trainer  # noqa: E402


def profile_step(config, backend: str, *, warmup: int, steps: int, top: int) -> dict:
  trainer = Trainer(config, backend=backend, devices=jax.devices()[:1])
  state = trainer.init_state()
  batches = [trainer.place_batch(b) for b in _batches(config, 4)]
  for step in range(warmup):
    state, metrics = trainer.train_step(state, batches[step % len(batches)])
  jax.block_until_ready(metrics["loss"])
  step = 0

  def run():
    nonlocal state, step
    state, metrics = trainer.train_step(state, batches[step % len(batches)])
    step += 1
    return metrics["loss"]

  return traced_device_time(run, steps, top=top)


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
      print_traced(f"{row['config']} {backend} (per step)", row)
  name = results_name("step_profile", args)
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, f"{name}.json")
  with open(path, "w") as f:
    json.dump({**metadata(), "steps": args.steps, "rows": rows}, f, indent=1)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
