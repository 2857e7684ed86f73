"""Grouped GEMM targets (jk_gmm, jk_gmm_swiglu, jk_gmm_swiglu_dgrad, jk_tgmm) and jax_kittens.ragged_dot.

Oracles: float64 numpy over the same bf16 inputs, and jax.lax.ragged_dot. The CPU tests run the CPU twins; the
`gpu` tests run the same checks through the sm90 kernels at sizes that fill the GPU, with NaN-poisoned outputs
(JAX_KITTENS_POISON_OUTPUTS, set in conftest.py).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kittens
from jax_kittens import grouped_matmul as gm
from jax_kittens import routing

BF16_TOL = 2e-2  # relative Frobenius error of bf16 operands/results with f32 accumulation (typ. 3e-3)


def rel_err(out, ref):
  out = np.asarray(out, np.float64)
  ref = np.asarray(ref, np.float64)
  assert np.all(np.isfinite(out)), "non-finite values in the output"
  return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)


def bf16(rng, *shape, scale=1.0):
  return jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)


def device_bf16(key, *shape, scale=1.0):
  """bf16() drawn on the default device: numpy's generator takes tens of seconds at the GPU tests' largest sizes."""
  return (jax.random.normal(key, shape, jnp.float32) * scale).astype(jnp.bfloat16)


def f64(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def aligned_layout(sizes, align, total_rows=None, head=0):
  """group_sizes -> (group_offsets, group_sizes) with each group's extent a multiple of align, the first starting at
  row ``head``."""
  sizes = np.asarray(sizes, np.int32)
  padded = (sizes + align - 1) // align * align
  offsets = (head + np.concatenate([[0], np.cumsum(padded)])).astype(np.int32)
  assert total_rows is None or offsets[-1] <= total_rows
  return jnp.asarray(offsets), jnp.asarray(sizes)


def data_rows_of(offsets, sizes):
  """[(group, row)] for every data row."""
  return [(g, r) for g in range(len(sizes)) for r in range(int(offsets[g]), int(offsets[g]) + int(sizes[g]))]


def data_row_mask(offsets, sizes, rows):
  """[rows] bool: True on data rows, False on padding and tail rows."""
  is_data = np.zeros(rows, bool)
  for _, r in data_rows_of(np.asarray(offsets), sizes):
    is_data[r] = True
  return is_data


def gmm_oracle(lhs, rhs, offsets, sizes, transpose_rhs=False, lhs2=None, rhs2=None):
  lhs, rhs = f64(lhs), f64(rhs)
  if transpose_rhs:
    rhs = rhs.transpose(0, 2, 1)
  if rhs2 is not None:
    rhs2 = f64(rhs2)
    lhs = np.concatenate([lhs, f64(lhs2)], axis=1)
    rhs = np.concatenate([rhs, rhs2.transpose(0, 2, 1) if transpose_rhs else rhs2], axis=1)
  out = np.zeros((lhs.shape[0], rhs.shape[2]))
  for g, (begin, size) in enumerate(zip(np.asarray(offsets)[:-1], np.asarray(sizes))):
    out[begin:begin + size] = lhs[begin:begin + size] @ rhs[g]
  return out


def swiglu64(gate, up, limit):
  if limit is not None:
    gate = np.minimum(gate, limit)
    up = np.clip(up, -limit, limit)
  return gate / (1 + np.exp(-gate)) * up


SIZE_CASES = {
    "skewed_with_empty": [37, 0, 130, 1, 0, 90],
    "all_in_one": [0, 0, 257, 0],
    "all_empty": [0, 0, 0],
    "single_rows": [1, 1, 1, 1, 1],
}


@pytest.mark.parametrize("case", SIZE_CASES)
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_gmm_padded_layout(case, out_dtype):
  rng = np.random.default_rng(len(case))
  sizes = SIZE_CASES[case]
  rows = sum((s + 127) // 128 * 128 for s in sizes) + 70  # a tail past the last group
  offsets, group_sizes = aligned_layout(sizes, gm.ROW_ALIGN, rows)
  lhs, rhs = bf16(rng, rows, 128), bf16(rng, len(sizes), 128, 64)
  out = gm.gmm(lhs, rhs, offsets, group_sizes, out_dtype=out_dtype)
  assert out.shape == (rows, 64) and out.dtype == out_dtype
  ref = gmm_oracle(lhs, rhs, offsets, group_sizes)
  if np.any(ref):
    assert rel_err(out, ref) < BF16_TOL
  # Padding and tail rows are exactly 0.
  is_data = data_row_mask(offsets, sizes, rows)
  assert np.all(f64(out)[~is_data] == 0)


@pytest.mark.parametrize("n", [512, 768])  # two 256-column blocks (cluster pairs on the GPU), three (none)
def test_gmm_large_groups(n):
  """Groups of more than 16 row tiles, which the scheduler cuts into bands (17 tiles: 9 + 8)."""
  rng = np.random.default_rng(n)
  sizes = [2100, 0, 1900, 5]
  rows = sum((s + 127) // 128 * 128 for s in sizes)
  offsets, group_sizes = aligned_layout(sizes, gm.ROW_ALIGN, rows)
  lhs, rhs = bf16(rng, rows, 64), bf16(rng, len(sizes), 64, n)
  out = gm.gmm(lhs, rhs, offsets, group_sizes)
  assert rel_err(out, gmm_oracle(lhs, rhs, offsets, group_sizes)) < BF16_TOL


@pytest.mark.parametrize("seed", range(4))
def test_gmm_random_group_layouts(seed):
  """Random mixes of empty, tiny (under 40 rows), one- or two-tile and 3- to 10-tile groups, with and without head
  and tail rows, through the row scheduler: every data row computed once, every other row 0."""
  rng = np.random.default_rng(100 + seed)
  num_groups = int(rng.integers(3, 12))
  kinds = rng.integers(0, 4, num_groups)
  sizes = [0 if k == 0 else int(rng.integers(1, 257)) if k == 1 else int(rng.integers(257, 1200)) if k == 2
           else int(rng.integers(1, 40)) for k in kinds]
  offsets, group_sizes = aligned_layout(sizes, gm.ROW_ALIGN, head=128 * int(rng.integers(0, 2)))
  rows = int(offsets[-1]) + int(rng.integers(0, 300))
  n = [512, 768][seed % 2]
  lhs, rhs = bf16(rng, rows, 64), bf16(rng, num_groups, 64, n)
  out = f64(gm.gmm(lhs, rhs, offsets, group_sizes))
  ref = gmm_oracle(lhs, rhs, offsets, group_sizes)
  if np.any(ref):
    assert rel_err(out, ref) < BF16_TOL
  assert np.all(out[~data_row_mask(offsets, sizes, rows)] == 0)


@pytest.mark.parametrize("n", [512, 768])  # cluster pairs on the GPU, or none
def test_gmm_groups_sorted_by_load(n):
  """Groups sorted by load, as a router that favours low expert indices makes them: heavy groups of one to three
  bands, then light groups of one or two row tiles, empty ones among them. The scheduler's visit plan moves the
  light groups between the heavy groups' bands; the CPU twin checks that the visits walk each tile once."""
  rng = np.random.default_rng(n)
  sizes = [4500, 2100, 900, 400, 257] + [int(s) for s in rng.integers(1, 257, 12)] + [0, 3, 0]
  offsets, group_sizes = aligned_layout(sizes, gm.ROW_ALIGN)
  rows = int(offsets[-1]) + 50
  lhs, rhs = bf16(rng, rows, 64), bf16(rng, len(sizes), 64, n)
  out = f64(gm.gmm(lhs, rhs, offsets, group_sizes))
  assert rel_err(out, gmm_oracle(lhs, rhs, offsets, group_sizes)) < BF16_TOL
  assert np.all(out[~data_row_mask(offsets, sizes, rows)] == 0)


