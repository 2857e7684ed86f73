"""Why one call of a layer takes longer than another: per call, each kernel's device time of the kittens
forward+backward and of the dense chain's.

Written when `layer.py` had the kittens fwd+bwd's median 9-16% over its min at deepseek-v4 and the dense chain's at
1-3%. It found the slower calls slower in every GEMM kernel, ours and cuBLAS's, by the same share: the clock under
the power cap, common to both. `layer.py`'s fixed order of calls had run the dense chain right after tokamax's slow
calls (since then `common.round_order` shuffles each round; benchmarks/NOTES.md, the thirty-first session).

The calls are made as `layer.py` makes them: the kittens fwd+bwd (per routing) and the dense chain's in alternation
(`common.round_order`), each synchronised on its outputs; first untraced, then under ``jax.profiler``. Per traced
call: the host's wall time, the device's span from the call's first kernel to the end of its last, the busy
time (its kernels' durations summed) and each XLA op's time. Then per op its min, median and max over the calls and
how much more it took in the slower half of the calls (by span) than in the faster half. One kernel slow in some
calls stands out there; a lower clock moves every op by the same factor; idle device time shows as span - busy, and
host time between the launches as wall - span.

  python3 benchmarks/layer_spread.py --shapes deepseek-v4     # on the GPU: benchmarks/results/layer_spread_h200.json
  python3 benchmarks/layer_spread.py --smoke                  # tiny shapes, any platform
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

import common  # noqa: E402
import layer  # noqa: E402

TOP_OPS = 12


def split_calls(events: list[common.DeviceEvent], module_of_call: list[str]) -> list[list[common.DeviceEvent]]:
  """The events (by start) of each call, in call order. Every call was synchronised before the next, and each
  function makes the same events per call, so call n's are the next (its module's events / its calls) events."""
  modules = sorted(set(module_of_call))
  module_of = lambda event: next((m for m in modules if event.module.startswith(m)), None)
  totals = collections.Counter(module_of(event) for event in events)
  calls_of = collections.Counter(module_of_call)
  if set(totals) != set(modules) or any(totals[m] % calls_of[m] for m in modules):
    raise RuntimeError(f"the trace does not hold whole calls: events per module {dict(totals)}, calls made "
                       f"{dict(calls_of)}")
  calls, position = [], 0
  for module in module_of_call:
    count = totals[module] // calls_of[module]
    call = events[position:position + count]
    if any(module_of(event) != module for event in call):
      raise RuntimeError(f"call {len(calls)} of {module} holds another function's events: the calls overlapped")
    calls.append(call)
    position += count
  return calls


def call_summary(events: list[common.DeviceEvent], wall_ms: float) -> dict:
  """One call's wall, span and busy times (ms) and its time per op and kernel ("op: kernel")."""
  per_op: dict[str, float] = {}
  for event in events:
    key = f"{event.op}: {event.kernel[:80]}"
    per_op[key] = per_op.get(key, 0.0) + event.duration_ns / 1e6
  span_ns = max(e.start_ns + e.duration_ns for e in events) - events[0].start_ns
  return {"wall_ms": wall_ms, "span_ms": span_ns / 1e6, "busy_ms": sum(per_op.values()), "ops_ms": per_op}


