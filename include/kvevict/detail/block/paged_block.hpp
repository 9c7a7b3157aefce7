// The CUDA paged compaction's logic as host-device functions (kvevict/cuda/paged.cuh runs them on
// the GPU; tests/test_paged_device_logic.cpp runs them on the host under the emulated block of
// detail/block/host_block.hpp). Not API.
//
// The tables, kept lists and lengths live in device memory, so the launcher cannot check them on
// the host. The call is all or nothing, like the host one:
//   1. mark: every listed page id is range-checked and counted (one counter per pool page);
//   2. validate: block r checks row r (its list's offsets and last_page_len, its pages counted
//      once, its kept offsets, positions strictly ascending and below the row's length, the same
//      count as the other heads of its list for per-sequence tables), adding its problems to `bad`;
//   3. finish (one block): if nothing was bad and the freed pages fit, writes the lengths, the
//      freed page ids (lists in order: an exclusive sum over chunks of lists) and their count, and
//      sets every row's rows-to-move; otherwise sets every row to -1 (nothing moves) and counts;
//   4. copy: the in-place tiles of compact_block.hpp over paged heads (keys, then values).
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/detail/base/softmax.hpp>
#include <kvevict/detail/base/stage_math.hpp>
#include <kvevict/detail/block/compact_block.hpp>
#include <kvevict/paged_types.hpp>
#include <kvevict/view.hpp>

#include <cstdint>

namespace kvevict::detail {

/// A row of a paged layer for the in-place tiles: row(j) is its token j through its page list.
template <class T>
struct paged_inplace_head {
  T* data;                    ///< the pool, offset to the row's head
  const std::int32_t* pages;  ///< the list's page ids
  index_t page_size, page_stride, token_stride;
  const pos_t* kept;
  KVEVICT_HOST_DEVICE T* row(index_t j) const {
    return data + index_t(pages[j / page_size]) * page_stride + (j % page_size) * token_stride;
  }
  KVEVICT_HOST_DEVICE index_t pos(index_t j) const { return kept[j]; }
};

/// The rows of one pool of a paged layer, with the kept lists (the Heads of compact_block.hpp's
/// in-place tiles: lengths are written by the finish step, not by set_length).
template <class T>
struct paged_inplace_heads {
  page_pool<T> pool;
  page_table table;
  ragged_positions kept;
  index_t kv_heads;
  page_lists lists;