def test_gmm_rows_outside_every_group_are_zero():
  """Rows before group_offsets[0] and after group_offsets[G] belong to no group: written as 0."""
  rng = np.random.default_rng(9)
  offsets = jnp.asarray([130, 200, 200, 330], jnp.int32)
  group_sizes = jnp.asarray([70, 0, 100], jnp.int32)
  lhs, rhs = bf16(rng, 400, 64), bf16(rng, 3, 64, 320)
  out = f64(gm.gmm(lhs, rhs, offsets, group_sizes))
  ref = gmm_oracle(lhs, rhs, offsets, group_sizes)
  assert rel_err(out, ref) < BF16_TOL
  assert np.all(out[:130] == 0) and np.all(out[300:] == 0)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gmm_transpose_and_rhs2(transpose_rhs):
  rng = np.random.default_rng(1)
  sizes = [50, 0, 77]
  offsets, group_sizes = aligned_layout(sizes, 64, 256)
  lhs, lhs2 = bf16(rng, 256, 128), bf16(rng, 256, 64)
  shape1, shape2 = ((3, 64, 128), (3, 64, 64)) if transpose_rhs else ((3, 128, 64), (3, 64, 64))
  rhs, rhs2 = bf16(rng, *shape1), bf16(rng, *shape2)
  out = gm.gmm(lhs, rhs, offsets, group_sizes, transpose_rhs=transpose_rhs, lhs2=lhs2, rhs2=rhs2)
  ref = gmm_oracle(lhs, rhs, offsets, group_sizes, transpose_rhs, lhs2, rhs2)
  assert rel_err(out, ref) < BF16_TOL


# Group sizes of the CPU tests of the SwiGLU GEMMs and tgmm: ragged with an empty group, everything in one group, and
# no rows at all (every output 0).
GROUP_SIZES = {"ragged": [70, 0, 200, 3], "all_in_one": [0, 273, 0, 0], "empty": [0, 0, 0, 0]}


@pytest.mark.parametrize("sizes", GROUP_SIZES.values(), ids=GROUP_SIZES.keys())
@pytest.mark.parametrize("limit", [None, 1.5])
def test_gmm_swiglu(limit, sizes):
  rng = np.random.default_rng(2)
  rows = 600
  offsets, group_sizes = aligned_layout(sizes, gm.ROW_ALIGN, rows)
  x, w_gate, w_up = bf16(rng, rows, 128), bf16(rng, 4, 128, 128, scale=0.1), bf16(rng, 4, 128, 128, scale=0.1)
  act, gate, up = gm.gmm_swiglu(x, w_gate, w_up, offsets, group_sizes, swiglu_limit=limit, save_preactivations=True)
  gate_ref = gmm_oracle(x, w_gate, offsets, group_sizes)
  up_ref = gmm_oracle(x, w_up, offsets, group_sizes)
  assert rel_err(gate, gate_ref) < BF16_TOL and rel_err(up, up_ref) < BF16_TOL
  assert rel_err(act, swiglu64(gate_ref, up_ref, limit)) < BF16_TOL
  if limit is not None and sum(sizes):
    assert np.mean(np.abs(up_ref) > limit) > 0.05  # the clamp is exercised
  act_only = gm.gmm_swiglu(x, w_gate, w_up, offsets, group_sizes, swiglu_limit=limit)
  np.testing.assert_array_equal(f64(act_only), f64(act))


def gathered_operands(rng, offsets, sizes, num_tokens, rows):
  """row_tokens [rows] for the layout (offsets, sizes): data rows take random tokens (one out of range, which reads
  as zeros), padding rows -1 or junk; and the [rows] indices that gather x into the same rows (num_tokens: zeros)."""
  row_tokens = np.where(rng.random(rows) < 0.5, -1, rng.integers(0, 10 * num_tokens, rows)).astype(np.int32)
  for _, r in data_rows_of(np.asarray(offsets), sizes):
    row_tokens[r] = rng.integers(0, num_tokens)
  first_data_row = data_rows_of(np.asarray(offsets), sizes)[0][1]
  row_tokens[first_data_row] = num_tokens + 5
  gather_index = np.where((row_tokens >= 0) & (row_tokens < num_tokens), row_tokens, num_tokens)
  return jnp.asarray(row_tokens), gather_index


def gather(tokens, gather_index):
  """tokens [T, C] -> rows [len(gather_index), C]: index T reads as zeros."""
  return jnp.concatenate([tokens, jnp.zeros((1, tokens.shape[1]), tokens.dtype)])[gather_index]


@pytest.mark.parametrize("save", [False, True])
def test_gmm_swiglu_gathered_equals_rows(save):
  """row_tokens: the same bits as gmm_swiglu over the rows gathered beforehand (zeros for tokens out of range)."""
  rng = np.random.default_rng(21)
  sizes, rows, num_tokens = [70, 0, 200, 3], 600, 150
  offsets, group_sizes = aligned_layout(sizes, gm.ROW_ALIGN, rows)
  x = bf16(rng, num_tokens, 128)
  w_gate, w_up = bf16(rng, 4, 128, 192, scale=0.1), bf16(rng, 4, 128, 192, scale=0.1)
  row_tokens, gather_index = gathered_operands(rng, offsets, sizes, num_tokens, rows)
  x_rows = gather(x, gather_index)
  run = functools.partial(gm.gmm_swiglu, save_preactivations=save, swiglu_limit=1.5)
  for out, ref in zip(jax.tree.leaves(run(x, w_gate, w_up, offsets, group_sizes, row_tokens=row_tokens)),
                      jax.tree.leaves(run(x_rows, w_gate, w_up, offsets, group_sizes))):
    np.testing.assert_array_equal(f64(out), f64(ref))


