// Layout of one member's region of a symmetric heap, shared by host and device code.
//
// Every member (device) of a heap owns a region of the same size, laid out identically:
//
//   [ SignalPad | send area | return area ]
//
// The pad holds the flags peers write to signal this member, and the per-expert counts this member publishes. The
// two data areas are the staging buffers of the two transports: `to_experts` pulls rows from the source's send area,
// `from_experts` pushes rows into the source's return area. Peers address each other through a table of region base
// pointers (peer_bases[rank]); on the GPU those are NVLink load/store addresses.
#pragma once

#include <cstdint>

#include "kernels/common.h"

namespace jk {
namespace heap {

constexpr int kMaxRanks = 64;
// A source signals its send area in at most this many chunks, so receivers (and, later, compute SMs of a persistent
// kernel) can start on the first chunks while the rest is still being staged.
constexpr int kMaxChunks = 64;
constexpr int kMaxExperts = 16384;

// Each protocol op is a channel with its own flags and its own sequence of epochs, so the ops of one step never
// wait on each other's flags.
enum Channel : int32_t { kPlanChannel = 0, kToExpertsChannel = 1, kFromExpertsChannel = 2, kNumChannels = 3 };

// Flags hold the epoch (1, 2, ...) of the call that set them; nothing is ever reset, and a waiter accepts any value
// >= the epoch it waits for.
struct SignalPad {
  // ready[channel][chunk][source]: the source has staged (plan: published, from: pushed) data of that epoch.
  uint64_t ready[kNumChannels][kMaxChunks][kMaxRanks];
  // done[channel][peer]: the peer has finished reading (to: pulled; plan: read counts) or consuming (from) the data
  // this member staged in that channel's epoch, so this member may overwrite it.
  uint64_t done[kNumChannels][kMaxRanks];
  // Blocks of one GPU launch that finished a phase (two per launch at most); the last one signals peers and resets
  // the count. Local to this member.
  uint32_t block_arrivals[kNumChannels][2];
  // Set by the first kernel of this member that records an error: device memory, so claiming needs no atomics on
  // host-mapped memory (which PCIe hosts do not guarantee).
  int32_t error_claim;
  int32_t unused_padding;
  // Tokens per global expert this member sends in the current plan epoch.
  int32_t counts[kMaxExperts];
};

constexpr int64_t kRegionAlignment = 4096;

JK_HOST_DEVICE int64_t align_up64(int64_t value, int64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

constexpr int64_t kPadBytes = (static_cast<int64_t>(sizeof(SignalPad)) + kRegionAlignment - 1) / kRegionAlignment *
                              kRegionAlignment;

// Bytes of each of the two data areas in a region of region_bytes.
JK_HOST_DEVICE int64_t data_area_bytes(int64_t region_bytes) {
  return (region_bytes - kPadBytes) / 2 / kRegionAlignment * kRegionAlignment;
}
JK_HOST_DEVICE int64_t send_area_offset(int64_t) { return kPadBytes; }
JK_HOST_DEVICE int64_t return_area_offset(int64_t region_bytes) {
  return kPadBytes + data_area_bytes(region_bytes);
}

// What went wrong, written once (first error wins) where the host can read it without synchronising.
enum ErrorCode : int32_t { kNoError = 0, kPeerTimeout = 1, kDeviceOrderMismatch = 2 };
struct ErrorRecord {
  int32_t code;
  int32_t rank;     // the member that saw it
  int32_t channel;
  int32_t peer;     // the peer it waited for
  uint64_t epoch;
};

}  // namespace heap
}  // namespace jk
