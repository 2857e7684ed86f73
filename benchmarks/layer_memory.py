"""Where the peak device memory of a forward+backward sits: `moe_ffn(backend="kittens")` with recompute off and on,
one layer and two stacked layers, at `layer.py`'s sizes (each model shape's single-GPU slice).

Per case: XLA's compiled memory analysis (`common.peak_memory`, what `layer.py` reports), and from XLA's dump of the
optimized module's buffer live ranges the instructions around the peak and the buffers live there, largest first,
each named with the kernel that wrote it where a kernel did. One layer's peak shows where the backward is tight;
two layers show what recompute is for, the residuals that one layer keeps while the other runs. Two layers have
weights of their own, as in a model. Only compiled, never run: the arguments are abstract.

  python3 benchmarks/layer_memory.py                   # on the H200: benchmarks/results/layer_memory_h200.json
  python3 benchmarks/layer_memory.py --shapes qwen3.5  # some shapes
  python3 benchmarks/layer_memory.py --smoke           # tiny shapes, any platform
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import sys
import tempfile

# XLA reads its flags once, when the backend starts: the dump goes where this process says before jax is imported.
DUMP_DIR = tempfile.mkdtemp(prefix="jk_layer_memory_")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP_DIR} --xla_dump_hlo_as_text"
                           " --xla_dump_hlo_module_re=.*layer_memory.*").strip()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

import common  # noqa: E402
import layer  # noqa: E402

LAYERS = (1, 2)
LISTED_BUFFERS = 12  # per case, the largest buffers live at the peak


def stacked_forward_backward(num_layers, recompute):
  """g(x, weights, ids, *experts of each layer, d_y) -> (y, gradients of x, the router weights and every expert
  weight) through ``num_layers`` kittens layers in a row (the same routing in each)."""
  routed = layer.routed_layer("kittens", None, recompute=recompute)

  def stack(x, weights, ids, *experts):
    for n in range(num_layers):
      x = routed(x, weights, ids, *experts[3 * n:3 * n + 3])
    return x

  differentiable = (0, 1, *range(3, 3 + 3 * num_layers))
  return layer.forward_backward(stack, differentiable)


def _dump(module_name: str, suffix: str) -> str:
  """The dump of the optimized module; the last one if XLA compiled it more than once (module_NNNN counts up)."""
  paths = sorted(glob.glob(os.path.join(DUMP_DIR, f"*.{module_name}.*after_optimizations{suffix}")))
  if not paths:
    raise RuntimeError(f"no *after_optimizations{suffix} of {module_name} in {DUMP_DIR}: {os.listdir(DUMP_DIR)[:8]}")
  with open(paths[-1]) as f:
    return f.read()


def live_range_peak(module_name: str) -> dict:
  """The peak of XLA's live-range dump of ``module_name``: the instructions around it and the buffers live there,
  each named with its custom call's target (jk_gmm_swiglu_dgrad, ...) where it has one."""
  text = _dump(module_name, "-live-range.txt")
  targets = dict(re.findall(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?custom_call_target=\"([^\"]+)\"",
                            _dump(module_name, ".txt"), re.MULTILINE))
  describe = lambda value: f"{value} ({targets[value.split('{')[0]]})" if value.split("{")[0] in targets else value
  sequence = {int(i): name for i, name in re.findall(r"^ {4}(\d+):(\S+)$", text, re.MULTILINE)}
  at = re.search(r"^ {2}Live ranges at (\d+) \(peak\):\n((?: {4}.*\n)*)", text, re.MULTILINE)
  if at is None:
    raise RuntimeError(f"no peak in the live-range dump of {module_name}")
  peak = int(at.group(1))
  buffers = [{"value": describe(value), "bytes": int(size)}
             for value, size in re.findall(r"^ {4}(\S+): (\d+) bytes", at.group(2), re.MULTILINE)]
  return {"live_peak_bytes": sum(b["bytes"] for b in buffers),
          "peak_instruction": describe(sequence.get(peak, str(peak))),
          "around_peak": [describe(sequence[i]) for i in range(peak - 3, peak + 4) if i in sequence],
          "buffers": sorted(buffers, key=lambda b: -b["bytes"])[:LISTED_BUFFERS]}


def measure_case(name, shape, num_tokens, num_layers, recompute):
  """Compiled for abstract arguments of the shape's single-GPU slice: nothing is allocated on the device."""
  num_local_experts = shape.num_experts // common.GPUS_PER_NODE
  h, i = shape.hidden, shape.intermediate
  bf16 = lambda *dims: jax.ShapeDtypeStruct(dims, jax.numpy.bfloat16)
  routing = (jax.ShapeDtypeStruct((num_tokens, shape.top_k), jax.numpy.float32),
             jax.ShapeDtypeStruct((num_tokens, shape.top_k), jax.numpy.int32))
  experts = (bf16(num_local_experts, h, i), bf16(num_local_experts, h, i), bf16(num_local_experts, i, h)) * num_layers
  fn = stacked_forward_backward(num_layers, recompute)
  module = f"layer_memory_{re.sub(r'[^a-z0-9]', '_', name)}_{num_layers}_{'recompute' if recompute else 'saved'}"
  fn.__name__ = module
  compiled = common.compile_fn(fn, bf16(num_tokens, h), *routing, *experts, bf16(num_tokens, h))
  return {**{f"{key}_bytes": size for key, size in common.peak_memory(compiled).items()},
          **live_range_peak(f"jit_{module}")}


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, any platform")
  common.add_shapes_argument(parser)
  parser.add_argument("--out-dir", default=None, help=f"default {common.RESULTS_DIR}; a temp dir with --smoke")
  args = parser.parse_args()
  shapes = common.selected_shapes(parser, args)
  num_tokens = common.SMOKE_NUM_TOKENS if args.smoke else common.NUM_TOKENS
  meta = common.metadata()
  print(f"layer memory: {meta}", flush=True)
  rows = [common.measure({"shape": name, "layers": num_layers, "recompute": recompute},
                         lambda: measure_case(name, shape, num_tokens, num_layers, recompute))
          for name, shape in shapes.items() for num_layers in LAYERS for recompute in (False, True)]
  for row in rows:
    print()
    common.print_table([row], ("shape", "layers", "recompute", "peak_bytes", "temp_bytes", "live_peak_bytes",
                               "peak_instruction", "error"))
    print("  around the peak: " + ", ".join(row.get("around_peak", [])))
    for buffer in row.get("buffers", []):
      print(f"    {buffer['bytes']:>14,}  {buffer['value']}")
  out_dir = args.out_dir or (os.path.join("/tmp", "jax_kittens_benchmarks") if args.smoke else common.RESULTS_DIR)
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, f"{common.results_name('layer_memory', args)}.json")
  with open(path, "w") as f:
    json.dump({**meta, "rows": rows}, f, indent=1)
  print(f"wrote {path}")
  shutil.rmtree(DUMP_DIR, ignore_errors=True)


if __name__ == "__main__":
  main()