@pytest.mark.parametrize("sizes", GROUP_SIZES.values(), ids=GROUP_SIZES.keys())
@pytest.mark.parametrize("limit", [None, 1.0])
def test_gmm_swiglu_dgrad_matches_autodiff(limit, sizes):
  rng = np.random.default_rng(3)
  rows = 520
  offsets, group_sizes = aligned_layout(sizes, gm.ROW_ALIGN, rows)
  inner, hidden = 128, 64
  gate, up = bf16(rng, rows, inner), bf16(rng, rows, inner)
  dy, w_down = bf16(rng, rows, hidden), bf16(rng, 4, inner, hidden, scale=0.1)
  row_weights = jnp.asarray(rng.uniform(0.1, 1.0, rows), jnp.float32)
  d_gate, d_up, d_weights, weighted_act = gm.gmm_swiglu_dgrad(dy, w_down, gate, up, row_weights, offsets, group_sizes,
                                                              swiglu_limit=limit, save_weighted_act=True)
  # Oracle: autodiff of  sum_r <dy[r], w_r * (swiglu(gate, up)[r] @ w_down[g])>  over data rows, in float64 numpy
  # form: g = dy @ w_down^T; d_act = w * g; d_w = <g, act>.
  g = gmm_oracle(dy, w_down, offsets, group_sizes, transpose_rhs=True)
  gate64, up64 = f64(gate), f64(up)
  gate_c = np.minimum(gate64, limit) if limit is not None else gate64
  up_c = np.clip(up64, -limit, limit) if limit is not None else up64
  sig = 1 / (1 + np.exp(-gate_c))
  act = gate_c * sig * up_c
  d_act = f64(row_weights)[:, None] * g
  gate_mask = np.where(gate64 < limit, 1.0, np.where(gate64 == limit, 0.5, 0.0)) if limit is not None else 1.0
  up_mask = (np.where(np.abs(up64) < limit, 1.0, np.where(np.abs(up64) == limit, 0.5, 0.0))
             if limit is not None else 1.0)
  d_gate_ref = d_act * up_c * sig * (1 + gate_c * (1 - sig)) * gate_mask
  d_up_ref = d_act * gate_c * sig * up_mask
  assert rel_err(d_gate, d_gate_ref) < BF16_TOL
  assert rel_err(d_up, d_up_ref) < BF16_TOL
  assert rel_err(d_weights, np.sum(g * act, axis=1)) < BF16_TOL
  is_data = data_row_mask(offsets, sizes, rows)
  assert rel_err(weighted_act, np.where(is_data[:, None], f64(row_weights)[:, None] * act, 0.0)) < BF16_TOL
  assert np.all(f64(d_weights)[~is_data] == 0) and np.all(f64(d_gate)[~is_data] == 0)
  assert np.all(f64(weighted_act)[~is_data] == 0)
  # Without weighted_act: the same bits for the rest.
  for out, ref in zip(gm.gmm_swiglu_dgrad(dy, w_down, gate, up, row_weights, offsets, group_sizes, swiglu_limit=limit),
                      (d_gate, d_up, d_weights)):
    np.testing.assert_array_equal(f64(out), f64(ref))


def test_gmm_swiglu_dgrad_gathered_equals_rows():
  """row_tokens: the same bits as the dgrad over dy rows gathered beforehand (zeros for tokens out of range)."""
  rng = np.random.default_rng(23)
  sizes, rows, num_tokens, inner, hidden = [40, 130, 0, 9], 520, 90, 128, 192
  offsets, group_sizes = aligned_layout(sizes, gm.ROW_ALIGN, rows)
  gate, up, dy = bf16(rng, rows, inner), bf16(rng, rows, inner), bf16(rng, num_tokens, hidden)
  w_down = bf16(rng, 4, inner, hidden, scale=0.1)
  row_weights = jnp.asarray(rng.uniform(0.1, 1.0, rows), jnp.float32)
  row_tokens, gather_index = gathered_operands(rng, offsets, sizes, num_tokens, rows)
  run = functools.partial(gm.gmm_swiglu_dgrad, swiglu_limit=1.0, save_weighted_act=True)
  got = run(dy, w_down, gate, up, row_weights, offsets, group_sizes, row_tokens=row_tokens)
  want = run(gather(dy, gather_index), w_down, gate, up, row_weights, offsets, group_sizes)
  for out, ref in zip(got, want):
    np.testing.assert_array_equal(f64(out), f64(ref))


@pytest.mark.parametrize("operand", ["lhs", "rhs"])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_tgmm_gathered_equals_rows(operand, out_dtype):
  """lhs_row_tokens / rhs_row_tokens: the same bits as tgmm over rows gathered beforehand, on groups that start
  anywhere (tgmm needs no alignment) and junk rows after the last one."""
  rng = np.random.default_rng(24)
  sizes, num_tokens = [33, 0, 150, 1], 70
  offsets = jnp.asarray(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32))
  rows = sum(sizes) + 20
  row_tokens, gather_index = gathered_operands(rng, offsets, sizes, num_tokens, rows)
  tokens = bf16(rng, num_tokens, 128 if operand == "lhs" else 192)
  other = bf16(rng, rows, 192 if operand == "lhs" else 128).at[sum(sizes):].set(jnp.nan)
  operands = (tokens, other) if operand == "lhs" else (other, tokens)
  rows_operands = (gather(tokens, gather_index), other) if operand == "lhs" else (other, gather(tokens, gather_index))
  group_sizes = jnp.asarray(sizes, jnp.int32)
  got = gm.tgmm(*operands, offsets, group_sizes, out_dtype=out_dtype, **{f"{operand}_row_tokens": row_tokens})
  want = gm.tgmm(*rows_operands, offsets, group_sizes, out_dtype=out_dtype)
  assert got.shape == (4, 128, 192) and got.dtype == out_dtype
  np.testing.assert_array_equal(f64(got), f64(want))
  assert np.all(f64(got)[1] == 0) and np.any(f64(got)[2] != 0)


