// weight_by_value_norm against a naive double-precision reference; LAVa's max over the whole head
// (window included); NaN; every documented error.
#include "support.hpp"

#include <kvevict/detail/block/simt.hpp>
#include <kvevict/detail/block/simt_bodies.hpp>
#include <kvevict/numeric.hpp>
#include <kvevict/weight.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

using namespace kvevict;
using kvtest::require_error;
using kvtest::value_of;

namespace {

template <class T>
T from_f(float f) {
  if constexpr (std::is_same_v<T, float16>) return to_float16(f);
  else if constexpr (std::is_same_v<T, bfloat16>) return to_bfloat16(f);
  else return f;
}

template <class T>
struct cache {
  std::vector<T> buf;
  kv_view<T> view;
  cache(index_t H, index_t Tn, index_t D, int layout, std::mt19937_64& g) {
    const index_t pad = layout >= 2 ? 2 : 0, row = D + pad;
    buf.assign(static_cast<std::size_t>(std::max<index_t>(1, H * Tn * row)), from_f<T>(0.f));
    const auto vals = kvtest::random_floats(g, buf.size(), -2.f, 2.f);
    for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = from_f<T>(vals[i]);
    view = layout % 2 == 0 ? value_of(make_kv_view(buf.data(), H, Tn, D, std::max<index_t>(1, Tn * row), row))
                           : value_of(make_kv_view(buf.data(), H, Tn, D, row, std::max<index_t>(1, H * row)));
  }
};

template <class T>
double l1(const kv_view<T>& v, index_t h, index_t t) {
  double s = 0;
  for (index_t k = 0; k < v.extent(2); ++k) s += std::fabs(static_cast<double>(to_float(v(h, t, k))));
  return s;
}

template <class V>
void random_trials(std::uint64_t seed, int trials) {
  auto g = kvtest::rng(seed);
  const index_t groups[] = {1, 2, 4, 8};
  for (int trial = 0; trial < trials; ++trial) {
    CAPTURE(seed);
    CAPTURE(trial);
    const index_t hkv = kvtest::uniform_int(g, 1, 4), group = groups[kvtest::uniform_int(g, 0, 3)];
    const index_t rows = hkv * group, tokens = kvtest::uniform_int(g, 0, 300), d = kvtest::uniform_int(g, 1, 160);
    const index_t cols = kvtest::uniform_int(g, 0, tokens);
    const value_weight mode = static_cast<value_weight>(kvtest::uniform_int(g, 0, 1));
    const bool use_lengths = kvtest::uniform_int(g, 0, 2) == 0;
    cache<V> values(hkv, tokens, d, static_cast<int>(kvtest::uniform_int(g, 0, 3)), g);
    std::vector<std::int32_t> lengths(static_cast<std::size_t>(hkv));
    for (auto& l : lengths) l = static_cast<std::int32_t>(kvtest::uniform_int(g, 0, tokens));
    const index_t stride = cols + kvtest::uniform_int(g, 0, 3);
    const auto init = kvtest::random_floats(g, static_cast<std::size_t>(std::max<index_t>(1, rows * stride)), 0.f, 1.f);
    auto s_seq = init, s_par = init;
    auto mv = [&](std::vector<float>& s) { return value_of(make_matrix_view(s.data(), rows, cols, std::max<index_t>(1, stride))); };
    const std::int32_t* lp = use_lengths ? lengths.data() : nullptr;
    REQUIRE(weight_by_value_norm(seq, mv(s_seq), values.view, mode, lp).ok());
    REQUIRE(weight_by_value_norm(par, mv(s_par), values.view, mode, lp).ok());
    REQUIRE(std::memcmp(s_seq.data(), s_par.data(), s_seq.size() * sizeof(float)) == 0);
    for (index_t r = 0; r < rows; ++r) {
      const index_t h = r / group, len = use_lengths ? lengths[static_cast<std::size_t>(h)] : tokens;
      double mx = 0;
      for (index_t t = 0; t < len; ++t) mx = std::max(mx, l1(values.view, h, t));
      for (index_t j = 0; j < stride; ++j) {
        const std::size_t i = static_cast<std::size_t>(r * stride + j);
        if (j >= cols || j >= len) {  // padding and columns past the head's length: untouched
          REQUIRE(s_seq[i] == init[i]);
          continue;
        }
        const double f = mode == value_weight::per_token ? l1(values.view, h, j) : mx;
        const double want = init[i] * f;
        // fp32: d sequential additions of exact |v| terms, then one product: <= (d + 1) u relative
        REQUIRE(std::fabs(s_seq[i] - want) <= (static_cast<double>(d) + 1) * 6e-8 * want + 1e-38);
      }
    }
  }
}

}  // namespace

