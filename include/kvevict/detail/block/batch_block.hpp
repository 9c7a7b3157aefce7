// The CUDA batched selection's offsets and its varlen rows as host-device functions
// (kvevict/cuda/batch.cuh runs them through the ops of select_ops.hpp; tests/test_paged_device_logic.cpp
// runs the same launch sequences on the host SIMT executor). Not API.
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/detail/block/block.hpp>
#include <kvevict/detail/block/compact_block.hpp>
#include <kvevict/detail/block/select_block.hpp>

#include <cstdint>

namespace kvevict::detail {

/// Sequence s's length in a varlen batch (columns [cu_seqlens[s], cu_seqlens[s+1]) of S sequences
/// in T columns, device data): -1 unless cu_seqlens[0] = 0, cu_seqlens[s] <= cu_seqlens[s+1] <=
/// cu_seqlens[S] <= T.
KVEVICT_HOST_DEVICE inline index_t varlen_length(const std::int32_t* cu_seqlens, index_t s, index_t S, index_t T) {
  index_t begin = 0, n = 0;
  return offsets_span_ok(cu_seqlens, s, S, begin, n) && cu_seqlens[S] <= T ? n : -1;
}

/// The rows r = s * H + h of a varlen batch for the selection ops (scores [H][T]: row r is columns
/// cu_seqlens[s] .. of matrix row h), ragged output as ragged_rows: row r keeps cu[r+1] - cu[r]
/// tokens at pos[cu[r] ..]. A row with bad sequence offsets or kept offsets is row_bad (skipped).
struct varlen_rows {
  const std::int32_t* cu_seqlens;
  index_t S, H, T;
  const std::int32_t* cu;
  pos_t* pos;
  index_t capacity;
  KVEVICT_HOST_DEVICE row_state state(index_t r) const {
    const index_t n = varlen_length(cu_seqlens, r / H, S, T);
    index_t k = 0;
    const bool ok = n >= 0 && ragged_row_ok(cu, r, S * H, capacity, pos != nullptr, k) && k <= n;
    return row_begin(ok ? n : 0, ok ? k : 0, ok);
  }
  KVEVICT_HOST_DEVICE pos_out out(index_t r) const { return {pos + cu[r], 1}; }
  template <class Scores>
  KVEVICT_HOST_DEVICE score_keys keys(const Scores& scores, index_t r) const {
    const index_t begin = varlen_length(cu_seqlens, r / H, S, T) >= 0 ? index_t(cu_seqlens[r / H]) : 0;
    return {scores.data_handle() + (r % H) * scores.stride(0) + begin * scores.stride(1), scores.stride(1)};
  }
  template <class Scores>
  KVEVICT_HOST_DEVICE index_t count(const Scores&) const {
    return S * H;
  }
};

/// Per-head batch offsets (one block): row r = (s, h) keeps min(budgets[s], its length) tokens;
/// cu[R + 1] receives their offsets. Lengths: varlen (cu_seqlens non-null: sequence s's columns,
/// varlen_length) or padded (row_lengths[r], null: T). All or nothing: if a budget is negative, a
/// length outside [0, T] (bad varlen offsets: every row of the sequence) or the total above
/// `capacity`, every offset is 0 (nothing is selected) and the number of problems is returned.
template <class Block>
KVEVICT_HOST_DEVICE index_t batch_offsets(Block& blk, const std::int32_t* budgets, const std::int32_t* row_lengths,
                                          const std::int32_t* cu_seqlens, index_t R, index_t H, index_t T,
                                          index_t capacity, std::int32_t* cu) {
  const index_t chunk = (R + blk.size() - 1) / blk.size();
  auto length = [&](index_t r) {
    if (cu_seqlens != nullptr) return varlen_length(cu_seqlens, r / H, R / H, T);
    return row_lengths != nullptr ? index_t(row_lengths[r]) : T;
  };
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