@pytest.mark.parametrize("sizes", GROUP_SIZES.values(), ids=GROUP_SIZES.keys())
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_tgmm(out_dtype, sizes):
  rng = np.random.default_rng(4)
  rows = 530
  offsets, group_sizes = aligned_layout(sizes, gm.ROW_ALIGN, rows)
  lhs, rhs = bf16(rng, rows, 128), bf16(rng, rows, 64)
  # Padding rows of the inputs must not reach the result, even when they hold non-finite garbage.
  lhs = jnp.where(data_row_mask(offsets, sizes, rows)[:, None], lhs, jnp.nan)
  out = gm.tgmm(lhs, rhs, offsets, group_sizes, out_dtype=out_dtype)
  assert out.shape == (4, 128, 64) and out.dtype == out_dtype
  ref = np.zeros((4, 128, 64))
  for g, r in data_rows_of(np.asarray(offsets), sizes):
    ref[g] += np.outer(f64(lhs[r]), f64(rhs[r]))
  assert rel_err(out, ref) < BF16_TOL
  for g in np.flatnonzero(np.asarray(sizes) == 0):
    assert np.all(f64(out)[g] == 0)


@pytest.mark.parametrize("n", [512, 768])  # two 256-column blocks (cluster pairs on the GPU), three (none)
def test_tgmm_output_rows_in_bands(n):
  """More than 16 output row tiles per group (K = 2176: 17, cut into bands of 9 + 8), the tiles in band order; the
  CPU twin checks that tiles 2j and 2j + 1 are a cluster's pair."""
  rng = np.random.default_rng(n + 1)
  sizes = [40, 0, 70]
  offsets = jnp.asarray(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32))
  lhs, rhs = bf16(rng, sum(sizes), 2176), bf16(rng, sum(sizes), n)
  out = gm.tgmm(lhs, rhs, offsets, jnp.asarray(sizes, jnp.int32), out_dtype=jnp.float32)
  ref = np.zeros((3, 2176, n))
  for g, r in data_rows_of(np.asarray(offsets), sizes):
    ref[g] += np.outer(f64(lhs[r]), f64(rhs[r]))
  assert rel_err(out, ref) < BF16_TOL
  assert np.all(f64(out)[1] == 0)


@pytest.mark.parametrize("case", ["skewed", "all_in_one", "with_empty", "short"])
@pytest.mark.parametrize("out_dtype", [None, jnp.float32])
def test_ragged_dot_matches_lax(case, out_dtype):
  rng = np.random.default_rng(5)
  m, k, n = 301, 128, 192
  sizes = {"skewed": [200, 3, 0, 98], "all_in_one": [0, 301, 0, 0], "with_empty": [0, 150, 0, 151],
           "short": [10, 20, 0, 5]}[case]  # "short": rows past sum(group_sizes) are 0
  lhs, rhs = bf16(rng, m, k), bf16(rng, 4, k, n)
  group_sizes = jnp.asarray(sizes, jnp.int32)
  out = gm.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=out_dtype, backend="kittens")
  ref = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=out_dtype)
  assert out.dtype == ref.dtype and out.shape == ref.shape
  assert rel_err(out, ref) < BF16_TOL
  assert np.all(f64(out)[sum(sizes):] == 0)


@pytest.mark.parametrize("case", ["skewed", "all_in_one"])
def test_ragged_dot_vjp_matches_lax(case):
  rng = np.random.default_rng(6)
  m, k, n = 200, 64, 128
  sizes = {"skewed": [120, 0, 80], "all_in_one": [0, 0, 190]}[case]
  lhs, rhs, cotangent = bf16(rng, m, k), bf16(rng, 3, k, n), bf16(rng, m, n)
  group_sizes = jnp.asarray(sizes, jnp.int32)

  def loss(fn, lhs, rhs):
    out = fn(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    return jnp.sum(out * cotangent.astype(jnp.float32))

  ours = jax.grad(functools.partial(loss, functools.partial(gm.ragged_dot, backend="kittens")), argnums=(0, 1))
  theirs = jax.grad(functools.partial(loss, jax.lax.ragged_dot), argnums=(0, 1))
  for got, want in zip(jax.jit(ours)(lhs, rhs), theirs(lhs, rhs)):
    assert got.dtype == want.dtype
    assert rel_err(got, want) < BF16_TOL


def test_ragged_dot_auto_falls_back_for_unsupported_shapes(monkeypatch):
  """Where "auto" picks the kernels (as on a GPU), arguments they do not take go to xla instead of raising."""
  monkeypatch.setattr(gm._extension, "kittens_by_default", lambda *arrays, **_: True)
  rng = np.random.default_rng(7)
  lhs, rhs = bf16(rng, 10, 24), bf16(rng, 2, 24, 40)
  group_sizes = jnp.asarray([4, 6], jnp.int32)
  np.testing.assert_array_equal(f64(gm.ragged_dot(lhs, rhs, group_sizes)),
                                f64(jax.lax.ragged_dot(lhs, rhs, group_sizes)))
  with pytest.raises(ValueError, match="multiples of 64"):
    gm.ragged_dot(lhs, rhs, group_sizes, backend="kittens")
  lhs32, rhs32 = (jnp.asarray(a, jnp.float32) for a in (bf16(rng, 10, 64), bf16(rng, 2, 64, 128)))
  np.testing.assert_array_equal(f64(gm.ragged_dot(lhs32, rhs32, group_sizes)),
                                f64(jax.lax.ragged_dot(lhs32, rhs32, group_sizes)))
  with pytest.raises(ValueError, match="needs bf16"):
    gm.ragged_dot(lhs32, rhs32, group_sizes, backend="kittens")
  # Supported arguments take the kernels.
  monkeypatch.setattr(gm, "_lax_ragged_dot", lambda *_, **__: pytest.fail("auto sent kernel-ready arguments to xla"))
  lhs16, rhs16, sizes = bf16(rng, 70, 64), bf16(rng, 2, 64, 128), jnp.asarray([30, 40], jnp.int32)
  np.testing.assert_array_equal(f64(gm.ragged_dot(lhs16, rhs16, sizes)),
                                f64(gm.ragged_dot(lhs16, rhs16, sizes, backend="kittens")))


def test_ragged_dot_takes_lax_arguments(monkeypatch):
  """jax.lax.ragged_dot's positional and keyword arguments: precisions run the kernels, the rest go to xla."""
  rng = np.random.default_rng(8)
  lhs, rhs = bf16(rng, 70, 64), bf16(rng, 3, 64, 128)
  group_sizes = jnp.asarray([30, 0, 33], jnp.int32)
  ref = jax.lax.ragged_dot(lhs, rhs, group_sizes, None, jnp.float32)
  for precision in (None, "highest", jax.lax.Precision.DEFAULT, ("high", jax.lax.Precision.HIGHEST)):
    out = gm.ragged_dot(lhs, rhs, group_sizes, precision, jnp.float32, backend="kittens")
    assert out.dtype == jnp.float32 and rel_err(out, ref) < BF16_TOL

  # "auto" where the kernels are the default: what they do not take goes to jax.lax.ragged_dot.
  monkeypatch.setattr(gm._extension, "kittens_by_default", lambda *arrays, **_: True)
  xla_calls = []
  monkeypatch.setattr(gm, "_lax_ragged_dot", lambda *args, **kwargs: xla_calls.append((args, kwargs)))
  gm.ragged_dot(lhs, rhs, group_sizes, jax.lax.DotAlgorithmPreset.BF16_BF16_F32)
  gm.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float16)
  gm.ragged_dot(lhs, rhs, group_sizes, group_offset=jnp.zeros((1,), jnp.int32))
  assert len(xla_calls) == 3
  assert xla_calls[0][0][3] == jax.lax.DotAlgorithmPreset.BF16_BF16_F32 and xla_calls[1][0][4] == jnp.float16
  assert xla_calls[2][1]["group_offset"].shape == (1,)
  assert rel_err(gm.ragged_dot(lhs, rhs, group_sizes, "highest", jnp.float32), ref) < BF16_TOL
  assert len(xla_calls) == 3  # a Precision stays on the kernels

  with pytest.raises(ValueError, match="precision None or a jax.lax.Precision"):
    gm.ragged_dot(lhs, rhs, group_sizes, jax.lax.DotAlgorithmPreset.BF16_BF16_F32, backend="kittens")
  with pytest.raises(ValueError, match="preferred_element_type bfloat16 or float32"):
    gm.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float16, backend="kittens")
  with pytest.raises(ValueError, match="group_offset and out_sharding None"):
    gm.ragged_dot(lhs, rhs, group_sizes, group_offset=jnp.zeros((1,), jnp.int32), backend="kittens")


