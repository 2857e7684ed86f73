"""benchmarks/: the profiling scripts run end to end on tiny shapes (any platform) and account for the device time."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(script, *args):
  """Runs benchmarks/``script`` with ``args``; a failure shows the end of its output (a bare CalledProcessError
  said nothing of why, on a machine where only the test log comes back)."""
  result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, check=False)
  assert result.returncode == 0, f"{script} {' '.join(map(str, args))} exited {result.returncode}:\n" + (
      result.stdout + result.stderr)[-3000:]


def test_layer_profile_smoke(tmp_path):
  run_script("layer_profile.py", "--smoke", "--shapes", "smoke-a", "--warmup", 1, "--calls", 2, "--out-dir", tmp_path)
  result = json.loads((tmp_path / "layer_profile_smoke_smoke-a.json").read_text())
  rows = result["rows"]
  # kittens and tokamax per routing and the dense chain, forward and forward+backward; the gate/up GEMM alone both
  # ways.
  layer_rows = {(backend, routing, mode) for backend in ("kittens", "tokamax") for routing in ("uniform", "skewed")
                for mode in ("fwd", "fwd_bwd")} | {("dense", "equal", mode) for mode in ("fwd", "fwd_bwd")}
  gate_up_rows = {(f"gate_up:{way}", routing, "fwd") for way in ("rows", "gathered")
                  for routing in ("uniform", "skewed")}
  assert {(r["backend"], r["routing"], r["mode"]) for r in rows} == layer_rows | gate_up_rows
  tokamax_importable = importlib.util.find_spec("tokamax") is not None
  for row in rows:
    if row["backend"] == "tokamax" and not tokamax_importable:
      assert row["error"].startswith("tokamax unavailable"), row
      continue
    assert "error" not in row, row["error"]
    assert row["busy_ms"] > 0 and row["top_kernels"]
    # The listed ops are the largest and add up to no more than the total.
    listed = [op["ms"] for op in row["top"]]
    assert listed == sorted(listed, reverse=True) and sum(listed) <= row["busy_ms"] * (1 + 1e-9)


def test_layer_spread_smoke(tmp_path):
  run_script("layer_spread.py", "--smoke", "--shapes", "smoke-a", "--iters", 3, "--out-dir", tmp_path)
  rows = json.loads((tmp_path / "layer_spread_smoke_smoke-a.json").read_text())["rows"]
  assert [r["function"] for r in rows] == ["kittens_uniform", "kittens_skewed", "dense"]
  for row in rows:
    assert len(row["untraced"]["times_ms"]) == 3 and len(row["calls"]) == 3
    for call in row["calls"]:
      # The trace was split into the calls that were made: each call's device work lies inside its wall time.
      assert 0 < call["busy_ms"] and 0 < call["span_ms"] <= call["wall_ms"] * (1 + 1e-6)
    traced = row["traced"]
    assert traced["span_ms"]["min"] <= traced["span_ms"]["median"] <= traced["span_ms"]["max"]
    assert all(op["min"] <= op["median"] <= op["max"] for op in traced["ops"])


def _benchmark_module(name):
  """A script of benchmarks/ as a module (the folder is not a package)."""
  folder = os.path.join(ROOT, "benchmarks")
  if folder not in sys.path:
    sys.path.insert(0, folder)
  return importlib.import_module(name)


def test_time_interleaved_alternates_and_records_failures():
  common = _benchmark_module("common")
  log = []

  def call(name, fail_at=None):
    def run(i):
      log.append((name, i))
      if i == fail_at:
        raise RuntimeError(f"{name} failed")
      return i
    return run

  fast, failing, broken = call("fast"), call("failing", fail_at=2), call("broken", fail_at=0)
  results = common.time_interleaved([fast, failing, broken], iters=4, min_iters=1, budget_s=10.0)
  # One warm-up each, then one timed call of each live function per round, in the round's order.
  assert log[:3] == [("fast", 0), ("failing", 0), ("broken", 0)]
  assert sorted(log[3:5]) == [("failing", 1), ("fast", 1)] and sorted(log[5:7]) == [("failing", 2), ("fast", 2)]
  assert log[7:] == [("fast", 3), ("fast", 4)]
  assert results[0]["iters"] == 4 and results[0]["min_ms"] <= results[0]["median_ms"]
  assert len(results[0]["times_ms"]) == 4 and min(results[0]["times_ms"]) == round(results[0]["min_ms"], 3)
  assert isinstance(results[1], RuntimeError) and str(results[1]) == "failing failed"
  assert isinstance(results[2], RuntimeError) and str(results[2]) == "broken failed"


def test_round_order_is_a_fixed_permutation_that_moves_every_function():
  common = _benchmark_module("common")
  rounds = [common.round_order([0, 3, 5, 7, 9], r) for r in range(1, 41)]
  assert all(sorted(order) == [0, 3, 5, 7, 9] for order in rounds)
  assert rounds == [common.round_order([0, 3, 5, 7, 9], r) for r in range(1, 41)]  # the same in every run
  # Every function comes first and last in some rounds, and follows each other one in some round.
  assert {order[0] for order in rounds} == {order[-1] for order in rounds} == {0, 3, 5, 7, 9}
  follows = {(order[n], order[n + 1]) for order in rounds for n in range(4)}
  assert follows == {(a, b) for a in (0, 3, 5, 7, 9) for b in (0, 3, 5, 7, 9) if a != b}


def test_time_interleaved_budget_bounds_slow_functions():
  common = _benchmark_module("common")
  import time  # noqa: PLC0415

  calls = {"slow": 0, "fast": 0}

  def slow(i):
    calls["slow"] += 1
    time.sleep(0.05)

  def fast(i):
    calls["fast"] += 1

  slow_result, fast_result = common.time_interleaved([slow, fast], iters=20, min_iters=3, budget_s=0.1)
  # The slow one's first timed call (~50 ms) sets its count to max(min_iters, 0.1 s / 50 ms) = 3.
  assert slow_result["iters"] == 3 and calls["slow"] == 4
  assert fast_result["iters"] == 20 and calls["fast"] == 21
  assert slow_result["median_ms"] >= 45


def test_add_ratio_matches_routing_and_gives_dense_its_ceiling():
  common = _benchmark_module("common")
  rows = [{"backend": "dense", "shape": "a", "mode": "fwd", "routing": "equal", "tflops": 600.0},
          {"backend": "tokamax", "shape": "a", "mode": "fwd", "routing": "uniform", "tflops": 250.0},
          {"backend": "tokamax", "shape": "a", "mode": "fwd", "routing": "skewed", "tflops": 200.0},
          {"backend": "kittens", "shape": "a", "mode": "fwd", "routing": "skewed", "tflops": 550.0},
          {"backend": "kittens", "shape": "a", "mode": "fwd_bwd", "routing": "uniform", "tflops": 500.0}]
  common.add_ratio(rows, "dense", ("shape", "mode"))
  common.add_ratio(rows, "tokamax", ("shape", "mode", "routing"))
  dense, _, _, skewed, no_baseline = rows
  assert dense["vs_tokamax"] == 2.4 and "vs_dense" not in dense  # against tokamax's uniform row
  assert skewed["vs_tokamax"] == 2.75 and skewed["vs_dense"] == round(550 / 600, 3)
  assert "vs_tokamax" not in no_baseline and "vs_dense" not in no_baseline


def test_benchmark_tables_smoke(tmp_path):
  """ragged_dot.py and layer.py end to end on the tiny shapes: every backend that exists here gets a timing."""
  for script, name in (("ragged_dot.py", "ragged_dot_smoke"), ("layer.py", "layer_smoke")):
    run_script(script, "--smoke", "--out-dir", tmp_path)
    rows = json.loads((tmp_path / f"{name}.json").read_text())["rows"]
    assert {r["backend"] for r in rows} == {"kittens", "xla", "tokamax", "dense"}
    for row in rows:
      if row["backend"] == "tokamax" and "error" in row:
        assert "tokamax unavailable" in row["error"]  # not installed on CI
        continue
      assert "error" not in row, row
      assert row["median_ms"] > 0 and row["iters"] >= 1 and row["tflops"] > 0
      if row["backend"] != "dense":
        assert row["vs_dense"] > 0


def test_layer_memory_smoke(tmp_path):
  """layer_memory.py end to end on one tiny shape: every case gets XLA's memory analysis and, from the live-range
  dump, the instructions around the peak and the largest buffers live there, the kernels' ones named."""
  run_script("layer_memory.py", "--smoke", "--shapes", "smoke-a", "--out-dir", tmp_path)
  rows = json.loads((tmp_path / "layer_memory_smoke_smoke-a.json").read_text())["rows"]
  assert [(r["layers"], r["recompute"]) for r in rows] == [(1, False), (1, True), (2, False), (2, True)]
  for row in rows:
    assert "error" not in row, row
    assert row["temp_bytes"] > 0 and row["peak_instruction"] in row["around_peak"]
    sizes = [b["bytes"] for b in row["buffers"]]
    assert sizes == sorted(sizes, reverse=True) and 0 < sum(sizes) <= row["live_peak_bytes"]
    assert any("(jk_" in b["value"] for b in row["buffers"])


