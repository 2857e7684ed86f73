// CUDA bindings of jk_gmm, jk_gmm_swiglu, jk_gmm_swiglu_dgrad and jk_tgmm: tensor maps, launch configuration and
// error checks around the sm90 kernels in kernels/sm90/grouped_gemm.cuh.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

#include "ffi/ffi_util.h"
#include "ffi/grouped_gemm_shapes.h"
#include "ffi/registry.h"
#include "kernels/sm90/grouped_gemm.cuh"

namespace jk {
namespace {

namespace gg = grouped_gemm;
namespace sm90 = grouped_gemm::sm90;

// cuTensorMapEncodeTiled through the runtime's driver entry point: the module never links libcuda.
ffi::Error tensor_map_encoder(PFN_cuTensorMapEncodeTiled_v12000* encode) {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static cudaError_t status = cudaSuccess;
  static std::once_flag once;
  std::call_once(once, [] {
    cudaDriverEntryPointQueryResult query;
    status = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&fn), 12000,
                                              cudaEnableDefault, &query);
    if (status == cudaSuccess && query != cudaDriverEntryPointSuccess) status = cudaErrorSymbolNotFound;
  });
  JK_CUDA_CHECK(status);
  *encode = fn;
  return ffi::Error::Success();
}

// A bf16 tensor map with 128-byte swizzle; dims innermost first, strides in bytes for dims 1.., box per dim.
template <int kRank>
ffi::Error make_map(CUtensorMap* map, const void* base, const uint64_t (&dims)[kRank], const uint64_t (&strides)[kRank],
                    const uint32_t (&box)[kRank]) {
  PFN_cuTensorMapEncodeTiled_v12000 encode;
  JK_FFI_RETURN_IF_ERROR(tensor_map_encoder(&encode));
  cuuint64_t global_dims[kRank];
  cuuint64_t global_strides[kRank];
  cuuint32_t box_dims[kRank];
  cuuint32_t element_strides[kRank];
  for (int i = 0; i < kRank; ++i) {
    global_dims[i] = dims[i];
    global_strides[i] = strides[i];
    box_dims[i] = box[i];
    element_strides[i] = 1;
  }
  CUresult result = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, kRank, const_cast<void*>(base), global_dims,
                           global_strides + 1, box_dims, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                           CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                           CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  JK_FFI_CHECK(result == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed with CUresult " + std::to_string(result));
  return ffi::Error::Success();
}

// Row-major [rows, cols] matrix, box [box_rows, 64].
ffi::Error matrix_map(CUtensorMap* map, const void* base, int64_t rows, int64_t cols, uint32_t box_rows) {
  return make_map<2>(map, base, {uint64_t(cols), uint64_t(rows)}, {0, uint64_t(cols) * 2}, {64, box_rows});
}

// Row-major [groups, rows, cols] weights, box [1, box_rows, 64].
ffi::Error weights_map(CUtensorMap* map, const void* base, int64_t groups, int64_t rows, int64_t cols,
                       uint32_t box_rows) {
  return make_map<3>(map, base, {uint64_t(cols), uint64_t(rows), uint64_t(groups)},
                     {0, uint64_t(cols) * 2, uint64_t(rows) * uint64_t(cols) * 2}, {64, box_rows, 1});
}

// An MN-major operand [groups, rows, cols] (rows the contraction) whose 64-column chunks of a box land one after
// another in shared memory, each a 64-line swizzled sub-tile: dims {64, rows, cols / 64, groups}, the chunk dim
// 128 bytes apart, so one TMA loads `chunks` sub-tiles of 64 rows. cols is a multiple of 64 (check_features).
ffi::Error chunked_map(CUtensorMap* map, const void* base, int64_t groups, int64_t rows, int64_t cols,
                       uint32_t chunks) {
  return make_map<4>(map, base, {64, uint64_t(rows), uint64_t(cols / 64), uint64_t(groups)},
                     {0, uint64_t(cols) * 2, 128, uint64_t(rows) * uint64_t(cols) * 2}, {64, 64, chunks, 1});
}

// The lhs arrives in 64-row halves of the 128-row tile (one per CTA of a cluster).
constexpr uint32_t kLhsBoxRows = 64;

// A bf16 [rows, cols] output written in the kernels' kStoreRows x 64 chunks.
ffi::Error output_map(CUtensorMap* map, void* base, int64_t rows, int64_t cols) {
  return matrix_map(map, base, rows, cols, sm90::kStoreRows);
}

// Launch configuration of the kernels: 384 threads, the full shared-memory ring, clusters of cluster_size CTAs.
cudaLaunchConfig_t launch_config(unsigned grid, int cluster_size, cudaStream_t stream, cudaLaunchAttribute* attribute) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid, 1, 1);
  config.blockDim = dim3(sm90::kThreads, 1, 1);
  config.dynamicSmemBytes = sm90::kSmemBytes;
  config.stream = stream;
  attribute->id = cudaLaunchAttributeClusterDimension;
  attribute->val.clusterDim.x = cluster_size;
  attribute->val.clusterDim.y = 1;
  attribute->val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return config;
}

