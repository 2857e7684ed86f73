"""benchmarks/: the profiling scripts run end to end on tiny shapes (any platform) and account for the device time."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_layer_profile_smoke(tmp_path):
  subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "layer_profile.py"), "--smoke", "--shapes",
                  "smoke-a", "--warmup", "1", "--calls", "2", "--out-dir", str(tmp_path)], check=True, cwd=ROOT,
                 capture_output=True, text=True)
  result = json.loads((tmp_path / "layer_profile_smoke.json").read_text())
  rows = result["rows"]
  # kittens per routing and the dense chain, forward and forward+backward; the gate/up GEMM alone both ways.
  layer_rows = {(backend, routing, mode) for backend, routing in (("kittens", "uniform"), ("kittens", "skewed"),
                                                                  ("dense", "equal")) for mode in ("fwd", "fwd_bwd")}
  gate_up_rows = {(f"gate_up:{way}", routing, "fwd") for way in ("rows", "gathered")
                  for routing in ("uniform", "skewed")}
  assert {(r["backend"], r["routing"], r["mode"]) for r in rows} == layer_rows | gate_up_rows
  for row in rows:
    assert "error" not in row, row["error"]
    assert row["busy_ms"] > 0 and row["top_kernels"]
    # The listed ops are the largest and add up to no more than the total.
    listed = [op["ms"] for op in row["top"]]
    assert listed == sorted(listed, reverse=True) and sum(listed) <= row["busy_ms"] * (1 + 1e-9)