def test_gemm_counters_cases_run(tmp_path):
  """Each case's launches (what ncu profiles on the GPU) run on the tiny shapes."""
  for case in _benchmark_module("gemm_counters").CASES:
    run_script("gemm_counters.py", "--run", case, "--shape", "smoke-a", "--smoke")


def test_gpu_power_with_a_stand_in_nvidia_smi(tmp_path):
  """gpu_power.measure_case on the tiny shapes: the samples' means and shares, FLOP and byte rates per launch."""
  gpu_power, common = _benchmark_module("gpu_power"), _benchmark_module("common")
  sample = "650.5, 700.00, 1980, 55, Active, Not Active, [N/A]"
  smi = tmp_path / "nvidia-smi"
  smi.write_text(f'#!/bin/sh\ncase "$*" in\n  *-lms*) while :; do echo "{sample}"; sleep 0.02; done ;;\n'
                 f'  *) echo "{sample}" ;;\nesac\n')
  smi.chmod(0o755)
  fields = gpu_power.query_fields(str(smi))
  shape = common.SMOKE_SHAPES["smoke-a"]
  row = gpu_power.measure_case("combine", shape, 64, "uniform", 0.3, str(smi), fields)
  assert row["samples"] > 0 and row["power_w"] == 650.5 and row["sm_mhz"] == 1980
  assert row["power_cap_share"] == 1.0 and row["hw_slowdown_share"] == 0.0 and "thermal_slowdown_share" not in row
  per_second = row["launches"] / row["seconds"]
  assert row["gb_per_s"] == pytest.approx((64 * shape.top_k + 64) * shape.hidden * 2 * per_second * 1e-9)
  assert row["tflops"] == pytest.approx(2 * 64 * shape.top_k * shape.hidden * per_second * 1e-12)
  assert row["pj_per_flop"] == pytest.approx(row["power_w"] / row["tflops"])
  assert "gb_per_s" not in gpu_power.measure_case("down", shape, 64, "uniform", 0.1, str(smi), fields)


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