def test_ragged_dot_patched_into_lax(monkeypatch):
  """``jax.lax.ragged_dot = jax_kittens.ragged_dot`` (a model patched in place): what goes to xla still runs."""
  rng = np.random.default_rng(9)
  lhs, rhs = bf16(rng, 20, 24), bf16(rng, 2, 24, 40)  # K, N not multiples of 64: the xla backend
  group_sizes = jnp.asarray([7, 13], jnp.int32)
  ref = jax.lax.ragged_dot(lhs, rhs, group_sizes)
  monkeypatch.setattr(jax.lax, "ragged_dot", gm.ragged_dot)
  np.testing.assert_array_equal(f64(jax.lax.ragged_dot(lhs, rhs, group_sizes)), f64(ref))


def test_argument_errors():
  x = jnp.zeros((128, 64), jnp.bfloat16)
  w = jnp.zeros((2, 64, 64), jnp.bfloat16)
  offsets, sizes = jnp.zeros((3,), jnp.int32), jnp.zeros((2,), jnp.int32)
  with pytest.raises(TypeError, match="lhs must be bfloat16"):
    gm.gmm(x.astype(jnp.float32), w, offsets, sizes)
  with pytest.raises(ValueError, match="group_offsets must have shape"):
    gm.gmm(x, w, sizes, sizes)
  with pytest.raises(ValueError, match="multiple of 64"):
    gm.gmm(x[:, :32], w[:, :32], offsets, sizes)
  with pytest.raises(ValueError, match="lhs2 and rhs2 must be given together"):
    gm.gmm(x, w, offsets, sizes, rhs2=w)
  with pytest.raises(ValueError, match="lhs2 must be"):
    gm.gmm(x, w, offsets, sizes, lhs2=x[:5], rhs2=w)
  with pytest.raises(ValueError, match="swiglu_limit"):
    gm.gmm_swiglu(x, w, w, offsets, sizes, swiglu_limit=-1.0)
  with pytest.raises(TypeError, match="row_tokens must be int32"):
    gm.gmm_swiglu(x, w, w, offsets, sizes, row_tokens=jnp.zeros((4,), jnp.float32))
  with pytest.raises(ValueError, match="row_tokens must have at least one row"):
    gm.gmm_swiglu(x, w, w, offsets, sizes, row_tokens=jnp.zeros((0,), jnp.int32))
  tokens = jnp.zeros((128,), jnp.int32)
  with pytest.raises(ValueError, match="gate must have shape"):
    gm.gmm_swiglu_dgrad(x, w, x[:100], x[:100], jnp.zeros((100,), jnp.float32), offsets, sizes, row_tokens=tokens)
  with pytest.raises(ValueError, match="not both"):
    gm.tgmm(x, x, offsets, sizes, lhs_row_tokens=tokens, rhs_row_tokens=tokens)
  with pytest.raises(ValueError, match="rhs must give R=100 rows"):
    gm.tgmm(x, x, offsets, sizes, lhs_row_tokens=tokens[:100])
  with pytest.raises(TypeError, match="rhs_row_tokens must be int32"):
    gm.tgmm(x, x, offsets, sizes, rhs_row_tokens=tokens.astype(jnp.float32))
  huge = jax.ShapeDtypeStruct((2**29, 64), jnp.bfloat16)  # traced only: 2^35 elements
  with pytest.raises(ValueError, match="T \\* C < 2\\^35"):
    jax.eval_shape(lambda t: gm.tgmm(t, x, offsets, sizes, lhs_row_tokens=tokens), huge)
  with pytest.raises(ValueError, match="backend"):
    gm.ragged_dot(x, w, sizes, backend="cuda")


_X, _W = jnp.zeros((128, 64), jnp.bfloat16), jnp.zeros((2, 64, 64), jnp.bfloat16)
_OFFSETS, _SIZES, _ROW_WEIGHTS = jnp.zeros((3,), jnp.int32), jnp.zeros((2,), jnp.int32), jnp.zeros((128,), jnp.float32)
_WIDE = jnp.zeros((2, 128, 64), jnp.bfloat16)  # [G, K=128, N]: K does not match _X