// One persistent CTA per SM (cluster per co-resident group of SMs), at most one per tile. Clusters of two when the
// n-block count is even: the scheduler then pairs the two n blocks of each (group, m block).
template <sm90::Mode kMode, bool kBMnMajor, typename OutT, int kCluster, sm90::Gathered kGathered>
ffi::Error launch_with_cluster(cudaStream_t stream, const sm90::TensorMaps& maps, const sm90::Params& params,
                               int64_t max_tiles) {
  auto kernel = sm90::grouped_gemm_kernel<kMode, kBMnMajor, OutT, kCluster, kGathered>;
  // Once per device (both cost more than a launch): the 4-stage ring's opt-in to more than the default 48 KB of
  // dynamic shared memory, then the count of co-resident clusters (the GPCs' SM counts can leave SMs over).
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached_clusters[kMaxDevices] = {};
  int ordinal;
  JK_CUDA_CHECK(cudaGetDevice(&ordinal));
  JK_FFI_CHECK(ordinal < kMaxDevices, "grouped GEMM: device ordinal above 63");
  int clusters = cached_clusters[ordinal].load(std::memory_order_acquire);
  cudaLaunchAttribute attribute;
  if (clusters == 0) {
    JK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, sm90::kSmemBytes));
    cudaLaunchConfig_t query = launch_config(kCluster, kCluster, stream, &attribute);
    JK_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &query));
    JK_FFI_CHECK(clusters > 0, "grouped GEMM: no cluster of the kernel fits on this device");
    cached_clusters[ordinal].store(clusters, std::memory_order_release);
  }
  int64_t grid = std::min<int64_t>(max_tiles, int64_t{clusters} * kCluster) / kCluster * kCluster;
  cudaLaunchConfig_t config = launch_config(static_cast<unsigned>(grid), kCluster, stream, &attribute);
  JK_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, maps, params));
  return ffi::Error::Success();
}

// Clusters of two CTAs when the n-block count is even (the scheduler then pairs the two n blocks of each (group,
// m block)): row pairs, or weight pairs where a row GEMM gathers its lhs (kernels/sm90/grouped_gemm.cuh).
int cluster_size(int64_t n_blocks) { return n_blocks % 2 == 0 ? 2 : 1; }

// The tile queue's counter is the op's tile_counter workspace result, zeroed on the stream.
template <sm90::Mode kMode, bool kBMnMajor, typename OutT, sm90::Gathered kGathered = sm90::Gathered::kNone>
ffi::Error launch(cudaStream_t stream, int32_t* tile_counter, const sm90::TensorMaps& maps, sm90::Params params,
                  int64_t max_tiles, int64_t n_blocks) {
  if (max_tiles <= 0) return ffi::Error::Success();
  params.tile_counter = tile_counter;
  JK_CUDA_CHECK(cudaMemsetAsync(params.tile_counter, 0, sizeof(int32_t), stream));
  if (cluster_size(n_blocks) == 1) {
    return launch_with_cluster<kMode, kBMnMajor, OutT, 1, kGathered>(stream, maps, params, max_tiles);
  }
  return launch_with_cluster<kMode, kBMnMajor, OutT, 2, kGathered>(stream, maps, params, max_tiles);
}

