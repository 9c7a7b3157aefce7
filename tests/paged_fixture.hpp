// Random paged layouts for the paged tests: a batch of sequences in a shuffled page pool (NHD or
// HND, per-sequence or per-head tables, partial last pages) and the same rows as a dense ragged
// cache, so paged and dense paths can be compared row for row.
#pragma once

#include "support.hpp"

#include <kvevict/paged.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

namespace kvtest {

struct paged_fixture {
  kvevict::index_t S = 0, H = 0, d = 0, dv = 0, page_size = 0, pages = 0;
  kvevict::page_lists lists = kvevict::page_lists::per_sequence;
  kvevict::page_layout layout = kvevict::page_layout::nhd;
  std::vector<float> kpool, vpool;
  std::vector<std::int32_t> indptr, indices, last;
  std::vector<std::int32_t> row_len;  ///< tokens per row (s, h)

  kvevict::index_t rows() const { return S * H; }
  kvevict::index_t list_count() const { return lists == kvevict::page_lists::per_head ? S * H : S; }
  kvevict::index_t heads_per_page() const { return lists == kvevict::page_lists::per_head ? 1 : H; }

  kvevict::paged_layer<float> layer() {
    kvevict::paged_layer<float> L;
    L.keys = value_of(kvevict::make_page_pool(kpool.data(), pages, page_size, heads_per_page(), d, layout));
    L.values = value_of(kvevict::make_page_pool(vpool.data(), pages, page_size, heads_per_page(), dv, layout));
    L.table = {indptr.data(), indices.data(), last.data(), list_count()};
    L.sequences = S;
    L.kv_heads = H;
    L.lists = lists;
    return L;
  }

  /// Row r's token j, as a copy (keys or values).
  std::vector<float> key_row(kvevict::index_t r, kvevict::index_t j) {
    const auto L = layer();
    return {L.key(r, j), L.key(r, j) + d};
  }
  std::vector<float> value_row(kvevict::index_t r, kvevict::index_t j) {
    const auto L = layer();
    return {L.value(r, j), L.value(r, j) + dv};
  }
};

/// A random layout: `spare` unused pages in the pool; per-head tables give every head of a
/// sequence its own length, per-sequence ones one length per sequence. Lengths in [0, max_len].
inline paged_fixture make_paged_fixture(std::mt19937_64& g, kvevict::index_t S, kvevict::index_t H,
                                        kvevict::index_t d, kvevict::index_t page_size, kvevict::page_lists lists,
                                        kvevict::page_layout layout, kvevict::index_t max_len,
                                        kvevict::index_t spare = 3, kvevict::index_t min_len = 0) {
  paged_fixture f;
  f.S = S, f.H = H, f.d = d, f.dv = d + 1, f.page_size = page_size, f.lists = lists, f.layout = layout;
  const kvevict::index_t n_lists = f.list_count();
  std::vector<kvevict::index_t> len(static_cast<std::size_t>(n_lists));
  kvevict::index_t total_pages = 0;
  for (auto& l : len) {
    l = uniform_int(g, min_len, max_len);
    total_pages += (l + page_size - 1) / page_size;
  }
  f.pages = total_pages + spare;
  std::vector<std::int32_t> perm(static_cast<std::size_t>(f.pages));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), g);
  f.indptr.assign(1, 0);
  kvevict::index_t at = 0;
  for (kvevict::index_t l = 0; l < n_lists; ++l) {
    const kvevict::index_t n = (len[l] + page_size - 1) / page_size;
    for (kvevict::index_t i = 0; i < n; ++i) f.indices.push_back(perm[static_cast<std::size_t>(at++)]);
    f.indptr.push_back(static_cast<std::int32_t>(f.indices.size()));
    f.last.push_back(static_cast<std::int32_t>(n == 0 ? 0 : len[l] - (n - 1) * page_size));
  }
  const kvevict::index_t hp = f.heads_per_page();
  f.kpool = random_floats(g, static_cast<std::size_t>(f.pages * page_size * hp * d));
  f.vpool = random_floats(g, static_cast<std::size_t>(f.pages * page_size * hp * f.dv));
  for (kvevict::index_t r = 0; r < f.rows(); ++r)
    f.row_len.push_back(static_cast<std::int32_t>(len[static_cast<std::size_t>(f.layer().list_of(r))]));
  return f;
}

/// The fixture's rows as dense ragged caches (row r = head r of the ragged cache, room = length).
struct dense_copy {
  std::vector<float> k, v;
  std::vector<std::int32_t> cu, lens_k, lens_v;
  kvevict::ragged_cache<float> keys, values;
};

inline dense_copy dense_of(paged_fixture& f) {
  dense_copy c;
  c.cu.assign(1, 0);
  for (auto n : f.row_len) c.cu.push_back(c.cu.back() + n);
  c.lens_k = c.lens_v = f.row_len;
  const auto R = f.rows();
  for (kvevict::index_t r = 0; r < R; ++r)
    for (kvevict::index_t j = 0; j < f.row_len[static_cast<std::size_t>(r)]; ++j) {
      const auto kr = f.key_row(r, j), vr = f.value_row(r, j);
      c.k.insert(c.k.end(), kr.begin(), kr.end());
      c.v.insert(c.v.end(), vr.begin(), vr.end());
    }
  c.k.resize(c.k.size() + 1);  // never empty
  c.v.resize(c.v.size() + 1);
  c.keys = {c.k.data(), c.cu.data(), c.lens_k.data(), R, f.d, f.d};
  c.values = {c.v.data(), c.cu.data(), c.lens_v.data(), R, f.dv, f.dv};
  return c;
}

}  // namespace kvtest
