// postprocess_scores (host) against the chain of the individual stages, bit for bit; the CUDA
// post-processing kernels (detail/block/postprocess_ops.hpp over pool_block.hpp and
// postprocess_device.hpp: tiles with staged spans, the per-block global path, staged norms, the
// head-max reduction) run on the host SIMT executor against the host stages, bit for bit; every
// documented error.
#include "support.hpp"

#include <kvevict/detail/block/pool_block.hpp>
#include <kvevict/detail/block/postprocess_device.hpp>
#include <kvevict/detail/block/postprocess_ops.hpp>
#include <kvevict/detail/block/simt.hpp>
#include <kvevict/detail/host/post_host.hpp>
#include <kvevict/detail/block/score_device.hpp>
#include <kvevict/compact.hpp>
#include <kvevict/gqa.hpp>
#include <kvevict/numeric.hpp>
#include <kvevict/pool.hpp>
#include <kvevict/postprocess.hpp>
#include <kvevict/protect.hpp>
#include <kvevict/score.hpp>
#include <kvevict/select.hpp>
#include <kvevict/weight.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <utility>
#include <vector>

using namespace kvevict;
using kvtest::require_error;
using kvtest::value_of;
using namespace kvtest::floats;

namespace {

template <class T>
T from_f(float f) {
  if constexpr (std::is_same_v<T, float16>) return to_float16(f);
  else if constexpr (std::is_same_v<T, bfloat16>) return to_bfloat16(f);
  else return f;
}

// Scores with ties, NaN (both signs), infinities, signed zeros.
float random_score(std::mt19937_64& g, bool specials) {
  if (specials) {
    switch (kvtest::uniform_int(g, 0, 30)) {
      case 0: return qnan;
      case 1: return -qnan;
      case 2: return inf;
      case 3: return -inf;
      case 4: return -0.f;
      case 5: return 0.f;
      case 6: return 0.25f;
      default: break;
    }
  }
  return static_cast<float>(kvtest::uniform_int(g, -1000, 1000)) / 997.f;
}

std::vector<float> random_scores(std::mt19937_64& g, std::size_t n, bool specials) {
  std::vector<float> v(n);
  for (auto& x : v) x = random_score(g, specials);
  return v;
}

// Same bits, except that any NaN equals any NaN: which NaN (sign, payload) an arithmetic operation on
// NaN operands returns is not specified (x86 returns one operand's, compilers may swap the operands of
// a commutative operation, CUDA returns the canonical NaN). Selection treats every NaN alike.
void require_same_bits(const float* a, const float* b, index_t n, index_t sa = 1, index_t sb = 1) {
  for (index_t i = 0; i < n; ++i) {
    CAPTURE(i);
    CAPTURE(a[i * sa]);
    CAPTURE(b[i * sb]);
    REQUIRE(((std::isnan(a[i * sa]) && std::isnan(b[i * sb])) || bits(a[i * sa]) == bits(b[i * sb])));
  }
}
// Exactly the same bits, NaN included (max pooling and the GQA max select an input, no arithmetic).
void require_identical_bits(const float* a, const float* b, index_t n, index_t sa = 1, index_t sb = 1) {
  for (index_t i = 0; i < n; ++i) {
    CAPTURE(i);
    REQUIRE(bits(a[i * sa]) == bits(b[i * sb]));
  }
}

// ---- pool_block: every decomposition gives pool1d's bits -----------------------------------------

// The whole row, one block after another, the suffixes stashed in the output row (the GPU's path for
// wide kernels, pool_row_impl's own storage).
void pool_by_blocks(pool_kind kind, avg_divisor div, const std::vector<float>& x, index_t n, index_t kernel,
                    std::vector<float>& y, index_t ys) {
  const index_t k = 2 * detail::pool_radius(kernel, n) + 1;
  for (index_t b = 0; b * k < n; ++b)
    detail::pool_block_any(
        kind, div, [&](index_t p) { REQUIRE((p >= 0 && p < n)); return x[static_cast<std::size_t>(p)]; }, y.data(), 0, ys,
        [&](index_t i, float v) { y[static_cast<std::size_t>(i * ys)] = v; }, n, kernel, b, 0, n);
}

// Tiles of `tile` outputs, each with its inputs copied to a span [t0 - r, t0 + tile + r) and its own
// stash, the blocks of a tile in reverse order (any order must do); reads outside the span fail.
void pool_by_tiles(pool_kind kind, avg_divisor div, const std::vector<float>& x, index_t n, index_t kernel, index_t tile,
                   std::vector<float>& y) {
  const index_t r = detail::pool_radius(kernel, n);
  for (index_t t0 = 0; t0 < n; t0 += tile) {
    const index_t hi = std::min(t0 + tile, n);
    std::vector<float> span(static_cast<std::size_t>(tile + 2 * r), qnan), stash(static_cast<std::size_t>(tile), qnan);
    for (index_t p = std::max<index_t>(0, t0 - r); p < std::min(n, hi + r); ++p)
      span[static_cast<std::size_t>(p - (t0 - r))] = x[static_cast<std::size_t>(p)];
    const index_t b0 = detail::pool_first_block(kernel, n, t0), b1 = detail::pool_last_block(kernel, n, hi);
    for (index_t b = b1; b >= b0; --b)
      detail::pool_block_any(
          kind, div,
          [&](index_t p) {
            REQUIRE((p >= t0 - r && p < hi + r && p >= 0 && p < n));
            return span[static_cast<std::size_t>(p - (t0 - r))];
          },
          stash.data(), t0, 1,
          [&](index_t i, float v) {
            REQUIRE((i >= t0 && i < hi));
            y[static_cast<std::size_t>(i)] = v;
          },
          n, kernel, b, t0, hi);
  }
}

}  // namespace

TEST_CASE("pool_block: whole-row blocks and tiles give pool1d's bits") {
  auto g = kvtest::rng(31);
  for (int trial = 0; trial < 400; ++trial) {
    CAPTURE(trial);
    const index_t n = kvtest::uniform_int(g, 1, trial % 10 == 0 ? 3000 : 120);
    const index_t kernel = trial % 7 == 0 ? 2 * kvtest::uniform_int(g, n / 2, n + 3) + 1 : 2 * kvtest::uniform_int(g, 0, 6) + 1;
    const pool_kind kind = trial % 2 ? pool_kind::max : pool_kind::avg;
    const avg_divisor div = trial % 3 == 0 ? avg_divisor::valid : avg_divisor::kernel;
    CAPTURE(n);
    CAPTURE(kernel);
    CAPTURE(static_cast<int>(kind));
    const auto x = random_scores(g, static_cast<std::size_t>(n), trial % 4 == 0);
    std::vector<float> ref(static_cast<std::size_t>(n));
    pool_options po;
    po.divisor = div;
    REQUIRE(pool1d(seq, value_of(make_matrix_view<const float>(x.data(), 1, n)), value_of(make_matrix_view(ref.data(), 1, n)),
                   kind, kernel, nullptr, po)
                .ok());
    std::vector<float> blocks(static_cast<std::size_t>(3 * n), -5.f);
    pool_by_blocks(kind, div, x, n, kernel, blocks, 3);
    require_same_bits(blocks.data(), ref.data(), n, 3, 1);
    if (kind == pool_kind::max) require_identical_bits(blocks.data(), ref.data(), n, 3, 1);
    for (index_t tile : {index_t(1), index_t(2), index_t(7), index_t(64), index_t(1024)}) {
      CAPTURE(tile);
      std::vector<float> tiled(static_cast<std::size_t>(n), -5.f);
      pool_by_tiles(kind, div, x, n, kernel, tile, tiled);
      require_same_bits(tiled.data(), ref.data(), n);
      if (kind == pool_kind::max) require_identical_bits(tiled.data(), ref.data(), n);
    }
  }
}