// Upper bound on gmm-type tiles (the device computes the exact count): every pseudo-group may add a partial tile.
int64_t row_tile_bound(int64_t rows, int64_t groups, int64_t n_blocks) {
  return (gg::ceil_div(rows, sm90::kBlockM) + groups + 2) * n_blocks;
}

ffi::Error base_params(const int32_t* offsets, const int32_t* sizes, int64_t groups, int64_t rows, int64_t n,
                       sm90::Params* p) {
  JK_FFI_CHECK(rows < (int64_t{1} << 31), "grouped GEMM: more than 2^31 - 1 rows");
  *p = sm90::Params{};
  p->layout = {offsets, sizes, static_cast<int32_t>(groups), static_cast<int32_t>(rows)};
  p->n = static_cast<int32_t>(n);
  return ffi::Error::Success();
}

ffi::Error check_features(const char* op, std::initializer_list<int64_t> dims) {
  for (int64_t d : dims) {
    JK_FFI_CHECK(d % 64 == 0, std::string(op) + ": feature dims must be multiples of 64");
  }
  return ffi::Error::Success();
}

// A gathered operand: the rows of tokens [num_tokens, cols] that row_tokens [R] picks (see "Gathered operands"),
// addressed in 32-bit counts of 16-byte chunks.
ffi::Error set_gathered(const char* op, const void* tokens, int64_t num_tokens, int64_t cols,
                        const int32_t* row_tokens, sm90::Params* p) {
  JK_FFI_CHECK(num_tokens < (int64_t{1} << 31) && num_tokens * cols / 8 < (int64_t{1} << 32),
               std::string(op) + ": a gathered operand [T, C] must have T < 2^31 and T * C < 2^35");
  p->tokens = static_cast<const uint16_t*>(tokens);
  p->row_tokens = row_tokens;
  p->num_tokens = static_cast<int32_t>(num_tokens);
  p->token_chunks = static_cast<uint32_t>(cols / 8);
  return ffi::Error::Success();
}

ffi::Error GmmCuda(cudaStream_t stream, ffi::Buffer<ffi::BF16> lhs, ffi::Buffer<ffi::BF16> lhs2,
                   ffi::Buffer<ffi::BF16> rhs, ffi::Buffer<ffi::BF16> rhs2, ffi::Buffer<ffi::S32> offsets,
                   ffi::Buffer<ffi::S32> sizes, ffi::Result<ffi::AnyBuffer> out,
                   ffi::ResultBuffer<ffi::S32> tile_counter, bool transpose_rhs) {
  gg::GmmShape s;
  JK_FFI_RETURN_IF_ERROR(gg::gmm_shape(lhs.dimensions(), lhs2.dimensions(), rhs.dimensions(), rhs2.dimensions(),
                                       offsets.element_count(), sizes.element_count(), tile_counter->element_count(),
                                       transpose_rhs, &s));
  JK_FFI_RETURN_IF_ERROR(check_features("jk_gmm", {s.k1, s.k2, s.n}));
  JK_FFI_CHECK(s.k1 > 0 && s.n > 0, "jk_gmm: K1 and N must be positive");
  ffi::DataType type = out->element_type();
  JK_FFI_CHECK(type == ffi::F32 || type == ffi::BF16, "jk_gmm: out must be bf16 or f32");
  JK_FFI_RETURN_IF_ERROR(poison_results(stream, *out));
  if (s.rows == 0) return ffi::Error::Success();
  sm90::TensorMaps maps{};
  JK_FFI_RETURN_IF_ERROR(matrix_map(&maps.a, lhs.untyped_data(), s.rows, s.k1, kLhsBoxRows));
  // Forward: rhs [G, K, N] is read as four MN-major 64 x 64 chunks in one box; transposed: rhs [G, N, K] as one
  // K-major 256-row box.
  auto map_rhs = [&](CUtensorMap* map, const void* base, int64_t k) {
    return transpose_rhs ? weights_map(map, base, s.groups, s.n, k, 256)
                         : chunked_map(map, base, s.groups, k, s.n, gg::kTileCols / 64);
  };
  JK_FFI_RETURN_IF_ERROR(map_rhs(&maps.b, rhs.untyped_data(), s.k1));
  if (s.k2 > 0) {
    JK_FFI_RETURN_IF_ERROR(matrix_map(&maps.a2, lhs2.untyped_data(), s.rows, s.k2, kLhsBoxRows));
    JK_FFI_RETURN_IF_ERROR(map_rhs(&maps.b2, rhs2.untyped_data(), s.k2));
  }
  sm90::Params p;
  JK_FFI_RETURN_IF_ERROR(base_params(offsets.typed_data(), sizes.typed_data(), s.groups, s.rows, s.n, &p));
  p.k_steps1 = static_cast<int32_t>(s.k1 / sm90::kBlockK);
  p.k_steps2 = static_cast<int32_t>(s.k2 / sm90::kBlockK);
  p.out = out->untyped_data();
  int64_t n_blocks = gg::ceil_div(s.n, gg::kTileCols);
  int64_t tiles = row_tile_bound(s.rows, s.groups, n_blocks);
  using M = sm90::Mode;
  int32_t* counter = tile_counter->typed_data();
  if (type == ffi::F32) {
    return transpose_rhs ? launch<M::kGmm, false, float>(stream, counter, maps, p, tiles, n_blocks)
                         : launch<M::kGmm, true, float>(stream, counter, maps, p, tiles, n_blocks);
  }
  JK_FFI_RETURN_IF_ERROR(output_map(&maps.out[0], p.out, s.rows, s.n));
  return transpose_rhs ? launch<M::kGmm, false, uint16_t>(stream, counter, maps, p, tiles, n_blocks)
                       : launch<M::kGmm, true, uint16_t>(stream, counter, maps, p, tiles, n_blocks);
}