namespace {
template <class VE>
void check_norm_kernels(std::uint64_t seed) {
  auto g = kvtest::rng(seed);
  const int best = static_cast<int>(host_isa_supported());
  for (int rep = 0; rep < 40; ++rep) {
    // n >= 64 on a third of the reps: the AVX-512 copy's four-block (64-row) path, then 16-row blocks and a tail
    const index_t n = rep % 3 == 0 ? kvtest::uniform_int(g, 64, 200) : kvtest::uniform_int(g, 0, 70), d = kvtest::uniform_int(g, 1, 150), es = rep % 4 == 3 ? 2 : 1;
    const index_t rs = d * es + kvtest::uniform_int(g, 0, 3);
    std::vector<VE> v(static_cast<std::size_t>(std::max<index_t>(n * rs, 1)));
    std::uniform_real_distribution<float> u(-3.0f, 3.0f);
    for (auto& x : v) {
      const index_t k = kvtest::uniform_int(g, 0, 60);
      const float f = k == 0 ? std::numeric_limits<float>::quiet_NaN() : k == 1 ? -std::numeric_limits<float>::infinity()
                      : k == 2 ? 3e-6f * u(g) : k == 3 ? -0.0f : u(g);
      if constexpr (std::is_same_v<VE, float>) x = f;
      else if constexpr (std::is_same_v<VE, float16>) x = k == 4 ? float16{0x7c01} : to_float16(f);  // k = 4: a signalling NaN
      else x = bfloat16{static_cast<std::uint16_t>(detail::float_bits(f) >> 16)};
    }
    std::vector<float> want(static_cast<std::size_t>(n));
    for (index_t r = 0; r < n; ++r) want[static_cast<std::size_t>(r)] = detail::value_l1_norm(v.data() + r * rs, d, es);
    for (int isa = 0; isa <= best; ++isa) {
      CAPTURE(isa);
      CAPTURE(n);
      CAPTURE(d);
      const host_isa_limit_guard limit(kvtest::isa_level(isa));
      std::vector<float> got(static_cast<std::size_t>(n), -1.0f);
      detail::value_l1_norms(v.data(), rs, es, n, d, got.data());
      // the first row whose bits differ; a row with two different NaNs gives a NaN whose payload
      // follows the operand order the compiler picks for the additions (here too: only NaN-ness)
      index_t first = -1;
      for (index_t r = n - 1; r >= 0; --r) {
        const float x = got[static_cast<std::size_t>(r)], y = want[static_cast<std::size_t>(r)];
        if (detail::float_bits(x) != detail::float_bits(y) && !(std::isnan(x) && std::isnan(y))) first = r;
      }
      CAPTURE(seed);
      CAPTURE(es);
      CAPTURE(first);
      CHECK(first == -1);
      if (first >= 0) {
        MESSAGE("got " << detail::float_bits(got[static_cast<std::size_t>(first)]) << " want "
                       << detail::float_bits(want[static_cast<std::size_t>(first)]));
      }
    }
  }
}
}  // namespace

TEST_CASE("value_l1_norms (the host kernel across rows): value_l1_norm's bits on every ISA copy, every type; the "
          "branch-free fp16 magnitude equals |to_float| for all 65536 halves") {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const float16 x{static_cast<std::uint16_t>(h)};
    REQUIRE(detail::abs_float_bits(x) == (detail::float_bits(to_float(x)) & 0x7fffffffu));
  }
  check_norm_kernels<float>(1);
  check_norm_kernels<float16>(2);
  check_norm_kernels<bfloat16>(3);
}