namespace {

// ---- the fused post-processing --------------------------------------------------------------------

template <class V>
struct case_data {
  index_t hkv, g, T, tv, d;
  std::vector<float> in;
  std::vector<V> values;
  std::vector<std::int32_t> row_lengths, value_lengths;
  postprocess_options opt;
  bool use_row_lengths, use_value_lengths;
  matrix_view<const float> in_view() const { return value_of(make_matrix_view<const float>(in.data(), hkv * g, T)); }
  kv_view<const V> values_view() const { return value_of(make_kv_view<const V>(values.data(), hkv, tv, d)); }
  const std::int32_t* rl() const { return use_row_lengths ? row_lengths.data() : nullptr; }
  const std::int32_t* vl() const { return use_value_lengths ? value_lengths.data() : nullptr; }
};

template <class V>
case_data<V> random_case(std::mt19937_64& g, int trial) {
  case_data<V> c;
  c.hkv = kvtest::uniform_int(g, 1, 3);
  c.g = kvtest::uniform_int(g, 1, 4);
  c.T = trial % 9 == 0 ? kvtest::uniform_int(g, 1000, 2600) : kvtest::uniform_int(g, 1, 90);
  c.tv = c.T + kvtest::uniform_int(g, 0, 5);
  c.d = kvtest::uniform_int(g, 0, 40);
  c.in = random_scores(g, static_cast<std::size_t>(c.hkv * c.g * c.T), trial % 3 == 0);
  c.values.resize(static_cast<std::size_t>(std::max<index_t>(1, c.hkv * c.tv * c.d)));
  for (auto& v : c.values) v = from_f<V>(static_cast<float>(kvtest::uniform_int(g, -500, 500)) / 61.f);
  if (trial % 11 == 5 && !c.values.empty()) c.values[static_cast<std::size_t>(kvtest::uniform_int(g, 0, static_cast<index_t>(c.values.size()) - 1))] = from_f<V>(qnan);
  c.use_row_lengths = trial % 4 == 1;
  c.use_value_lengths = trial % 5 == 2;
  for (index_t h = 0; h < c.hkv; ++h) {
    c.row_lengths.push_back(static_cast<std::int32_t>(kvtest::uniform_int(g, 0, c.T)));
    c.value_lengths.push_back(static_cast<std::int32_t>(kvtest::uniform_int(g, 0, c.tv)));
  }
  const gqa_op ops[] = {gqa_op::mean, gqa_op::max, gqa_op::sum};
  const pool_kind kinds[] = {pool_kind::max, pool_kind::avg, pool_kind::none};
  c.opt.gqa = ops[trial % 3];
  c.opt.order = (trial / 3) % 2 ? gqa_order::gqa_first : gqa_order::pool_first;
  c.opt.pool = kinds[(trial / 2) % 3];
  c.opt.kernel = trial % 13 == 0 ? 2 * kvtest::uniform_int(g, 1025, 1100) + 1 : 2 * kvtest::uniform_int(g, 0, 5) + 1;
  c.opt.divisor = trial % 7 == 3 ? avg_divisor::valid : avg_divisor::kernel;
  c.opt.weight_values = trial % 2 == 0;
  c.opt.weight = trial % 4 == 0 ? value_weight::head_max : value_weight::per_token;
  c.opt.n_sink = kvtest::uniform_int(g, 0, 4);
  c.opt.n_recent = kvtest::uniform_int(g, 0, 8);
  c.opt.unpooled_tail = trial % 5 == 3 ? (trial * 7) % (c.T + 3) : 0;  // past the row length too
  return c;
}

// The chain of the individual host stages (docs: what postprocess_scores equals on positions < L).
template <class V>
std::vector<float> chain(const case_data<V>& c) {
  const index_t hq = c.hkv * c.g;
  std::vector<float> out(static_cast<std::size_t>(c.hkv * c.T), -3.f);
  const auto ov = value_of(make_matrix_view(out.data(), c.hkv, c.T));
  pool_options po;
  po.divisor = c.opt.divisor;
  // row r of length L pooled over its first P = L - unpooled_tail positions, [P, L) copied
  const auto row_length = [&](index_t kv_head) { return c.use_row_lengths ? index_t{c.row_lengths[static_cast<std::size_t>(kv_head)]} : c.T; };
  const auto pooled_of = [&](index_t kv_head) {
    return static_cast<std::int32_t>(std::max<index_t>(0, row_length(kv_head) - c.opt.unpooled_tail));
  };
  const auto copy_tail = [&](const float* from, index_t fs, float* to, index_t ts, index_t kv_head) {
    for (index_t t = pooled_of(kv_head); t < row_length(kv_head); ++t) to[t * ts] = from[t * fs];
  };
  if (c.opt.order == gqa_order::pool_first) {
    std::vector<float> tmp(static_cast<std::size_t>(hq * c.T), -4.f);
    std::vector<std::int32_t> qlen;
    for (index_t q = 0; q < hq; ++q) qlen.push_back(pooled_of(q / c.g));
    REQUIRE(pool1d(seq, c.in_view(), value_of(make_matrix_view(tmp.data(), hq, c.T)), c.opt.pool, c.opt.kernel,
                   c.use_row_lengths || c.opt.unpooled_tail > 0 ? qlen.data() : nullptr, po)
                .ok());
    for (index_t q = 0; q < hq; ++q) copy_tail(c.in.data() + q * c.T, 1, tmp.data() + q * c.T, 1, q / c.g);
    REQUIRE(gqa_reduce(seq, value_of(make_matrix_view<const float>(tmp.data(), hq, c.T)), ov, c.opt.gqa).ok());
  } else {
    std::vector<float> tmp(static_cast<std::size_t>(c.hkv * c.T), -4.f);
    REQUIRE(gqa_reduce(seq, c.in_view(), value_of(make_matrix_view(tmp.data(), c.hkv, c.T)), c.opt.gqa).ok());
    std::vector<std::int32_t> plen;
    for (index_t h = 0; h < c.hkv; ++h) plen.push_back(pooled_of(h));
    REQUIRE(pool1d(seq, value_of(make_matrix_view<const float>(tmp.data(), c.hkv, c.T)), ov, c.opt.pool, c.opt.kernel,
                   c.use_row_lengths || c.opt.unpooled_tail > 0 ? plen.data() : nullptr, po)
                .ok());
    for (index_t h = 0; h < c.hkv; ++h) copy_tail(tmp.data() + h * c.T, 1, out.data() + h * c.T, 1, h);
  }
  if (c.opt.weight_values) REQUIRE(weight_by_value_norm(seq, ov, c.values_view(), c.opt.weight, c.vl()).ok());
  REQUIRE(protect(seq, ov, c.opt.n_sink, c.opt.n_recent, c.rl()).ok());
  return out;
}

template <class Backend, class V>
std::vector<float> host_fused(Backend be, const case_data<V>& c) {
  std::vector<float> out(static_cast<std::size_t>(c.hkv * c.T), -3.f);
  const auto ov = value_of(make_matrix_view(out.data(), c.hkv, c.T));
  workspace ws;
  REQUIRE(postprocess_scores(be, ws, c.in_view(), ov, c.values_view(), c.opt, c.rl(), c.vl()).ok());
  std::vector<unsigned char> mem;
  ws = kvtest::shifted_workspace(mem, ws.bytes);
  REQUIRE(postprocess_scores(be, ws, c.in_view(), ov, c.values_view(), c.opt, c.rl(), c.vl()).ok());
  return out;
}

// The CUDA kernels on the host: postprocess_launch (the sequence cuda/postprocess.cuh launches:
// head-max factors by value_norm_max_launch, then pp_tile_op over tiles or, for wide kernels,
// pp_block_op, as pp_choose_variant picks) on the SIMT executor, grids capped at 2 blocks half the
// time, 1 to 3 resident blocks.
template <class V>
std::vector<float> executor_fused(std::mt19937_64& g, const case_data<V>& c, index_t drop = 0,
                                  std::string* error = nullptr) {
  using namespace detail;
  std::vector<float> out(static_cast<std::size_t>(c.hkv * c.T), -3.f);
  const bool head_max = c.opt.weight_values && c.opt.weight == value_weight::head_max;
  std::vector<float> factors(static_cast<std::size_t>(c.hkv), qnan);
  std::vector<float> partial(static_cast<std::size_t>(std::max<index_t>(1, c.hkv * stage_tiles(c.tv))), qnan);
  std::vector<float> stash(static_cast<std::size_t>(c.hkv * c.T), qnan);
  const auto ov = value_of(make_matrix_view(out.data(), c.hkv, c.T));
  const pp_params a = make_pp_params(c.in_view(), ov, c.opt, c.rl(), c.vl(), head_max ? factors.data() : nullptr);
  const pp_values<V> vals = make_pp_values(c.values_view(), c.opt.weight_values);
  simt_executor ex(g(), 0);
  ex.resident(1 + static_cast<index_t>(g() % 3));
  ex.drop_barrier(drop);
  simt_launcher<simt_executor> l{ex};
  int bad = 0;
  postprocess_launch(l, a, vals, partial.data(), head_max ? factors.data() : nullptr, stash.data(), &bad,
                     g() % 2 == 0 ? index_t(2) : index_t(1) << 20);
  if (error != nullptr) {  // a run with a deliberately missing barrier: its report
    *error = ex.error();
    return out;
  }
  REQUIRE_MESSAGE(l.ok, ex.error());
  CHECK(bad == 0);
  return out;
}

template <class V>
void compare_fused(std::uint64_t seed, int trials) {
  auto g = kvtest::rng(seed);
  for (int trial = 0; trial < trials; ++trial) {
    CAPTURE(seed);
    CAPTURE(trial);
    const case_data<V> c = random_case<V>(g, trial);
    CAPTURE(c.hkv);
    CAPTURE(c.g);
    CAPTURE(c.T);
    CAPTURE(c.d);
    CAPTURE(static_cast<int>(c.opt.gqa));
    CAPTURE(static_cast<int>(c.opt.order));
    CAPTURE(static_cast<int>(c.opt.pool));
    CAPTURE(c.opt.kernel);
    CAPTURE(c.opt.weight_values);
    CAPTURE(static_cast<int>(c.opt.weight));
    CAPTURE(c.use_row_lengths);
    CAPTURE(c.use_value_lengths);
    const auto ref = chain(c);
    const auto fused = host_fused(seq, c);
    const auto fused_par = host_fused(par, c);
    // the executor on half the trials, and on every long-row (trial % 9) and wide-kernel (trial % 13) one
    const bool on_executor = trial % 2 == 0 || trial % 9 == 0 || trial % 13 == 0;
    const auto emu = on_executor ? executor_fused(g, c) : fused;
    if (trial < 6) {  // any base alignment of the workspace: the same bits, aligned sub-buffers
      std::vector<float> shifted(fused_par.size(), -3.f);
      const auto ov = value_of(make_matrix_view(shifted.data(), c.hkv, c.T));
      kvtest::check_workspace_shifts(
          [&](workspace& ws) {
            return postprocess_scores(par, ws, c.in_view(), ov, c.values_view(), c.opt, c.rl(), c.vl());
          },
          [&] { return kvtest::bytes_of(shifted); });
      CHECK(kvtest::bytes_of(shifted) == kvtest::bytes_of(fused_par));
    }
    for (index_t h = 0; h < c.hkv; ++h) {
      CAPTURE(h);
      const index_t L = c.use_row_lengths ? c.row_lengths[static_cast<std::size_t>(h)] : c.T;
      const float* r = ref.data() + h * c.T;
      require_same_bits(fused.data() + h * c.T, r, L);
      require_same_bits(fused_par.data() + h * c.T, r, L);
      require_same_bits(emu.data() + h * c.T, r, L);
      for (index_t t = L; t < c.T; ++t) {  // positions >= L are left alone
        REQUIRE(fused[static_cast<std::size_t>(h * c.T + t)] == -3.f);
        REQUIRE(emu[static_cast<std::size_t>(h * c.T + t)] == -3.f);
      }
    }
  }
}

// The host's fused call on seq and par equals the chain on positions < L and leaves the rest alone.
template <class V>
void require_fused_equals_chain(const case_data<V>& c) {
  const auto ref = chain(c);
  const auto fused = host_fused(seq, c);
  const auto fused_par = host_fused(par, c);
  for (index_t h = 0; h < c.hkv; ++h) {
    CAPTURE(h);
    const index_t L = c.use_row_lengths ? c.row_lengths[static_cast<std::size_t>(h)] : c.T;
    require_same_bits(fused.data() + h * c.T, ref.data() + h * c.T, L);
    require_same_bits(fused_par.data() + h * c.T, ref.data() + h * c.T, L);
    for (index_t t = L; t < c.T; ++t) REQUIRE(fused[static_cast<std::size_t>(h * c.T + t)] == -3.f);
  }
}

}  // namespace

