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
// - Why n pairs: a 2-CTA cluster (a row pair) claims tiles 2j and 2j + 1 together, which must share their lhs (rows,
//   or tgmm's output rows), for the lhs multicast. With an even n-block count every band has an even tile count, so
//   2j is always a pair's first tile. With an odd count there are no clusters, and pairs are single tiles. The row
//   GEMMs that gather their lhs run weight pairs instead, tiles two apart: m fastest, one n block of two adjacent m
//   blocks, which share their weight block except where a band's n pair, a visit or a group ends between them.
constexpr int32_t kMaxBandBlocks = 16;

struct GridBlock {
  int32_t m_block;
  int32_t n_block;
};

JK_HOST_DEVICE int32_t band_count(int32_t m_blocks) { return (m_blocks + kMaxBandBlocks - 1) / kMaxBandBlocks; }

// The first m block of band `band` (band_count(m_blocks) is one past the last band): bands b < extra are one block
// taller than the rest.
JK_HOST_DEVICE int32_t band_first_block(int32_t band, int32_t m_blocks) {
  const int32_t bands = band_count(m_blocks);
  const int32_t short_height = m_blocks / bands, extra = m_blocks % bands;
  return band * short_height + (band < extra ? band : extra);
}

JK_HOST_DEVICE GridBlock band_order(int32_t local, int32_t m_blocks, int32_t n_blocks) {
  const int32_t pair = n_blocks % 2 == 0 ? 2 : 1;
  const int32_t bands = band_count(m_blocks);
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
  const int32_t first_block = band_first_block(band, m_blocks);
  const int32_t in_band = local - first_block * n_blocks;
  const int32_t pair_index = in_band / pair;  // over (n pair, m block), m fastest
  return {first_block + pair_index % height, pair_index / height * pair + in_band % pair};
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

// The row GEMMs' visit plan: in which order their tiles visit the groups.
// A light group (one or two m blocks) reads a whole weight block per tile for a few rows, so its tiles are bound by
// DRAM, while a heavy group's tiles share each weight block across a band and are bound by the tensor cores. Where the
// groups come sorted by load (a router that favours low expert indices, as the benchmark's skewed routing does), index
// order runs every light group back to back at the end, in waves that DRAM alone limits. The plan spreads the light
// groups evenly between the heavy groups' bands, in proportion to the heavy m blocks done (on an H100 at qwen3.5 it
// took 2.2% off the skewed forward, whose cost over the uniform one fell from 5.7% to 3.3%; visiting the groups 0, G-1,
// 1, G-2, ... had taken 1% off): heavy band s (of all heavy groups' bands in index order), with `blocks_before` heavy m
// blocks ahead of it, goes to position s + min(L, blocks_before * (L + 1) / heavy_blocks), and the L light groups fill
// the positions left, in index order. Empty groups have no tiles and no visit. Without light or heavy groups the plan
// would be index order, and none is made; nor where the visits would not fit: kMaxVisits of them (the kernels keep the
// plan in the last 1.5 KB of their shared memory), groups below 2^11 and at most 31 bands a group (about 62K rows).
// A visit is group | band << 11: one band of a heavy group (its own segment of the group's band order), or a whole
// light group (band 0).
constexpr int32_t kLightGroupBlocks = 2;
constexpr int32_t kMaxVisits = 768;
constexpr int32_t kVisitGroupBits = 11;
constexpr uint16_t kNoVisit = 0xFFFF;  // band 31 of group 2047: past the limits

struct VisitPlan {
  int32_t count;  // 0: no plan, index order
  uint16_t visits[kMaxVisits];
};

struct VisitTotals {
  int32_t heavy_blocks = 0;  // m blocks of the heavy groups (< 2^24: R < 2^31)
  int32_t heavy_bands = 0;
  int32_t light_groups = 0;
  int32_t widest = 0;  // the most bands of one group

  JK_HOST_DEVICE int32_t visits() const { return heavy_bands + light_groups; }
  JK_HOST_DEVICE bool planned(int32_t groups) const {
    return light_groups > 0 && heavy_bands > 0 && visits() <= kMaxVisits && groups < (1 << kVisitGroupBits) &&
           widest <= (1 << (16 - kVisitGroupBits)) - 1;
  }
};

template <int kBlockM>
JK_HOST_DEVICE int32_t group_m_blocks(const GroupLayout& l, int32_t g) {
  const RowExtent e = row_extent(l, g);
  return (e.end - e.begin + kBlockM - 1) / kBlockM;
}

JK_HOST_DEVICE int32_t heavy_visit_position(int32_t heavy_band, int32_t blocks_before, const VisitTotals& totals) {
  const int64_t lights_before =
      static_cast<int64_t>(blocks_before) * (totals.light_groups + 1) / totals.heavy_blocks;
  return heavy_band + static_cast<int32_t>(lights_before < totals.light_groups ? lights_before : totals.light_groups);
}

JK_HOST_DEVICE uint16_t pack_visit(int32_t group, int32_t band) {
  return static_cast<uint16_t>(group | band << kVisitGroupBits);
}

// The host's plan.
template <int kBlockM>
inline void plan_visits(const GroupLayout& l, VisitPlan* plan) {
  VisitTotals totals;
  for (int32_t g = 0; g < l.groups; ++g) {
    const int32_t m_blocks = group_m_blocks<kBlockM>(l, g);
    if (m_blocks > kLightGroupBlocks) {
      totals.heavy_blocks += m_blocks;
      totals.heavy_bands += band_count(m_blocks);
      totals.widest = band_count(m_blocks) > totals.widest ? band_count(m_blocks) : totals.widest;
    } else if (m_blocks > 0) {
      ++totals.light_groups;
    }
  }
  plan->count = totals.planned(l.groups) ? totals.visits() : 0;
  if (plan->count == 0) return;
  uint16_t* visits = plan->visits;
  for (int32_t v = 0; v < plan->count; ++v) visits[v] = kNoVisit;
  int32_t heavy_band = 0, blocks_before = 0;
  for (int32_t g = 0; g < l.groups; ++g) {
    const int32_t m_blocks = group_m_blocks<kBlockM>(l, g);
    if (m_blocks <= kLightGroupBlocks) continue;
    for (int32_t b = 0; b < band_count(m_blocks); ++b, ++heavy_band)
      visits[heavy_visit_position(heavy_band, blocks_before + band_first_block(b, m_blocks), totals)] =
          pack_visit(g, b);
    blocks_before += m_blocks;
  }
  int32_t v = 0;
  for (int32_t g = 0; g < l.groups; ++g) {
    const int32_t m_blocks = group_m_blocks<kBlockM>(l, g);
    if (m_blocks == 0 || m_blocks > kLightGroupBlocks) continue;
    while (visits[v] != kNoVisit) ++v;
    visits[v] = pack_visit(g, 0);
  }
}

#if defined(__CUDACC__)
// The device's plan, by one warp (lanes over the groups): the host's, with the light groups listed first (into
// `lights` [kMaxVisits]) and the positions they fill found by ballots.
template <int kBlockM>
__device__ void plan_visits_warp(const GroupLayout& l, VisitPlan& plan, uint16_t* lights, int lane) {
  const uint32_t lanes_below = (1u << lane) - 1;
  VisitTotals totals;
  for (int32_t base = 0; base < l.groups; base += 32) {
    const int32_t g = base + lane;
    const int32_t m_blocks = g < l.groups ? group_m_blocks<kBlockM>(l, g) : 0;
    const bool heavy = m_blocks > kLightGroupBlocks, light = m_blocks > 0 && !heavy;
    const uint32_t light_lanes = __ballot_sync(~0u, light);
    const int32_t light_index = totals.light_groups + __popc(light_lanes & lanes_below);
    if (light && light_index < kMaxVisits) lights[light_index] = static_cast<uint16_t>(g);
    totals.light_groups += __popc(light_lanes);
    totals.heavy_blocks += static_cast<int32_t>(__reduce_add_sync(~0u, heavy ? m_blocks : 0));
    const uint32_t bands = heavy ? band_count(m_blocks) : 0;
    totals.heavy_bands += static_cast<int32_t>(__reduce_add_sync(~0u, bands));
    const int32_t widest = static_cast<int32_t>(__reduce_max_sync(~0u, bands));
    totals.widest = widest > totals.widest ? widest : totals.widest;
  }
  const int32_t count = totals.planned(l.groups) ? totals.visits() : 0;
  if (lane == 0) plan.count = count;
  if (count == 0) return;
  for (int32_t v = lane; v < count; v += 32) plan.visits[v] = kNoVisit;
  __syncwarp();
  int32_t heavy_band = 0, blocks_before = 0;  // of the chunks before
  for (int32_t base = 0; base < l.groups; base += 32) {
    const int32_t g = base + lane;
    const int32_t m_blocks = g < l.groups ? group_m_blocks<kBlockM>(l, g) : 0;
    const int32_t blocks = m_blocks > kLightGroupBlocks ? m_blocks : 0, bands = band_count(blocks);
    int32_t bands_through = bands, blocks_through = blocks;  // inclusive scans over the lanes
    for (int d = 1; d < 32; d *= 2) {
      const int32_t lower_bands = __shfl_up_sync(~0u, bands_through, d);
      const int32_t lower_blocks = __shfl_up_sync(~0u, blocks_through, d);
      if (lane >= d) bands_through += lower_bands, blocks_through += lower_blocks;
    }
    for (int32_t b = 0; b < bands; ++b) {
      const int32_t blocks_ahead = blocks_before + blocks_through - blocks + band_first_block(b, blocks);
      plan.visits[heavy_visit_position(heavy_band + bands_through - bands + b, blocks_ahead, totals)] =
          pack_visit(g, b);
    }
    heavy_band += __shfl_sync(~0u, bands_through, 31);
    blocks_before += __shfl_sync(~0u, blocks_through, 31);
  }
  __syncwarp();
  int32_t light = 0;
  for (int32_t base = 0; base < count; base += 32) {
    const int32_t v = base + lane;
    const bool open = v < count && plan.visits[v] == kNoVisit;
    const uint32_t open_lanes = __ballot_sync(~0u, open);
    if (open) plan.visits[v] = pack_visit(lights[light + __popc(open_lanes & lanes_below)], 0);
    light += __popc(open_lanes);
  }
  __syncwarp();
}
#endif

// The tile scheduler of the row-grouped GEMMs: linear tile t -> RowTile. Tiles run visit by visit (the plan's, or
// every group in index order), each in band order, then the tail and head pseudo-groups. The kernels' CTAs claim
// increasing t from a counter; the CPU twins walk every t, so CI covers the same decomposition. Queries must come
// with nondecreasing t (a forward-only cursor over the visits).
template <int kBlockM, int kBlockN>
struct RowTileScheduler {
  const VisitPlan* plan;
  int32_t n_blocks;
  int32_t position = 0;      // of the visit holding the next tile
  int32_t group = 0;
  int32_t visit_end = 0;     // one past the visit's last linear tile
  int32_t local_offset = 0;  // linear tile - tile of the group's band order
  int32_t m_blocks = 0;      // of the group
  RowExtent extent{0, 0, 0};

  JK_HOST_DEVICE RowTileScheduler(const GroupLayout& l, int32_t n, const VisitPlan* visit_plan)
      : plan(visit_plan), n_blocks((n + kBlockN - 1) / kBlockN) {
    enter_visit(l);
  }

  // The visits: the plan's (or the groups in index order), then the tail and the head.
  JK_HOST_DEVICE int32_t visit_count(const GroupLayout& l) const { return plan->count > 0 ? plan->count : l.groups; }

  JK_HOST_DEVICE void enter_visit(const GroupLayout& l) {
    const int32_t count = visit_count(l);
    int32_t band = -1;  // the whole group
    if (position >= count) {
      group = l.groups + position - count;
    } else if (plan->count == 0) {
      group = position;
    } else {
      const uint16_t visit = plan->visits[position];
      group = visit & ((1 << kVisitGroupBits) - 1);
      band = visit >> kVisitGroupBits;
    }
    extent = row_extent(l, group);
    m_blocks = (extent.end - extent.begin + kBlockM - 1) / kBlockM;
    const bool whole = band < 0 || m_blocks <= kLightGroupBlocks;
    const int32_t first_block = whole ? 0 : band_first_block(band, m_blocks);
    const int32_t last_block = whole ? m_blocks : band_first_block(band + 1, m_blocks);
    local_offset = visit_end - first_block * n_blocks;
    visit_end += (last_block - first_block) * n_blocks;
  }

  // False when t is past the last tile.
  JK_HOST_DEVICE bool get(const GroupLayout& l, int32_t t, RowTile* tile) {
    while (t >= visit_end) {
      if (position == visit_count(l) + 1) return false;
      ++position;
      enter_visit(l);
    }
    const GridBlock block = band_order(t - local_offset, m_blocks, n_blocks);
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
