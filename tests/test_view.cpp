#include "support.hpp"

#include <kvevict/detail/base/checks.hpp>
#include <kvevict/view.hpp>

#include <cstdint>
#include <vector>

using namespace kvevict;
using kvtest::require_error;
using kvtest::value_of;

TEST_CASE("kv views: head-major and token-major address the same logical element") {
  const index_t H = 3, T = 5, D = 4;
  std::vector<float> hm(H * T * D), tm(H * T * D);
  for (index_t h = 0; h < H; ++h)
    for (index_t t = 0; t < T; ++t)
      for (index_t d = 0; d < D; ++d) {
        const float v = static_cast<float>(h * 100 + t * 10 + d);
        hm[(h * T + t) * D + d] = v;
        tm[(t * H + h) * D + d] = v;
      }
  auto a = value_of(make_kv_view(hm.data(), H, T, D, kv_layout::head_major));
  auto b = value_of(make_kv_view(tm.data(), H, T, D, kv_layout::token_major));
  for (index_t h = 0; h < H; ++h)
    for (index_t t = 0; t < T; ++t)
      for (index_t d = 0; d < D; ++d) REQUIRE(a(h, t, d) == b(h, t, d));
  CHECK(b.stride(0) == D);
  CHECK(b.stride(1) == H * D);
  CHECK(a.stride(0) == T * D);
}

TEST_CASE("kv views: padded strides and zero-sized views") {
  std::vector<float> buf(2 * 8 * 6);
  auto v = value_of(make_kv_view(buf.data(), 2, 8, 4, /*head*/ 48, /*token*/ 6));
  CHECK(v.extent(2) == 4);
  auto empty = value_of(make_kv_view<float>(nullptr, 0, 10, 64));  // no elements: null is fine
  CHECK(empty.size() == 0);
  auto no_dim = value_of(make_kv_view<float>(nullptr, 4, 10, 0));
  CHECK(no_dim.size() == 0);
}

TEST_CASE("kv views: bad shapes are specific errors") {
  float x = 0;
  require_error(make_kv_view(&x, -1, 2, 2).error(), errc::invalid_argument, "extent 0 is negative");
  require_error(make_kv_view<float>(nullptr, 2, 2, 2).error(), errc::null_pointer, "data is null");
  require_error(make_kv_view(&x, 2, 2, 2, 4, 0).error(), errc::invalid_argument, "stride 1 must be positive");
  require_error(make_kv_view(&x, index_t(1) << 40, index_t(1) << 40, 64).error(), errc::size_overflow, "overflow");
  // token stride 2 < dim 4: token t and t+1 would share elements
  require_error(make_kv_view(&x, 1, 3, 4, 100, 2).error(), errc::overlap, "alias");
  require_error(make_matrix_view(&x, 3, 4, 2).error(), errc::overlap, "alias");
}

TEST_CASE("kv views: token_range is the same elements, in both layouts; bad ranges are errors") {
  const index_t H = 3, T = 7, D = 2;
  std::vector<float> buf(H * T * D);
  for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<float>(i);
  for (kv_layout layout : {kv_layout::head_major, kv_layout::token_major}) {
    const auto v = value_of(make_kv_view(buf.data(), H, T, D, layout));
    for (index_t first = 0; first <= T; ++first)
      for (index_t n = 0; first + n <= T; ++n) {
        const auto r = value_of(token_range(v, first, n));
        REQUIRE(r.extent(0) == H);
        REQUIRE(r.extent(1) == n);
        REQUIRE(r.extent(2) == D);
        for (index_t h = 0; h < H; ++h)
          for (index_t t = 0; t < n; ++t)
            for (index_t d = 0; d < D; ++d) REQUIRE(&r(h, t, d) == &v(h, first + t, d));
      }
    require_error(token_range(v, 5, 3).error(), errc::out_of_range, "token_range: tokens [5, 5 + 3) of a view of 7 tokens");
    require_error(token_range(v, -1, 1).error(), errc::out_of_range, "token_range");
    require_error(token_range(v, 0, -1).error(), errc::out_of_range, "token_range");
    require_error(token_range(v, 8, 0).error(), errc::out_of_range, "token_range");
  }
}

TEST_CASE("check_view catches hand-built views the factories would reject") {
  float x[4] = {};
  using exts = cuda::std::dextents<index_t, 2>;
  matrix_view<float> null_view(nullptr, cuda::std::layout_stride::mapping<exts>(exts(2, 2), cuda::std::array<index_t, 2>{2, 1}));
  require_error(detail::check_view("fn", "scores", null_view), errc::null_pointer, "fn: scores: data is null");
  matrix_view<float> ok_view(x, cuda::std::layout_stride::mapping<exts>(exts(2, 2), cuda::std::array<index_t, 2>{2, 1}));
  CHECK(detail::check_view("fn", "scores", ok_view).ok());
}

TEST_CASE("offsets: must start at 0, never decrease, stay within the rows") {
  const std::int32_t good[] = {0, 2, 2, 5};
  CHECK(detail::check_offsets("fn", "cu", good, 3, 5).ok());
  require_error(detail::check_offsets("fn", "cu", good, 3, 4), errc::out_of_range, "past the 4 rows");
  const std::int32_t dec[] = {0, 3, 2};
  require_error(detail::check_offsets("fn", "cu", dec, 2), errc::invalid_argument, "decreases at head 1");
  const std::int32_t start[] = {1, 3};
  require_error(detail::check_offsets("fn", "cu", start, 1), errc::invalid_argument, "cu[0] must be 0");
  require_error(detail::check_offsets("fn", "cu", nullptr, 1), errc::null_pointer, "null");
}

TEST_CASE("ragged views address head-major rows through cu_lens") {
  std::vector<float> rows(6 * 3);
  for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i);
  const std::int32_t cu[] = {0, 1, 1, 6};
  ragged_view<float> r{rows.data(), cu, 3, 2, 3};
  CHECK(r.length(0) == 1);
  CHECK(r.length(1) == 0);
  CHECK(r.length(2) == 5);
  CHECK(r.total_rows() == 6);
  CHECK(r.row(2, 1)[1] == 7.f);  // flat row 2, column 1
}