TEST_CASE("postprocess_scores: host and the CUDA kernels on the executor equal the chain of stages bit for bit") {
  compare_fused<float>(41, 260);
  compare_fused<float16>(42, 80);
  compare_fused<bfloat16>(43, 80);
}

TEST_CASE("postprocess_scores: long rows on the chunked small-kernel path (pool first, no weighting) equal the chain") {
  // The host runs pool_first without weighting on contiguous rows by chunks of positions
  // (detail::post_chunk): rows of several chunks, the pooled part ending inside or at a chunk
  // boundary, sinks and recent windows crossing chunk boundaries, every GQA op and pool kind; groups
  // of more query heads than one pass pools (detail::post_rows) on every fourth trial.
  auto g = kvtest::rng(1819);
  for (int trial = 0; trial < 48; ++trial) {
    CAPTURE(trial);
    case_data<float> c = random_case<float>(g, 1);
    if (trial % 4 == 3) c.g = kvtest::uniform_int(g, detail::post_rows + 1, 3 * detail::post_rows);
    c.T = kvtest::uniform_int(g, 1000, 3200);
    c.tv = c.T;
    c.d = 0;  // no weighting: the values are not read
    c.values.assign(1, 0.f);
    c.in = random_scores(g, static_cast<std::size_t>(c.hkv * c.g * c.T), trial % 3 == 0);
    if (trial % 4 == 0)  // non-negative scores: the raw-bits path of max pooling
      for (auto& v : c.in) v = std::isnan(v) ? 0.5f : std::fabs(v);
    c.use_row_lengths = trial % 2 == 1;
    c.row_lengths.clear();
    for (index_t h = 0; h < c.hkv; ++h) c.row_lengths.push_back(static_cast<std::int32_t>(kvtest::uniform_int(g, 0, c.T)));
    const gqa_op ops[] = {gqa_op::mean, gqa_op::max, gqa_op::sum};
    c.opt.gqa = ops[trial % 3];
    c.opt.order = gqa_order::pool_first;
    c.opt.pool = trial % 5 == 4 ? pool_kind::avg : (trial % 2 ? pool_kind::max : pool_kind::avg);
    c.opt.kernel = 2 * kvtest::uniform_int(g, 1, 4) + 1;
    c.opt.divisor = trial % 7 == 3 ? avg_divisor::valid : avg_divisor::kernel;
    c.opt.weight_values = false;
    c.opt.n_sink = trial % 3 == 0 ? kvtest::uniform_int(g, 1000, 1100) : kvtest::uniform_int(g, 0, 4);
    c.opt.n_recent = trial % 3 == 1 ? kvtest::uniform_int(g, 1000, 2100) : kvtest::uniform_int(g, 0, 40);
    c.opt.unpooled_tail = trial % 4 == 2 ? 1024 + 7 * trial : trial % 4 == 3 ? kvtest::uniform_int(g, 1, 40) : 0;
    CAPTURE(c.T);
    CAPTURE(c.g);
    CAPTURE(static_cast<int>(c.opt.gqa));
    CAPTURE(static_cast<int>(c.opt.pool));
    CAPTURE(c.opt.kernel);
    CAPTURE(c.opt.unpooled_tail);
    require_fused_equals_chain(c);
  }
}

