// The keys of one row (sequence, KV head) of a paged layer as a key source of the host score
// kernels (detail/host/score_host.hpp): token t of the source is token first + t of the row, read
// through its page list. Internal; kvevict/paged.hpp builds them.
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/paged_types.hpp>

#include <cstdint>
#include <type_traits>

namespace kvevict::detail {

template <class K>
struct paged_key_source {
  using element_type = const K;
  const K* data = nullptr;             ///< the pool, offset to the row's head
  const std::int32_t* pages = nullptr;  ///< the row's page ids (indices + indptr[list])
  index_t page_size = 1, page_stride = 0, token_stride = 0;
  index_t first = 0;  ///< the row's token read as token 0

  /// Key elements are contiguous in a page pool.
  index_t stride(int) const { return 1; }
};

template <class K>
inline const K* kv_row(const paged_key_source<K>& s, index_t, index_t t) {
  const index_t j = s.first + t;
  return s.data + s.pages[j / s.page_size] * s.page_stride + (j % s.page_size) * s.token_stride;
}

/// Row r's keys from token `first` on.
template <class T>
paged_key_source<std::remove_const_t<T>> paged_keys_of(const paged_layer<T>& L, index_t r, index_t first) {
  const index_t l = L.list_of(r);
  return {L.keys.data + L.head_of(r) * L.keys.head_stride, L.table.indices + L.table.indptr[l], L.keys.page_size,
          L.keys.page_stride, L.keys.token_stride, first};
}

}  // namespace kvevict::detail
