"""End-to-end training throughput of the MoE LM (models/), backend kittens vs xla in the same run, and loss agreement.

For each config (``--configs``; default ``small`` and the large-geometry ``kimi-k2-geom`` and ``glm-5-geom``):
tokens/s of `models.train.Trainer`'s jitted train step with ``moe_ffn(backend="kittens")`` and ``backend="xla"``
(median step time after warm-up). Then a loss-curve check: both backends train ``small`` from the same
initialisation on the same batches for ``--curve-steps`` steps; the result records max |loss_kittens - loss_xla|
(bf16 noise is expected).

  python3 benchmarks/train.py            # one GPU: benchmarks/results/train_h200.json + train_h200.png
  python3 benchmarks/train.py --smoke    # a micro config, any platform (/tmp/jax_kittens_benchmarks/train_smoke.json)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import RESULTS_DIR, error_message, metadata, results_name  # noqa: E402
from models import data  # noqa: E402
from models.configs import get_config  # noqa: E402
from models.train import Trainer  # noqa: E402

BACKENDS = ("kittens", "xla")
SMOKE = dict(hidden=64, num_layers=2, num_heads=2, dense_intermediate=128, num_experts=4, top_k=2,
             expert_intermediate=64, seq_len=32, batch_size=4, steps=100, warmup_steps=2, dtype="bfloat16")


def _configs(args):
  if args.smoke:
    return [get_config("tiny", **SMOKE)], get_config("tiny", **SMOKE)
  throughput_configs = [get_config(name) for name in args.configs.split(",")]
  return throughput_configs, get_config("small", steps=max(args.curve_steps, 2))


def _batches(config, steps, seed=0):
  tokens, _ = data.train_eval_split(data.load_documents())
  stream = data.Batches(tokens, config.batch_size, config.seq_len, seed)
  return [stream.at(step) for step in range(steps)]


def throughput(config, backend: str, *, warmup: int, steps: int) -> dict:
  """Median train-step time over ``steps`` after ``warmup`` steps -> tokens/s."""
  trainer = Trainer(config, backend=backend, devices=jax.devices()[:1])
  state = trainer.init_state()
  batches = [trainer.place_batch(b) for b in _batches(config, 4)]
  times = []
  for step in range(warmup + steps):
    began = time.perf_counter()
    state, metrics = trainer.train_step(state, batches[step % len(batches)])
    jax.block_until_ready(metrics["loss"])
    if step >= warmup:
      times.append(time.perf_counter() - began)
  step_s = float(np.median(times))
  return {"tokens_per_s": config.batch_size * config.seq_len / step_s, "step_ms": step_s * 1e3,
          "params": trainer.num_params, "tokens_per_step": config.batch_size * config.seq_len,
          "final_loss": float(metrics["loss"])}


def loss_curve(config, backend: str, steps: int) -> list[float]:
  """Train losses of ``steps`` steps from seed 0 on the fixed batch sequence."""
  trainer = Trainer(config, backend=backend, devices=jax.devices()[:1], seed=0)
  state = trainer.init_state()
  losses = []
  for batch in _batches(config, steps):
    state, metrics = trainer.train_step(state, trainer.place_batch(batch))
    losses.append(float(metrics["loss"]))
  return losses


def _plot(path, meta, rows, curves):
  import matplotlib  # noqa: PLC0415

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  fig, (bars, lines) = plt.subplots(1, 2, figsize=(11, 4))
  configs = sorted({row["config"] for row in rows})
  for offset, backend in enumerate(BACKENDS):
    values = [next((r.get("tokens_per_s", 0.0) for r in rows if r["config"] == c and r["backend"] == backend), 0.0)
              for c in configs]
    bars.bar(np.arange(len(configs)) + 0.4 * offset, values, 0.4, label=backend)
  bars.set_xticks(np.arange(len(configs)) + 0.2, configs)
  bars.set(ylabel="training tokens / s", title=f"{meta['gpu']}, jax {meta['jax']}")
  bars.legend()
  for backend, losses in curves.items():
    if isinstance(losses, list):
      lines.plot(np.arange(1, len(losses) + 1), losses, label=backend, lw=1)
  lines.set(xlabel="step", ylabel="train loss (nats / byte)", title="same init, same batches")
  lines.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--smoke", action="store_true", help="a micro config on any platform")
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--steps", type=int, default=10, help="timed steps per backend")
  parser.add_argument("--curve-steps", type=int, default=300)
  # kimi-k2-geom: xla's train step needs more than the H200's memory there (8bdc354), so glm-5-geom gives the
  # large-geometry ratio.
  parser.add_argument("--configs", default="small,kimi-k2-geom,glm-5-geom", help="throughput configs, comma-separated")
  parser.add_argument("--out-dir", default=None, help=f"default {RESULTS_DIR}; a temp dir with --smoke")
  args = parser.parse_args()
  if args.smoke:
    args.curve_steps = min(args.curve_steps, 20)
  args.out_dir = args.out_dir or (os.path.join("/tmp", "jax_kittens_benchmarks") if args.smoke else RESULTS_DIR)
  meta = metadata()
  throughput_configs, curve_config = _configs(args)
  rows = []
  for config in throughput_configs:
    for backend in BACKENDS:
      row = {"config": config.name if not args.smoke else "smoke", "backend": backend}
      try:
        row.update(throughput(config, backend, warmup=args.warmup, steps=args.steps))
      except Exception as error:  # noqa: BLE001 (one failing backend must not stop the other)
        row["error"] = error_message(error)
      print(row, flush=True)
      rows.append(row)
    by_backend = {r["backend"]: r for r in rows if r["config"] == rows[-1]["config"] and "tokens_per_s" in r}
    if len(by_backend) == 2:
      by_backend["kittens"]["speedup_vs_xla"] = by_backend["kittens"]["tokens_per_s"] / by_backend["xla"][
          "tokens_per_s"]
  curves = {}
  for backend in BACKENDS:
    try:
      curves[backend] = loss_curve(curve_config, backend, args.curve_steps)
    except Exception as error:  # noqa: BLE001
      curves[backend] = {"error": error_message(error)}
  agreement = {"config": curve_config.name if not args.smoke else "smoke", "steps": args.curve_steps}
  if all(isinstance(c, list) for c in curves.values()):
    diff = np.abs(np.asarray(curves["kittens"]) - np.asarray(curves["xla"]))
    agreement.update(max_abs_loss_diff=float(diff.max()), mean_abs_loss_diff=float(diff.mean()),
                     final_loss={b: c[-1] for b, c in curves.items()})
  else:
    agreement["error"] = {b: c["error"] for b, c in curves.items() if isinstance(c, dict)}
  print(agreement, flush=True)
  name = results_name("train", args)
  os.makedirs(args.out_dir, exist_ok=True)
  path = os.path.join(args.out_dir, f"{name}.json")
  with open(path, "w") as f:
    json.dump({**meta, "rows": rows, "loss_agreement": agreement, "loss_curves": curves}, f, indent=1)
  _plot(os.path.join(args.out_dir, f"{name}.png"), meta, rows, curves)
  print(f"wrote {path} and {name}.png")


if __name__ == "__main__":
  main()
