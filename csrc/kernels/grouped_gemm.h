// Group/row math and SwiGLU arithmetic shared by the grouped GEMM CPU twins (ffi/grouped_gemm.cc) and the sm90
// kernels (kernels/sm90/grouped_gemm.cuh), so both platforms compute the same function.
//
// Row layout: group g owns the row extent [offsets[g], offsets[g+1]); its first sizes[g] rows hold data, the rest
// are alignment padding. Outputs are written over every row: data rows get their product, padding rows, the tail
// [offsets[G], rows) and the head [0, offsets[0]) get 0. Input padding rows are never read into a result.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/common.h"

namespace jk {
namespace grouped_gemm {

// Where the groups are: group g owns the row extent [offsets[g], offsets[g+1]) of a [rows, *] buffer.
struct GroupLayout {
  const int32_t* offsets;  // [groups + 1]
  const int32_t* sizes;    // [groups]
  int32_t groups;
  int32_t rows;  // R < 2^31 (checked by the bindings)
};

// Rows [begin, end) of pseudo-group g; rows in [begin, data_end) hold data. Pseudo-groups 0..G-1 are the groups
// (sizes clipped to the extent and the buffer, defensive against inconsistent offsets/sizes), G is the tail
// [offsets[G], R) and G+1 the head [0, offsets[0]); neither holds data. Together they cover every row once when
// the offsets are nondecreasing.
struct RowExtent {
  int32_t begin;
  int32_t end;
  int32_t data_end;
};

JK_HOST_DEVICE int32_t clamp_row(int32_t row, int32_t rows) { return row < 0 ? 0 : (row > rows ? rows : row); }

JK_HOST_DEVICE RowExtent row_extent(const GroupLayout& l, int32_t g) {
  if (g == l.groups + 1) return {0, clamp_row(l.offsets[0], l.rows), 0};
  int32_t begin = clamp_row(l.offsets[g], l.rows);
  if (g == l.groups) return {begin, l.rows, begin};
  int32_t end = clamp_row(l.offsets[g + 1], l.rows);
  if (end < begin) end = begin;
  int32_t size = l.sizes[g] > 0 ? l.sizes[g] : 0;
  return {begin, end, begin + (size < end - begin ? size : end - begin)};
}

JK_HOST_DEVICE int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Band order, the tile order of every kernel here: tile `local` of an m_blocks x n_blocks grid of output tiles ->
// its (m block, n block). The m blocks are cut into bands of at most kMaxBandBlocks (balanced: 20 blocks make two
// bands of 10), and a band's tiles run m fastest, in n pairs: (m0, n0), (m0, n1), (m1, n0), (m1, n1), ..., (m0, n2),
// (m0, n3), ...
// - Why bands, m fastest: the ~132 CTAs running at one time then cover about 16 m blocks x 8 n blocks, the window
//   that reads the fewest operand bytes per k step (a tile reads 128 lhs lines and 256 rhs lines: 16 x 128 + 8 x 256
//   is the least of a x 128 + b x 256 with a x b = 132). Each weight (rhs) n block is shared by all the band's m
//   blocks while the band's rows stay in L2 across its n blocks. tgmm's large groups need it too: ordered n fastest
//   over a whole group, the window was 5 m blocks x all 28 n blocks of deepseek-v4's dW_down, and every wave re-read
//   the group's dy from DRAM (16-19% more time under skewed routing than uniform on an H100; band order cut that
//   to 4-5%). This only holds while the tiles in flight are a contiguous run of the order, which the kernels' tile
//   queue keeps (kernels/sm90/grouped_gemm.cuh).
// - Why n pairs: a 2-CTA cluster claims tiles 2j and 2j + 1 together, which must share their lhs (rows, or tgmm's
//   output rows), for the lhs multicast. With an even n-block count every band has an even tile count, so 2j is
//   always a pair's first tile. With an odd count there are no clusters, and pairs are single tiles.
constexpr int32_t kMaxBandBlocks = 16;

struct GridBlock {
  int32_t m_block;
  int32_t n_block;
};

JK_HOST_DEVICE GridBlock band_order(int32_t local, int32_t m_blocks, int32_t n_blocks) {
  const int32_t pair = n_blocks % 2 == 0 ? 2 : 1;
  const int32_t bands = (m_blocks + kMaxBandBlocks - 1) / kMaxBandBlocks;
  // Bands b < extra are one block taller than the rest: band b starts at m block b * short_height + min(b, extra).
  const int32_t short_height = m_blocks / bands, extra = m_blocks % bands;
  const int32_t tall_tiles = extra * (short_height + 1) * n_blocks;
  int32_t band, height;
  if (local < tall_tiles) {
    height = short_height + 1;
    band = local / (height * n_blocks);
  } else {
    height = short_height;
    band = extra + (local - tall_tiles) / (height * n_blocks);
  }
  const int32_t band_first_block = band * short_height + (band < extra ? band : extra);
  const int32_t in_band = local - band_first_block * n_blocks;
  const int32_t pair_index = in_band / pair;  // over (n pair, m block), m fastest
  return {band_first_block + pair_index % height, pair_index / height * pair + in_band % pair};
}

// One output tile of a row-grouped GEMM (gmm, gmm_swiglu, gmm_swiglu_dgrad): rows [row0, row0 + written) of
// pseudo-group `group`, of which the first `valid` hold data (the rest are written as 0), and columns
// [n0, n0 + block_n).
struct RowTile {
  int32_t group;
  int32_t row0;
  int32_t valid;
  int32_t written;
  int32_t n_block;
  int32_t n0;
};

// The tile scheduler of the row-grouped GEMMs: linear tile t -> RowTile, the pseudo-groups in order, each in band
// order. The kernels' CTAs claim increasing t from a counter; the CPU twins walk every t, so CI covers the same
// decomposition. Queries must come with nondecreasing t (a forward-only cursor over the pseudo-groups).
template <int kBlockM, int kBlockN>
struct RowTileScheduler {
  int32_t n_blocks;
  int32_t group = 0;             // pseudo-group holding the next tile
  int32_t group_first_tile = 0;  // its first linear tile
  int32_t group_tiles = 0;
  int32_t m_blocks = 0;          // of the pseudo-group
  RowExtent extent{0, 0, 0};