ffi::Error GmmSwigluCuda(cudaStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::S32> row_tokens,
                         ffi::Buffer<ffi::BF16> w_gate, ffi::Buffer<ffi::BF16> w_up, ffi::Buffer<ffi::S32> offsets,
                         ffi::Buffer<ffi::S32> sizes, ffi::ResultBuffer<ffi::BF16> act,
                         ffi::ResultBuffer<ffi::BF16> gate_out, ffi::ResultBuffer<ffi::BF16> up_out,
                         ffi::ResultBuffer<ffi::S32> tile_counter, float swiglu_limit) {
  gg::SwigluShape s;
  JK_FFI_RETURN_IF_ERROR(gg::swiglu_shape(x.dimensions(), row_tokens.element_count(), w_gate.dimensions(),
                                          w_up.dimensions(), act->dimensions(), gate_out->dimensions(),
                                          offsets.element_count(), sizes.element_count(),
                                          tile_counter->element_count(), &s));
  JK_FFI_RETURN_IF_ERROR(check_features("jk_gmm_swiglu", {s.hidden, s.inner}));
  JK_FFI_CHECK(s.hidden > 0 && s.inner > 0, "jk_gmm_swiglu: H and I must be positive");
  JK_FFI_RETURN_IF_ERROR(poison_results(stream, *act, *gate_out, *up_out));
  if (s.rows == 0) return ffi::Error::Success();
  sm90::TensorMaps maps{};
  constexpr uint32_t kChunks = gg::kSwigluTileCols / 64;  // a tile's gate (and up) columns, one box each
  JK_FFI_RETURN_IF_ERROR(chunked_map(&maps.b, w_gate.untyped_data(), s.groups, s.hidden, s.inner, kChunks));
  JK_FFI_RETURN_IF_ERROR(chunked_map(&maps.b2, w_up.untyped_data(), s.groups, s.hidden, s.inner, kChunks));
  sm90::Params p;
  JK_FFI_RETURN_IF_ERROR(base_params(offsets.typed_data(), sizes.typed_data(), s.groups, s.rows, s.inner, &p));
  p.k_steps1 = static_cast<int32_t>(s.hidden / sm90::kBlockK);
  p.out = act->untyped_data();
  p.out2 = s.save_preactivations ? gate_out->typed_data() : nullptr;
  p.out3 = s.save_preactivations ? up_out->typed_data() : nullptr;
  p.clamp = {swiglu_limit};
  if (s.gathered) {
    JK_FFI_RETURN_IF_ERROR(
        set_gathered("jk_gmm_swiglu", x.untyped_data(), s.tokens, s.hidden, row_tokens.typed_data(), &p));
  } else {
    JK_FFI_RETURN_IF_ERROR(matrix_map(&maps.a, x.untyped_data(), s.rows, s.hidden, kLhsBoxRows));
  }
  JK_FFI_RETURN_IF_ERROR(output_map(&maps.out[0], p.out, s.rows, s.inner));
  if (s.save_preactivations) {
    JK_FFI_RETURN_IF_ERROR(output_map(&maps.out[1], p.out2, s.rows, s.inner));
    JK_FFI_RETURN_IF_ERROR(output_map(&maps.out[2], p.out3, s.rows, s.inner));
  }
  int64_t n_blocks = gg::ceil_div(s.inner, gg::kSwigluTileCols);
  int64_t tiles = row_tile_bound(s.rows, s.groups, n_blocks);
  using M = sm90::Mode;
  using G = sm90::Gathered;
  int32_t* counter = tile_counter->typed_data();
  return s.gathered ? launch<M::kSwiglu, true, uint16_t, G::kLhs>(stream, counter, maps, p, tiles, n_blocks)
                    : launch<M::kSwiglu, true, uint16_t>(stream, counter, maps, p, tiles, n_blocks);
}

