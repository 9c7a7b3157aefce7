// CUDA overload of <kvevict/pool.hpp> (pool1d), and the tile/block kernels that the fused
// post-processing (<kvevict/cuda/postprocess.cuh>) shares with it. Bit-identical to the host for
// every kind, kernel, divisor and row length (NaN results: see docs/cuda.md).
//
// Kernels up to 2 * pp_max_radius + 1 = 2049: one CTA per (row, tile of 1024 outputs) stages the
// tile's inputs (1024 + kernel - 1 of them) in shared memory once and pools them block by block with
// pool_block (one thread per block of `kernel` outputs, O(1) work per output). Wider kernels: one
// thread per pooling block, inputs read from global memory, the block's suffixes kept in the output
// row as pool_row_impl does (O(1) work per output, kernel/(2 x 1024) times fewer threads).
//
// Row lengths live in device memory: a row whose length is outside [0, T] is skipped (left
// unwritten) and counted once in *bad_rows when bad_rows is non-null (the kernel's check of what the
// host check_lengths does on the host backends).
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/cuda/error.cuh>
#include <kvevict/cuda/launch.cuh>
#include <kvevict/detail/base/checks.hpp>
#include <kvevict/detail/block/pool_block.hpp>
#include <kvevict/detail/block/postprocess_device.hpp>
#include <kvevict/pool.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>

#include <cstdint>

namespace kvevict {
namespace detail {

/// The guard of a row's lengths: row_lengths[h] in [0, T] and, when weighting, value_lengths[h] in
/// [0, tv]; a bad row is counted once (by the caller flagged `count`).
__device__ inline bool pp_row_lengths(const pp_params& a, index_t tv, index_t h, index_t& L, index_t& vlen, int* bad,
                                      bool count) {
  if (!device_row_length(a.row_lengths, h, a.T, L, bad, count)) return false;
  vlen = tv;
  if (a.weight && !device_row_length(a.value_lengths, h, tv, vlen, bad, count)) return false;
  return true;
}

/// One CTA per (KV head or row, tile of pp_tile outputs): pp_run_tile with the inputs staged in
/// shared memory. 37,888 bytes of static shared memory. At least two CTAs per SM: without the
/// minimum ptxas gave the fp16 variant 80 registers and 56 B of spill on sm_80; with it every
/// variant fits 128 registers without spilling (two CTAs: 75,776 B of shared memory).
template <class VE>
__global__ void __launch_bounds__(stage_rows, 2) pp_tile_kernel(const pp_params a, const pp_values<VE> vals, int* bad) {
  __shared__ float span[pp_span];
  __shared__ float stash[pp_tile];
  __shared__ float acc[pp_tile];
  __shared__ float stage[stage_rows * stage_ld];
  const cta_ctx ctx{stage};
  const index_t tiles = pp_tiles_per_row(a.T), items = a.hkv * tiles;
  for (index_t item = blockIdx.x; item < items; item += gridDim.x) {
    const index_t h = item / tiles, t0 = (item % tiles) * pp_tile;
    index_t L = 0, vlen = 0;
    if (!pp_row_lengths(a, vals.tv, h, L, vlen, bad, t0 == 0 && threadIdx.x == 0) || t0 >= L) continue;
    __syncthreads();  // the previous item is done with the shared buffers
    pp_run_tile(ctx, a, vals, h, L, vlen, t0, span, stash, acc);
  }
}

/// One thread per (KV head or row, work item of pp_run_block), for kernels above 2 * pp_max_radius + 1.
/// stash: [hkv][T] floats (pool_first with a group of several heads), else unused.
template <class VE>
__global__ void __launch_bounds__(stage_rows) pp_block_kernel(const pp_params a, const pp_values<VE> vals, float* stash,
                                                             index_t items_per_row, int* bad) {
  const index_t items = a.hkv * items_per_row;
  const index_t stride = static_cast<index_t>(gridDim.x) * blockDim.x;
  for (index_t it = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; it < items; it += stride) {
    const index_t h = it / items_per_row, b = it % items_per_row;
    index_t L = 0, vlen = 0;
    if (!pp_row_lengths(a, vals.tv, h, L, vlen, bad, b == 0)) continue;
    pp_run_block(a, vals, h, L, vlen, b, stash != nullptr ? stash + h * a.T : nullptr);
  }
}

/// Launches the fused work in the decomposition pp_choose_variant picks.
template <class VE>
status pp_launch(const char* fn, cuda_t be, const pp_params& a, const pp_values<VE>& vals, float* stash, int* bad) {
  if (a.hkv == 0 || a.T == 0) return {};
  if (pp_choose_variant(a.pool, a.kernel) == pp_variant::tiles) {
    const index_t tiles = pp_tiles_per_row(a.T);
    pp_tile_kernel<VE><<<grid_for(a.hkv * tiles), stage_rows, 0, stream_of(be)>>>(a, vals, bad);
  } else {
    const index_t bpr = pp_items_per_row(a);
    pp_block_kernel<VE><<<grid_for((a.hkv * bpr + stage_rows - 1) / stage_rows), stage_rows, 0, stream_of(be)>>>(
        a, vals, stash, bpr, bad);
  }
  return cuda_status(cudaGetLastError(), fn);
}

}  // namespace detail

/// pool1d on the GPU (views and row_lengths in device memory). Same semantics, checks and messages as
/// the host overload, except that row lengths are checked by the kernel: a row with a length outside
/// [0, T] is left unwritten and counted in *bad_rows (a device int, if non-null). No workspace, no
/// host synchronisation; bit-identical to the host.
inline status pool1d(cuda_t be, matrix_view<const float> in, matrix_view<float> out, pool_kind kind, index_t kernel,
                     const std::int32_t* row_lengths = nullptr, pool_options options = {}, int* bad_rows = nullptr) {
  constexpr const char* fn = "pool1d(cuda)";
  KVEVICT_TRY(detail::check_pool1d_views(fn, in, out));
  KVEVICT_TRY(detail::check_pool_params(fn, kind, kernel, options));
  KVEVICT_TRY(detail::check_pool1d_overlap(fn, in, out, row_lengths));
  KVEVICT_TRY(detail::check_device_alignment(fn, "in", in.data_handle()));
  KVEVICT_TRY(detail::check_device_alignment(fn, "out", out.data_handle()));
  KVEVICT_TRY(detail::check_device_alignment(fn, "row_lengths", row_lengths));
  // the fused work with groups of one row, no weighting and no protection: gqa `sum` over one member
  // is the input itself, no arithmetic (NaN bits kept)
  postprocess_options o;
  o.gqa = gqa_op::sum;
  o.order = gqa_order::gqa_first;
  o.pool = kind;
  o.kernel = kernel;
  o.divisor = options.divisor;
  detail::pp_params a = detail::make_pp_params(in, out, o, row_lengths, nullptr, nullptr);
  a.protect = false;
  return detail::pp_launch<float>(fn, be, a, detail::pp_values<float>{}, nullptr, bad_rows);
}

}  // namespace kvevict