TEST_CASE("max_nan_fold (the head-max weight's maximum of norms) equals the max_nan fold, NaN included") {
  // the integer path (every operand non-negative, no NaN) and the fallback (a NaN, a negative, -0 or
  // a NaN start anywhere): the same bits as folding max_nan in order (the last NaN wins)
  auto g = kvtest::rng(77);
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(), detail::bits_float(0x7fc00123u),
                            detail::bits_float(0xffc00005u), std::numeric_limits<float>::infinity(), 0.0f, -0.0f,
                            1e-45f, std::numeric_limits<float>::max(), -1.0f};
  for (int rep = 0; rep < 2000; ++rep) {
    const index_t n = kvtest::uniform_int(g, 0, 80);
    std::vector<float> x(static_cast<std::size_t>(n));
    for (auto& v : x) v = static_cast<float>(kvtest::uniform_int(g, 0, 40)) * 0.25f;  // ties
    const int kind = rep % 4;  // 0: clean; 1-3: one to three specials put anywhere
    for (int s = 0; s < kind && n > 0; ++s)
      x[static_cast<std::size_t>(kvtest::uniform_int(g, 0, n - 1))] = specials[kvtest::uniform_int(g, 0, 8)];
    const float m0 = rep % 7 == 0 ? specials[kvtest::uniform_int(g, 0, 8)] : 0.0f;
    float want = m0;
    for (const float v : x) want = detail::max_nan(want, v);
    const float got = detail::max_nan_fold(m0, x.data(), n);
    CAPTURE(rep);
    REQUIRE(detail::float_bits(got) == detail::float_bits(want));
  }
}

TEST_CASE("weight_by_value_norm: VATP and LAVa match the double reference (random shapes, layouts, types, GQA rows)") {
  random_trials<float>(1, 60);
  random_trials<float16>(2, 40);
  random_trials<bfloat16>(3, 40);
}

TEST_CASE("weight_by_value_norm: LAVa's max covers the observation window, VATP weights token by token") {
  // 1 KV head, 5 tokens of dim 2; scores cover only the 3 prefix tokens (window of 2)
  std::vector<float> v = {1, 1, 0.5f, 0.5f, 2, -1, 10, 0, 0.25f, 0.25f};  // norms 2, 1, 3, 10, 0.5
  auto values = value_of(make_kv_view(v.data(), 1, 5, 2));
  std::vector<float> s = {0.5f, 0.25f, 0.25f};
  REQUIRE(weight_by_value_norm(seq, value_of(make_matrix_view(s.data(), 1, 3)), values, value_weight::head_max).ok());
  CHECK(s == std::vector<float>{5.f, 2.5f, 2.5f});  // max norm 10 is the window's first token
  s = {0.5f, 0.25f, 0.25f};
  REQUIRE(weight_by_value_norm(seq, value_of(make_matrix_view(s.data(), 1, 3)), values, value_weight::per_token).ok());
  CHECK(s == std::vector<float>{1.f, 0.25f, 0.75f});
  // lengths: head restricted to 2 tokens -> max over norms {2, 1}, column 2 untouched
  s = {0.5f, 0.25f, 0.25f};
  const std::int32_t len[] = {2};
  REQUIRE(weight_by_value_norm(par, value_of(make_matrix_view(s.data(), 1, 3)), values, value_weight::head_max, len).ok());
  CHECK(s == std::vector<float>{1.f, 0.5f, 0.25f});
}