namespace {
// The cases of the two register-summed pooling tests below: pool first without weighting, a GQA mean
// or sum over groups of 2..12 heads, rows of t_lo..t_hi positions with lengths, sinks, recent windows
// and on every fourth trial an unpooled tail; score(g, trial) draws each score, set(g, trial, c) the
// pooling (and may spoil a score).
template <class Score, class Set>
void check_group_sum_chunks(std::uint64_t seed, int trials, index_t t_lo, index_t t_hi, Score score, Set set) {
  auto g = kvtest::rng(seed);
  for (int trial = 0; trial < trials; ++trial) {
    CAPTURE(trial);
    case_data<float> c = random_case<float>(g, 1);
    c.g = kvtest::uniform_int(g, 2, 12);
    c.T = kvtest::uniform_int(g, t_lo, t_hi);
    c.tv = c.T;
    c.d = 0;
    c.values.assign(1, 0.f);
    c.in.resize(static_cast<std::size_t>(c.hkv * c.g * c.T));
    for (auto& v : c.in) v = score(g, trial);
    c.use_row_lengths = trial % 2 == 1;
    c.row_lengths.clear();
    for (index_t h = 0; h < c.hkv; ++h) c.row_lengths.push_back(static_cast<std::int32_t>(kvtest::uniform_int(g, 0, c.T)));
    c.opt.gqa = trial % 2 ? gqa_op::sum : gqa_op::mean;
    c.opt.order = gqa_order::pool_first;
    c.opt.weight_values = false;
    c.opt.n_sink = kvtest::uniform_int(g, 0, 4);
    c.opt.n_recent = kvtest::uniform_int(g, 0, 40);
    c.opt.unpooled_tail = trial % 4 == 3 ? kvtest::uniform_int(g, 1, 1500) : 0;
    set(g, trial, c);
    CAPTURE(c.T);
    CAPTURE(c.g);
    CAPTURE(c.opt.kernel);
    CAPTURE(c.opt.unpooled_tail);
    require_fused_equals_chain(c);
  }
}
}  // namespace

TEST_CASE("postprocess_scores: max pooling summed over the group in registers (SnapKV's chunks) equals the chain") {
  // Pool first with max and a GQA mean or sum on non-negative scores takes detail::pool_fast_group_sum
  // for whole interior chunks where the AVX-512F copy runs (elsewhere the row-by-row path): scores
  // with zeros, ties, subnormals, FLT_MAX and +inf; on every third trial one negative, -0, NaN or -inf
  // in the rows, whose chunk falls back to the row-by-row path.
  const auto score = [](auto& g, int trial) {
    switch (kvtest::uniform_int(g, 0, 15)) {
      case 0: return 0.f;
      case 1: return std::numeric_limits<float>::denorm_min() * static_cast<float>(kvtest::uniform_int(g, 1, 5));
      case 2: return trial % 2 ? inf : std::numeric_limits<float>::max() / 4.f;
      case 3: case 4: return static_cast<float>(kvtest::uniform_int(g, 0, 3)) * 0.25f;  // ties
      default: return kvtest::random_floats(g, 1, 0.f, 1.f)[0];
    }
  };
  check_group_sum_chunks(1823, 36, 1000, 3200, score, [](auto& g, int trial, case_data<float>& c) {
    const float bad[] = {-0.25f, -0.f, qnan, -inf};
    if (trial % 3 == 2) c.in[static_cast<std::size_t>(kvtest::uniform_int(g, 0, static_cast<index_t>(c.in.size()) - 1))] = bad[trial % 4];
    c.opt.pool = pool_kind::max;
    c.opt.kernel = 2 * kvtest::uniform_int(g, 1, 4) + 1;
  });
}

TEST_CASE("postprocess_scores: average pooling (k = 5) summed over the group in registers (CAKE's chunks) equals the "
          "chain") {
  // Pool first with avg, k = 5, and a GQA mean or sum takes detail::pool_fast_group_sum for whole
  // interior chunks where the AVX-512F copy runs (post_chunk is a multiple of 80): scores of any sign
  // with -0, subnormals, huge values, +-inf and NaN; both divisors; rows long enough for one to three
  // interior chunks; some trials with other kernels (the row-by-row path).
  const auto score = [](auto& g, int trial) {
    switch (kvtest::uniform_int(g, 0, 40)) {
      case 0: return -0.f;
      case 1: return std::numeric_limits<float>::denorm_min() * static_cast<float>(kvtest::uniform_int(g, -5, 5));
      case 2: return std::numeric_limits<float>::max() / (trial % 2 ? 2.f : -3.f);
      case 3: return trial % 3 == 0 ? qnan : trial % 3 == 1 ? -inf : inf;
      default: return kvtest::random_floats(g, 1, -1.f, 1.f)[0];
    }
  };
  check_group_sum_chunks(1826, 30, 2100, 4400, score, [](auto& g, int trial, case_data<float>& c) {
    c.opt.pool = pool_kind::avg;
    c.opt.divisor = trial % 3 == 0 ? avg_divisor::valid : avg_divisor::kernel;
    c.opt.kernel = trial % 5 == 4 ? 2 * kvtest::uniform_int(g, 1, 4) + 1 : 5;
  });
}