  JK_HOST_DEVICE RowTileScheduler(const GroupLayout& l, int32_t n) : n_blocks((n + kBlockN - 1) / kBlockN) {
    enter_group(l);
  }

  JK_HOST_DEVICE void enter_group(const GroupLayout& l) {
    extent = row_extent(l, group);
    m_blocks = (extent.end - extent.begin + kBlockM - 1) / kBlockM;
    group_tiles = m_blocks * n_blocks;
  }

  // False when t is past the last tile.
  JK_HOST_DEVICE bool get(const GroupLayout& l, int32_t t, RowTile* tile) {
    while (t >= group_first_tile + group_tiles) {
      if (group == l.groups + 1) return false;
      group_first_tile += group_tiles;
      ++group;
      enter_group(l);
    }
    const GridBlock block = band_order(t - group_first_tile, m_blocks, n_blocks);
    tile->n_block = block.n_block;
    tile->group = group;
    tile->row0 = extent.begin + block.m_block * kBlockM;
    int32_t valid = extent.data_end - tile->row0;
    tile->valid = valid < 0 ? 0 : (valid > kBlockM ? kBlockM : valid);
    int32_t written = extent.end - tile->row0;
    tile->written = written > kBlockM ? kBlockM : written;
    tile->n0 = tile->n_block * kBlockN;
    return true;
  }
};

// tgmm tiles: out[group][m0 : m0 + block_m, n0 : n0 + block_n], contracting the group's data rows
// [row0, row0 + valid). Every group has the same number of tiles, in band order.
struct ContractionTile {
  int32_t group;
  int32_t row0;
  int32_t valid;
  int32_t m0;
  int32_t n0;
};

template <int kBlockM, int kBlockN>
JK_HOST_DEVICE bool contraction_tile(const GroupLayout& l, int32_t m_extent, int32_t n, int32_t t,
                                     ContractionTile* tile) {
  const int32_t m_blocks = (m_extent + kBlockM - 1) / kBlockM, n_blocks = (n + kBlockN - 1) / kBlockN;
  const int32_t per_group = m_blocks * n_blocks;
  if (t >= per_group * l.groups) return false;
  const int32_t g = t / per_group;
  const RowExtent e = row_extent(l, g);
  const GridBlock block = band_order(t - g * per_group, m_blocks, n_blocks);
  tile->group = g;
  tile->row0 = e.begin;
  tile->valid = e.data_end - e.begin;
  tile->m0 = block.m_block * kBlockM;
  tile->n0 = block.n_block * kBlockN;
  return true;
}

// Tile shapes of the sm90 kernels, which the CPU twins walk too.
constexpr int kTileRows = 128;          // rows of every tile (ROW_ALIGN in Python)
constexpr int kTileCols = 256;          // output columns of gmm, dgrad and tgmm tiles
constexpr int kSwigluTileCols = 128;    // gate and up columns of a gmm_swiglu tile (128 + 128 products)

// The SwiGLU clamp: gate to (-inf, limit], up to [-limit, limit]; limit <= 0 means none (the attr carries a
// positive limit or 0). Gradient factors follow JAX's min/max: 1 inside, 0 outside, 1/2 on the bound.
struct SwigluClamp {
  float limit;
  JK_HOST_DEVICE bool active() const { return limit > 0.0f; }
};

JK_HOST_DEVICE float clamp_gate(float gate, SwigluClamp c) { return c.active() && gate > c.limit ? c.limit : gate; }
JK_HOST_DEVICE float clamp_up(float up, SwigluClamp c) {
  if (!c.active()) return up;
  return up > c.limit ? c.limit : (up < -c.limit ? -c.limit : up);
}
JK_HOST_DEVICE float gate_grad_factor(float gate, SwigluClamp c) {
  if (!c.active() || gate < c.limit) return 1.0f;
  return gate == c.limit ? 0.5f : 0.0f;
}
JK_HOST_DEVICE float up_grad_factor(float up, SwigluClamp c) {
  if (!c.active() || (up < c.limit && up > -c.limit)) return 1.0f;
  return (up == c.limit || up == -c.limit) ? 0.5f : 0.0f;
}

JK_HOST_DEVICE float sigmoid(float x) {
#if defined(__CUDA_ARCH__)
  // The hardware reciprocal and one Newton step, within an ulp of 1 / y, without a branch. The IEEE division and
  // __frcp_rn call a slow path for y out of the normal range; that call split every element of the SwiGLU epilogues
  // into its own branch region, so the compiler ran each element's MUFU chain to the end before starting the next.
  // The exponent is capped so that y stays finite (y = inf would make the Newton step 0 * inf): for x < -88 the
  // reciprocal flushes to 0, where the division gives a denormal.
  const float y = 1.0f + __expf(fminf(-x, 88.0f));
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(y));
  return fmaf(r, fmaf(-y, r, 1.0f), r);
#else
  return 1.0f / (1.0f + std::exp(-x));
#endif
}

// act = silu(gate') * up' with the clamped gate', up'.
JK_HOST_DEVICE float swiglu(float gate, float up, SwigluClamp c) {
  float g = clamp_gate(gate, c);
  return g * sigmoid(g) * clamp_up(up, c);
}

// Backward of swiglu for d_act: d_gate and d_up w.r.t. the unclamped inputs. Returns swiglu(gate, up, c) (the same
// bits), which the router-weight gradient needs, so the sigmoid is computed once.
JK_HOST_DEVICE float swiglu_backward(float gate, float up, float d_act, SwigluClamp c, float* d_gate, float* d_up) {
  float g = clamp_gate(gate, c);
  float u = clamp_up(up, c);
  float s = sigmoid(g);
  float silu = g * s;
  *d_gate = d_act * u * s * (1.0f + g * (1.0f - s)) * gate_grad_factor(gate, c);
  *d_up = d_act * silu * up_grad_factor(up, c);
  return silu * u;
}

}  // namespace grouped_gemm
}  // namespace jk
