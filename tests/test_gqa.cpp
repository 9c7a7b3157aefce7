#include "support.hpp"

#include <kvevict/detail/block/simt.hpp>
#include <kvevict/detail/block/simt_bodies.hpp>
#include <kvevict/gqa.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

using namespace kvevict;
using kvtest::require_error;
using kvtest::value_of;
using namespace kvtest::floats;

namespace {

// Naive reference: the group's scores in query-head order.
float reference(gqa_op op, const std::vector<float>& group) {
  if (op == gqa_op::max) {
    float best = group[0];
    for (float v : group)
      if (ranks_above(v, best)) best = v;
    return best;
  }
  float s = group[0];
  for (std::size_t j = 1; j < group.size(); ++j) s += group[j];
  return op == gqa_op::mean ? s / static_cast<float>(group.size()) : s;
}

// A random score with occasional special values.
float random_score(std::mt19937_64& g, bool specials) {
  if (specials) {
    switch (kvtest::uniform_int(g, 0, 19)) {
      case 0: return qnan;
      case 1: return -qnan;
      case 2: return inf;
      case 3: return -inf;
      case 4: return -0.f;
      case 5: return 0.f;
      case 6: return from_bits(0x7fa00001u);  // NaNs with other payloads
      case 7: return from_bits(0xffc00010u);
      case 8: return from_bits(0x7f800001u);
      default: break;
    }
  }
  return static_cast<float>(kvtest::uniform_int(g, -1000, 1000)) / 64.f;
}

// [rows][cols] in a buffer with the given layout: row-major with padding, or column-major.
struct matrix {
  std::vector<float> buf;
  matrix_view<float> view;
  matrix(index_t rows, index_t cols, bool column_major, index_t pad) {
    buf.assign(static_cast<std::size_t>(std::max<index_t>(1, rows * cols + (rows + cols) * pad + pad)), -777.f);
    const index_t ext[2] = {rows, cols};
    const index_t str_rm[2] = {std::max<index_t>(1, cols + pad), 1};
    const index_t str_cm[2] = {1, std::max<index_t>(1, rows + pad)};
    view = value_of(detail::make_strided<float, 2>("test", buf.data(), ext, column_major ? str_cm : str_rm));
  }
};

template <class Backend>
void matches_reference(Backend be, std::uint64_t seed) {
  auto g = kvtest::rng(seed);
  for (int trial = 0; trial < 60; ++trial) {
    const index_t hkv = kvtest::uniform_int(g, 1, 5), grp = kvtest::uniform_int(g, 1, 4), hq = hkv * grp;
    const index_t T = trial % 10 == 0 ? 0 : kvtest::uniform_int(g, 1, 600);  // crosses 256-column blocks
    const bool specials = trial % 3 == 0;
    CAPTURE(seed);
    CAPTURE(trial);
    matrix in(hq, T, trial % 4 == 1, trial % 2), out(hkv, T, trial % 4 == 2, trial % 3);
    for (index_t q = 0; q < hq; ++q)
      for (index_t t = 0; t < T; ++t) in.view(q, t) = random_score(g, specials);
    for (gqa_op op : {gqa_op::mean, gqa_op::max, gqa_op::sum}) {
      CAPTURE(gqa_op_name(op));
      REQUIRE(gqa_reduce(be, in.view, out.view, op).ok());
      std::vector<float> group(static_cast<std::size_t>(grp));
      for (index_t h = 0; h < hkv; ++h)
        for (index_t t = 0; t < T; ++t) {
          for (index_t j = 0; j < grp; ++j) group[j] = in.view(h * grp + j, t);
          const float want = reference(op, group), got = out.view(h, t);
          if (std::isnan(want)) REQUIRE(std::isnan(got));
          else REQUIRE(bits(got) == bits(want));
          if (op == gqa_op::max) {  // NaNs included: the bits of the fold of total_order_max in head order
            float m = group[0];
            for (index_t j = 1; j < grp; ++j) m = detail::total_order_max(m, group[j]);
            REQUIRE(bits(got) == bits(m));
          }
        }
      // in place: out = the first H_kv rows of (a copy of) in
      matrix copy = in;
      copy.view = matrix_view<float>(copy.buf.data(), in.view.mapping());
      const index_t ext[2] = {hkv, T};
      const index_t str[2] = {in.view.stride(0), in.view.stride(1)};
      auto head = value_of(detail::make_strided<float, 2>("test", copy.buf.data(), ext, str));
      REQUIRE(gqa_reduce(be, copy.view, head, op).ok());
      for (index_t h = 0; h < hkv; ++h)
        for (index_t t = 0; t < T; ++t) {
          if (std::isnan(out.view(h, t))) REQUIRE(std::isnan(head(h, t)));
          else REQUIRE(bits(head(h, t)) == bits(out.view(h, t)));
        }
    }
  }
}

}  // namespace

