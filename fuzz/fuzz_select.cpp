// Fuzzes select_topk (dense and ragged) and select_topk_flat on seq and par: arbitrary score bit
// patterns (every NaN payload, infinities, signed zeros, subnormals), shapes, strides, row
// lengths, budgets and floors, valid or not. A call must either fail cleanly, writing nothing,
// or return exactly what a naive sort-based reference returns; seq and par must agree.
#include <kvevict/select.hpp>

#include "fuzz_input.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

using namespace kvevict;
using kvfuzz::input;
using kvfuzz::require;

namespace {

bool ranks_before(float a, index_t pa, float b, index_t pb) {
  const bool a_nan = std::isnan(a), b_nan = std::isnan(b);
  if (a_nan != b_nan) return b_nan;
  if (!a_nan && a != b) return a > b;
  return pa < pb;
}

std::vector<pos_t> naive_topk(const float* row, index_t stride, index_t n, index_t k) {
  std::vector<pos_t> idx(static_cast<std::size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(),
                   [&](pos_t i, pos_t j) { return ranks_before(row[i * stride], i, row[j * stride], j); });
  idx.resize(static_cast<std::size_t>(k));
  std::sort(idx.begin(), idx.end());
  return idx;
}

template <class Backend>
status run_dense(Backend be, matrix_view<const float> s, const std::int32_t* lens, matrix_view<pos_t> kept) {
  std::vector<unsigned char> mem;
  workspace ws;
  KVEVICT_TRY(select_topk(be, ws, s, lens, kept));
  mem.resize(ws.bytes + 1);
  ws.data = mem.data();
  return select_topk(be, ws, s, lens, kept);
}

template <class Backend>
status run_flat(Backend be, matrix_view<const float> s, const std::int32_t* lens, index_t total,
                const std::int32_t* floors, std::int32_t* cu, pos_t* pos) {
  std::vector<unsigned char> mem;
  workspace ws;
  KVEVICT_TRY(select_topk_flat(be, ws, s, lens, total, floors, cu, pos));
  mem.resize(ws.bytes + 1);
  ws.data = mem.data();
  return select_topk_flat(be, ws, s, lens, total, floors, cu, pos);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  input in{data, size};
  const index_t R = in.take(1) % 5;
  const index_t T = in.take(2) % 700;
  const std::uint32_t flags = in.take(1);
  const index_t pad = flags & 3;
  const bool transposed = flags & 4, use_lens = flags & 8, flat = flags & 16, use_floors = flags & 32;
  const int value_mode = static_cast<int>(flags >> 6);  // 0: raw bits, 1: 3 values, 2: 2 bytes of bits, 3: specials

  std::vector<std::int32_t> lens(static_cast<std::size_t>(R));
  for (auto& l : lens) {
    const std::uint32_t v = in.take(2);
    l = (v & 0x8000u) ? static_cast<std::int32_t>(v % (T + 3)) - 1 : static_cast<std::int32_t>(T);  // sometimes invalid
  }
  const index_t k = in.take(2) % (T + 2);
  const index_t total = static_cast<index_t>(in.take(2) % (R * T + 2));
  std::vector<std::int32_t> floors(static_cast<std::size_t>(R));
  for (auto& f : floors) f = static_cast<std::int32_t>(in.take(1) % (T + 2));

  const index_t row_stride = transposed ? 1 : T + pad, col_stride = transposed ? R + pad : 1;
  std::vector<float> buf(static_cast<std::size_t>((R + pad) * (T + pad) + 1), 0.f);
  static const std::uint32_t specials[] = {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0x7f800000u, 0xff800000u,
                                           0x00000000u, 0x80000000u, 0x00000001u, 0x80000001u, 0x3f800000u,
                                           0xbf800000u, 0x7f7fffffu, 0xff7fffffu, 0x00800000u, 0x807fffffu};
  for (index_t r = 0; r < R; ++r)
    for (index_t t = 0; t < T; ++t) {
      std::uint32_t bits = 0;
      switch (value_mode) {
        case 0: bits = in.take(4); break;
        case 1: bits = std::uint32_t(0x3f800000u + (in.take(1) % 3) * 0x00800000u); break;
        case 2: bits = in.take(2) << 16; break;
        default: bits = specials[in.take(1) % std::size(specials)]; break;
      }
      std::memcpy(&buf[static_cast<std::size_t>(r * row_stride + t * col_stride)], &bits, 4);
    }
  using exts = cuda::std::dextents<index_t, 2>;
  const matrix_view<const float> s(
      buf.data(), cuda::std::layout_stride::mapping<exts>(
                      exts(R, T), cuda::std::array<index_t, 2>{std::max<index_t>(1, row_stride), std::max<index_t>(1, col_stride)}));
  const std::int32_t* lp = use_lens ? lens.data() : nullptr;
  auto len = [&](index_t r) { return use_lens ? index_t(lens[r]) : T; };
  bool lens_valid = true;
  for (index_t r = 0; r < R; ++r) lens_valid = lens_valid && len(r) >= 0 && len(r) <= T;

  if (!flat) {
    std::vector<pos_t> a(static_cast<std::size_t>(R * k + 1), -5), b(a);
    const auto kv = [&](std::vector<pos_t>& o) { return *make_matrix_view(o.data(), R, k); };
    const status sa = run_dense(seq, s, lp, kv(a));
    const status sb = run_dense(par_t{1 + static_cast<int>(flags % 3)}, s, lp, kv(b));
    require(sa.ok() == sb.ok() && sa.code() == sb.code());
    bool valid = lens_valid;
    for (index_t r = 0; valid && r < R; ++r) valid = k <= len(r);
    require(sa.ok() == valid);
    if (!sa.ok()) {
      require(std::all_of(a.begin(), a.end(), [](pos_t p) { return p == -5; }));
      return 0;
    }
    require(a == b);
    for (index_t r = 0; r < R; ++r) {
      const auto ref = naive_topk(buf.data() + r * row_stride, std::max<index_t>(1, col_stride), len(r), k);
      require(std::equal(ref.begin(), ref.end(), a.begin() + r * k));
    }
    return 0;
  }

  // flat
  const std::int32_t* fp = use_floors ? floors.data() : nullptr;
  std::vector<std::int32_t> cu(static_cast<std::size_t>(R + 1), -5), cu2(cu);
  std::vector<pos_t> a(static_cast<std::size_t>(total + 1), -5), b(a);
  const status sa = run_flat(seq, s, lp, total, fp, cu.data(), a.data());
  const status sb = run_flat(par_t{2}, s, lp, total, fp, cu2.data(), b.data());
  require(sa.ok() == sb.ok() && sa.code() == sb.code());
  if (!sa.ok()) {
    require(std::all_of(a.begin(), a.end(), [](pos_t p) { return p == -5; }));
    require(std::all_of(cu.begin(), cu.end(), [](std::int32_t c) { return c == -5; }));
    return 0;
  }
  require(cu == cu2 && a == b && cu[0] == 0 && cu[R] == total);
  // the counts: floors first, then the best remaining entries by (score, row, position)
  struct entry {
    float s;
    index_t r, p;
  };
  std::vector<entry> rest;
  std::vector<index_t> count(static_cast<std::size_t>(R), 0);
  index_t left = total;
  for (index_t r = 0; r < R; ++r) {
    const float* row = buf.data() + r * row_stride;
    const index_t cs = std::max<index_t>(1, col_stride), f = fp ? fp[r] : 0;
    std::vector<pos_t> order = naive_topk(row, cs, len(r), len(r));  // all positions, ascending
    std::stable_sort(order.begin(), order.end(),
                     [&](pos_t i, pos_t j) { return ranks_before(row[i * cs], i, row[j * cs], j); });
    for (index_t i = f; i < len(r); ++i) rest.push_back({row[order[i] * cs], r, order[i]});
    count[r] = f;
    left -= f;
  }
  std::stable_sort(rest.begin(), rest.end(), [](const entry& x, const entry& y) {
    const bool xn = std::isnan(x.s), yn = std::isnan(y.s);
    if (xn != yn) return yn;
    if (!xn && x.s != y.s) return x.s > y.s;
    return x.r != y.r ? x.r < y.r : x.p < y.p;
  });
  for (index_t i = 0; i < left; ++i) ++count[rest[i].r];
  for (index_t r = 0; r < R; ++r) require(cu[r + 1] - cu[r] == count[r]);
  // each row keeps its own top count_r; its floor is met; the rows' worst kept vs best dropped
  // across rows respect the joint order (floors aside)
  for (index_t r = 0; r < R; ++r) {
    const index_t c = cu[r + 1] - cu[r];
    require(c >= (fp ? fp[r] : 0) && c <= len(r));
    const auto ref = naive_topk(buf.data() + r * row_stride, std::max<index_t>(1, col_stride), len(r), c);
    require(std::equal(ref.begin(), ref.end(), a.begin() + cu[r]));
  }
  return 0;
}