TEST_CASE("weight_by_value_norm: NaN in a value poisons its token (VATP) or its head (LAVa) only") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> v(2 * 3 * 2, 1.f);  // 2 KV heads, 3 tokens, dim 2: every norm 2
  v[1 * 2 + 1] = nan;                     // head 0, token 1
  auto values = value_of(make_kv_view(v.data(), 2, 3, 2));
  std::vector<float> s(4 * 3, 1.f);  // 4 rows = 2 query heads per KV head
  REQUIRE(weight_by_value_norm(seq, value_of(make_matrix_view(s.data(), 4, 3)), values, value_weight::per_token).ok());
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < 3; ++j) CHECK(std::isnan(s[r * 3 + j]) == (r < 2 && j == 1));
  std::fill(s.begin(), s.end(), 1.f);
  REQUIRE(weight_by_value_norm(par, value_of(make_matrix_view(s.data(), 4, 3)), values, value_weight::head_max).ok());
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < 3; ++j) {
      CHECK(std::isnan(s[r * 3 + j]) == (r < 2));
      if (r >= 2) CHECK(s[r * 3 + j] == 2.f);
    }
  // NaN scores stay NaN
  std::vector<float> ok_v(6, 1.f), ns = {nan, 1.f};
  REQUIRE(weight_by_value_norm(seq, value_of(make_matrix_view(ns.data(), 1, 2)),
                               value_of(make_kv_view(ok_v.data(), 1, 3, 2)), value_weight::per_token)
              .ok());
  CHECK(std::isnan(ns[0]));
  CHECK(ns[1] == 2.f);
}

TEST_CASE("weight_by_value_norm: errors are specific and nothing is written") {
  std::vector<float> v(2 * 4 * 3, 1.f), s(3 * 4, 0.5f);
  auto values = value_of(make_kv_view(v.data(), 2, 4, 3));
  const auto before = s;
  require_error(weight_by_value_norm(seq, value_of(make_matrix_view(s.data(), 3, 4)), values, value_weight::head_max),
                errc::shape_mismatch, "scores have 3 rows, not a multiple of the 2 KV heads");
  std::vector<float> wide(2 * 5, 1.f);
  require_error(weight_by_value_norm(seq, value_of(make_matrix_view(wide.data(), 2, 5)), values, value_weight::per_token),
                errc::shape_mismatch, "scores have 5 columns but values hold only 4 tokens");
  const std::int32_t bad_len[] = {1, 5};
  require_error(weight_by_value_norm(par, value_of(make_matrix_view(s.data(), 2, 4)), values, value_weight::head_max,
                                     bad_len),
                errc::out_of_range, "lengths[1] = 5 is outside [0, 4]");
  const std::int32_t neg_len[] = {-1, 0};
  require_error(weight_by_value_norm(par, value_of(make_matrix_view(s.data(), 2, 4)), values, value_weight::head_max,
                                     neg_len),
                errc::out_of_range, "lengths[0] = -1");
  require_error(weight_by_value_norm(seq, value_of(make_matrix_view(s.data(), 2, 4)), values, static_cast<value_weight>(7)),
                errc::invalid_argument, "unknown value_weight value 7");
  auto inside = value_of(make_matrix_view(v.data() + 2, 2, 4));
  require_error(weight_by_value_norm(seq, inside, values, value_weight::per_token), errc::overlap,
                "scores overlap values");
  using exts2 = cuda::std::dextents<index_t, 2>;
  matrix_view<float> null_scores(nullptr, cuda::std::layout_stride::mapping<exts2>(exts2(2, 4), cuda::std::array<index_t, 2>{4, 1}));
  require_error(weight_by_value_norm(seq, null_scores, values, value_weight::per_token), errc::null_pointer,
                "weight_by_value_norm: scores: data is null");
  using exts3 = cuda::std::dextents<index_t, 3>;
  kv_view<float> null_values(nullptr, cuda::std::layout_stride::mapping<exts3>(exts3(2, 4, 3), cuda::std::array<index_t, 3>{12, 3, 1}));
  require_error(weight_by_value_norm(seq, value_of(make_matrix_view(s.data(), 2, 4)), null_values, value_weight::per_token),
                errc::null_pointer, "weight_by_value_norm: values: data is null");
  CHECK(s == before);
  CHECK(std::all_of(v.begin(), v.end(), [](float x) { return x == 1.f; }));
}