ffi::Error GmmSwigluDgradCuda(cudaStream_t stream, ffi::Buffer<ffi::BF16> dy, ffi::Buffer<ffi::S32> row_tokens,
                              ffi::Buffer<ffi::BF16> w_down, ffi::Buffer<ffi::BF16> gate, ffi::Buffer<ffi::BF16> up,
                              ffi::Buffer<ffi::F32> row_weights, ffi::Buffer<ffi::S32> offsets,
                              ffi::Buffer<ffi::S32> sizes, ffi::ResultBuffer<ffi::BF16> d_gate,
                              ffi::ResultBuffer<ffi::BF16> d_up, ffi::ResultBuffer<ffi::F32> d_row_weights,
                              ffi::ResultBuffer<ffi::BF16> weighted_act,
                              ffi::ResultBuffer<ffi::F32> row_weight_partials,
                              ffi::ResultBuffer<ffi::S32> tile_counter, float swiglu_limit) {
  gg::DgradShape s;
  JK_FFI_RETURN_IF_ERROR(gg::dgrad_shape(dy.dimensions(), row_tokens.element_count(), w_down.dimensions(),
                                         gate.dimensions(), up.dimensions(), row_weights.element_count(),
                                         weighted_act->dimensions(), row_weight_partials->dimensions(),
                                         offsets.element_count(), sizes.element_count(),
                                         tile_counter->element_count(), &s));
  JK_FFI_RETURN_IF_ERROR(check_features("jk_gmm_swiglu_dgrad", {s.hidden, s.inner}));
  JK_FFI_CHECK(s.hidden > 0 && s.inner > 0, "jk_gmm_swiglu_dgrad: H and I must be positive");
  JK_FFI_RETURN_IF_ERROR(
      poison_results(stream, *d_gate, *d_up, *d_row_weights, *weighted_act, *row_weight_partials));
  if (s.rows == 0) return ffi::Error::Success();
  int64_t n_blocks = gg::ceil_div(s.inner, gg::kTileCols);
  sm90::TensorMaps maps{};
  // w_down [G, I, H] is the K-major [N = I, K = H] operand of g = dy @ w_down^T, in boxes of 256 rows, or of 128
  // where weight pairs (a gathered dy in clusters) load it in halves.
  const uint32_t box_rows = s.gathered && cluster_size(n_blocks) == 2 ? gg::kTileCols / 2 : gg::kTileCols;
  JK_FFI_RETURN_IF_ERROR(weights_map(&maps.b, w_down.untyped_data(), s.groups, s.inner, s.hidden, box_rows));
  sm90::Params p;
  JK_FFI_RETURN_IF_ERROR(base_params(offsets.typed_data(), sizes.typed_data(), s.groups, s.rows, s.inner, &p));
  if (s.gathered) {
    JK_FFI_RETURN_IF_ERROR(
        set_gathered("jk_gmm_swiglu_dgrad", dy.untyped_data(), s.tokens, s.hidden, row_tokens.typed_data(), &p));
  } else {
    JK_FFI_RETURN_IF_ERROR(matrix_map(&maps.a, dy.untyped_data(), s.rows, s.hidden, kLhsBoxRows));
  }
  p.k_steps1 = static_cast<int32_t>(s.hidden / sm90::kBlockK);
  p.out = d_gate->untyped_data();
  p.out2 = d_up->typed_data();
  p.out3 = s.save_weighted_act ? weighted_act->typed_data() : nullptr;
  p.gate_in = gate.typed_data();
  p.up_in = up.typed_data();
  p.row_weights = row_weights.typed_data();
  p.row_weight_partials = row_weight_partials->typed_data();
  p.clamp = {swiglu_limit};
  JK_FFI_RETURN_IF_ERROR(output_map(&maps.out[0], p.out, s.rows, s.inner));
  JK_FFI_RETURN_IF_ERROR(output_map(&maps.out[1], p.out2, s.rows, s.inner));
  if (s.save_weighted_act) JK_FFI_RETURN_IF_ERROR(output_map(&maps.out[2], p.out3, s.rows, s.inner));
  const int64_t tiles = row_tile_bound(s.rows, s.groups, n_blocks);
  constexpr sm90::Mode kDgrad = sm90::Mode::kSwigluDgrad;
  JK_FFI_RETURN_IF_ERROR(
      (s.gathered ? launch<kDgrad, false, uint16_t, sm90::Gathered::kLhs>(stream, tile_counter->typed_data(), maps,
                                                                          p, tiles, n_blocks)
                  : launch<kDgrad, false, uint16_t>(stream, tile_counter->typed_data(), maps, p, tiles, n_blocks)));
  constexpr int kThreads = 256;
  sm90::sum_row_weight_partials<<<static_cast<unsigned>(gg::ceil_div(s.rows, kThreads)), kThreads, 0, stream>>>(
      p.row_weight_partials, static_cast<int32_t>(n_blocks), s.rows, d_row_weights->typed_data());
  JK_CUDA_CHECK(cudaGetLastError());
  return ffi::Error::Success();
}

