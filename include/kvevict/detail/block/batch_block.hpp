// The CUDA batched selection's offsets, its varlen rows and its flattened per-sequence selection as
// host-device functions
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

/// Row r's length in a batch: varlen (cu_seqlens non-null: sequence r / H's columns,
/// varlen_length, -1 if bad) or padded (row_lengths[r], null: T; unchecked).
KVEVICT_HOST_DEVICE inline index_t batch_row_length(const std::int32_t* row_lengths, const std::int32_t* cu_seqlens,
                                                    index_t r, index_t S, index_t H, index_t T) {
  if (cu_seqlens != nullptr) return varlen_length(cu_seqlens, r / H, S, T);
  return row_lengths != nullptr ? index_t(row_lengths[r]) : T;
}

/// Batch offsets (one block). Per head (!flattened): row r = (s, h) keeps min(budgets[s], its
/// length) tokens. Flattened: sequence s keeps min(budgets[s] * H, the sum of its rows' lengths),
/// counted on its last row (the other rows' offsets are the sequence's start, until
/// batch_flat_sequence splits the sequence's count over its heads). cu[R + 1] receives the
/// offsets. Lengths: batch_row_length. All or nothing: if a budget is negative, a length outside
/// [0, T] (bad varlen offsets: every row of the sequence) or the total above `capacity`, every
/// offset is 0 (nothing is selected) and the number of problems is returned.
template <class Block>
KVEVICT_HOST_DEVICE index_t batch_offsets(Block& blk, const std::int32_t* budgets, const std::int32_t* row_lengths,
                                          const std::int32_t* cu_seqlens, index_t R, index_t H, index_t T,
                                          index_t capacity, std::int32_t* cu, bool flattened = false) {
  const index_t chunk = (R + blk.size() - 1) / blk.size();
  auto length = [&](index_t r) { return batch_row_length(row_lengths, cu_seqlens, r, R / H, H, T); };
  auto keep = [&](index_t r) {
    if (flattened) {
      if (r % H != H - 1) return index_t(0);
      index_t tokens = 0;
      for (index_t i = r - (H - 1); i <= r; ++i) tokens += length(i);
      const index_t b = index_t(budgets[r / H]) * H;
      return b < tokens ? b : tokens;
    }
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

/// The rows of a batch for the flattened selection: row r = (s, h)'s keys and length (padded rows
/// of a [S*H][T] matrix or varlen columns of a [H][T] one; batch_row_length).
struct batch_keys {
  matrix_view<const float> scores;
  const std::int32_t* row_lengths;
  const std::int32_t* cu_seqlens;
  index_t S, H, T;
  KVEVICT_HOST_DEVICE index_t length(index_t r) const { return batch_row_length(row_lengths, cu_seqlens, r, S, H, T); }
  KVEVICT_HOST_DEVICE score_keys keys(index_t r) const {
    if (cu_seqlens == nullptr) return {scores.data_handle() + r * scores.stride(0), scores.stride(1)};
    return {scores.data_handle() + (r % H) * scores.stride(0) + index_t(cu_seqlens[r / H]) * scores.stride(1),
            scores.stride(1)};
  }
};

/// Sequence s of a flattened batch by one block (after batch_offsets(flattened) wrote its start
/// cu[s*H] and end cu[(s+1)*H]): the top min(budgets[s] * H, its tokens) entries of its H rows
/// taken as one row (head 0's positions, then head 1's, ...: equal scores go to the lower head,
/// then the lower position, as select_topk_flat without floors): the radix passes over every
/// row's keys into one histogram, then per head its count (the threshold's tied entries to the
/// lower heads first), its offset cu[s*H + h + 1] and its ordered emit at pos[cu[s*H + h] ..].
/// A sequence whose budget or lengths are bad, or whose offsets do not span its count (the
/// offsets op refused the batch: every offset 0), is left alone.
template <class Block>
KVEVICT_HOST_DEVICE void batch_flat_sequence(Block& blk, const batch_keys& b, const std::int32_t* budgets, index_t s,
                                             std::int32_t* cu, pos_t* pos, select_smem& sm) {
  const index_t H = b.H, first = s * H;
  bool ok = budgets[s] >= 0;
  index_t tokens = 0;
  for (index_t h = 0; h < H; ++h) {
    const index_t n = b.length(first + h);
    ok = ok && row_length_ok(n, b.T);
    tokens += ok ? n : 0;
  }
  const index_t keep = ok ? imin(index_t(budgets[s]) * H, tokens) : 0, base = cu[first];
  if (!ok || index_t(cu[first + H]) - base != keep) return;  // uniform over the block
  row_state st = row_begin(tokens, keep, true);
  for (int pass = 0; pass < radix_passes && !st.done; ++pass) {
    const int bins = radix_pass_bins(pass);
    block_fill(blk, sm.hist, bins, 0u);
    blk.sync();
    const radix_threshold t = st.t;
    for (index_t h = 0; h < H; ++h)
      block_histogram(blk, b.keys(first + h), 0, b.length(first + h),
                      [t](std::uint32_t key) { return radix_tied(key, t); }, pass, sm.hist);
    blk.sync();
    const radix_bucket bucket = block_choose(blk, [&](int bin) { return sm.hist[bin]; }, bins, st.t.ties, sm);
    row_narrow(st, pass, bucket, false);
  }
  index_t at = base, ties_left = st.t.ties;
  for (index_t h = 0; h < H; ++h) {
    const index_t n = b.length(first + h);
    const score_keys keys = b.keys(first + h);
    const pos_out out{pos + at, 1};
    index_t kept = 0;
    if (st.mode == row_all) {
      kept = n;
      block_emit_all(blk, 0, n, out);
    } else if (st.mode == row_select) {
      const ucount c = block_count(blk, keys, 0, n, st.t);
      const index_t ties = imin(static_cast<index_t>(c & 0xffffffffu), ties_left);
      ties_left -= ties;
      kept = static_cast<index_t>(c >> 32) + ties;
      if (kept > 0) block_emit(blk, keys, 0, n, st.t, ties, out, kept, 0, sm.keys);
    }
    at += kept;
    blk.each([&](int tid) {  // cu[first + H] (= at now) is the offsets op's, read by the next sequence's block
      if (tid == 0 && h + 1 < H) cu[first + h + 1] = static_cast<std::int32_t>(at);
    });
    blk.sync();  // sm.keys (the emit's staging) is reused by the next head
  }
}

}  // namespace kvevict::detail
