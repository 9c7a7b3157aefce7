// Kernel bodies written once over the SIMT execution context of detail/block/simt.hpp: the CUDA
// kernels are one-line wrappers (cuda/protect.cuh, cuda/gqa.cuh) and the host tests run the same
// bodies under simt_executor (real barriers, warps, race checks) with the same launch shapes. Not API.
//
// Converted so far: protect (protect_body) and gqa_reduce (gqa_reduce_body). docs/cuda.md,
// "Kernel bodies on the host", lists the kernels that are not converted yet.
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/detail/base/stage_math.hpp>
#include <kvevict/gqa.hpp>

#include <cstdint>

namespace kvevict::detail {

/// A launch: blocks and threads per block.
struct simt_shape {
  index_t grid = 1, block = 1;
};

/// Blocks for a grid-stride loop over `items` work items: min(items, cap) (never 0). Every kernel
/// loops `for (item = block; item < items; item += grid)` with 64-bit items, so any size fits and the
/// results do not depend on the grid (tests pass a small cap to exercise the stride).
KVEVICT_HOST_DEVICE constexpr index_t simt_grid(index_t items, index_t cap = index_t(1) << 20) noexcept {
  return items < 1 ? 1 : items < cap ? items : cap;
}

/// The length of row `row` from lengths in device memory (or `limit` when there are none). A length
/// outside [0, limit] returns false; if `count`, 1 is added to *bad (when bad is non-null).
template <class Ctx>
KVEVICT_HOST_DEVICE bool simt_row_length(Ctx& c, const std::int32_t* lengths, index_t row, index_t limit,
                                         index_t& len, int* bad, bool count) {
  len = lengths != nullptr ? static_cast<index_t>(lengths[row]) : limit;
  if (len >= 0 && len <= limit) return true;
  if (count && bad != nullptr) c.atomic_add(bad, 1);
  return false;
}

// ---- protect: one thread per element, grid-stride ------------------------------------------------
inline constexpr index_t protect_threads = 256;
inline simt_shape protect_shape(index_t R, index_t T, index_t cap = index_t(1) << 20) {
  return {simt_grid((R * T + protect_threads - 1) / protect_threads, cap), protect_threads};
}
template <class Ctx>
KVEVICT_HOST_DEVICE void protect_body(Ctx& c, float* s, index_t s0, index_t s1, index_t R, index_t T, index_t n_sink,
                                      index_t n_recent, const std::int32_t* lengths, int* bad) {
  const index_t items = R * T, stride = c.grid_dim() * c.block_dim();
  for (index_t it = c.block() * c.block_dim() + c.thread(); it < items; it += stride) {
    const index_t r = it / T, t = it % T;
    index_t L = 0;
    if (!simt_row_length(c, lengths, r, T, L, bad, t == 0) || t >= L) continue;
    float& v = s[r * s0 + t * s1];
    v = protect_value(v, t, protect_sink_end(L, n_sink), protect_recent_begin(L, n_recent));
  }
}

// ---- gqa_reduce: one thread per (KV head, column); in place one thread per column ---------------
inline constexpr index_t gqa_threads = 256;
inline simt_shape gqa_reduce_shape(index_t hkv, index_t T, bool in_place, index_t cap = index_t(1) << 20) {
  return {simt_grid(((in_place ? 1 : hkv) * T + gqa_threads - 1) / gqa_threads, cap), gqa_threads};
}
/// In place (out = the first H_kv rows of in) one thread per column walks the KV heads in ascending
/// order, as the host does, so that row h is written only after every group reading it was reduced.
template <class Ctx>
KVEVICT_HOST_DEVICE void gqa_reduce_body(Ctx& c, const float* in, index_t is0, index_t is1, float* out, index_t os0,
                                         index_t os1, index_t hkv, index_t g, index_t T, gqa_op op, bool in_place) {
  const index_t heads = in_place ? 1 : hkv;  // in place: one item per column covers every head
  const index_t items = heads * T, stride = c.grid_dim() * c.block_dim();
  for (index_t it = c.block() * c.block_dim() + c.thread(); it < items; it += stride) {
    const index_t t = it % T, h0 = in_place ? 0 : it / T, h1 = in_place ? hkv : h0 + 1;
    for (index_t h = h0; h < h1; ++h) {
      const float* col = in + (h * g) * is0 + t * is1;
      float acc = col[0];
      for (index_t j = 1; j < g; ++j) acc = gqa_combine(op, acc, col[j * is0]);
      out[h * os0 + t * os1] = gqa_finish(op, acc, g);
    }
  }
}

}  // namespace kvevict::detail
