// Expert-parallel layout math shared by the CPU twin and the CUDA kernels: who keeps which rows where.
//
// Terms. Rank s holds T tokens with k routed (token, slot) entries each; its schedule (align 1) puts them in
// expert-major *positions* 0..T*k-1 over the E = num_ranks * experts_per_rank global experts. counts[s][g] is how
// many of rank s's entries go to global expert g, owned by rank g / experts_per_rank.
//
// Receive rows. Rank d has `capacity` static rows. What it keeps is decided in (source rank, local expert) order,
// as the pure-JAX reference does: the entries past the capacity are the last sources' highest local experts. The kept
// rows are *placed* in (local expert, source rank) order, so each local expert's rows are contiguous, starting at
// row 0, and the grouped GEMM runs on them directly.
//
// A receive block is the rows of one (local expert e, source s) pair at rank d: `kept` rows at receive rows
// [recv_offset, recv_offset + kept), taken from positions [source_position, source_position + kept) of rank s.
#pragma once

#include <cstdint>

#include "kernels/common.h"

namespace jk {
namespace ep {

struct Layout {
  int32_t num_ranks;
  int32_t experts_per_rank;
  int32_t capacity;
  JK_HOST_DEVICE int32_t num_experts() const { return num_ranks * experts_per_rank; }
};

// The three int32 fields of one receive block, stored row-major in the [num_ranks * experts_per_rank, 3] table;
// block b = e * num_ranks + s.
struct Block {
  int32_t recv_offset;
  int32_t source_position;
  int32_t kept;
};
constexpr int kBlockFields = 3;

JK_HOST_DEVICE int32_t clamp_kept(int64_t capacity_left, int32_t wanted) {
  return capacity_left <= 0 ? 0 : (capacity_left < wanted ? static_cast<int32_t>(capacity_left) : wanted);
}

// counts: [num_ranks][num_experts]. Rows of (source s, local expert e) that rank `dest` keeps.
JK_HOST_DEVICE int32_t kept_rows(const int32_t* counts, const Layout& layout, int32_t dest, int32_t source,
                                 int32_t local_expert) {
  const int32_t experts = layout.num_experts();
  const int32_t first = dest * layout.experts_per_rank;
  int64_t before = 0;
  for (int32_t s = 0; s < source; ++s) {
    for (int32_t e = 0; e < layout.experts_per_rank; ++e) before += counts[s * experts + first + e];
  }
  for (int32_t e = 0; e < local_expert; ++e) before += counts[source * experts + first + e];
  return clamp_kept(layout.capacity - before, counts[source * experts + first + local_expert]);
}

// First expert-major position of global expert g at rank s (an exclusive prefix sum of its counts).
JK_HOST_DEVICE int32_t expert_position(const int32_t* counts, const Layout& layout, int32_t source, int32_t expert) {
  int32_t position = 0;
  for (int32_t g = 0; g < expert; ++g) position += counts[source * layout.num_experts() + g];
  return position;
}

// The receive table of rank `dest`: blocks [num_ranks * experts_per_rank] and group_sizes [experts_per_rank].
// Sequential: the table is small (num_ranks * experts_per_rank entries) next to the rows it describes.
JK_HOST_DEVICE void receive_blocks(const int32_t* counts, const Layout& layout, int32_t dest, Block* blocks,
                                   int32_t* group_sizes) {
  int32_t row = 0;
  for (int32_t e = 0; e < layout.experts_per_rank; ++e) {
    int32_t group = 0;
    for (int32_t s = 0; s < layout.num_ranks; ++s) {
      Block& block = blocks[e * layout.num_ranks + s];
      block.kept = kept_rows(counts, layout, dest, s, e);
      block.recv_offset = row;
      block.source_position = expert_position(counts, layout, s, dest * layout.experts_per_rank + e);
      row += block.kept;
      group += block.kept;
    }
    group_sizes[e] = group;
  }
}

// Entries of rank `source` to global expert g that their owner keeps: the first send_kept of them in position order.
JK_HOST_DEVICE int32_t send_kept(const int32_t* counts, const Layout& layout, int32_t source, int32_t expert) {
  return kept_rows(counts, layout, expert / layout.experts_per_rank, source, expert % layout.experts_per_rank);
}

// Chunk of the source's send area that holds `position`.
JK_HOST_DEVICE int32_t chunk_of(int64_t position, int32_t chunk_rows) {
  return static_cast<int32_t>(position / chunk_rows);
}

}  // namespace ep
}  // namespace jk