template <class V>
void compare_long_weighted(std::uint64_t seed, int trials) {
  // Long rows of every recipe shape with weighting (VATP: pool first, per-token; LAVa: GQA max
  // first, head max), GQA first and no pooling (StreamingLLM / H2O / TOVA / Knorm): the chunked
  // finish (detail::post_finish_chunk: division, weight, protection per chunk, norms only of the
  // unprotected weighted positions) against the chain. Values with NaN and norms that overflow to
  // +inf (0 * inf = NaN, large * inf = +inf -> FLT_MAX), tied scores, sinks / windows / value
  // lengths across chunk boundaries, lengths 0 and T.
  auto g = kvtest::rng(seed);
  for (int trial = 0; trial < trials; ++trial) {
    CAPTURE(trial);
    case_data<V> c = random_case<V>(g, 1);
    c.T = kvtest::uniform_int(g, 1000, 3200);
    c.tv = c.T + kvtest::uniform_int(g, 0, 3);
    c.d = kvtest::uniform_int(g, 1, 48);
    c.in = random_scores(g, static_cast<std::size_t>(c.hkv * c.g * c.T), trial % 3 == 0);
    if (trial % 5 == 1)  // ties: few distinct scores
      for (auto& v : c.in) v = static_cast<float>(kvtest::uniform_int(g, 0, 3)) * 0.5f;
    c.values.resize(static_cast<std::size_t>(c.hkv * c.tv * c.d));
    const float big = std::is_same_v<V, float> ? 3e38f : std::is_same_v<V, float16> ? 60000.f : 3e38f;
    for (auto& v : c.values) {
      const int k = static_cast<int>(kvtest::uniform_int(g, 0, 400));
      v = from_f<V>(k == 0 && trial % 4 == 3 ? qnan : k == 1 && trial % 6 == 5 ? big : k == 2 ? 0.f
                    : static_cast<float>(kvtest::uniform_int(g, -500, 500)) / 61.f);
    }
    if (trial % 7 == 6)  // a head whose values are all zero: norms 0, weights 0
      for (index_t i = 0; i < c.tv * c.d; ++i) c.values[static_cast<std::size_t>(i)] = from_f<V>(0.f);
    c.use_row_lengths = trial % 2 == 1;
    c.use_value_lengths = trial % 3 == 2;
    c.row_lengths.clear();
    c.value_lengths.clear();
    for (index_t h = 0; h < c.hkv; ++h) {
      const index_t pick = kvtest::uniform_int(g, 0, 9);
      c.row_lengths.push_back(static_cast<std::int32_t>(pick == 0 ? 0 : pick == 1 ? c.T : kvtest::uniform_int(g, 0, c.T)));
      c.value_lengths.push_back(static_cast<std::int32_t>(kvtest::uniform_int(g, 0, c.tv)));
    }
    const gqa_op ops[] = {gqa_op::mean, gqa_op::max, gqa_op::sum};
    const pool_kind kinds[] = {pool_kind::max, pool_kind::avg, pool_kind::none};
    c.opt.gqa = ops[trial % 3];
    c.opt.order = (trial / 3) % 2 ? gqa_order::gqa_first : gqa_order::pool_first;
    c.opt.pool = kinds[(trial / 2) % 3];
    c.opt.kernel = 2 * kvtest::uniform_int(g, 1, 4) + 1;
    c.opt.divisor = trial % 7 == 3 ? avg_divisor::valid : avg_divisor::kernel;
    c.opt.weight_values = trial % 8 != 7;  // and a few unweighted rows of the same paths
    c.opt.weight = trial % 4 < 2 ? value_weight::per_token : value_weight::head_max;
    c.opt.n_sink = trial % 5 == 0 ? kvtest::uniform_int(g, 1000, 1100) : kvtest::uniform_int(g, 0, 4);
    c.opt.n_recent = trial % 5 == 2 ? kvtest::uniform_int(g, 1000, 2100) : kvtest::uniform_int(g, 0, 40);
    c.opt.unpooled_tail = trial % 4 == 2 ? 1024 + 7 * trial : trial % 4 == 3 ? kvtest::uniform_int(g, 1, 40) : 0;
    CAPTURE(c.T);
    CAPTURE(c.g);
    CAPTURE(c.d);
    CAPTURE(static_cast<int>(c.opt.gqa));
    CAPTURE(static_cast<int>(c.opt.order));
    CAPTURE(static_cast<int>(c.opt.pool));
    CAPTURE(c.opt.kernel);
    CAPTURE(c.opt.weight_values);
    CAPTURE(static_cast<int>(c.opt.weight));
    CAPTURE(c.opt.unpooled_tail);
    require_fused_equals_chain(c);
  }
}

TEST_CASE("postprocess_scores: long rows with weighting, GQA first and no pooling (the chunked finish) equal the chain") {
  compare_long_weighted<float>(1820, 64);
  compare_long_weighted<float16>(1821, 24);
  compare_long_weighted<bfloat16>(1822, 12);
}

TEST_CASE("post_combine / post_finish: the baseline and AVX2 copies equal the per-element stage functions") {
  // detail/host/post_host.hpp called directly on chunks of 0-1100 positions, every (s, e, r), NaN
  // payloads of both signs, +-inf, -0, subnormals, FLT_MAX, per-token weights and one factor.
  auto g = kvtest::rng(1823);
  const float specials[] = {qnan, -qnan, detail::bits_float(0x7fa00001u), inf, -inf, -0.f, 0.f, 1e-45f, -1e-45f,
                            std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(), 0.5f};
  const auto pick = [&] {
    return kvtest::uniform_int(g, 0, 3) == 0 ? specials[kvtest::uniform_int(g, 0, 11)]
                                              : static_cast<float>(kvtest::uniform_int(g, -300, 300)) / 7.f;
  };
  using combine_fn = void (*)(bool, float*, const float*, index_t);
  using finish_fn = void (*)(float*, index_t, index_t, index_t, index_t, index_t, const float*, float);
  std::vector<std::pair<combine_fn, finish_fn>> copies = {{detail::post_combine_base, detail::post_finish_base},
                                                          {detail::post_combine, detail::post_finish}};
#if KVEVICT_HOST_X86_DISPATCH
  if (host_isa_supported() >= host_isa::avx2) copies.emplace_back(detail::post_combine_avx2, detail::post_finish_avx2);
#endif
  for (int trial = 0; trial < 300; ++trial) {
    CAPTURE(trial);
    const index_t n = trial % 10 == 0 ? kvtest::uniform_int(g, 0, 9) : kvtest::uniform_int(g, 1, 1100);
    std::vector<float> o(static_cast<std::size_t>(n)), x(o.size()), w(o.size());
    for (auto& v : o) v = pick();
    for (auto& v : x) v = pick();
    for (auto& v : w) v = std::fabs(pick());
    index_t s = kvtest::uniform_int(g, 0, n), r = kvtest::uniform_int(g, 0, n);
    if (r < s) std::swap(r, s);
    const index_t e = kvtest::uniform_int(g, s, r), div_g = trial % 3 == 0 ? 0 : kvtest::uniform_int(g, 1, 8);
    const bool is_max = trial % 2 == 0, per_token = trial % 4 < 2;
    const float factor = std::fabs(pick());
    // the references: gqa_combine, then gqa_finish / postprocess_finish per element
    std::vector<float> rc = o, rf = o;
    for (index_t p = 0; p < n; ++p) {
      const auto i = static_cast<std::size_t>(p);
      rc[i] = detail::gqa_combine(is_max ? gqa_op::max : gqa_op::sum, o[i], x[i]);
      const float v = div_g > 0 ? detail::gqa_finish(gqa_op::mean, o[i], div_g) : o[i];
      const bool weighted = p >= s && p < e;
      rf[i] = detail::postprocess_finish(v, p, weighted, per_token ? w[i] : factor, s, r);
    }
    for (const auto& [combine, finish] : copies) {
      std::vector<float> c1 = o, f1 = o;
      combine(is_max, c1.data(), x.data(), n);
      finish(f1.data(), n, s, e, r, div_g, per_token ? w.data() : nullptr, factor);
      if (is_max) require_identical_bits(c1.data(), rc.data(), n);
      else require_same_bits(c1.data(), rc.data(), n);
      require_same_bits(f1.data(), rf.data(), n);
    }
  }
}

