// The CUDA batched selection's offsets as a host-device function (kvevict/cuda/batch.cuh runs it
// in one block; tests/test_paged_device_logic.cpp runs it on the host under the emulated block).
// Not API.
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/detail/block/block.hpp>
#include <kvevict/detail/block/select_block.hpp>

#include <cstdint>

namespace kvevict::detail {

/// Per-head batch offsets (one block): row r = (s, h) of a padded batch keeps min(budgets[s],
/// row_lengths[r]) tokens (row_lengths null: T); cu[R + 1] receives their offsets. All or nothing:
/// if a budget is negative, a length outside [0, T] or the total above `capacity`, every offset is
/// 0 (nothing is selected) and the number of problems is returned.
template <class Block>
KVEVICT_HOST_DEVICE index_t batch_offsets(Block& blk, const std::int32_t* budgets, const std::int32_t* row_lengths,
                                          index_t R, index_t H, index_t T, index_t capacity, std::int32_t* cu) {
  const index_t chunk = (R + blk.size() - 1) / blk.size();
  auto length = [&](index_t r) { return row_lengths != nullptr ? index_t(row_lengths[r]) : T; };
  auto keep = [&](index_t r) {
    const index_t b = budgets[r / H], n = length(r);
    return b < n ? b : n;
  };
  const index_t bad = static_cast<index_t>(block_sum(blk, [&](int tid) {
    ucount b = 0;
    for (index_t r = tid * chunk; r < R && r < (tid + 1) * chunk; ++r)
      b += (budgets[r / H] < 0 || length(r) < 0 || length(r) > T) ? 1u : 0u;
    return b;
  }));
  index_t added = bad;
  blk.exclusive_sum(
      [&](int tid) {
        ucount s = 0;
        for (index_t r = tid * chunk; bad == 0 && r < R && r < (tid + 1) * chunk; ++r) s += static_cast<ucount>(keep(r));
        return s;
      },
      [&](int tid, ucount, ucount prefix, ucount total) {
        const bool ok = bad == 0 && static_cast<index_t>(total) <= capacity && total <= INT32_MAX;
        if (bad == 0 && !ok) added = 1;  // uniform
        index_t at = static_cast<index_t>(prefix);
        if (tid == 0) cu[0] = 0;
        for (index_t r = tid * chunk; r < R && r < (tid + 1) * chunk; ++r) {
          at += ok ? keep(r) : 0;
          cu[r + 1] = static_cast<std::int32_t>(ok ? at : 0);
        }
      });
  return added;
}

}  // namespace kvevict::detail