def spread(summaries: list[dict]) -> dict:
  """Over one function's calls: min, median and max of wall, span and busy; per op the same and its excess in the
  slower half of the calls (by span) over the faster half, largest first."""
  by_span = sorted(summaries, key=lambda s: s["span_ms"])
  fast, slow = by_span[:len(by_span) // 2], by_span[len(by_span) // 2:]
  stats = lambda values: {"min": min(values), "median": statistics.median(values), "max": max(values)}
  mean = lambda calls, op: statistics.fmean(c["ops_ms"].get(op, 0.0) for c in calls)
  ops = [{"op": op, **stats([s["ops_ms"].get(op, 0.0) for s in summaries]),
          "slow_minus_fast_ms": mean(slow, op) - mean(fast, op) if fast else 0.0}
         for op in summaries[0]["ops_ms"]]
  ops.sort(key=lambda o: -abs(o["slow_minus_fast_ms"]))
  return {**{f"{field}_ms": stats([s[f"{field}_ms"] for s in summaries]) for field in ("wall", "span", "busy")},
          "slow_minus_fast_span_ms": (statistics.fmean(s["span_ms"] for s in slow) -
                                      statistics.fmean(s["span_ms"] for s in fast)) if fast else 0.0,
          "ops": ops}


def named(fn, name):
  """fn under another __name__: jit names the XLA module after it, which tells the calls apart in the trace."""
  def wrapper(*args):
    return fn(*args)
  wrapper.__name__ = name
  return wrapper


def alternate(functions: dict, calls: int, log: list[str] | None = None) -> list[dict | Exception]:
  """`common.time_interleaved` of ``functions`` ({label: (jitted fn, arg sets)}), ``calls`` timed calls each; ``log``
  gets every call's label in call order, the warm-ups included."""
  def caller(label, fn, arg_sets):
    def call(i):
      if log is not None:
        log.append(label)
      return fn(*arg_sets[i % len(arg_sets)])
    return call

  return common.time_interleaved([caller(label, *function) for label, function in functions.items()], iters=calls,
                                 min_iters=calls, budget_s=1e9)


def measure_shape(name, shape, num_tokens, calls):
  inputs = layer.shape_inputs(jax.random.key(sum(map(ord, name))), shape, num_tokens)
  kittens = layer.forward_backward(layer.routed_layer("kittens", None), layer.ROUTED_DIFFERENTIABLE)
  # One jit per routing, though one executable would serve both: the module names tell their calls apart.
  functions = {f"kittens_{routing}": (jax.jit(named(kittens, f"kittens_{routing}")),
                                      [(x, *inputs["routings"][routing], *inputs["experts"], inputs["d_y"])
                                       for x in inputs["xs"]])
               for routing in common.ROUTINGS}
  functions["dense"] = (jax.jit(named(layer.forward_backward(layer.dense_layer, layer.DENSE_DIFFERENTIABLE), "dense")),
                        [(inputs["dense_rows"], *inputs["experts"], inputs["dense_d_y"])])
  untraced = alternate(functions, calls)
  order: list[str] = []
  traced: list[dict] = []
  events = common.trace(lambda: traced.extend(alternate(functions, calls, order)))
  # time_interleaved's warm-up calls come first, one per function.
  per_call = split_calls(events, [f"jit_{label}" for label in order])[len(functions):]
  events_of: dict[str, list] = {label: [] for label in functions}
  for label, call_events in zip(order[len(functions):], per_call):
    events_of[label].append(call_events)
  summaries = {label: [call_summary(call_events, wall)
                       for call_events, wall in zip(events_of[label], timed["times_ms"])]
               for label, timed in zip(functions, traced)}
  rows = []
  for (label, result), calls_of in zip(zip(functions, untraced), summaries.values()):
    row = {"shape": name, "function": label, "untraced": result if isinstance(result, dict) else str(result),
           "traced": spread(calls_of), "calls": [{k: round(v, 4) if isinstance(v, float) else v
                                                  for k, v in c.items() if k != "ops_ms"} for c in calls_of]}
    rows.append(row)
    report(row)
  return rows


def report(row):
  untraced, traced = row["untraced"], row["traced"]
  times = untraced.get("times_ms", []) if isinstance(untraced, dict) else []
  print(f"== {row['shape']} {row['function']}: untraced median {statistics.median(times) if times else 0:.2f} ms, "
        f"min {min(times, default=0):.2f}; runs " + " ".join(f"{t:.1f}" for t in times), flush=True)
  fmt = lambda s: f"{s['min']:.2f} / {s['median']:.2f} / {s['max']:.2f}"
  print(f"  traced (min / median / max ms): wall {fmt(traced['wall_ms'])}, span {fmt(traced['span_ms'])}, busy "
        f"{fmt(traced['busy_ms'])}; slower half's span - faster half's: {traced['slow_minus_fast_span_ms']:.3f} ms")
  print("  spans: " + " ".join(f"{c['span_ms']:.1f}" for c in row["calls"]))
  for op in traced["ops"][:TOP_OPS]:
    print(f"  {op['slow_minus_fast_ms']:+8.3f} ms slow - fast   {fmt(op)}   {op['op'][:100]}", flush=True)


def main():
  args = common.parse_args(__doc__.splitlines()[0])
  meta = {**common.metadata(), "calls": args.iters}
  print(f"layer spread: {meta}", flush=True)
  path = os.path.join(args.out_dir, f"{common.results_name('layer_spread', args)}.json")
  os.makedirs(args.out_dir, exist_ok=True)
  rows = []
  for name, shape in args.model_shapes.items():
    rows += measure_shape(name, shape, common.num_tokens(args), args.iters)
    with open(path, "w") as f:  # after every shape, so that a run cut short keeps the shapes it finished
      json.dump({**meta, "rows": rows}, f, indent=1)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