TEST_CASE("post_finish: the GQA mean of a power-of-two group multiplies by 1 / g, the division's bits for every "
          "kind of float") {
  // every subnormal (where the quotient is rounded: ties to even included), then a stride over all
  // other patterns (normals, the largest, infinities, NaNs of both signs), through each copy's
  // finish with g = 1, 2, 4, ..., 64 against the per-element division gqa_finish
  std::vector<float> in;
  for (std::uint32_t b = 0; b < (1u << 23); b += 3) in.push_back(detail::bits_float(b));
  for (std::uint64_t b = 1u << 23; b < (1ull << 32); b += 4093) in.push_back(detail::bits_float(static_cast<std::uint32_t>(b)));
  for (std::uint32_t b : {0x7f7fffffu, 0x7f800000u, 0x7fc00000u, 0x7fa00001u, 0x80000001u, 0xff7fffffu, 0xff800000u})
    in.push_back(detail::bits_float(b));
  std::vector<void (*)(float*, index_t, index_t, index_t, index_t, index_t, const float*, float)> copies = {
      detail::post_finish_base};
#if KVEVICT_HOST_X86_DISPATCH
  if (host_isa_supported() >= host_isa::avx2) copies.push_back(detail::post_finish_avx2);
#endif
  const index_t n = static_cast<index_t>(in.size());
  std::vector<float> want(in.size()), got(in.size());
  for (index_t g = 1; g <= 64; g *= 2) {
    CAPTURE(g);
    for (index_t i = 0; i < n; ++i) {
      const float v = detail::gqa_finish(gqa_op::mean, in[static_cast<std::size_t>(i)], g);
      want[static_cast<std::size_t>(i)] = v == inf ? std::numeric_limits<float>::max() : v;  // protect_value
    }
    for (const auto& finish : copies) {
      got = in;
      finish(got.data(), n, 0, 0, n, g, nullptr, 1.0f);
      index_t bad = 0;
      for (index_t i = 0; i < n; ++i)
        if (bits(got[static_cast<std::size_t>(i)]) != bits(want[static_cast<std::size_t>(i)]) &&
            !(std::isnan(got[static_cast<std::size_t>(i)]) && std::isnan(want[static_cast<std::size_t>(i)])))
          ++bad;
      CHECK(bad == 0);
    }
  }
}

TEST_CASE("postprocess_scores: staged norms and key norms equal the host's row functions") {
  auto g = kvtest::rng(51);
  for (int trial = 0; trial < 200; ++trial) {
    const index_t d = kvtest::uniform_int(g, 0, 300);
    std::vector<float16> row(static_cast<std::size_t>(std::max<index_t>(1, d)));
    for (auto& x : row) x = to_float16(static_cast<float>(kvtest::uniform_int(g, -3000, 3000)) / 7.f);
    // the staging reads 16 elements at a time, widened, and continues the sum
    float v = 0.0f, k = 0.0f;
    for (index_t d0 = 0; d0 < d; d0 += 16) {
      float piece[16];
      const index_t n = std::min<index_t>(16, d - d0);
      for (index_t i = 0; i < n; ++i) piece[i] = detail::widen(row[static_cast<std::size_t>(d0 + i)]);
      v = detail::value_l1_accumulate(v, piece, n, 1);
      k = detail::key_sq_accumulate(k, piece, n, 1);
    }
    CHECK(bits(v) == bits(detail::value_l1_norm(row.data(), d, 1)));
    CHECK(bits(-std::sqrt(k)) == bits(detail::key_norm_score(row.data(), d, 1)));
  }
}

TEST_CASE("postprocess_scores: defaults, no-values overload, empty shapes") {
  postprocess_options o;
  CHECK(o.gqa == gqa_op::mean);
  CHECK(o.order == gqa_order::pool_first);
  CHECK(o.pool == pool_kind::max);
  CHECK(o.kernel == 7);
  CHECK(!o.weight_values);
  std::vector<float> in(4 * 10), out(2 * 10, 1.f);
  auto g = kvtest::rng(5);
  in = random_scores(g, in.size(), false);
  workspace ws;
  const auto iv = value_of(make_matrix_view<const float>(in.data(), 4, 10));
  const auto ov = value_of(make_matrix_view(out.data(), 2, 10));
  REQUIRE(postprocess_scores(seq, ws, iv, ov, o).ok());
  CHECK(ws.bytes == detail::workspace_max_align - 1 + 2 * 10 * sizeof(float));  // + the worst-case base padding
  std::vector<float> mem((ws.bytes + sizeof(float) - 1) / sizeof(float));
  ws.data = mem.data();
  REQUIRE(postprocess_scores(seq, ws, iv, ov, o).ok());
  // max pooling 7 then mean over pairs of query heads
  for (index_t h = 0; h < 2; ++h)
    for (index_t t = 0; t < 10; ++t) {
      float m[2];
      for (int j = 0; j < 2; ++j) {
        m[j] = -inf;
        for (index_t p = std::max<index_t>(0, t - 3); p <= std::min<index_t>(9, t + 3); ++p)
          m[j] = std::max(m[j], in[static_cast<std::size_t>((h * 2 + j) * 10 + p)]);
      }
      CHECK(out[static_cast<std::size_t>(h * 10 + t)] == (m[0] + m[1]) / 2.f);
    }
  // no pooling needs no workspace; T = 0 and H = 0 do nothing
  o.pool = pool_kind::none;
  workspace ws2;
  REQUIRE(postprocess_scores(seq, ws2, iv, ov, o).ok());
  CHECK(ws2.bytes == 0);
  workspace ws3;
  REQUIRE(postprocess_scores(seq, ws3, value_of(make_matrix_view<const float>(in.data(), 4, 0)),
                             value_of(make_matrix_view(out.data(), 2, 0)), o)
              .ok());
  REQUIRE(postprocess_scores(seq, ws3, value_of(make_matrix_view<const float>(in.data(), 0, 5)),
                             value_of(make_matrix_view(out.data(), 0, 5)), o)
              .ok());
}