def test_gemm_counters_source_regions():
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import gemm_counters  # noqa: PLC0415 (the benchmarks folder is not a package)

  listing = [  # (sass, warp-stall samples): a consumer's tile head, k loop and epilogue, then the producer
      ("LOP3.LUT R4, R4, 0x1, RZ, 0xc0, !PT", 6),
      ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R9+UR8], R4", 10),  # the k loop's top
      ("HGMMA.64x256x16.F32.BF16 R24, gdesc[UR8].tnspB, R24, gsb0", 20),
      ("WARPGROUP.DEPBAR.LE gsb0, 0x1", 40),
      ("@!P0 BRA 0x1010", 10),
      ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 4),
      ("STSM.16.M88.4 [R0], R8", 8),
      ("UTMACCTL.PF [UR4]", 1),
      ("UTMALDG.2D desc[UR14], [UR16], [UR4]", 1),
      ("UCGABAR_WAIT", 100),
  ]
  rows = [{"address": hex(0x1000 + 16 * i), "sass": sass, "samples": float(samples)}
          for i, (sass, samples) in enumerate(listing)]
  regions = gemm_counters.source_regions(rows)
  assert regions["idle_of_all"] == 0.5
  shares = [regions[name] for name in ("tile_head", "main_loop", "epilogue", "producer")]
  assert shares == pytest.approx([0.06, 0.84, 0.08, 0.02])
  assert not regions["head_k_steps"]
  assert gemm_counters.source_regions([r for r in rows if "HGMMA" not in r["sass"]]) is None

  # k steps unrolled ahead of the loop (the held chunks' stores): the loop is still the branch back across the last
  # HGMMA, and the unrolled steps count to the tile head.
  peeled = listing[:1] + [("HGMMA.64x256x16.F32.BF16 R24, gdesc[UR8].tnspB, RZ, !UPT, gsb0", 30)] + listing[1:]
  rows = [{"address": hex(0x1000 + 16 * i), "sass": sass, "samples": float(samples)}
          for i, (sass, samples) in enumerate(peeled)]
  rows[5]["sass"] = "@!P0 BRA 0x1020"  # the loop's top moved one instruction down
  regions = gemm_counters.source_regions(rows)
  assert regions["head_k_steps"]
  assert [regions[name] for name in ("tile_head", "main_loop")] == pytest.approx([36 / 130, 84 / 130])