@pytest.mark.parametrize("call,error,words", [
    (lambda: gm.gmm(_X, _WIDE, _OFFSETS, _SIZES), ValueError, "lhs must have K1 = 128 columns"),
    (lambda: gm.gmm(_X, _W, _OFFSETS, _SIZES, lhs2=_X, rhs2=_WIDE), ValueError, "lhs2 must be"),
    (lambda: gm.gmm(_X, _W, _OFFSETS, _SIZES, lhs2=_X[:, :32], rhs2=_WIDE[:, :32]), ValueError, "K2=32"),
    (lambda: gm.gmm(_X, _W, _OFFSETS, _SIZES, lhs2=_X, rhs2=_WIDE.reshape(2, 64, 128)), ValueError,
     "rhs2 must match rhs"),
    (lambda: gm.gmm(_X, _W, _OFFSETS, _SIZES, out_dtype=jnp.float16), TypeError, "out_dtype must be"),
    (lambda: gm.gmm(_X, _W, _OFFSETS, _SIZES.astype(jnp.float32)), TypeError, "group_sizes must be int32"),
    (lambda: gm.gmm_swiglu(_X, _W, _WIDE.reshape(2, 64, 128), _OFFSETS, _SIZES), ValueError, "w_up must have"),
    (lambda: gm.gmm_swiglu(_X[:, :32], _W[:, :32], _W[:, :32], _OFFSETS, _SIZES), ValueError, "H=32"),
    (lambda: gm.gmm_swiglu(_X, _W[:, :, :32], _W[:, :, :32], _OFFSETS, _SIZES), ValueError, "I=32"),
    (lambda: gm.gmm_swiglu(_X, _WIDE, _WIDE, _OFFSETS, _SIZES), ValueError, "x must have H=128 columns"),
    (lambda: gm.gmm_swiglu_dgrad(_X, _WIDE.reshape(2, 64, 128), _X, _X, _ROW_WEIGHTS, _OFFSETS, _SIZES), ValueError,
     "dy must have H=128 columns"),
    (lambda: gm.gmm_swiglu_dgrad(_X, _W, _X, _X, _ROW_WEIGHTS.astype(jnp.bfloat16), _OFFSETS, _SIZES), TypeError,
     "row_weights must be float32"),
    (lambda: gm.gmm_swiglu_dgrad(_X, _W, _X, _X, _ROW_WEIGHTS[:100], _OFFSETS, _SIZES), ValueError,
     "row_weights must have shape"),
    (lambda: gm.gmm_swiglu_dgrad(_X, _W[:, :32], _X[:, :32], _X[:, :32], _ROW_WEIGHTS, _OFFSETS, _SIZES), ValueError,
     "I=32"),
    (lambda: gm.tgmm(_X[:, :32], _X, _OFFSETS, _SIZES), ValueError, "K=32"),
    (lambda: gm.tgmm(_X, _X[:, :32], _OFFSETS, _SIZES), ValueError, "N=32"),
    (lambda: gm.tgmm(_X, _X, _OFFSETS, _SIZES, out_dtype=jnp.float16), TypeError, "out_dtype must be"),
    (lambda: gm.tgmm(_X, _X[:100], _OFFSETS, _SIZES), ValueError, "rhs must give R=128 rows"),
    (lambda: gm.ragged_dot(_X, _WIDE, _SIZES), ValueError, "rhs must be \\[G, K=64, N\\]"),
    (lambda: gm.ragged_dot(_X, _W, jnp.zeros((3,), jnp.int32)), ValueError, "group_sizes must have shape \\[G=2\\]"),
    (lambda: gm.ragged_dot(_X, _W, _SIZES.astype(jnp.float32), backend="kittens"), ValueError, "int32 group_sizes"),
    (lambda: gm.ragged_dot([[0.0]], _W, _SIZES), TypeError, "lhs must be an array"),
])
def test_shape_and_dtype_errors_name_the_argument(call, error, words):
  with pytest.raises(error, match=words):
    call()