TEST_CASE("postprocess_scores: errors") {
  std::vector<float> in(4 * 10, 0.5f), out(2 * 10, 1.f), vals(2 * 12 * 3, 1.f);
  std::vector<std::int32_t> lens{10, 11}, neg{-1, 3};
  const auto iv = value_of(make_matrix_view<const float>(in.data(), 4, 10));
  const auto ov = value_of(make_matrix_view(out.data(), 2, 10));
  const auto vv = value_of(make_kv_view<const float>(vals.data(), 2, 12, 3));
  postprocess_options o;
  workspace ws;
  auto run = [&](matrix_view<const float> i, matrix_view<float> oo, const postprocess_options& op,
                 const std::int32_t* rl = nullptr, const std::int32_t* vl = nullptr) {
    workspace w;
    return postprocess_scores(seq, w, i, oo, vv, op, rl, vl);
  };
  // views
  const matrix_view<float> bad_out(nullptr, cuda::std::layout_stride::mapping<cuda::std::dextents<index_t, 2>>(
                                                cuda::std::dextents<index_t, 2>(2, 10), cuda::std::array<index_t, 2>{10, 1}));
  require_error(run(iv, bad_out, o), errc::null_pointer, "postprocess_scores: out: data is null");
  // shapes
  require_error(run(iv, value_of(make_matrix_view(out.data(), 3, 10)), o), errc::shape_mismatch,
                "4 query heads are not a multiple of 3 KV heads");
  require_error(run(iv, value_of(make_matrix_view(out.data(), 2, 9)), o), errc::shape_mismatch,
                "in has 10 tokens per row but out has 9");
  require_error(run(value_of(make_matrix_view<const float>(in.data(), 0, 10)), ov, o), errc::shape_mismatch,
                "in has 0 query heads but out has 2 KV heads");
  // options
  postprocess_options b = o;
  b.gqa = static_cast<gqa_op>(7);
  require_error(run(iv, ov, b), errc::invalid_argument, "op = 7 is not a gqa_op");
  b = o;
  b.order = static_cast<gqa_order>(5);
  require_error(run(iv, ov, b), errc::invalid_argument, "opt.order = 5 is not a gqa_order");
  b = o;
  b.pool = static_cast<pool_kind>(9);
  require_error(run(iv, ov, b), errc::invalid_argument, "kind = 9 is not a pool_kind");
  b = o;
  b.divisor = static_cast<avg_divisor>(4);
  require_error(run(iv, ov, b), errc::invalid_argument, "options.divisor = 4 is not an avg_divisor");
  b = o;
  b.unpooled_tail = -2;
  require_error(run(iv, ov, b), errc::invalid_argument, "postprocess_scores: opt.unpooled_tail = -2 must be >= 0");
  b = o;
  b.kernel = 4;
  require_error(run(iv, ov, b), errc::invalid_argument, "kernel = 4 is even");
  b.kernel = 0;
  require_error(run(iv, ov, b), errc::invalid_argument, "kernel = 0 must be odd and >= 1");
  b = o;
  b.n_sink = -1;
  require_error(run(iv, ov, b), errc::invalid_argument, "n_sink = -1 is negative");
  b = o;
  b.n_recent = -2;
  require_error(run(iv, ov, b), errc::invalid_argument, "n_recent = -2 is negative");
  b = o;
  b.weight_values = true;
  b.weight = static_cast<value_weight>(3);
  require_error(run(iv, ov, b), errc::invalid_argument, "unknown value_weight value 3");
  b.weight = value_weight::per_token;
  require_error(postprocess_scores(seq, ws, iv, ov, b), errc::invalid_argument,
                "opt.weight_values is set but no values were given");
  require_error(postprocess_scores(seq, ws, iv, ov, value_of(make_kv_view<const float>(vals.data(), 2, 9, 3)), b),
                errc::shape_mismatch, "scores have 10 columns but values hold only 9 tokens");
  require_error(postprocess_scores(seq, ws, iv, ov, value_of(make_kv_view<const float>(vals.data(), 1, 12, 3)), b),
                errc::shape_mismatch, "values have 1 KV heads but out has 2 rows");
  // lengths
  require_error(run(iv, ov, o, lens.data()), errc::out_of_range, "row_lengths[1] = 11 is outside [0, 10]");
  require_error(run(iv, ov, b, nullptr, neg.data()), errc::out_of_range, "value_lengths[0] = -1 is outside [0, 12]");
  // overlap
  require_error(run(value_of(make_matrix_view<const float>(out.data(), 2, 10)), ov, o), errc::overlap,
                "in and out overlap");
  require_error(postprocess_scores(seq, ws, iv, ov, value_of(make_kv_view<const float>(out.data(), 2, 10, 1)), b),
                errc::overlap, "scores overlap values");
  require_error(run(iv, ov, o, reinterpret_cast<const std::int32_t*>(out.data() + 3)), errc::overlap,
                "row_lengths lie inside out");
  require_error(run(iv, ov, b, nullptr, reinterpret_cast<const std::int32_t*>(out.data() + 3)), errc::overlap,
                "lengths lie inside scores");
  // workspace
  workspace tiny;
  std::vector<unsigned char> mem(8);
  tiny.data = mem.data();
  tiny.bytes = mem.size();
  require_error(postprocess_scores(seq, tiny, iv, ov, o), errc::workspace_too_small, "workspace has 8 bytes");
  // nothing was written by any failed call
  for (float x : out) CHECK(x == 1.f);
}

TEST_CASE("shared checks: the errors the CUDA work added to the host stages") {
  std::vector<float> in(4 * 10, 0.5f), out(2 * 10, 1.f), vals(2 * 10 * 3, 1.f);
  // gqa_reduce with no query heads but KV heads would read a row that does not exist
  require_error(gqa_reduce(seq, value_of(make_matrix_view<const float>(in.data(), 0, 10)),
                           value_of(make_matrix_view(out.data(), 2, 10)), gqa_op::mean),
                errc::shape_mismatch, "gqa_reduce: in has 0 query heads but out has 2 KV heads");
  for (float x : out) CHECK(x == 1.f);
  // weight_by_value_norm: (valid) lengths stored inside the scores it would scale. The buffer holds
  // int32 lengths; the scores view over it is never read when the call fails.
  std::vector<std::int32_t> raw(20, 0);
  raw[4] = 3;
  raw[5] = 4;
  require_error(weight_by_value_norm(seq, value_of(make_matrix_view(reinterpret_cast<float*>(raw.data()), 2, 10)),
                                     value_of(make_kv_view<const float>(vals.data(), 2, 10, 3)), value_weight::per_token,
                                     raw.data() + 4),
                errc::overlap, "weight_by_value_norm: lengths lie inside scores");
  CHECK(raw[4] == 3);
}

namespace {

/// An engine's executor as kvevict::on sees it: two workers (the calling thread and one
/// std::thread per loop), ranges handed out in reverse and interleaved, every call and iteration
/// counted, and every worker id checked to be in range and not shared by concurrent tasks.
struct counting_executor {
  std::atomic<long> loops{0}, iterations{0}, bad_worker{0};
  std::atomic<int> busy[2] = {{0}, {0}};
  int concurrency() const { return 2; }
  void parallel_for(index_t n, task_ref task) {
    ++loops;
    auto run = [&](int worker) {
      // worker w takes the chunks w, w + 2, ... from the end: a partition unlike seq's or par's
      const index_t chunk = 3;
      const index_t chunks = (n + chunk - 1) / chunk;
      for (index_t c = chunks - 1 - worker; c >= 0; c -= 2) {
        const index_t b = c * chunk, e = std::min(n, b + chunk);
        if (busy[worker].fetch_add(1) != 0) ++bad_worker;
        task(b, e, worker);
        busy[worker].fetch_sub(1);
        iterations += e - b;
      }
    };
    std::thread other(run, 1);
    run(0);
    other.join();
  }
};

}  // namespace