// tgmm's kernels for its output type: none, or one operand gathered.
template <typename OutT>
ffi::Error launch_tgmm(cudaStream_t stream, int32_t* tile_counter, const gg::TgmmShape& s,
                       const sm90::TensorMaps& maps, const sm90::Params& p, int64_t tiles, int64_t n_blocks) {
  using G = sm90::Gathered;
  constexpr sm90::Mode kTgmm = sm90::Mode::kTgmm;
  if (s.lhs_gathered) return launch<kTgmm, true, OutT, G::kLhs>(stream, tile_counter, maps, p, tiles, n_blocks);
  if (s.rhs_gathered) return launch<kTgmm, true, OutT, G::kRhs>(stream, tile_counter, maps, p, tiles, n_blocks);
  return launch<kTgmm, true, OutT>(stream, tile_counter, maps, p, tiles, n_blocks);
}

ffi::Error TgmmCuda(cudaStream_t stream, ffi::Buffer<ffi::BF16> lhs, ffi::Buffer<ffi::S32> lhs_row_tokens,
                    ffi::Buffer<ffi::BF16> rhs, ffi::Buffer<ffi::S32> rhs_row_tokens, ffi::Buffer<ffi::S32> offsets,
                    ffi::Buffer<ffi::S32> sizes, ffi::Result<ffi::AnyBuffer> out,
                    ffi::ResultBuffer<ffi::S32> tile_counter) {
  gg::TgmmShape s;
  JK_FFI_RETURN_IF_ERROR(gg::tgmm_shape(lhs.dimensions(), lhs_row_tokens.element_count(), rhs.dimensions(),
                                        rhs_row_tokens.element_count(), out->dimensions(), offsets.element_count(),
                                        sizes.element_count(), tile_counter->element_count(), &s));
  JK_FFI_RETURN_IF_ERROR(check_features("jk_tgmm", {s.k, s.n}));
  ffi::DataType type = out->element_type();
  JK_FFI_CHECK(type == ffi::F32 || type == ffi::BF16, "jk_tgmm: out must be bf16 or f32");
  JK_FFI_RETURN_IF_ERROR(poison_results(stream, *out));
  if (s.groups == 0 || s.k == 0 || s.n == 0) return ffi::Error::Success();
  int64_t n_blocks = gg::ceil_div(s.n, gg::kTileCols);
  int64_t tiles = s.groups * gg::ceil_div(s.k, sm90::kBlockM) * n_blocks;
  size_t out_bytes = static_cast<size_t>(s.groups * s.k * s.n) * (type == ffi::F32 ? 4 : 2);
  if (s.rows == 0) {  // no rows, so no tensor maps: every group is empty
    JK_CUDA_CHECK(cudaMemsetAsync(out->untyped_data(), 0, out_bytes, stream));
    return ffi::Error::Success();
  }
  sm90::TensorMaps maps{};
  sm90::Params p;
  JK_FFI_RETURN_IF_ERROR(base_params(offsets.typed_data(), sizes.typed_data(), s.groups, s.rows, s.n, &p));
  // Both operands MN-major: 64 contraction rows x 64 features per box (or gathered line by line).
  if (s.lhs_gathered) {
    JK_FFI_RETURN_IF_ERROR(
        set_gathered("jk_tgmm", lhs.untyped_data(), s.lhs_tokens, s.k, lhs_row_tokens.typed_data(), &p));
  } else {
    JK_FFI_RETURN_IF_ERROR(matrix_map(&maps.a, lhs.untyped_data(), s.rows, s.k, 64));
  }
  if (s.rhs_gathered) {
    JK_FFI_RETURN_IF_ERROR(
        set_gathered("jk_tgmm", rhs.untyped_data(), s.rhs_tokens, s.n, rhs_row_tokens.typed_data(), &p));
  } else {
    JK_FFI_RETURN_IF_ERROR(chunked_map(&maps.b, rhs.untyped_data(), 1, s.rows, s.n, gg::kTileCols / 64));
  }
  p.m_extent = static_cast<int32_t>(s.k);
  p.out = out->untyped_data();
  if (type == ffi::F32) return launch_tgmm<float>(stream, tile_counter->typed_data(), s, maps, p, tiles, n_blocks);
  JK_FFI_RETURN_IF_ERROR(weights_map(&maps.out[0], p.out, s.groups, s.k, s.n, sm90::kStoreRows));
  return launch_tgmm<uint16_t>(stream, tile_counter->typed_data(), s, maps, p, tiles, n_blocks);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GmmCudaHandler, GmmCuda,
                              gmm_signature(ffi::Ffi::Bind()
                                                .Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
JK_REGISTER_FFI("jk_gmm", "CUDA", GmmCudaHandler);

XLA_FFI_DEFINE_HANDLER_SYMBOL(GmmSwigluCudaHandler, GmmSwigluCuda,
                              gmm_swiglu_signature(ffi::Ffi::Bind()
                                                       .Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
JK_REGISTER_FFI("jk_gmm_swiglu", "CUDA", GmmSwigluCudaHandler);

XLA_FFI_DEFINE_HANDLER_SYMBOL(GmmSwigluDgradCudaHandler, GmmSwigluDgradCuda,
                              gmm_swiglu_dgrad_signature(ffi::Ffi::Bind()
                                                             .Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
JK_REGISTER_FFI("jk_gmm_swiglu_dgrad", "CUDA", GmmSwigluDgradCudaHandler);

XLA_FFI_DEFINE_HANDLER_SYMBOL(TgmmCudaHandler, TgmmCuda,
                              tgmm_signature(ffi::Ffi::Bind()
                                                 .Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
JK_REGISTER_FFI("jk_tgmm", "CUDA", TgmmCudaHandler);

}  // namespace jk
