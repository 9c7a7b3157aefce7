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
#include <kvevict/cuda/simt.cuh>
#include <kvevict/detail/base/checks.hpp>
#include <kvevict/detail/block/pool_block.hpp>
#include <kvevict/detail/block/postprocess_device.hpp>
#include <kvevict/detail/block/postprocess_ops.hpp>
#include <kvevict/pool.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>

#include <cstdint>

// The kernels are the ops of detail/block/postprocess_ops.hpp (pp_tile_op, pp_block_op), launched by
// postprocess_launch on cuda_launcher; the host tests run the same sequence on the SIMT executor.

namespace kvevict {

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
  detail::cuda_launcher l{detail::stream_of(be), fn};
  detail::postprocess_launch(l, a, detail::pp_values<float>{}, nullptr, nullptr, nullptr, bad_rows);
  return l.err;
}

}  // namespace kvevict
