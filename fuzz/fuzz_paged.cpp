// Fuzzes the block-table validation of paged KV caches (kvevict/paged.hpp): arbitrary CSR tables
// (indptr, page ids, last_page_len: out of range, duplicated, shared, not monotone or fine), page
// sizes, list kinds and kept lists, through validate_paged_layer and compact_paged on seq and par.
// A call must agree with a naive reference on whether the input is valid; when it fails, nothing
// (pools, lengths, freed pages, count) is written; when it succeeds, the pools, lengths and freed
// pages equal a naive row-by-row simulation, and seq == par.
#include <kvevict/paged.hpp>

#include "fuzz_input.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

using namespace kvevict;
using kvfuzz::require;

namespace {

/// The table's validity, checked the slow and obvious way.
bool naive_table_ok(const std::vector<std::int32_t>& indptr, const std::vector<std::int32_t>& indices,
                    const std::vector<std::int32_t>& last, index_t lists, index_t pages, index_t ps) {
  if (indptr[0] != 0) return false;
  for (index_t l = 0; l < lists; ++l)
    if (indptr[l + 1] < indptr[l]) return false;
  if (indptr[lists] > pages) return false;
  for (index_t l = 0; l < lists; ++l) {
    const index_t n = indptr[l + 1] - indptr[l];
    if (n == 0 ? last[l] != 0 : (last[l] < 1 || last[l] > ps)) return false;
  }
  for (index_t i = 0; i < indptr[lists]; ++i) {
    if (indices[i] < 0 || indices[i] >= pages) return false;
    for (index_t j = 0; j < i; ++j)
      if (indices[j] == indices[i]) return false;
  }
  return true;
}

struct outcome {
  std::vector<float> k, v;
  std::vector<std::int32_t> lengths, freed;
  std::int32_t count = -3;
  status st;
};

template <class Backend>
outcome run(Backend be, const paged_layer<float>& proto, std::vector<float> k, std::vector<float> v,
            const ragged_positions& kept, index_t lists, index_t capacity) {
  outcome o;
  o.k = std::move(k);
  o.v = std::move(v);
  o.lengths.assign(static_cast<std::size_t>(lists) + 1, -3);
  o.freed.assign(static_cast<std::size_t>(capacity) + 1, -3);
  paged_layer<float> L = proto;
  L.keys.data = o.k.data();
  L.values.data = o.v.data();
  const paged_compaction_out out{o.lengths.data(), o.freed.data(), capacity, &o.count};
  workspace ws;
  o.st = compact_paged(be, ws, L, kept, out);
  if (!o.st.ok()) return o;
  std::vector<unsigned char> mem(ws.bytes + 1);
  ws.data = mem.data();
  o.st = compact_paged(be, ws, L, kept, out);
  return o;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  kvfuzz::input in{data, size};
  const std::uint32_t flags = in.take(1);
  const bool per_head = flags & 1, hnd = flags & 2;
  const index_t ps = 1 + in.take(1) % 8, pages = in.take(1) % 24, S = in.take(1) % 4, H = 1 + in.take(1) % 3;
  const index_t lists = per_head ? S * H : S, R = S * H, d = 1 + (flags >> 2) % 3;
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(lists) + 1, 0);
  std::vector<std::int32_t> last(static_cast<std::size_t>(lists) + 1, 0);
  for (index_t l = 0; l < lists; ++l) {
    const std::uint32_t b = in.take(1);
    indptr[l + 1] = (b & 0x80u) ? indptr[l] - static_cast<std::int32_t>(b & 1u)  // sometimes decreasing
                                : indptr[l] + static_cast<std::int32_t>(b % 4);
    const std::uint32_t c = in.take(1);
    last[l] = (c & 0x80u) ? static_cast<std::int32_t>(c % (ps + 2)) : std::min<std::int32_t>(static_cast<std::int32_t>(ps), 1 + static_cast<std::int32_t>(c % ps));
  }
  if (in.take(1) == 0xffu) indptr[0] = 1;
  const index_t listed = std::max<index_t>(0, indptr[lists]);
  std::vector<std::int32_t> indices(static_cast<std::size_t>(listed) + 1, 0);
  for (index_t i = 0; i < listed; ++i) {
    const std::uint32_t b = in.take(1);
    indices[i] = (b & 0xc0u) == 0xc0u ? static_cast<std::int32_t>(b % (pages + 3)) - 1  // maybe out of range
                                      : static_cast<std::int32_t>((i * 7 + (b & 1u)) % std::max<index_t>(pages, 1));
  }
  // kept lists: each row keeps a strictly ascending subset of its tokens (sometimes a bad one)
  const index_t hp = per_head ? 1 : H;
  std::vector<float> k(static_cast<std::size_t>(std::max<index_t>(pages, 1) * ps * hp * d)), v(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = static_cast<float>(i), v[i] = -static_cast<float>(i);
  paged_layer<float> L;
  L.keys = *make_page_pool(k.data(), pages, ps, hp, d, hnd ? page_layout::hnd : page_layout::nhd);
  L.values = *make_page_pool(v.data(), pages, ps, hp, d, hnd ? page_layout::hnd : page_layout::nhd);
  L.table = {indptr.data(), indices.data(), last.data(), lists};
  L.sequences = S;
  L.kv_heads = H;
  L.lists = per_head ? page_lists::per_head : page_lists::per_sequence;
  const bool table_ok = naive_table_ok(indptr, indices, last, lists, pages, ps);
  {
    workspace ws;
    status st = validate_paged_layer(ws, L);
    std::vector<unsigned char> mem(ws.bytes + 1);
    ws.data = mem.data();
    if (st.ok()) st = validate_paged_layer(ws, L);
    require(st.ok() == table_ok);
  }
  std::vector<pos_t> pos;
  std::vector<std::int32_t> cu(1, 0);
  index_t shared = 0;
  for (index_t r = 0; r < R; ++r) {
    const index_t n = table_ok ? L.length(r) : 0;
    const std::uint32_t b = in.take(1);
    if (per_head || r % H == 0) shared = n > 0 ? b % (n + 1) : 0;
    const index_t count = (b & 0xe0u) == 0xe0u ? shared + 1 : shared;  // sometimes too many, or unlike its list
    for (index_t j = 0; j < count; ++j) pos.push_back(static_cast<pos_t>(n - count + j));  // the last `count`
    cu.push_back(static_cast<std::int32_t>(pos.size()));
  }
  bool kept_ok = true;  // every row within its tokens, one count per list
  for (index_t r = 0; r < R; ++r) {
    const index_t n = table_ok ? L.length(r) : 0, c = cu[r + 1] - cu[r];
    kept_ok = kept_ok && c <= n && (per_head || r % H == 0 || c == cu[r] - cu[r - 1]);
  }
  pos.push_back(0);
  const ragged_positions kept{pos.data(), cu.data(), R};
  // freed pages the reference expects, and a capacity sometimes too small
  index_t freed = 0;
  if (table_ok && kept_ok)
    for (index_t l = 0; l < lists; ++l) freed += L.table.pages(l) - (index_t(cu[l * (per_head ? 1 : H) + 1] - cu[l * (per_head ? 1 : H)]) + ps - 1) / ps;
  const index_t capacity = (flags & 0x40u) && freed > 0 ? freed - 1 : pages;
  const bool valid = table_ok && kept_ok && freed <= capacity;
  const outcome a = run(seq, L, k, v, kept, lists, capacity);
  const outcome b = run(par_t{2}, L, k, v, kept, lists, capacity);
  require(a.st.ok() == valid && b.st.ok() == valid);
  if (!valid) {
    require(a.k == k && a.v == v && a.count == -3);
    require(std::all_of(a.lengths.begin(), a.lengths.end(), [](std::int32_t x) { return x == -3; }));
    require(std::all_of(a.freed.begin(), a.freed.end(), [](std::int32_t x) { return x == -3; }));
    return 0;
  }
  require(a.k == b.k && a.v == b.v && a.lengths == b.lengths && a.freed == b.freed && a.count == b.count);
  // the naive simulation: row r's token j becomes its token pos[j], page by page
  std::vector<float> rk = k;
  paged_layer<float> N = L;
  N.keys.data = rk.data();
  for (index_t r = 0; r < R; ++r)
    for (index_t j = 0; j < cu[r + 1] - cu[r]; ++j) {
      const float* src = N.key(r, pos[cu[r] + j]);
      std::vector<float> row(src, src + d);
      std::copy(row.begin(), row.end(), N.key(r, j));
    }
  require(rk == a.k);
  require(a.count == freed);
  return 0;
}