// The CUDA kernels' own bodies (the four ops of detail/block/simt_bodies.hpp that cuda/weight.cuh
// launches through the same detail::weight_launch) on the host SIMT executor: bit-identical with
// weight_by_value_norm(seq) for both modes, float / float16 / bfloat16 values, partial 256-token
// tiles, head dims that are not multiples of the 16-element staging, per-head lengths (and an
// invalid device length: that head skipped and counted), small grid caps (grid-stride loops).
namespace {
template <class VE>
void weight_on_executor(std::mt19937_64& g, int trial) {
  CAPTURE(trial);
  const index_t hkv = 1 + static_cast<index_t>(g() % 3), group = 1 + static_cast<index_t>(g() % 3);
  const index_t tv = 1 + static_cast<index_t>(g() % 600), d = 1 + static_cast<index_t>(g() % 40);
  const index_t cols = 1 + static_cast<index_t>(g() % static_cast<std::uint64_t>(tv)), rows = hkv * group;
  std::vector<VE> v;
  for (float x : kvtest::random_floats(g, static_cast<std::size_t>(hkv * tv * d), -2.f, 2.f)) {
    if constexpr (std::is_same_v<VE, float16>) v.push_back(to_float16(x));
    else if constexpr (std::is_same_v<VE, bfloat16>) v.push_back(to_bfloat16(x));
    else v.push_back(x);
  }
  const auto s0 = kvtest::random_floats(g, static_cast<std::size_t>(rows * cols), 0.f, 1.f);
  std::vector<std::int32_t> lens(static_cast<std::size_t>(hkv));
  for (auto& l : lens) l = static_cast<std::int32_t>(g() % static_cast<std::uint64_t>(tv + 1));
  const bool with_lengths = trial % 3 != 0, bad_head = with_lengths && trial % 4 == 1;
  const auto vv = *make_kv_view(static_cast<const VE*>(v.data()), hkv, tv, d);
  for (value_weight mode : {value_weight::per_token, value_weight::head_max}) {
    CAPTURE(static_cast<int>(mode));
    std::vector<float> expect = s0, got = s0;
    std::vector<std::int32_t> dl = lens;
    if (bad_head) dl[0] = static_cast<std::int32_t>(tv + 5);
    for (index_t h = bad_head ? 1 : 0; h < hkv; ++h) {  // the reference, head by head (a bad head untouched)
      auto sh = *make_matrix_view(expect.data() + h * group * cols, group, cols);
      auto vh = *make_kv_view(static_cast<const VE*>(v.data()) + h * tv * d, 1, tv, d);
      REQUIRE(weight_by_value_norm(seq, sh, vh, mode, with_lengths ? lens.data() + h : nullptr).ok());
    }
    const detail::pp_values<VE> vals{v.data(), vv.stride(0), vv.stride(1), vv.stride(2), tv, d};
    std::vector<float> partial(static_cast<std::size_t>(hkv * detail::stage_tiles(tv))), factors(static_cast<std::size_t>(hkv));
    detail::simt_executor ex(static_cast<std::uint64_t>(trial) * 2 + (mode == value_weight::head_max));
    detail::simt_launcher<detail::simt_executor> l{ex};
    int bad = 0;
    detail::weight_launch(l, got.data(), cols, 1, rows, cols, vals, hkv, mode == value_weight::head_max,
                          with_lengths ? dl.data() : nullptr, &bad, partial.data(), factors.data(),
                          trial % 2 == 0 ? 2 : index_t(1) << 20);
    REQUIRE_MESSAGE(l.ok, ex.error());
    CHECK(std::memcmp(got.data(), expect.data(), got.size() * sizeof(float)) == 0);
    CHECK(bad == (bad_head ? 1 : 0));
  }
}
}  // namespace

TEST_CASE("weight_by_value_norm: the CUDA kernel bodies under the SIMT executor equal seq bit for bit") {
  auto g = kvtest::rng(2104);
  for (int trial = 0; trial < 6; ++trial) {
    weight_on_executor<float>(g, trial);
    weight_on_executor<float16>(g, trial + 6);
    weight_on_executor<bfloat16>(g, trial + 12);
  }
}