TEST_CASE("on(executor): every stage's loops go through the caller's executor, bit-identical with seq") {
  auto g = kvtest::rng(181);
  const index_t hq = 8, hkv = 4, T = 700, d = 16, w = 8, P = T - w, k = 96;
  std::vector<float> q = kvtest::random_floats(g, static_cast<std::size_t>(hq * w * d), -2.f, 2.f);
  std::vector<float> keys = kvtest::random_floats(g, static_cast<std::size_t>(hkv * T * d), -2.f, 2.f);
  std::vector<float> vals = kvtest::random_floats(g, static_cast<std::size_t>(hkv * T * d));
  keys[5] = keys[6];  // a tie
  counting_executor ex;
  const auto qv = value_of(make_kv_view<const float>(q.data(), hq, w, d));
  const auto kview = value_of(make_kv_view<const float>(keys.data(), hkv, T, d));
  const auto vview = value_of(make_kv_view<const float>(vals.data(), hkv, T, d));

  auto pipeline = [&](auto be, std::vector<float>& scores, std::vector<float>& post, std::vector<pos_t>& kept,
                      std::vector<float>& kc, std::vector<float>& pooled, std::vector<float>& reduced) {
    // window scores (scratch per worker), the fused post-processing, top-k, compaction
    scores.assign(static_cast<std::size_t>(hq * P), 0.f);
    workspace ws;
    REQUIRE(window_scores(be, ws, qv, kview, value_of(make_matrix_view(scores.data(), hq, P))).ok());
    std::vector<unsigned char> mem(ws.bytes);
    ws.data = mem.data();
    REQUIRE(window_scores(be, ws, qv, kview, value_of(make_matrix_view(scores.data(), hq, P))).ok());
    const auto sv = value_of(make_matrix_view<const float>(scores.data(), hq, P));
    postprocess_options o;
    o.pool = pool_kind::avg;
    o.kernel = 5;
    o.weight_values = true;
    o.n_sink = 2;
    post.assign(static_cast<std::size_t>(hkv * P), 0.f);
    workspace pw;
    REQUIRE(postprocess_scores(be, pw, sv, value_of(make_matrix_view(post.data(), hkv, P)), vview, o).ok());
    std::vector<unsigned char> pmem(pw.bytes);
    pw.data = pmem.data();
    REQUIRE(postprocess_scores(be, pw, sv, value_of(make_matrix_view(post.data(), hkv, P)), vview, o).ok());
    pooled.assign(static_cast<std::size_t>(hq * P), 0.f);
    REQUIRE(pool1d(be, sv, value_of(make_matrix_view(pooled.data(), hq, P)), pool_kind::max, 7).ok());
    reduced.assign(static_cast<std::size_t>(hkv * P), 0.f);
    REQUIRE(gqa_reduce(be, value_of(make_matrix_view<const float>(pooled.data(), hq, P)),
                       value_of(make_matrix_view(reduced.data(), hkv, P)), gqa_op::mean)
                .ok());
    kept.assign(static_cast<std::size_t>(hkv * k), 0);
    workspace sw;
    const auto postv = value_of(make_matrix_view<const float>(post.data(), hkv, P));
    REQUIRE(select_topk(be, sw, postv, nullptr, value_of(make_matrix_view(kept.data(), hkv, k))).ok());
    std::vector<unsigned char> smem(sw.bytes);
    sw.data = smem.data();
    REQUIRE(select_topk(be, sw, postv, nullptr, value_of(make_matrix_view(kept.data(), hkv, k))).ok());
    // flattened selection (per-worker scratch, several passes), then weighting, protection and
    // in-place compaction of a copy of the values
    std::vector<std::int32_t> fcu(static_cast<std::size_t>(hkv + 1));
    std::vector<pos_t> fpos(static_cast<std::size_t>(hkv * k));
    workspace fw;
    REQUIRE(select_topk_flat(be, fw, postv, nullptr, hkv * k, nullptr, fcu.data(), fpos.data()).ok());
    std::vector<unsigned char> fmem(fw.bytes);
    fw.data = fmem.data();
    REQUIRE(select_topk_flat(be, fw, postv, nullptr, hkv * k, nullptr, fcu.data(), fpos.data()).ok());
    for (std::size_t i = 0; i < fpos.size(); ++i) reduced.push_back(static_cast<float>(fpos[i]));
    std::vector<float> wt = reduced;
    const auto wv = value_of(make_matrix_view(wt.data(), hkv, P));
    REQUIRE(weight_by_value_norm(be, wv, vview, value_weight::per_token).ok());
    REQUIRE(protect(be, wv, 3, 5).ok());
    reduced.insert(reduced.end(), wt.begin(), wt.begin() + hkv * P);
    std::vector<float> vc = vals;
    REQUIRE(compact_inplace(be, value_of(make_kv_view(vc.data(), hkv, T, d)),
                            value_of(make_matrix_view<const pos_t>(kept.data(), hkv, k)))
                .ok());
    reduced.insert(reduced.end(), vc.begin(), vc.begin() + hkv * k * d);
    kc.assign(static_cast<std::size_t>(hkv * k * d), 0.f);
    REQUIRE(compact(be, kview, value_of(make_matrix_view<const pos_t>(kept.data(), hkv, k)),
                    value_of(make_kv_view(kc.data(), hkv, k, d)))
                .ok());
  };
  std::vector<float> s0, p0, c0, l0, r0, s1, p1, c1, l1, r1;
  std::vector<pos_t> k0, k1;
  pipeline(seq, s0, p0, k0, c0, l0, r0);
  pipeline(on(ex), s1, p1, k1, c1, l1, r1);
  auto same_bits = [](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };
  CHECK(same_bits(s0, s1));
  CHECK(same_bits(p0, p1));
  CHECK(same_bits(l0, l1));
  CHECK(same_bits(r0, r1));
  CHECK(same_bits(c0, c1));
  CHECK(k0 == k1);
  // scores, the post-processing's stages, pooling, GQA, selection and compaction each ran loops on ex
  CHECK(ex.loops.load() >= 6);
  CHECK(ex.iterations.load() >= hq + hkv + hq + hkv + hkv);
  CHECK(ex.bad_worker.load() == 0);
  // the workspace of a stage with per-worker scratch is sized by the executor's concurrency
  workspace q1, q2;
  REQUIRE(select_topk(seq, q1, value_of(make_matrix_view<const float>(p0.data(), hkv, P)), nullptr,
                      value_of(make_matrix_view(k0.data(), hkv, k)))
              .ok());
  REQUIRE(select_topk(on(ex), q2, value_of(make_matrix_view<const float>(p0.data(), hkv, P)), nullptr,
                      value_of(make_matrix_view(k0.data(), hkv, k)))
              .ok());
  CHECK(q2.bytes > q1.bytes);
}

// The pooling tiles' plain shared-memory accesses (staged inputs, the blocks' suffix stash, the
// outputs, the value norms) are announced to the executor (plain_read / plain_write): a barrier of
// pp_tile_op left out is reported as a race between plain accesses of two threads.
TEST_CASE("postprocess on the executor: a missing barrier around the pooling tile's plain accesses is reported") {
  auto g = kvtest::rng(4242);
  for (const gqa_order order : {gqa_order::gqa_first, gqa_order::pool_first}) {
    CAPTURE(static_cast<int>(order));
    case_data<float> c = random_case<float>(g, 2);
    c.hkv = 1;
    c.g = 2;
    c.T = 80;
    c.tv = 80;
    c.d = 4;
    c.in = random_scores(g, static_cast<std::size_t>(c.hkv * c.g * c.T), false);
    c.values.assign(static_cast<std::size_t>(c.hkv * c.tv * c.d), 0.5f);
    c.use_row_lengths = c.use_value_lengths = false;
    c.opt.order = order;
    c.opt.pool = pool_kind::max;
    c.opt.kernel = 7;
    c.opt.weight_values = true;
    c.opt.weight = value_weight::per_token;
    std::string error;
    (void)executor_fused(g, c, 0, &error);
    CHECK(error.empty());  // every barrier in place: no report
    int plain = 0;
    for (index_t k = 1; k <= 8; ++k) {
      (void)executor_fused(g, c, k, &error);
      if (error.find("race") != std::string::npos && error.find("plain") != std::string::npos) ++plain;
    }
    CHECK(plain > 0);
  }
}