TEST_CASE("gqa_reduce: random shapes, layouts, ops and special values match the naive reference") {
  matches_reference(seq, 1);
  matches_reference(par, 2);
  matches_reference(par_t{3}, 3);
}

TEST_CASE("gqa_reduce: seq and par are bit-identical") {
  auto g = kvtest::rng(7);
  const index_t hkv = 4, grp = 4, T = 3000;
  std::vector<float> in(static_cast<std::size_t>(hkv * grp * T));
  in = kvtest::random_floats(g, in.size());
  for (gqa_op op : {gqa_op::mean, gqa_op::max, gqa_op::sum}) {
    std::vector<float> a(static_cast<std::size_t>(hkv * T)), b(a.size());
    REQUIRE(gqa_reduce(seq, value_of(make_matrix_view<const float>(in.data(), hkv * grp, T)),
                       value_of(make_matrix_view(a.data(), hkv, T)), op)
                .ok());
    REQUIRE(gqa_reduce(par, value_of(make_matrix_view<const float>(in.data(), hkv * grp, T)),
                       value_of(make_matrix_view(b.data(), hkv, T)), op)
                .ok());
    CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("gqa_reduce: NaN, infinities and signed zeros by op") {
  // 2 KV heads x 3 query heads, 4 tokens; each column of a group is one case
  std::vector<float> in = {
      // group 0: columns {NaN,1,2} {NaN,NaN,NaN} {+inf,-inf,0} {-0,-0,-0}
      qnan, qnan, inf, -0.f,  //
      1.f, qnan, -inf, -0.f,  //
      2.f, qnan, 0.f, -0.f,   //
      // group 1: {-inf,-inf,-inf} {NaN,-inf,-3} {-0,+0,-0} {1,2,3}
      -inf, qnan, -0.f, 1.f,  //
      -inf, -inf, 0.f, 2.f,   //
      -inf, -3.f, -0.f, 3.f,
  };
  std::vector<float> out(8);
  auto iv = value_of(make_matrix_view<const float>(in.data(), 6, 4));
  auto ov = value_of(make_matrix_view(out.data(), 2, 4));

  REQUIRE(gqa_reduce(seq, iv, ov, gqa_op::max).ok());
  CHECK(out[0] == 2.f);          // NaN ranks below everything: ignored while a number is present
  CHECK(std::isnan(out[1]));     // all NaN stays NaN
  CHECK(out[2] == inf);
  CHECK(bits(out[3]) == bits(-0.f));
  CHECK(out[4] == -inf);
  CHECK(out[5] == -3.f);         // -inf and -3 beat NaN
  CHECK(bits(out[6]) == bits(0.f));  // +0 above -0
  CHECK(out[7] == 3.f);

  REQUIRE(gqa_reduce(seq, iv, ov, gqa_op::sum).ok());
  CHECK(std::isnan(out[0]));  // NaN propagates through sums
  CHECK(std::isnan(out[1]));
  CHECK(std::isnan(out[2]));  // inf + -inf
  CHECK(bits(out[3]) == bits(-0.f));
  CHECK(out[4] == -inf);
  CHECK(std::isnan(out[5]));
  CHECK(out[7] == 6.f);

  REQUIRE(gqa_reduce(seq, iv, ov, gqa_op::mean).ok());
  CHECK(std::isnan(out[0]));
  CHECK(out[4] == -inf);
  CHECK(out[7] == 2.f);
}

TEST_CASE("gqa_reduce: group size 1 is a copy; empty shapes are fine") {
  std::vector<float> in = {1.f, qnan, -0.f, inf, 5.f, 6.f}, out(6, 9.f);
  for (gqa_op op : {gqa_op::mean, gqa_op::max, gqa_op::sum}) {
    REQUIRE(gqa_reduce(seq, value_of(make_matrix_view<const float>(in.data(), 2, 3)),
                       value_of(make_matrix_view(out.data(), 2, 3)), op)
                .ok());
    for (std::size_t i = 0; i < in.size(); ++i) CHECK(bits(out[i]) == bits(in[i]));
  }
  std::vector<float> one(1);
  CHECK(gqa_reduce(seq, value_of(make_matrix_view<const float>(one.data(), 0, 3)),
                   value_of(make_matrix_view(one.data(), 0, 3)), gqa_op::sum)
            .ok());
  CHECK(gqa_reduce(par, value_of(make_matrix_view<const float>(in.data(), 4, 0)),
                   value_of(make_matrix_view(out.data(), 2, 0)), gqa_op::sum)
            .ok());
}

TEST_CASE("gqa_reduce: bad input gives specific errors and writes nothing") {
  std::vector<float> in(6 * 5, 1.f), out(4 * 5, 0.f);
  auto iv = value_of(make_matrix_view<const float>(in.data(), 6, 5));
  require_error(gqa_reduce(seq, iv, value_of(make_matrix_view(out.data(), 4, 5)), gqa_op::mean),
                errc::shape_mismatch, "gqa_reduce: 6 query heads are not a multiple of 4 KV heads");
  require_error(gqa_reduce(seq, iv, value_of(make_matrix_view(out.data(), 3, 4)), gqa_op::mean),
                errc::shape_mismatch, "in has 5 tokens per row but out has 4");
  require_error(gqa_reduce(seq, iv, value_of(make_matrix_view(out.data(), 0, 5)), gqa_op::mean),
                errc::shape_mismatch, "out has 0 KV heads but in has 6 query heads");
  require_error(gqa_reduce(seq, iv, value_of(make_matrix_view(out.data(), 3, 5)), static_cast<gqa_op>(7)),
                errc::invalid_argument, "op = 7 is not a gqa_op");
  CHECK(std::all_of(out.begin(), out.end(), [](float x) { return x == 0.f; }));

  // overlap: out one row into in is refused; out = the first rows of in (same strides) is in place
  require_error(gqa_reduce(seq, iv, value_of(make_matrix_view(in.data() + 5, 3, 5)), gqa_op::sum), errc::overlap,
                "in and out overlap");
  require_error(gqa_reduce(seq, iv, value_of(make_matrix_view(in.data(), 3, 5, 6)), gqa_op::sum), errc::overlap,
                "allowed only in place");
  REQUIRE(gqa_reduce(par, iv, value_of(make_matrix_view(in.data(), 3, 5)), gqa_op::sum).ok());
  CHECK(in[0] == 2.f);
  CHECK(in[14] == 2.f);

  // views built by hand get the same checks
  using exts = cuda::std::dextents<index_t, 2>;
  matrix_view<const float> null_in(nullptr, cuda::std::layout_stride::mapping<exts>(exts(6, 5), cuda::std::array<index_t, 2>{5, 1}));
  require_error(gqa_reduce(seq, null_in, value_of(make_matrix_view(out.data(), 3, 5)), gqa_op::sum),
                errc::null_pointer, "gqa_reduce: in: data is null");
  matrix_view<float> aliased(out.data(), cuda::std::layout_stride::mapping<exts>(exts(3, 5), cuda::std::array<index_t, 2>{1, 1}));
  require_error(gqa_reduce(seq, iv, aliased, gqa_op::sum), errc::overlap, "gqa_reduce: out: strides make distinct");
}

// The CUDA kernel's own body (detail::gqa_reduce_body, wrapped by cuda/gqa.cuh) on the host SIMT
// executor with the launcher's shape (and a small grid cap): bit-identical with gqa_reduce(seq), out
// of place and in place, every op, NaN and infinities included.
TEST_CASE("gqa_reduce: the CUDA kernel body under the SIMT executor equals seq bit for bit") {
  auto g = kvtest::rng(2102);
  const gqa_op ops[] = {gqa_op::mean, gqa_op::max, gqa_op::sum};
  for (int trial = 0; trial < 12; ++trial) {
    CAPTURE(trial);
    const index_t hkv = 1 + static_cast<index_t>(g() % 3), grp = 1 + static_cast<index_t>(g() % 4);
    const index_t hq = hkv * grp, T = 1 + static_cast<index_t>(g() % 600);
    const gqa_op op = ops[trial % 3];
    const bool in_place = trial % 2 == 1;
    std::vector<float> in = kvtest::random_floats(g, static_cast<std::size_t>(hq * T), -2.f, 2.f);
    in[static_cast<std::size_t>(g() % in.size())] = std::numeric_limits<float>::quiet_NaN();
    in[static_cast<std::size_t>(g() % in.size())] = -std::numeric_limits<float>::infinity();
    std::vector<float> expect = in, got = in, out_e(static_cast<std::size_t>(hkv * T)), out_g(out_e.size());
    const auto iv = *make_matrix_view(static_cast<const float*>(expect.data()), hq, T);
    float* oe = in_place ? expect.data() : out_e.data();
    float* og = in_place ? got.data() : out_g.data();
    REQUIRE(gqa_reduce(seq, iv, *make_matrix_view(oe, hkv, T), op).ok());
    const detail::simt_shape sh = detail::gqa_reduce_shape(hkv, T, in_place, trial % 4 == 0 ? 3 : index_t(1) << 20);
    detail::simt_executor ex(static_cast<std::uint64_t>(trial));
    REQUIRE_MESSAGE(ex.run(sh.grid, sh.block, [&](detail::simt_thread& c) {
      detail::gqa_reduce_body(c, got.data(), T, 1, og, T, 1, hkv, grp, T, op, in_place);
    }), ex.error());
    const std::vector<float>& e = in_place ? expect : out_e;
    const std::vector<float>& r = in_place ? got : out_g;
    CHECK(std::memcmp(r.data(), e.data(), r.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("gqa max rows: the baseline, AVX2 and AVX-512F copies give the bits of the total_order_max fold") {
  auto g = kvtest::rng(1818);
  for (int trial = 0; trial < 60; ++trial) {
    const index_t grp = kvtest::uniform_int(g, 1, 8), n = kvtest::uniform_int(g, 0, detail::gqa_chunk);
    const index_t xs = n + kvtest::uniform_int(g, 0, 5);
    std::vector<float> x(static_cast<std::size_t>(std::max<index_t>(1, grp * xs)));
    for (auto& v : x) v = random_score(g, trial % 2 == 0);
    std::vector<float> want(static_cast<std::size_t>(std::max<index_t>(1, n)));
    for (index_t t = 0; t < n; ++t) {
      float m = x[static_cast<std::size_t>(t)];
      for (index_t j = 1; j < grp; ++j) m = detail::total_order_max(m, x[static_cast<std::size_t>(j * xs + t)]);
      want[static_cast<std::size_t>(t)] = m;
    }
    std::vector<float> got(want.size(), 7.f);
    detail::gqa_max_rows_body(got.data(), x.data(), xs, grp, n);
    for (index_t t = 0; t < n; ++t) REQUIRE(bits(got[t]) == bits(want[t]));
#if KVEVICT_HOST_X86_DISPATCH
    if (host_isa_supported() >= host_isa::avx2) {
      std::vector<float> got2(want.size(), 7.f);
      detail::gqa_max_rows_avx2(got2.data(), x.data(), xs, grp, n);
      for (index_t t = 0; t < n; ++t) REQUIRE(bits(got2[t]) == bits(want[t]));
    }
    if (host_isa_supported() >= host_isa::avx512) {
      std::vector<float> got3(want.size(), 7.f);
      detail::gqa_max_rows_avx512(got3.data(), x.data(), xs, grp, n);
      for (index_t t = 0; t < n; ++t) REQUIRE(bits(got3[t]) == bits(want[t]));
    }
#endif
  }
}

TEST_CASE("gqa sum rows: the baseline, AVX2 and AVX-512F copies give the bits of gqa_combine / gqa_finish (mean, sum)") {
  auto g = kvtest::rng(1820);
  for (int trial = 0; trial < 80; ++trial) {
    const index_t grp = kvtest::uniform_int(g, 1, 8), n = kvtest::uniform_int(g, 0, detail::gqa_chunk);
    const index_t xs = n + kvtest::uniform_int(g, 0, 5);
    const gqa_op op = trial % 2 == 0 ? gqa_op::mean : gqa_op::sum;
    std::vector<float> x(static_cast<std::size_t>(std::max<index_t>(1, grp * xs)));
    for (auto& v : x) v = random_score(g, trial % 3 == 0);
    if (trial % 5 == 1)  // huge terms: the order of the additions decides overflow and rounding
      for (auto& v : x) v = std::ldexp(static_cast<float>(kvtest::uniform_int(g, -1000, 1000)) / 999.f, 127);
    std::vector<float> want(static_cast<std::size_t>(std::max<index_t>(1, n)));
    for (index_t t = 0; t < n; ++t) {
      float a = x[static_cast<std::size_t>(t)];
      for (index_t j = 1; j < grp; ++j) a = detail::gqa_combine(op, a, x[static_cast<std::size_t>(j * xs + t)]);
      want[static_cast<std::size_t>(t)] = detail::gqa_finish(op, a, grp);
    }
    // a NaN sum: its sign and payload follow the operand order the compiler picks for +: NaN only
    const auto same = [&](const std::vector<float>& got) {
      for (index_t t = 0; t < n; ++t) {
        CAPTURE(t);
        if (std::isnan(want[static_cast<std::size_t>(t)])) REQUIRE(std::isnan(got[static_cast<std::size_t>(t)]));
        else REQUIRE(bits(got[static_cast<std::size_t>(t)]) == bits(want[static_cast<std::size_t>(t)]));
      }
    };
    std::vector<float> got(want.size(), 7.f);
    detail::gqa_sum_rows_body(got.data(), x.data(), xs, grp, n, op == gqa_op::mean);
    same(got);
#if KVEVICT_HOST_X86_DISPATCH
    if (host_isa_supported() >= host_isa::avx2) {
      std::vector<float> got2(want.size(), 7.f);
      detail::gqa_sum_rows_avx2(got2.data(), x.data(), xs, grp, n, op == gqa_op::mean);
      same(got2);
    }
    if (host_isa_supported() >= host_isa::avx512) {
      std::vector<float> got3(want.size(), 7.f);
      detail::gqa_sum_rows_avx512(got3.data(), x.data(), xs, grp, n, op == gqa_op::mean);
      same(got3);
    }
#endif
  }
}
