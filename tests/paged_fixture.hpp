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

/// A two-phase call with a workspace of exactly the queried size (misaligned bases included).
template <class F>
kvevict::status two_phase(F&& call) {
  kvevict::workspace q;
  KVEVICT_TRY(call(q));
  std::vector<unsigned char> mem;
  kvevict::workspace ws = shifted_workspace(mem, q.bytes, 0xa5);
  return call(ws);
}

/// Random strictly ascending kept lists, one per row; per-sequence tables keep one count per
/// sequence (every head of a list the same count).
inline std::vector<std::vector<kvevict::pos_t>> random_kept(std::mt19937_64& g, const paged_fixture& f) {
  std::vector<std::vector<kvevict::pos_t>> kept(static_cast<std::size_t>(f.rows()));
  kvevict::index_t shared = 0;
  for (kvevict::index_t r = 0; r < f.rows(); ++r) {
    const kvevict::index_t n = f.row_len[static_cast<std::size_t>(r)];
    if (f.lists == kvevict::page_lists::per_head || r % f.H == 0) shared = uniform_int(g, 0, n);
    std::vector<kvevict::pos_t> all(static_cast<std::size_t>(n));
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), g);
    all.resize(static_cast<std::size_t>(shared));
    std::sort(all.begin(), all.end());
    kept[static_cast<std::size_t>(r)] = all;
  }
  return kept;
}

/// Kept lists as one ragged list (pos never empty).
struct flat_kept {
  std::vector<kvevict::pos_t> pos;
  std::vector<std::int32_t> cu{0};
  kvevict::ragged_positions view(kvevict::index_t rows) const { return {pos.data(), cu.data(), rows}; }
};
inline flat_kept flatten(const std::vector<std::vector<kvevict::pos_t>>& k) {
  flat_kept f;
  for (const auto& row : k) {
    f.pos.insert(f.pos.end(), row.begin(), row.end());
    f.cu.push_back(static_cast<std::int32_t>(f.pos.size()));
  }
  f.pos.push_back(0);
  return f;
}

/// The outputs of a paged compaction, filled with a marker (-7) so writes show.
struct paged_outputs {
  std::vector<std::int32_t> lengths, freed;
  std::int32_t count = -7;
  kvevict::paged_compaction_out out(kvevict::index_t capacity) {
    return {lengths.data(), freed.data(), capacity, &count};
  }
  kvevict::paged_compaction_out out() { return out(static_cast<kvevict::index_t>(freed.size())); }
};
inline paged_outputs room_for(const paged_fixture& f) {
  paged_outputs o;
  o.lengths.assign(static_cast<std::size_t>(f.list_count()) + 1, -7);
  o.freed.assign(static_cast<std::size_t>(f.pages) + 1, -7);
  return o;
}
/// Two compactions of equal layouts gave the same pools and outputs.
inline void check_same_compaction(const paged_fixture& a, const paged_outputs& oa, const paged_fixture& b,
                                  const paged_outputs& ob) {
  CHECK(a.kpool == b.kpool);
  CHECK(a.vpool == b.vpool);
  CHECK(oa.lengths == ob.lengths);
  CHECK(oa.freed == ob.freed);
  CHECK(oa.count == ob.count);
}

}  // namespace kvtest
