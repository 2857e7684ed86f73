"""Board power and SM clock of each grouped GEMM against cuBLAS's dense GEMM at the same shape, each run for seconds.

Under ncu our GEMMs take about cuBLAS's cycles but run at a 9-11% lower SM clock (NOTES.md, the eleventh session).
This says whether both run at the board's power cap, and what each draws per FLOP: each case of `gemm_counters.py`
launches back to back for --seconds while `nvidia-smi` samples power, SM clock, temperature and the clock-event
reasons (why the clock is held below its maximum) every 100 ms. The memory-bound cases (`gemm_counters.MOVED_BYTES`:
the combine, and XLA summing the same bytes from contiguous rows) also get their bytes a second.

  python3 benchmarks/gpu_power.py --shapes kimi-k2 --cases down,dense_down   # on the GPU: gpu_power_h200.json
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

import common  # noqa: E402
import gemm_counters  # noqa: E402

NUMERIC_FIELDS = {"power.draw": "power_w", "power.limit": "power_limit_w", "clocks.sm": "sm_mhz",
                  "temperature.gpu": "temperature_c"}
REASON_FIELDS = {"clocks_event_reasons.sw_power_cap": "power_cap_share",
                 "clocks_event_reasons.hw_slowdown": "hw_slowdown_share",
                 "clocks_event_reasons.sw_thermal_slowdown": "thermal_slowdown_share"}
LAUNCHES_PER_BATCH = 8  # one batch stays queued while the host waits for the one before


def smi_query(nvidia_smi: str, fields: list[str]) -> list[str]:
  """The nvidia-smi command line that reads `fields` of GPU 0 once (csv, no header, no units)."""
  return [nvidia_smi, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits", "-i", "0"]


def query_fields(nvidia_smi: str) -> list[str]:
  """The fields this nvidia-smi answers: all of them, or without the clock-event reasons (older drivers)."""
  for fields in (list(NUMERIC_FIELDS) + list(REASON_FIELDS), list(NUMERIC_FIELDS)):
    probe = subprocess.run(smi_query(nvidia_smi, fields), capture_output=True, text=True)
    if probe.returncode == 0:
      return fields
  raise RuntimeError(f"{nvidia_smi} answers none of {list(NUMERIC_FIELDS)}: {probe.stderr.strip()[-300:]}")


def summarize(lines: list[str], fields: list[str]) -> dict:
  """nvidia-smi samples (csv, noheader, nounits; one line per sample of `fields`) -> the means of the numeric fields
  and the share of samples in which each clock-event reason was active. Unreadable values ("[N/A]") are skipped."""
  values: dict[str, list[float]] = {field: [] for field in fields}
  for line in lines:
    parts = [part.strip() for part in line.split(",")]
    if len(parts) != len(fields):
      continue
    for field, text in zip(fields, parts):
      if field in REASON_FIELDS:
        if text in ("Active", "Not Active"):
          values[field].append(1.0 if text == "Active" else 0.0)
      else:
        try:
          values[field].append(float(text))
        except ValueError:
          pass
  names = {**NUMERIC_FIELDS, **REASON_FIELDS}
  summary = {names[field]: sum(v) / len(v) for field, v in values.items() if v}
  summary["samples"] = max((len(v) for v in values.values()), default=0)
  return summary


def measure_case(case, shape, num_tokens, routing, seconds, nvidia_smi, fields) -> dict:
  fn, args = gemm_counters.case_call(case, shape, num_tokens, routing)
  jax.block_until_ready(fn(*args))  # compile
  warm_until = time.perf_counter() + 1.0
  while time.perf_counter() < warm_until:
    jax.block_until_ready(fn(*args))
  sampler = subprocess.Popen(smi_query(nvidia_smi, fields) + ["-lms", "100"], stdout=subprocess.PIPE, text=True)
  launches, queued = 0, None
  start = time.perf_counter()
  try:
    while time.perf_counter() - start < seconds:
      for _ in range(LAUNCHES_PER_BATCH):
        out = fn(*args)
      launches += LAUNCHES_PER_BATCH
      if queued is not None:
        jax.block_until_ready(queued)
      queued = out
    jax.block_until_ready(queued)
    elapsed = time.perf_counter() - start
  finally:
    sampler.terminate()
    samples = sampler.communicate()[0].splitlines()
  _, flops_of = gemm_counters.CASES[case]
  flops = flops_of(num_tokens * shape.top_k, shape.hidden, shape.intermediate)
  row = {"case": case, "routing": routing, "seconds": elapsed, "launches": launches,
         "ms_per_launch": 1e3 * elapsed / launches, "tflops": flops * launches / elapsed * 1e-12,
         **summarize(samples, fields)}
  if case in gemm_counters.MOVED_BYTES:
    moved = gemm_counters.MOVED_BYTES[case](num_tokens, shape.top_k, shape.hidden)
    row["gb_per_s"] = moved * launches / elapsed * 1e-9
  if "power_w" in row:
    row["pj_per_flop"] = row["power_w"] / row["tflops"]  # W / (TFLOP/s) = pJ per FLOP
  return row


def report(row) -> str:
  keys = ("ms_per_launch", "tflops", "gb_per_s", "power_w", "sm_mhz", "pj_per_flop", "power_cap_share",
          "temperature_c")
  return "  ".join(f"{key}={row[key]:.3f}" for key in keys if key in row)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shapes", default="kimi-k2", help="comma-separated model shapes")
  parser.add_argument("--cases", default=",".join(gemm_counters.CASES), help="comma-separated gemm_counters cases")
  parser.add_argument("--routings", default="uniform", help=f"comma-separated, of {common.ROUTINGS}")
  parser.add_argument("--seconds", type=float, default=5.0, help="measured time per case (after 1 s of warm-up)")
  parser.add_argument("--nvidia-smi", default="nvidia-smi")
  parser.add_argument("--out-dir", default=common.RESULTS_DIR)
  args = parser.parse_args()
  fields = query_fields(args.nvidia_smi)
  os.makedirs(args.out_dir, exist_ok=True)
  runs = [(name, routing, case) for name in args.shapes.split(",") for routing in args.routings.split(",")
          for case in args.cases.split(",")]

  def profile(case, name, routing):
    return {"shape": name, **measure_case(case, common.MODEL_SHAPES[name], common.NUM_TOKENS, routing, args.seconds,
                                          args.nvidia_smi, fields)}

  gemm_counters.profile_all(runs, profile, report, os.path.join(args.out_dir, f"gpu_power_{common.gpu_tag()}.json"))


if __name__ == "__main__":
  main()
