"""GPU triage of the fused MoE layer: every grouped-GEMM op at the layer's shapes, CUDA kernel vs its CPU twin.

Run from the repo root on the GPU machine:  timeout 540 python3 tests/gpu_triage.py [load] [T]  (.ci/gpu triage)
Prints, per op and output: relative Frobenius error GPU vs CPU twin (expect <~5e-3), non-finite count, and where the
mismatches are (data rows vs padding rows, row-in-tile and column-in-tile histograms), then the whole layer's
errors vs the f32 reference AND vs the kittens layer on the CPU (tells a reference problem from a kernel one).
"""
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jax_kittens import fused_moe, grouped_matmul as gm, permute, routing  # noqa: E402
import test_fused_moe as tfm  # noqa: E402

LOAD = sys.argv[1] if len(sys.argv) > 1 else "uniform"
T = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
H, I, E, K = 1024, 512, 16, 4
cpu = jax.devices("cpu")[0]
try:
  gpu = jax.devices("gpu")[0]
except RuntimeError:  # smoke test of this script without a GPU: both sides run the CPU twins
  gpu = cpu


def f64(a):
  return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def report(name, got, want, offsets=None, sizes=None, tile_cols=256):
  g, w = f64(got), f64(want)
  bad = ~np.isclose(g, w, rtol=2e-2, atol=2e-2 * (np.abs(w).max() + 1e-30))
  err = np.linalg.norm(np.nan_to_num(g - w, nan=1e30)) / max(np.linalg.norm(w), 1e-30)
  line = f"{name:28s} rel_err {err:.2e} nonfinite {int((~np.isfinite(g)).sum())} bad {int(bad.sum())}/{bad.size}"
  if bad.any() and g.ndim == 2:
    rows, cols = np.nonzero(bad)
    line += f"\n    bad rows {len(np.unique(rows))} (first {rows.min()}, last {rows.max()}), cols mod {tile_cols} hist "
    line += str(np.bincount(cols % tile_cols // 32, minlength=tile_cols // 32))
    line += f", row-in-tile//16 hist {np.bincount(rows % 128 // 16, minlength=8)}"
    if offsets is not None:
      o, s = np.asarray(offsets), np.asarray(sizes)
      data = np.zeros(g.shape[0], bool)
      for e in range(len(s)):
        data[o[e]:o[e] + s[e]] = True
      line += f", in data rows {int(data[rows].sum())}, in padding/tail rows {int((~data[rows]).sum())}"
  elif bad.any() and g.ndim == 3:
    grp, m, n = np.nonzero(bad)
    line += f"\n    bad groups {np.unique(grp)}, m mod 128 //16 hist {np.bincount(m % 128 // 16, minlength=8)}, "
    line += f"n mod 256 //32 hist {np.bincount(n % 256 // 32, minlength=8)}"
  print(line, flush=True)


def both(fn, *args, **kw):
  """fn on the GPU and on the CPU twin with the same inputs."""
  out = []
  for dev in (gpu, cpu):
    t0 = time.time()
    with jax.default_device(dev):
      res = jax.jit(lambda *a: fn(*a, **kw))(*[jax.device_put(a, dev) for a in args])
      res = jax.block_until_ready(res)
    print(f"  [{fn.__name__} on {dev.platform}: {time.time() - t0:.1f}s]", flush=True)
    out.append(res)
  return out


def step(name, thunk):
  try:
    thunk()
  except Exception:  # keep going: one broken op must not hide the others
    print(f"{name}: EXCEPTION\n{traceback.format_exc()}", flush=True)


rng = np.random.default_rng(0)
with jax.default_device(gpu):
  layer = tfm.make_layer(rng, T, H, I, E, K, LOAD, None, False)
  sched = routing.schedule(layer["ids"], E, align=gm.ROW_ALIGN, backend="kittens")
  num_rows = routing.num_schedule_rows(layer["ids"].size, E, gm.ROW_ALIGN)
  x_rows, row_weights = permute.gather_rows(layer["x"], sched, num_rows, weights=layer["weights"])
  dy = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
  dy_rows = permute.gather_rows(dy, sched, num_rows)
  row_tokens = permute.row_tokens(sched.rows, num_rows)
  off, siz = sched.expert_offsets, sched.tokens_per_expert
print(f"R={num_rows} offsets[-1]={int(off[-1])} sizes={np.asarray(siz)}", flush=True)
state = {}


def swiglu():
  g, c = both(gm.gmm_swiglu, x_rows, layer["w_gate"], layer["w_up"], off, siz, save_preactivations=True)
  for n, a, b in zip(("swiglu act", "swiglu gate", "swiglu up"), g, c):
    report(n, a, b, off, siz, 128)
  state["gate"], state["up"], state["act"] = c[1], c[2], c[0]


def dgrad():
  g, c = both(gm.gmm_swiglu_dgrad, dy_rows, layer["w_down"], state["gate"], state["up"], row_weights, off, siz)
  for n, a, b in zip(("dgrad d_gate", "dgrad d_up"), g[:2], c[:2]):
    report(n, a, b, off, siz)
  report("dgrad d_row_weights", g[2][:, None], c[2][:, None], off, siz)
  state["d_gate"], state["d_up"] = c[0], c[1]

  def dgrad_gathered(dy, row_tokens, *operands):
    return gm.gmm_swiglu_dgrad(dy, *operands, row_tokens=row_tokens)

  g, _ = both(dgrad_gathered, dy, row_tokens, layer["w_down"], state["gate"], state["up"], row_weights, off, siz)
  for n, a, b in zip(("dgrad gathered d_gate", "dgrad gathered d_up"), g[:2], c[:2]):
    report(n, a, b, off, siz)


def dx_rhs2():
  def gmm_dx(d_gate, w_gate, offsets, sizes, d_up, w_up):
    return gm.gmm(d_gate, w_gate, offsets, sizes, transpose_rhs=True, lhs2=d_up, rhs2=w_up)

  g, c = both(gmm_dx, state["d_gate"], layer["w_gate"], off, siz, state["d_up"], layer["w_up"])
  report("gmm transposed + lhs2, rhs2", g, c, off, siz)
  g, c = both(gm.gmm, jax.device_put(state["d_gate"], gpu), layer["w_gate"], off, siz, transpose_rhs=True)
  report("gmm transposed, K=I only", g, c, off, siz)


def tgmms():
  for out_dtype in (jnp.float32, jnp.bfloat16):
    g, c = both(gm.tgmm, x_rows, jax.device_put(state["d_gate"], gpu), off, siz, out_dtype=out_dtype)
    report(f"tgmm dW_gate {jnp.dtype(out_dtype)}", g, c)
  g, c = both(gm.tgmm, jax.device_put(state["act"], gpu), dy_rows, off, siz)
  report("tgmm dW_down", g, c)

  def tgmm_gathered(lhs, rhs, row_tokens, offsets, sizes, operand):
    return gm.tgmm(lhs, rhs, offsets, sizes, out_dtype=jnp.bfloat16, **{f"{operand}_row_tokens": row_tokens})

  g, c = both(tgmm_gathered, layer["x"], jax.device_put(state["d_gate"], gpu), row_tokens, off, siz, operand="lhs")
  report("tgmm dW_gate, x gathered", g, c)
  g, c = both(tgmm_gathered, jax.device_put(state["act"], gpu), dy, row_tokens, off, siz, operand="rhs")
  report("tgmm dW_down, dy gathered", g, c)


def whole_layer():
  d_y = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
  results = []
  for dev in (gpu, cpu):
    with jax.default_device(dev):
      args = [jax.device_put(a, dev) for a in tfm.layer_args(layer)[:5]] + [None]
      fn = tfm.grads_fn(fused_moe.moe_ffn, jax.device_put(layer["ids"], dev), jax.device_put(d_y, dev))
      results.append(jax.block_until_ready(fn(*args)))
  with jax.default_device(gpu):
    ref_y, ref_grads = tfm.f32_reference(layer, d_y, None)
  print("layer GPU vs f32 reference:", tfm.errors_against(*results[0], ref_y, ref_grads), flush=True)
  print("layer GPU vs kittens on CPU:", tfm.errors_against(*results[0], *results[1]), flush=True)
  print("layer CPU vs f32 reference:", tfm.errors_against(*results[1], ref_y, ref_grads), flush=True)


for name, thunk in (("swiglu", swiglu), ("dgrad", dgrad), ("dx_rhs2", dx_rhs2), ("tgmm", tgmms),
                    ("layer", whole_layer)):
  print(f"== {name}", flush=True)
  step(name, thunk)
