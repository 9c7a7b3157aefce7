// kvevict/paged_types.hpp: paged KV caches as serving engines keep them (docs/paged.md). No code
// paths: the views, their geometry and the row addressing every paged stage shares.
//
//   page_pool<T>     one layer's K (or V) page pool, NHD [pages][page_size][H][d] or
//                    HND [pages][H][page_size][d] (any strides; rows contiguous)
//   page_table       CSR block tables (FlashInfer's paged_kv_t): list r holds pages
//                    indices[indptr[r] .. indptr[r+1]), all full except the last, which holds
//                    last_page_len[r] tokens (1..page_size; 0 only for a list without pages)
//   paged_layer<T>   keys + values + one table for a batch of sequences, with the lists either
//                    one per sequence (every KV head of a sequence in the same pages) or one per
//                    (sequence, KV head) (heads of a layer hold different token counts; a page
//                    then holds one head: pool heads == 1)
//
// A *row* of a paged layer is a (sequence, KV head) pair, r = s * kv_heads + h: the unit of
// scoring, selection and compaction, as a KV head is for a dense cache. A token-major contiguous
// cache per sequence (llama.cpp's [T][H][d]) is an NHD pool with one page of `capacity` tokens per
// sequence (make_token_major_pool).
#pragma once

#include <kvevict/config.hpp>

#include <cstdint>

namespace kvevict {

enum class page_layout {
  nhd,  ///< [pages][page_size][heads][dim] (FlashInfer NHD, vLLM's flash-attention layout)
  hnd,  ///< [pages][heads][page_size][dim] (FlashInfer HND)
};

/// One page pool: element (page, slot, head, k) at data[page*page_stride + slot*token_stride +
/// head*head_stride + k] (strides in elements, rows contiguous). The library never owns it.
template <class T>
struct page_pool {
  T* data = nullptr;
  index_t pages = 0;      ///< pages in the pool (valid page ids: [0, pages))
  index_t page_size = 0;  ///< tokens per page
  index_t heads = 0;      ///< KV heads per page (1 for per-head tables)
  index_t dim = 0;        ///< head dim
  index_t page_stride = 0, token_stride = 0, head_stride = 0;

  KVEVICT_HOST_DEVICE T* row(index_t page, index_t slot, index_t head) const {
    return data + page * page_stride + slot * token_stride + head * head_stride;
  }
};

/// CSR block tables (FlashInfer's indptr / indices / last_page_len), int32 like theirs.
struct page_table {
  const std::int32_t* indptr = nullptr;         ///< [lists + 1], indptr[0] == 0, non-decreasing
  const std::int32_t* indices = nullptr;        ///< [indptr[lists]] page ids
  const std::int32_t* last_page_len = nullptr;  ///< [lists] tokens in the last page
  index_t lists = 0;

  KVEVICT_HOST_DEVICE index_t pages(index_t list) const { return indptr[list + 1] - indptr[list]; }
  /// Tokens held by a list: full pages, then the last page's tokens.
  KVEVICT_HOST_DEVICE index_t length(index_t list, index_t page_size) const {
    const index_t n = pages(list);
    return n == 0 ? 0 : (n - 1) * page_size + last_page_len[list];
  }
  /// Page of token j of a list.
  KVEVICT_HOST_DEVICE index_t page_of(index_t list, index_t j, index_t page_size) const {
    return indices[indptr[list] + j / page_size];
  }
};

/// Whose tokens a list holds.
enum class page_lists {
  per_sequence,  ///< list s: sequence s, every KV head (pool heads == kv_heads)
  per_head,      ///< list s * kv_heads + h: KV head h of sequence s (pool heads == 1)
};

/// One layer of a batch's paged KV cache. Keys and values share the table (as in FlashInfer and
/// vLLM); their pools have the same pages, page size and heads (dims may differ).
template <class T>
struct paged_layer {
  page_pool<T> keys;
  page_pool<T> values;
  page_table table;
  index_t sequences = 0;
  index_t kv_heads = 0;
  page_lists lists = page_lists::per_sequence;

  KVEVICT_HOST_DEVICE index_t rows() const { return sequences * kv_heads; }
  KVEVICT_HOST_DEVICE index_t list_of(index_t row) const { return lists == page_lists::per_head ? row : row / kv_heads; }
  KVEVICT_HOST_DEVICE index_t head_of(index_t row) const { return lists == page_lists::per_head ? 0 : row % kv_heads; }
  /// Tokens row r holds.
  KVEVICT_HOST_DEVICE index_t length(index_t row) const { return table.length(list_of(row), keys.page_size); }
  KVEVICT_HOST_DEVICE T* key(index_t row, index_t j) const { return at(keys, row, j); }
  KVEVICT_HOST_DEVICE T* value(index_t row, index_t j) const { return at(values, row, j); }

 private:
  KVEVICT_HOST_DEVICE T* at(const page_pool<T>& p, index_t row, index_t j) const {
    const index_t l = list_of(row);
    return p.row(table.page_of(l, j, p.page_size), j % p.page_size, head_of(row));
  }
};

/// What a paged compaction reports back to the engine (caller-provided memory; host memory for
/// the host backends, device memory for cuda).
struct paged_compaction_out {
  std::int32_t* lengths = nullptr;      ///< [lists] tokens each list holds afterwards
  std::int32_t* freed_pages = nullptr;  ///< room for freed_capacity page ids: the pages given back
  index_t freed_capacity = 0;
  std::int32_t* freed_count = nullptr;  ///< how many page ids were written
};

}  // namespace kvevict
