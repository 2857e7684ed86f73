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


def test_gemm_counters_cases_run(tmp_path):
  """Each case's launches (what ncu profiles on the GPU) run on the tiny shapes."""
  for case in ("swiglu_rows", "swiglu_gathered", "down", "dense_gate", "dense_down"):
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gemm_counters.py"), "--run", case, "--shape",
                    "smoke-a", "--smoke"], check=True, cwd=ROOT, capture_output=True, text=True)


def test_gemm_counters_reads_ncu_csv():
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import gemm_counters  # noqa: PLC0415 (the benchmarks folder is not a package)

  output = "\n".join([
      "==PROF== Connected to process 4242",
      '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
      '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"',
      '"0","4242","python3","127.0.0.1","void k()","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0",'
      '"GPU Speed Of Light Throughput","Duration","ns","1,070,336"',
      '"0","4242","python3","127.0.0.1","void k()","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0",'
      '"Memory Workload Analysis","L2 Hit Rate","%","83.12"',
      '"0","4242","python3","127.0.0.1","void k()","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0",'
      '"Launch Statistics","Function Cache Configuration","","CachePreferNone"',
      "==PROF== Disconnected from process 4242",
  ])
  metrics = gemm_counters.parse_ncu_csv(output)
  assert metrics["GPU Speed Of Light Throughput / Duration"] == {"value": 1070336.0, "unit": "ns"}
  assert metrics["Memory Workload Analysis / L2 Hit Rate"]["value"] == 83.12
  assert metrics["Launch Statistics / Function Cache Configuration"]["value"] == "CachePreferNone"