def test_schedule_layout_feeds_gmm():
  """The kittens row layout end to end: schedule(align=ROW_ALIGN) offsets drive gmm over gathered rows."""
  rng = np.random.default_rng(8)
  tokens, top_k, experts = 96, 2, 4
  ids = jnp.asarray(rng.integers(0, experts, (tokens, top_k)), jnp.int32)
  sched = routing.schedule(ids, experts, align=gm.ROW_ALIGN)
  rows = routing.num_schedule_rows(tokens * top_k, experts, gm.ROW_ALIGN)
  x = bf16(rng, tokens, 64)
  token_of_row = np.zeros(rows, np.int64)
  token_of_row[np.asarray(sched.rows).reshape(-1)] = np.arange(tokens * top_k) // top_k
  x_rows = x[token_of_row]
  w = bf16(rng, experts, 64, 64)
  out = gm.gmm(x_rows, w, sched.expert_offsets, sched.tokens_per_expert)
  flat_rows = np.asarray(sched.rows).reshape(-1)
  flat_ids = np.asarray(ids).reshape(-1)
  ref = np.stack([f64(x[i // top_k]) @ f64(w[flat_ids[i]]) for i in range(tokens * top_k)])
  assert rel_err(f64(out)[flat_rows], ref) < BF16_TOL


# ---------------------------------------------------------------------------------------------------------------
# GPU: the sm90 kernels at sizes that fill the chip, outputs poisoned with NaN first.

def test_kernel_outputs_are_poisoned_under_the_tests():
  """The GPU tests find an output element a kernel missed only if the CUDA handlers fill their results with NaN
  before the kernels run: conftest.py's JAX_KITTENS_POISON_OUTPUTS, read once by the extension."""
  assert jax_kittens.build_info()["poison_outputs"] is True


GPU_SHAPES = [  # (rows M, K, N, groups)
    (65536, 7168, 2048, 48),
    (65536, 2048, 7168, 48),
    (20000, 4096, 1024, 64),
]


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,groups", GPU_SHAPES)
def test_gpu_ragged_dot_large(m, k, n, groups):
  rng = np.random.default_rng(m + k)
  lhs_key, rhs_key = jax.random.split(jax.random.key(m + k))
  lhs = device_bf16(lhs_key, m, k)
  rhs = device_bf16(rhs_key, groups, k, n, scale=k ** -0.5)
  raw = rng.dirichlet(np.full(groups, 0.3)) * (m - 123)  # skewed, some near-empty groups
  sizes = np.floor(raw).astype(np.int32)
  sizes[3] = 0
  group_sizes = jnp.asarray(sizes)
  out = jax.jit(functools.partial(gm.ragged_dot, backend="kittens"))(lhs, rhs, group_sizes)
  ref = jax.jit(functools.partial(jax.lax.ragged_dot, preferred_element_type=jnp.float32))(lhs, rhs, group_sizes)
  assert rel_err(out, ref) < 1e-2
  # Row by row too: a few wrong rows (a group boundary off by one) hide in the whole array's error.
  total = int(sizes.sum())
  data_out, data_ref = out[:total].astype(jnp.float32), ref[:total]
  row_errors = jnp.linalg.norm(data_out - data_ref, axis=1) / jnp.linalg.norm(data_ref, axis=1)
  assert float(jnp.max(row_errors)) < 3e-2
  assert np.all(np.asarray(out[total:], np.float32) == 0)


# Output widths on the GPU: an odd number of 256-column blocks runs single CTAs, an even one clusters of two (the last
# block here half full); bf16 outputs of full row tiles leave through TMA stores, the rest from registers.
# With k2, a second product over another K range (lhs2, rhs2: the layer's dx).
@pytest.mark.gpu
@pytest.mark.parametrize("n,k2", [(768, 0), (1408, 0), (768, 512)])
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gpu_gmm_outputs_fully_written(transpose_rhs, n, k2):
  rng = np.random.default_rng(11)
  rows, k = 8192 + 77, 1024
  sizes = [1000, 0, 3000, 129, 0, 2000]
  offsets, group_sizes = aligned_layout(sizes, gm.ROW_ALIGN, rows)
  lhs = bf16(rng, rows, k)
  rhs = bf16(rng, len(sizes), *((n, k) if transpose_rhs else (k, n)), scale=k ** -0.5)
  second = {}
  if k2:
    second = dict(lhs2=bf16(rng, rows, k2),
                  rhs2=bf16(rng, len(sizes), *((n, k2) if transpose_rhs else (k2, n)), scale=k2 ** -0.5))
  fn = jax.jit(functools.partial(gm.gmm, transpose_rhs=transpose_rhs))
  out = fn(lhs, rhs, offsets, group_sizes, **second)
  ref = gmm_oracle(lhs, rhs, offsets, group_sizes, transpose_rhs, second.get("lhs2"), second.get("rhs2"))
  assert rel_err(out, ref) < 1e-2
  assert np.all(f64(out)[int(offsets[-1]):] == 0)


def gpu_groups(rng, empty, tail_rows):
  """16 groups of 0-899 rows, group `empty` empty, on the aligned layout with tail_rows rows after the last:
  (sizes, rows, group_offsets, group_sizes)."""
  sizes = rng.integers(0, 900, 16).astype(np.int32)
  sizes[empty] = 0
  rows = int(((sizes + 127) // 128 * 128).sum()) + tail_rows
  return (sizes, rows, *aligned_layout(sizes, gm.ROW_ALIGN, rows))


@pytest.mark.gpu
@pytest.mark.parametrize("inner", [1024, 1216])  # 1216: swiglu pairs 10 blocks (the last half full), dgrad has 5
@pytest.mark.parametrize("limit", [None, 7.0])
def test_gpu_swiglu_and_dgrad(limit, inner):
  rng = np.random.default_rng(12)
  groups, hidden = 16, 2048
  sizes, rows, offsets, group_sizes = gpu_groups(rng, empty=0, tail_rows=128)
  x = bf16(rng, rows, hidden)
  w_gate, w_up = bf16(rng, groups, hidden, inner, scale=4 * hidden ** -0.5), bf16(rng, groups, hidden, inner,
                                                                                   scale=4 * hidden ** -0.5)
  swiglu_fn = jax.jit(functools.partial(gm.gmm_swiglu, swiglu_limit=limit, save_preactivations=True))
  act, gate, up = swiglu_fn(x, w_gate, w_up, offsets, group_sizes)
  gate_ref = gmm_gpu_reference(x, w_gate, offsets, sizes)
  up_ref = gmm_gpu_reference(x, w_up, offsets, sizes)
  assert rel_err(gate, gate_ref) < 1e-2 and rel_err(up, up_ref) < 1e-2
  assert rel_err(act, swiglu64(gate_ref, up_ref, limit)) < 1e-2
  dy = bf16(rng, rows, hidden)
  w_down = bf16(rng, groups, inner, hidden, scale=inner ** -0.5)
  row_weights = jnp.asarray(rng.uniform(0.1, 1, rows), jnp.float32)
  dgrad_fn = jax.jit(functools.partial(gm.gmm_swiglu_dgrad, swiglu_limit=limit, save_weighted_act=True))
  d_gate, d_up, d_w, weighted_act = dgrad_fn(dy, w_down, gate, up, row_weights, offsets, group_sizes)
  g = gmm_gpu_reference(dy, jnp.swapaxes(w_down, 1, 2), offsets, sizes)
  gate64, up64 = f64(gate), f64(up)
  act64 = swiglu64(gate64, up64, limit)
  assert rel_err(d_w, np.sum(g * f64(jnp.asarray(act64, jnp.bfloat16)), axis=1)) < 1e-2
  is_data = data_row_mask(offsets, sizes, rows)
  assert rel_err(weighted_act, np.where(is_data[:, None], f64(row_weights)[:, None] * act64, 0.0)) < 1e-2
  gate_c = np.minimum(gate64, limit) if limit else gate64
  up_c = np.clip(up64, -limit, limit) if limit else up64
  sig = 1 / (1 + np.exp(-gate_c))
  d_act = f64(row_weights)[:, None] * g
  # JAX's min/max pass half the gradient on a tie, and bf16 pre-activations land exactly on the limit often.
  gate_factor = np.where(gate64 < limit, 1.0, np.where(gate64 == limit, 0.5, 0.0)) if limit else 1.0
  up_factor = np.where(np.abs(up64) < limit, 1.0, np.where(np.abs(up64) == limit, 0.5, 0.0)) if limit else 1.0
  d_up_ref = d_act * gate_c * sig * up_factor
  d_gate_ref = d_act * up_c * sig * (1 + gate_c * (1 - sig)) * gate_factor
  assert rel_err(d_gate, d_gate_ref) < 1e-2 and rel_err(d_up, d_up_ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("save,inner", [(False, 1216), (True, 1216), (False, 1088)])
def test_gpu_swiglu_gathered_equals_rows(save, inner):
  """The cp.async gather of the lhs gives the same bits as the TMA loads of rows gathered beforehand: in weight pairs,
  each CTA gathering its tile's lines and the pair sharing its weights (inner 1216: 10 n blocks), and alone (1088:
  9)."""
  rng = np.random.default_rng(22)
  groups, hidden, num_tokens = 16, 2048, 3000
  sizes, rows, offsets, group_sizes = gpu_groups(rng, empty=3, tail_rows=100)
  x = bf16(rng, num_tokens, hidden)
  w_gate, w_up = (bf16(rng, groups, hidden, inner, scale=4 * hidden ** -0.5) for _ in range(2))
  row_tokens, gather_index = gathered_operands(rng, offsets, sizes, num_tokens, rows)
  x_rows = gather(x, gather_index)
  fn = jax.jit(functools.partial(gm.gmm_swiglu, save_preactivations=save))
  want = jax.tree.leaves(fn(x_rows, w_gate, w_up, offsets, group_sizes))
  got = jax.tree.leaves(fn(x, w_gate, w_up, offsets, group_sizes, row_tokens=row_tokens))
  for out, ref in zip(got, want):
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
  assert rel_err(want[0], swiglu64(gmm_gpu_reference(x_rows, w_gate, offsets, sizes),
                                   gmm_gpu_reference(x_rows, w_up, offsets, sizes), None)) < 1e-2


def gmm_gpu_reference(lhs, rhs, offsets, sizes):
  """float32-accumulated per-group jnp.dot on the device, as float64 numpy (padding rows 0)."""
  out = np.zeros((lhs.shape[0], rhs.shape[2]))
  offsets = np.asarray(offsets)
  for g, size in enumerate(sizes):
    if size:
      begin = int(offsets[g])
      out[begin:begin + size] = np.asarray(
          jnp.dot(lhs[begin:begin + size], rhs[g], preferred_element_type=jnp.float32), np.float64)
  return out


@pytest.mark.gpu
# K = 2176: 17 output row tiles per group, in bands of 9 + 8
@pytest.mark.parametrize("k,n,out_dtype", [(2176, 1024, jnp.float32), (1088, 1408, jnp.bfloat16),
                                           (960, 576, jnp.bfloat16)])
def test_gpu_tgmm(k, n, out_dtype):
  rng = np.random.default_rng(13)
  groups = 12
  sizes = rng.integers(0, 2000, groups).astype(np.int32)
  sizes[1] = 0
  rows = int(sizes.sum()) + 50
  offsets = jnp.asarray(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32))  # unaligned groups
  lhs, rhs = bf16(rng, rows, k), bf16(rng, rows, n)
  # The rows after the last group are read by its last k step and must be zeroed there, NaN or not.
  lhs, rhs = lhs.at[rows - 50:].set(jnp.nan), rhs.at[rows - 50:].set(jnp.nan)
  fn = jax.jit(functools.partial(gm.tgmm, out_dtype=out_dtype))
  out = fn(lhs, rhs, offsets, jnp.asarray(sizes))
  offsets = np.asarray(offsets)
  for g in range(groups):
    a = lhs[offsets[g]:offsets[g] + sizes[g]]
    ref = np.asarray(jnp.dot(a.T, rhs[offsets[g]:offsets[g] + sizes[g]], preferred_element_type=jnp.float32))
    if sizes[g] == 0:
      assert np.all(np.asarray(out[g]) == 0)
    else:
      assert rel_err(out[g], ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("inner", [1024, 1216])  # 4 n blocks: weight pairs; 5: alone
def test_gpu_dgrad_gathered_equals_rows(inner):
  """The dgrad's cp.async gather of dy gives the same bits as TMA loads of dy rows gathered beforehand."""
  rng = np.random.default_rng(25)
  groups, hidden, num_tokens = 16, 2048, 3000
  sizes, rows, offsets, group_sizes = gpu_groups(rng, empty=5, tail_rows=100)
  dy = bf16(rng, num_tokens, hidden)
  gate, up = bf16(rng, rows, inner), bf16(rng, rows, inner)
  w_down = bf16(rng, groups, inner, hidden, scale=inner ** -0.5)
  row_weights = jnp.asarray(rng.uniform(0.1, 1, rows), jnp.float32)
  row_tokens, gather_index = gathered_operands(rng, offsets, sizes, num_tokens, rows)
  fn = jax.jit(functools.partial(gm.gmm_swiglu_dgrad, save_weighted_act=True))
  want = fn(gather(dy, gather_index), w_down, gate, up, row_weights, offsets, group_sizes)
  got = fn(dy, w_down, gate, up, row_weights, offsets, group_sizes, row_tokens=row_tokens)
  for out, ref in zip(got, want):
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
  g = gmm_gpu_reference(gather(dy, gather_index), jnp.swapaxes(w_down, 1, 2), offsets, sizes)
  act = f64(jnp.asarray(swiglu64(f64(gate), f64(up), None), jnp.bfloat16))
  assert rel_err(want[2], np.sum(g * act, axis=1)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("operand,k,n,out_dtype", [
    # 4 n blocks: clusters, each CTA gathering and forwarding half the lhs; K = 1088: the last m block's second half
    # lies past the tokens' columns (zeros, as from a TMA box)
    ("lhs", 1088, 1024, jnp.bfloat16),
    ("lhs", 2048, 576, jnp.float32),    # 3: alone
    ("rhs", 1024, 1408, jnp.bfloat16),  # 6, the last half full: clusters, each CTA gathering its own rhs
    ("rhs", 960, 576, jnp.bfloat16),    # 3, the last a quarter full: alone
])
def test_gpu_tgmm_gathered_equals_rows(operand, k, n, out_dtype):
  """tgmm's cp.async gather of either operand (a contraction row's 64 columns per line) gives the same bits as TMA
  loads of the rows gathered beforehand, on unaligned groups with NaN rows after the last one in the other operand."""
  rng = np.random.default_rng(26)
  groups, num_tokens = 12, 5000
  sizes = rng.integers(0, 2000, groups).astype(np.int32)
  sizes[1] = 0
  rows = int(sizes.sum()) + 50
  offsets = jnp.asarray(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32))
  row_tokens, gather_index = gathered_operands(rng, offsets, sizes, num_tokens, rows)
  tokens = bf16(rng, num_tokens, k if operand == "lhs" else n)
  other = bf16(rng, rows, n if operand == "lhs" else k).at[rows - 50:].set(jnp.nan)
  token_rows = gather(tokens, gather_index)
  operands, rows_operands = ((tokens, other), (token_rows, other)) if operand == "lhs" else ((other, tokens),
                                                                                             (other, token_rows))
  fn = jax.jit(functools.partial(gm.tgmm, out_dtype=out_dtype))
  group_sizes = jnp.asarray(sizes)
  want = fn(*rows_operands, offsets, group_sizes)
  gathered = {f"{operand}_row_tokens": row_tokens}
  got = fn(*operands, offsets, group_sizes, **gathered)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert np.all(np.asarray(got[1], np.float32) == 0)
  begin, size = int(offsets[2]), int(sizes[2])
  lhs_rows, rhs_rows = rows_operands
  ref = jnp.dot(lhs_rows[begin:begin + size].T, rhs_rows[begin:begin + size], preferred_element_type=jnp.float32)
  assert rel_err(got[2], ref) < 1e-2