def test_gpu_power_summarizes_nvidia_smi_samples():
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import gpu_power  # noqa: PLC0415 (the benchmarks folder is not a package)

  fields = ["power.draw", "clocks.sm", "clocks_event_reasons.sw_power_cap"]
  lines = ["690.5, 1560, Active", "700.5, 1540, Active", "[N/A], 1600, Not Active", "garbled line"]
  summary = gpu_power.summarize(lines, fields)
  assert summary["power_w"] == pytest.approx(695.5)
  assert summary["sm_mhz"] == pytest.approx(1566.6667, rel=1e-4)
  assert summary["power_cap_share"] == pytest.approx(2 / 3)
  assert summary["samples"] == 3
  assert gpu_power.summarize([], fields) == {"samples": 0}


def sass_listing(kernel_loop):
  """`cuobjdump -sass` text of one gmm kernel (cluster 2, bf16 out) whose consumer k loop is `kernel_loop`."""
  name = ("_ZN2jk12grouped_gemm4sm9019grouped_gemm_kernelILNS1_4ModeE0ELb1EtLi2ELNS1_8GatheredE0EEEv"
          "NS1_10TensorMapsENS1_6ParamsE")
  code = ["MOV R1, c[0x0][0x28]", "STL [R1+0x14], R0", "HGMMA.64x256x16.F32.BF16 R24, gdesc[UR8].tnspB, RZ, !UPT, gsb0",
          *kernel_loop, "WARPGROUP.DEPBAR.LE gsb0, 0x0", "EXIT"]
  loop_head = 0x10 * 3  # the first instruction of kernel_loop
  lines = [f"\tcode for sm_90a\n\t\tFunction : {name}", "\t.headerflags\t@\"EF_CUDA_SM90\""]
  for i, text in enumerate(code):
    text = text.replace("LOOP_HEAD", hex(loop_head))
    lines.append(f"        /*{0x10 * i:04x}*/                   {text} ;   /* 0x000fe20000000800 */")
  return "\n".join(lines) + "\n"


def test_kloop_sass_finds_the_consumer_k_loop_and_flags_demoted_uniform_registers(tmp_path, capsys):
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import kloop_sass  # noqa: PLC0415 (the benchmarks folder is not a package)

  uniform = ["SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R215+UR5+0x38000], R208", "ULEA UR5, UR6, UR7, 0xd",
             "HGMMA.64x256x16.F32.BF16 R24, gdesc[UR12].tnspB, R24, UP0", "WARPGROUP.DEPBAR.LE gsb0, 0x1",
             "@!P1 BRA LOOP_HEAD"]
  demoted = uniform[:1] + ["R2UR UR16, R2", "R2UR UR17, R3", "R2UR UR18, R214", "R2UR UR19, R215"] + uniform[2:]
  (tmp_path / "base.sass").write_text(sass_listing(uniform))
  (tmp_path / "variant.sass").write_text(sass_listing(demoted))

  kernels = kloop_sass.functions((tmp_path / "variant.sass").read_text())
  assert list(kernels) == ["gmm          rhs mn-major out bf16 cluster 2 gathered none"]
  loop = kloop_sass.k_loop(next(iter(kernels.values())))
  # The loop runs from the back edge's target to the back edge; the peeled k step before it is not in it.
  assert loop == kloop_sass.KLoop(instructions=8, r2ur=4, uniform=0, local_memory=1)
  assert kloop_sass.k_loop(next(iter(kloop_sass.functions(sass_listing(uniform)).values()))).uniform == 1

  assert kloop_sass.main([str(tmp_path / "base.sass"), str(tmp_path / "variant.sass")]) == 0
  out = capsys.readouterr().out
  assert "4*" in out and "uniform registers demoted" in out
  assert kloop_sass.main([str(tmp_path / "base.sass"), str(tmp_path / "base.sass")]) == 0
  assert "demoted" not in capsys.readouterr().out
