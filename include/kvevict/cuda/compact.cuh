// CUDA overloads of <kvevict/compact.hpp>. Same semantics as the host backends; launches are
// asynchronous on the backend's stream and never synchronise the host.
//
// Positions live in device memory, so they cannot be range-checked before the launch. The kernel
// instead skips (leaves unwritten) every row whose position is outside [0, tokens) and, if
// `bad_positions` is non-null (a device int), atomically adds the number of such rows to it.
// Positions produced by kvevict's selection are always in range.
#pragma once

#include <kvevict/compact.hpp>
#include <kvevict/cuda/error.cuh>

namespace kvevict {
namespace detail {

// One warp per kept row, lanes across the head dimension; grid-stride over rows so any number
// of rows fits a bounded grid.
template <class T>
__global__ void compact_dense_kernel(kv_view<const T> src, matrix_view<const pos_t> kept, kv_view<T> dst,
                                     int* bad_positions) {
  constexpr int warp = 32;
  const index_t k = kept.extent(1), rows = kept.extent(0) * k, dim = src.extent(2);
  const index_t warps_per_grid = index_t(gridDim.x) * (blockDim.x / warp);
  const int lane = int(threadIdx.x % warp);
  for (index_t r = index_t(blockIdx.x) * (blockDim.x / warp) + threadIdx.x / warp; r < rows; r += warps_per_grid) {
    const index_t h = r / k, j = r % k;
    const pos_t p = kept(h, j);
    if (p < 0 || p >= src.extent(1)) {
      if (lane == 0 && bad_positions != nullptr) atomicAdd(bad_positions, 1);
      continue;
    }
    const T* s = src.data_handle() + h * src.stride(0) + p * src.stride(1);
    T* d = dst.data_handle() + h * dst.stride(0) + j * dst.stride(1);
    for (index_t e = lane; e < dim; e += warp) d[e * dst.stride(2)] = s[e * src.stride(2)];
  }
}

}  // namespace detail

/// Dense gather on the GPU: dst[h][j][:] = src[h][kept[h][j]][:]. Views hold device pointers.
template <class S, class T>
status compact(cuda_t be, kv_view<S> src_in, matrix_view<const pos_t> kept, kv_view<T> dst,
               int* bad_positions = nullptr) {
  static_assert(std::is_same_v<std::remove_const_t<S>, T>, "compact: src and dst element types differ");
  constexpr const char* fn = "compact(cuda)";
  const kv_view<const T> src = src_in;
  KVEVICT_TRY(detail::check_compact_dense_shapes(fn, src, kept, dst));
  const index_t rows = kept.extent(0) * kept.extent(1);
  if (rows == 0 || src.extent(2) == 0) return {};
  constexpr int threads = 256, rows_per_block = threads / 32;
  const index_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  const unsigned grid = static_cast<unsigned>(blocks < 65535 * 16 ? blocks : 65535 * 16);
  detail::compact_dense_kernel<T><<<grid, threads, 0, detail::stream_of(be)>>>(src, kept, dst, bad_positions);
  return detail::cuda_status(cudaGetLastError(), fn);
}

}  // namespace kvevict