  KVEVICT_HOST_DEVICE index_t heads() const { return kept.heads; }
  KVEVICT_HOST_DEVICE index_t list_of(index_t r) const { return lists == page_lists::per_head ? r : r / kv_heads; }
  KVEVICT_HOST_DEVICE index_t heads_per_list() const { return lists == page_lists::per_head ? 1 : kv_heads; }
  KVEVICT_HOST_DEVICE paged_inplace_head<T> head(index_t r) const {
    const index_t h = lists == page_lists::per_head ? 0 : r % kv_heads;
    return {pool.data + h * pool.head_stride, table.indices + table.indptr[list_of(r)], pool.page_size,
            pool.page_stride, pool.token_stride, kept.pos + kept.cu[r]};
  }
  KVEVICT_HOST_DEVICE void set_length(index_t, index_t) const {}
};

/// List l's offsets and last page: indptr[0] == 0, 0 <= indptr[l] <= indptr[l+1] <= indptr[lists],
/// last_page_len in [1, page_size] (0 for a list without pages). Its page count and length.
KVEVICT_HOST_DEVICE inline bool paged_list_ok(const page_table& t, index_t l, index_t page_size, index_t& pages,
                                              index_t& length) {
  const index_t a = t.indptr[l], b = t.indptr[l + 1], last = t.last_page_len[l];
  pages = b - a;
  const bool ok = t.indptr[0] == 0 && a >= 0 && a <= b && b <= t.indptr[t.lists] &&
                  (pages == 0 ? last == 0 : last >= 1 && last <= page_size);
  length = ok && pages > 0 ? (pages - 1) * page_size + last : 0;
  if (!ok) pages = 0;
  return ok;
}

/// Step 1 for listed page i (i < indptr[lists], when indptr[lists] is in [0, pool pages]):
/// counts it with count(marks + id) (an atomic increment on the GPU); returns 1 if its id is
/// outside the pool (not counted).
template <class Count>
KVEVICT_HOST_DEVICE int paged_mark_page(const page_table& t, index_t i, index_t pool_pages, std::uint32_t* marks,
                                        const Count& count) {
  const std::int32_t p = t.indices[i];
  if (p < 0 || p >= pool_pages) return 1;
  count(marks + p);
  return 0;
}

/// Step 2 for row r (block-uniform): the number of problems (0: the row may move).
template <class Block, class T>
KVEVICT_HOST_DEVICE index_t paged_validate_row(Block& blk, const paged_inplace_heads<T>& hs, index_t r,
                                               const std::uint32_t* marks) {
  const index_t R = hs.heads(), l = hs.list_of(r), per = hs.heads_per_list();
  index_t pages = 0, length = 0, kb = 0, n = 0;
  if (!paged_list_ok(hs.table, l, hs.pool.page_size, pages, length)) return 1;
  if (!offsets_span_ok(hs.kept.cu, r, R, kb, n) || (hs.kept.pos == nullptr && n > 0) || n > length) return 1;
  for (index_t h = l * per; h < l * per + per; ++h) {  // the list's heads keep one count
    index_t b2 = 0, n2 = 0;
    if (!offsets_span_ok(hs.kept.cu, h, R, b2, n2) || n2 != n) return 1;
  }
  const std::int32_t* ids = hs.table.indices + hs.table.indptr[l];
  const index_t bad_pages = static_cast<index_t>(block_sum(blk, [&](int tid) {
    ucount b = 0;
    for (index_t i = tid; i < pages; i += blk.size()) {
      const std::int32_t p = ids[i];
      b += (p < 0 || p >= hs.pool.pages || marks[p] != 1u) ? 1u : 0u;
    }
    return b;
  }));
  if (bad_pages > 0) return bad_pages;
  return inplace_bad_positions(blk, hs.head(r), n, length);
}

/// Step 3 (one block): all or nothing. `bad`: the problems steps 1-2 counted (read after them).
/// Lists are cut into one chunk per thread; an exclusive sum of the chunks' freed pages places
/// each chunk's ids. head_rows[r] = kept count, or -1 for every row when anything is wrong.
/// Returns the problems it adds (1 if the freed pages exceed the capacity).
template <class Block, class T>
KVEVICT_HOST_DEVICE index_t paged_finish(Block& blk, const paged_inplace_heads<T>& hs, index_t bad,
                                         const paged_compaction_out& out, index_t* head_rows) {
  const index_t lists = hs.table.lists, per = hs.heads_per_list(), ps = hs.pool.page_size, R = hs.heads();
  const index_t chunk = (lists + blk.size() - 1) / (blk.size() > 0 ? blk.size() : 1);
  auto kept_of = [&](index_t l) { return index_t(hs.kept.cu[l * per + 1] - hs.kept.cu[l * per]); };
  auto freed_of = [&](index_t l) {
    return index_t(hs.table.indptr[l + 1] - hs.table.indptr[l]) - (kept_of(l) + ps - 1) / ps;
  };
  index_t added = 0;
  bool ok = bad == 0;
  if (ok) {
    // offsets and kept counts were validated in step 2 (nothing is read unless bad == 0)
    index_t total = 0;
    blk.exclusive_sum(
        [&](int tid) {
          ucount s = 0;
          for (index_t l = tid * chunk; l < lists && l < (tid + 1) * chunk; ++l) s += static_cast<ucount>(freed_of(l));
          return s;
        },
        [&](int tid, ucount, ucount prefix, ucount all) {
          total = static_cast<index_t>(all);  // uniform
          if (total > out.freed_capacity) return;
          index_t at = static_cast<index_t>(prefix);
          for (index_t l = tid * chunk; l < lists && l < (tid + 1) * chunk; ++l) {
            const index_t keep = (kept_of(l) + ps - 1) / ps;
            for (index_t i = hs.table.indptr[l] + keep; i < hs.table.indptr[l + 1]; ++i)
              out.freed_pages[at++] = hs.table.indices[i];
            out.lengths[l] = static_cast<std::int32_t>(kept_of(l));
          }
          if (tid == 0) *out.freed_count = static_cast<std::int32_t>(total);
        });
    if (total > out.freed_capacity) {
      ok = false;
      added = 1;
    }
  }
  blk.each([&](int tid) {
    for (index_t r = tid; r < R; r += blk.size()) head_rows[r] = ok ? index_t(hs.kept.cu[r + 1] - hs.kept.cu[r]) : -1;
  });
  return added;
}

/// Row r's token count for a kernel that reads it (the paged scores), or -1 if its list's offsets
/// or last page are bad, a page id is outside the pool, or it holds more than `cols` tokens.
template <class T>
KVEVICT_HOST_DEVICE index_t paged_readable_row(const paged_layer<T>& L, index_t r, index_t cols) {
  index_t pages = 0, length = 0;
  const index_t l = L.list_of(r);
  if (!paged_list_ok(L.table, l, L.keys.page_size, pages, length) || length > cols) return -1;
  for (index_t i = 0; i < pages; ++i) {
    const std::int32_t p = L.table.indices[L.table.indptr[l] + i];
    if (p < 0 || p >= L.keys.pages) return -1;
  }
  return length;
}

/// Value weighting of row r (rows of `group` score rows each, n readable tokens), thread tid of
/// `threads`: per_token multiplies column j by ||v_j||_1; head_max first needs the row's max norm,
/// which paged_value_max_part computes per thread (merged with max_nan: NaN wins, order free).
template <class T>
KVEVICT_HOST_DEVICE float paged_value_max_part(const paged_layer<T>& L, index_t r, index_t n, int tid, int threads) {
  float m = 0.0f;
  for (index_t j = tid; j < n; j += threads) m = max_nan(m, value_l1_norm(L.value(r, j), L.values.dim, 1));
  return m;
}
template <class T>
KVEVICT_HOST_DEVICE void paged_weight_part(const paged_layer<T>& L, index_t r, index_t n, index_t group, float* scores,
                                           index_t s0, index_t s1, bool head_max, float row_max, int tid,
                                           int threads) {
  for (index_t j = tid; j < n; j += threads) {
    const float f = head_max ? row_max : value_l1_norm(L.value(r, j), L.values.dim, 1);
    for (index_t q = r * group; q < (r + 1) * group; ++q) scores[q * s0 + j * s1] *= f;
  }
}

}  // namespace kvevict::detail
