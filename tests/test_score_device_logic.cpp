// The CUDA attention-score kernels' own bodies (detail/block/score_ops.hpp: statistics pass, merge,
// columns pass) and launch sequence, run on the host SIMT executor (detail/block/score_emulation.hpp:
// real barriers and warp shuffles, shared-memory race and barrier checks, interleaved blocks, small
// grid caps for the grid-stride loops), bit for bit against attention_scores on seq (the device
// follows the host's summation order, docs/score.md "Summation order"; NaN: the same pattern), and
// within the host's bound (docs/score.md) of a naive double-precision reference. Random inputs in
// float, float16 and bfloat16, every reduce mode, separately rounded and fused logits, with and
// without block keys, prefix or all columns, partial tiles, chunks and row blocks, w above the
// 128-row block (the per-head pass-2 path), several 1024-column chunks (splits of 16 tiles, the last
// one partial), GQA-reduced output (bit for bit gqa_reduce of seq's per-head output), NaN and
// infinities. Small shapes: the executor runs every thread as a fiber.
#include <kvevict/detail/block/score_emulation.hpp>
#include <kvevict/detail/block/simt.hpp>
#include <kvevict/detail/block/simt_bodies.hpp>
#include "paged_fixture.hpp"
#include "support.hpp"

#include <kvevict/gqa.hpp>
#include <kvevict/numeric.hpp>
#include <kvevict/paged.hpp>
#include <kvevict/score.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

using namespace kvevict;
using kvtest::require_error;
using kvtest::value_of;

namespace {

constexpr double u32 = 5.9604644775390625e-08;  // 2^-24

template <class T>
T from_f(float f) {
  if constexpr (std::is_same_v<T, float16>) return to_float16(f);
  else if constexpr (std::is_same_v<T, bfloat16>) return to_bfloat16(f);
  else return f;
}

std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// An owning [H][T][D] tensor, head-major or token-major, optionally padded rows.
template <class T>
struct tensor {
  std::vector<T> buf;
  kv_view<T> view;
  tensor(index_t H, index_t Tn, index_t D, int layout, std::mt19937_64& g, float lo, float hi) {
    const index_t pad = layout >= 2 ? 5 : 0, row = D + pad;
    buf.assign(static_cast<std::size_t>(std::max<index_t>(1, H * Tn * row)), from_f<T>(0.f));
    const auto vals = kvtest::random_floats(g, buf.size(), lo, hi);
    for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = from_f<T>(vals[i]);
    view = layout % 2 == 0 ? value_of(make_kv_view(buf.data(), H, Tn, D, std::max<index_t>(1, Tn * row), row))
                           : value_of(make_kv_view(buf.data(), H, Tn, D, row, std::max<index_t>(1, H * row)));
  }
};

// Naive double reference: the whole attention matrix of each query head, then the column reduction.
// mag: the column's magnitude (sum-based, as in tests/test_score.cpp); dot: max (d+2)·scale·Σ|q k|.
struct reference {
  std::vector<double> val, mag;
  double dot = 0;
};

template <class QE, class KE>
reference naive(const kv_view<const QE>& q, const kv_view<const KE>& prefix, const kv_view<const KE>& block, index_t oc,
                const score_options& opt) {
  const index_t hq = q.extent(0), w = q.extent(1), d = q.extent(2), hkv = prefix.extent(0), p = prefix.extent(1);
  const bool hb = block.extent(1) > 0;
  const index_t cols = p + (hb ? w : 0);
  const double scale = opt.scale == 0.f ? static_cast<double>(static_cast<float>(1.0 / std::sqrt(double(d)))) : opt.scale;
  reference ref;
  ref.val.assign(static_cast<std::size_t>(hq * oc), 0.0);
  ref.mag.assign(ref.val.size(), 0.0);
  for (index_t h = 0; h < hq; ++h) {
    const index_t g = h / (hq / hkv);
    std::vector<double> a(static_cast<std::size_t>(w * cols), 0.0);
    for (index_t i = 0; i < w; ++i) {
      const index_t vis = p + (hb ? i + 1 : 0);
      double m = -std::numeric_limits<double>::infinity();
      for (index_t j = 0; j < vis; ++j) {
        double s = 0, sa = 0;
        for (index_t k = 0; k < d; ++k) {
          const double x = to_float(q(h, i, k));
          const double y = j < p ? to_float(prefix(g, j, k)) : to_float(block(g, j - p, k));
          s += x * y;
          sa += std::fabs(x * y);
        }
        ref.dot = std::max(ref.dot, (double(d) + 2) * scale * sa);
        a[static_cast<std::size_t>(i * cols + j)] = s * scale;
        m = std::max(m, s * scale);
      }
      double sum = 0;
      for (index_t j = 0; j < vis; ++j) sum += (a[static_cast<std::size_t>(i * cols + j)] = std::exp(a[static_cast<std::size_t>(i * cols + j)] - m));
      for (index_t j = 0; j < vis; ++j) a[static_cast<std::size_t>(i * cols + j)] /= sum;
    }
    for (index_t j = 0; j < oc; ++j) {
      double s = 0, s2 = 0;
      for (index_t i = 0; i < w; ++i) {
        const double x = a[static_cast<std::size_t>(i * cols + j)];
        s += x;
        s2 += x * x;
      }
      const double mean = s / double(w);
      double m2 = 0;
      for (index_t i = 0; i < w; ++i) m2 += (a[static_cast<std::size_t>(i * cols + j)] - mean) * (a[static_cast<std::size_t>(i * cols + j)] - mean);
      const index_t seen = j < p ? w : w - (j - p);
      double v = 0, mg = 0;
      switch (opt.reduce) {
        case score_reduce::sum: v = mg = s; break;
        case score_reduce::mean: v = mg = mean; break;
        case score_reduce::mean_visible: v = mg = s / double(seen); break;
        case score_reduce::mean_plus_variance: {
          const double var = opt.variance == variance_estimator::biased ? m2 / double(w) : w > 1 ? m2 / double(w - 1) : 0.0;
          v = mean + opt.gamma * var;
          mg = mean + 2.0 * opt.gamma * s2 / double(std::max<index_t>(1, w - 1));
          break;
        }
      }
      ref.val[static_cast<std::size_t>(h * oc + j)] = v;
      ref.mag[static_cast<std::size_t>(h * oc + j)] = mg;
    }
  }
  return ref;
}

// The host's bound (docs/score.md).
double host_rel(double dot, index_t cols, index_t w) {
  return u32 * (2 * dot + 4 + (128 + 8 + double((cols + 1023) / 1024)) + double(w) + 4);
}

double worst_ratio = 0;
long equal_values = 0;

// A grid cap for one run: usually none, sometimes 1 or 2 blocks (every item through the grid-stride loops).
index_t trial_cap(std::mt19937_64& g) {
  const auto r = g() % 4;
  return r == 0 ? 1 : r == 1 ? 2 : index_t(1) << 20;
}

template <class QE, class KE>
void run_case(std::mt19937_64& g, index_t hkv, index_t group, index_t w, index_t p, index_t d, bool has_block,
              bool all_cols, score_options opt, gqa_op op, int layout, float range, bool specials) {
  CAPTURE(hkv);
  CAPTURE(group);
  CAPTURE(w);
  CAPTURE(p);
  CAPTURE(d);
  CAPTURE(has_block);
  CAPTURE(all_cols);
  CAPTURE(static_cast<int>(opt.reduce));
  CAPTURE(opt.fused_multiply_add);
  CAPTURE(static_cast<int>(op));
  CAPTURE(layout);
  const index_t hq = hkv * group;
  tensor<QE> q(hq, w, d, layout, g, -range, range);
  tensor<KE> k(hkv, p + w, d, layout, g, -range, range);
  if (specials) {
    // a NaN key element, a -inf key (masked where the query element is positive and the others finite
    // would be too fragile: it yields -inf or +inf logits, both exercised), a NaN query row element
    const index_t t = kvtest::uniform_int(g, 0, p + w - 1);
    k.view(kvtest::uniform_int(g, 0, hkv - 1), t, kvtest::uniform_int(g, 0, d - 1)) = from_f<KE>(std::numeric_limits<float>::quiet_NaN());
    k.view(kvtest::uniform_int(g, 0, hkv - 1), kvtest::uniform_int(g, 0, p + w - 1), 0) = from_f<KE>(-std::numeric_limits<float>::infinity());
    if (hq > 1) q.view(kvtest::uniform_int(g, 0, hq - 1), kvtest::uniform_int(g, 0, w - 1), 0) = from_f<QE>(std::numeric_limits<float>::quiet_NaN());
  }
  const auto split = value_of(split_window(kv_view<const KE>(k.view), w));
  const kv_view<const KE> block = has_block ? split.window : kv_view<const KE>{};
  const index_t oc = has_block && all_cols ? p + w : p;
  const kv_view<const QE> qv = q.view;

  std::vector<float> host(static_cast<std::size_t>(std::max<index_t>(1, hq * oc)), -7.f);
  std::vector<float> emu(host.size(), -7.f), emu_kv(static_cast<std::size_t>(std::max<index_t>(1, hkv * oc)), -7.f);
  std::vector<float> kv_ref(emu_kv.size(), -9.f);
  const auto hv = value_of(make_matrix_view(host.data(), hq, oc));
  const auto ev = value_of(make_matrix_view(emu.data(), hq, oc));
  const auto ekv = value_of(make_matrix_view(emu_kv.data(), hkv, oc));
  workspace ws;
  REQUIRE(attention_scores(seq, ws, qv, split.prefix, block, hv, opt).ok());
  std::vector<unsigned char> mem;
  ws = kvtest::shifted_workspace(mem, ws.bytes);
  REQUIRE(attention_scores(seq, ws, qv, split.prefix, block, hv, opt).ok());
  const index_t cap = trial_cap(g);
  const status st = kvevict::detail::emulate_cuda_attention_scores(qv, split.prefix, block, ev, ekv, op, opt, g(), cap);
  REQUIRE_MESSAGE(st.ok(), st.message());
  // the GQA-reduced output is gqa_reduce of seq's per-head output, bit for bit
  REQUIRE(gqa_reduce(seq, matrix_view<const float>(hv), value_of(make_matrix_view(kv_ref.data(), hkv, oc)), op).ok());
  for (std::size_t i = 0; i < static_cast<std::size_t>(hkv * oc); ++i) {
    const bool both_nan = std::isnan(emu_kv[i]) && std::isnan(kv_ref[i]);
    CHECK((both_nan || bits_of(emu_kv[i]) == bits_of(kv_ref[i])));
  }

  const reference ref = naive(qv, split.prefix, block, oc, opt);
  score_options o2 = opt;
  detail::score_shape sh;
  REQUIRE(detail::check_attention_inputs("t", qv, split.prefix, block, o2, sh).ok());
  sh.out_cols = oc;
  const double rh = host_rel(ref.dot, sh.cols, w);
  for (index_t h = 0; h < hq; ++h)
    for (index_t j = 0; j < oc; ++j) {
      const std::size_t i = static_cast<std::size_t>(h * oc + j);
      CAPTURE(h);
      CAPTURE(j);
      REQUIRE(std::isnan(emu[i]) == std::isnan(host[i]));
      if (std::isnan(emu[i])) continue;
      REQUIRE(bits_of(emu[i]) == bits_of(host[i]));
      ++equal_values;
      REQUIRE(!std::isnan(ref.val[i]));
      if (!std::isfinite(ref.dot)) continue;  // an infinite logit elsewhere: only the NaN pattern is pinned
      const double tol_h = 2 * rh * ref.mag[i] + 1e-37;
      const double err = std::fabs(double(emu[i]) - ref.val[i]);
      worst_ratio = std::max(worst_ratio, err / tol_h);
      CHECK(err <= tol_h);
    }
}

// chunks: prefixes around the 1024-column chunk boundaries (block keys crossing one, chunks of 1 to
// 16 tiles), one KV head, w up to 12, d up to 5 (the executor's cost is the logits).
template <class QE, class KE>
void random_cases(std::uint64_t seed, int n, bool specials, bool chunks = false) {
  auto g = kvtest::rng(seed);
  const score_reduce reds[] = {score_reduce::mean, score_reduce::sum, score_reduce::mean_visible,
                               score_reduce::mean_plus_variance};
  const gqa_op ops[] = {gqa_op::mean, gqa_op::max, gqa_op::sum};
  for (int trial = 0; trial < n; ++trial) {
    CAPTURE(seed);
    CAPTURE(trial);
    const index_t hkv = kvtest::uniform_int(g, 1, 2), group = kvtest::uniform_int(g, 1, 3);
    // w small, or above the 128-row block (one head: pass 2 in pieces of one head); P around tile
    // multiples, incl. P = 0 with block keys; d around the 32-element staging chunk
    const bool tall = !chunks && trial % 11 == 10;
    const index_t w = tall ? kvtest::uniform_int(g, 129, 140) : kvtest::uniform_int(g, 1, chunks ? 12 : 20);
    const bool has_block = trial % 4 != 3;
    const index_t bases[] = {1000, 1024, 2030};
    const index_t p = chunks ? bases[trial % 3] + kvtest::uniform_int(g, -12, 12)
                      : has_block && trial % 7 == 0 ? 0
                                                    : kvtest::uniform_int(g, 1, tall ? 70 : 150);
    const index_t d = tall ? kvtest::uniform_int(g, 1, 6) : kvtest::uniform_int(g, 1, chunks ? 5 : 40);
    score_options opt;
    opt.reduce = reds[trial % 4];
    opt.fused_multiply_add = trial % 3 == 1;
    opt.variance = trial % 2 ? variance_estimator::biased : variance_estimator::unbiased;
    if (trial % 6 == 5) opt.scale = 0.37f;
    run_case<QE, KE>(g, tall || chunks ? 1 : hkv, tall ? std::min<index_t>(group, 2) : group, w, p, d, has_block,
                     trial % 2 == 0, opt, ops[trial % 3], trial % 4, trial % 9 == 4 || (chunks && trial % 3 == 1) ? 6.f : 1.f,
                     specials);
  }
}

}  // namespace

TEST_CASE("cuda score logic: the kernels on the executor equal seq bit for bit (float)") {
  random_cases<float, float>(101, 40, false);
}

TEST_CASE("cuda score logic: float16 and bfloat16 inputs, mixed element types") {
  random_cases<float16, float16>(202, 16, false);
  random_cases<bfloat16, bfloat16>(303, 16, false);
  random_cases<float, bfloat16>(404, 10, false);
  random_cases<float16, float>(505, 10, false);
}

TEST_CASE("cuda score logic: NaN and infinities: the host's NaN pattern, other values bit for bit") {
  random_cases<float, float>(606, 30, true);
  random_cases<float16, float16>(707, 10, true);
}

TEST_CASE("cuda score logic: several chunks (splits of 16 tiles), partial last chunk, bit for bit with seq") {
  random_cases<float, float>(811, 4, false, true);
  random_cases<float16, float16>(812, 3, false, true);
  random_cases<bfloat16, float>(813, 3, true, true);
}

TEST_CASE("cuda score logic: a long prefix and a row whose logits are all -inf") {
  auto g = kvtest::rng(808);
  score_options opt;
  // 1 KV head, 2 query heads, w = 3, P = 2200: 35 tiles, 3 chunks (splits of 16, 16 and 3 tiles)
  run_case<float16, float16>(g, 1, 2, 3, 2200, 8, true, false, opt, gqa_op::max, 0, 1.f, false);
  // a query row of -inf against positive keys: every logit -inf, the row is NaN (as PyTorch)
  tensor<float> q(1, 2, 4, 0, g, 0.5f, 1.f);
  tensor<float> k(1, 10, 4, 0, g, 0.5f, 1.f);
  for (index_t t = 0; t < 4; ++t) q.view(0, 1, t) = -std::numeric_limits<float>::infinity();
  const auto split = value_of(split_window(kv_view<const float>(k.view), 2));
  std::vector<float> host(8), emu(8), none(1);
  workspace ws;
  const auto qv = kv_view<const float>(q.view);
  REQUIRE(attention_scores(seq, ws, qv, split.prefix, split.window, value_of(make_matrix_view(host.data(), 1, 8))).ok());
  std::vector<unsigned char> mem(ws.bytes);
  ws.data = mem.data();
  REQUIRE(attention_scores(seq, ws, qv, split.prefix, split.window, value_of(make_matrix_view(host.data(), 1, 8))).ok());
  REQUIRE(kvevict::detail::emulate_cuda_attention_scores(qv, split.prefix, split.window, value_of(make_matrix_view(emu.data(), 1, 8)),
                                               matrix_view<float>{}, gqa_op::mean, opt)
              .ok());
  for (std::size_t j = 0; j < 8; ++j) {
    CHECK(std::isnan(host[j]));
    CHECK(std::isnan(emu[j]));
  }
}

TEST_CASE("cuda score logic: the statistics helpers") {
  using namespace detail;
  const float inf = std::numeric_limits<float>::infinity(), qnan = std::numeric_limits<float>::quiet_NaN();
  // the device's chunk is the host's: its size and lanes
  static_assert(cs_chunk == score_chunk && cs_chunk_lanes == score_lanes, "the device follows the host's chunks");
  // the host's e of a logit in its chunk: e^(l - m), or for a chunk whose max is -inf the NaN or 0
  CHECK(score_chunk_e(2.5f, 2.5f) == 1.0f);
  CHECK(score_chunk_e(-inf, 1.0f) == 0.0f);
  CHECK(score_chunk_e(-inf, -inf) == 0.0f);
  CHECK(std::isnan(score_chunk_e(-qnan, -inf)));
  CHECK(std::isnan(score_chunk_e(inf, inf)));
  CHECK(score_chunk_scale(1.0f, softmax_stats{1.0f, 4.0f}) == 0.25f);
  const float lanes[8] = {1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 1e8f};
  CHECK(score_lanes_total(lanes) == ((((((1.f + 2.f) + 3.f) + 4.f) + 5.f) + 6.f) + 7.f) + 1e8f);
  // visible columns of a chunk and of a tile's runs
  CHECK(score_chunk_count(1030, 0) == 1024);
  CHECK(score_chunk_count(1030, 1) == 6);
  CHECK(score_chunk_count(1030, 2) == 0);
  CHECK(score_run_count(70, 64, 0) == 6);
  CHECK(score_run_count(70, 64, 1) == 0);
  CHECK(score_run_count(200, 64, 1) == 32);
  CHECK(score_run_count(10, 64, 0) == 0);
  // merging with the empty statistics is exact, in either order
  const softmax_stats a{1.25f, 3.5f};
  CHECK(softmax_merge(softmax_empty(), a).sum == 3.5f);
  CHECK(softmax_merge(a, softmax_empty()).sum == 3.5f);
  // the logit term: separately rounded vs fused differ exactly where fma does
  const float x = 1.0f + 1.0f / 4096, y = 1.0f - 1.0f / 4096;
  CHECK(logit_term<false>(-1.0f, x, y) == (x * y) - 1.0f);
  CHECK(logit_term<true>(-1.0f, x, y) == std::fma(x, y, -1.0f));
  // widening matches to_float on every fp16 / bf16 pattern (NaN: any NaN)
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const float16 h{static_cast<std::uint16_t>(b)};
    const bfloat16 bf{static_cast<std::uint16_t>(b)};
    const float a1 = widen(h), b1 = to_float(h), a2 = widen(bf), b2 = to_float(bf);
    CHECK(((std::isnan(a1) && std::isnan(b1)) || bits_of(a1) == bits_of(b1)));
    CHECK(((std::isnan(a2) && std::isnan(b2)) || bits_of(a2) == bits_of(b2)));
  }
}

namespace {
// The worst bank conflict of one shared-memory access phase: the most distinct 4-byte words that
// fall into one of the 32 banks (the same word twice is a broadcast, not a conflict).
int bank_degree(const std::vector<long>& words) {
  std::vector<std::vector<long>> banks(32);
  for (long w : words) {
    auto& b = banks[static_cast<std::size_t>(w % 32)];
    if (std::find(b.begin(), b.end(), w) == b.end()) b.push_back(w);
  }
  std::size_t worst = 0;
  for (const auto& b : banks) worst = std::max(worst, b.size());
  return static_cast<int>(worst);
}
}  // namespace

TEST_CASE("cuda score logic: shared-memory staging and logit-tile accesses are conflict-free or 2-way") {
  using namespace detail;
  // staging: every (row, element) of a chunk exactly once; each warp's stores s[dd * ld + row] hit 32 banks
  for (const auto& [rows, ld] : {std::pair<int, int>{cs_rows, cs_q_ld}, std::pair<int, int>{cs_keys, cs_k_ld}}) {
    std::vector<int> seen(static_cast<std::size_t>(rows * cs_dchunk), 0);
    for (int e0 = 0; e0 < rows * cs_dchunk; e0 += 32) {
      std::vector<long> words;
      for (int lane = 0; lane < 32; ++lane) {
        const cs_stage_slot sl = cs_stage_slot_of(e0 + lane);
        REQUIRE(sl.row >= 0);
        REQUIRE(sl.row < rows);
        REQUIRE(sl.dd >= 0);
        REQUIRE(sl.dd < cs_dchunk);
        ++seen[static_cast<std::size_t>(sl.row * cs_dchunk + sl.dd)];
        words.push_back(static_cast<long>(sl.dd) * ld + sl.row);
      }
      CHECK(bank_degree(words) == 1);
    }
    CHECK(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; }));
  }
  // logit / probability tile: thread (tr, tk) stores rows tr*8+r, columns tk*4 .. tk*4+3 as two float2
  // (a 64-bit access is served per half warp); the chunk max reads row tid/2, columns
  // (tid%2)*32 + i, one float per thread; the lane sums read row tid/2 in groups of 8 columns.
  constexpr int key_threads = cs_keys / cs_thread_keys;
  for (int w = 0; w < cs_threads / 32; ++w) {
    for (int r = 0; r < cs_thread_rows; ++r)
      for (int pair = 0; pair < 2; ++pair)
        for (int half_warp = 0; half_warp < 2; ++half_warp) {
          std::vector<long> words;
          for (int lane = half_warp * 16; lane < half_warp * 16 + 16; ++lane) {
            const int tid = w * 32 + lane, tr = tid / key_threads, tk = tid % key_threads;
            const long base = static_cast<long>(tr * cs_thread_rows + r) * cs_l_ld + tk * cs_thread_keys + 2 * pair;
            words.push_back(base);
            words.push_back(base + 1);
          }
          CHECK(bank_degree(words) <= 2);
        }
    for (int i = 0; i < cs_half; ++i) {
      std::vector<long> words;
      for (int lane = 0; lane < 32; ++lane) {
        const int tid = w * 32 + lane;
        words.push_back(static_cast<long>(tid / 2) * cs_l_ld + (tid % 2) * cs_half + i);
      }
      CHECK(bank_degree(words) <= 2);
    }
    // the chunk sums' lane reads: thread 2r + h reads row r, column 8 g + 4 h + l (lane 4 h + l)
    for (int l = 0; l < cs_chunk_lanes / 2; ++l)
      for (int grp = 0; grp < cs_keys / cs_chunk_lanes; ++grp) {
        std::vector<long> words;
        for (int lane = 0; lane < 32; ++lane) {
          const int tid = w * 32 + lane;
          words.push_back(static_cast<long>(tid / 2) * cs_l_ld + grp * cs_chunk_lanes + (tid % 2) * (cs_chunk_lanes / 2) + l);
        }
        CHECK(bank_degree(words) <= 2);
      }
  }
}

TEST_CASE("cuda score logic: the plan's splits are the host's chunks and cover every tile") {
  detail::score_shape sh;
  sh.hq = 32;
  sh.hkv = 8;
  sh.group = 4;
  sh.w = 32;
  sh.d = 128;
  sh.has_block = true;
  for (index_t p : {index_t(0), index_t(1), index_t(63), index_t(4096), index_t(32768), index_t(1) << 20}) {
    sh.p = p;
    sh.cols = p + sh.w;
    sh.out_cols = p > 0 ? p : sh.cols;
    detail::cuda_score_plan pl;
    REQUIRE(detail::make_cuda_score_plan("t", sh, pl).ok());
    CHECK(pl.tiles == (sh.cols + 63) / 64);
    CHECK(pl.tiles_per_split == detail::cs_chunk_tiles);
    CHECK(pl.splits == (sh.cols + detail::cs_chunk - 1) / detail::cs_chunk);
    CHECK(pl.splits * pl.tiles_per_split >= pl.tiles);
    CHECK((pl.splits - 1) * pl.tiles_per_split < pl.tiles);
    CHECK(pl.part_entries == pl.rows_total * pl.splits);
  }
  // H2O-sized: many rows, 98 chunks of 1024 columns
  sh.w = 100000;
  sh.p = 0;
  sh.cols = sh.out_cols = sh.w;
  detail::cuda_score_plan pl;
  REQUIRE(detail::make_cuda_score_plan("t", sh, pl).ok());
  CHECK(pl.splits == 98);
  CHECK(pl.part_entries == index_t(100000) * 98 * 32);  // 2.5 GB of statistics: docs/cuda.md
}

TEST_CASE("cuda score logic: checks shared with the host name the output") {
  std::vector<float> q(2 * 3 * 4, 0.1f), k(1 * 8 * 4, 0.2f), out(2 * 8);
  const auto qv = value_of(make_kv_view<const float>(q.data(), 2, 3, 4));
  const auto s = value_of(split_window(value_of(make_kv_view<const float>(k.data(), 1, 8, 4)), 3));
  // an out_kv with the wrong number of rows
  require_error(kvevict::detail::emulate_cuda_attention_scores(qv, s.prefix, s.window, matrix_view<float>{},
                                                     value_of(make_matrix_view(out.data(), 2, 5)), gqa_op::mean, {}),
                errc::shape_mismatch, "out_kv has 2 rows but there are 1 KV heads");
  require_error(kvevict::detail::emulate_cuda_attention_scores(qv, s.prefix, s.window, matrix_view<float>{},
                                                     value_of(make_matrix_view(out.data(), 1, 6)), gqa_op::mean, {}),
                errc::shape_mismatch, "out_kv has 6 columns; expected P = 5 (prefix columns) or P + w = 8");
}

TEST_CASE("cuda score logic: report") {
  MESSAGE("values equal to seq's bit for bit: ", equal_values,
          "; largest |emulated - exact| / host bound over the randomized cases: ", worst_ratio);
  CHECK(equal_values > 10000);
  CHECK(worst_ratio <= 1.0);
}

// key_norm_scores' and position_scores' CUDA kernel bodies (key_norm_op, position_op, launched by
// cuda/score.cuh with the same shapes) on the host SIMT executor: bit-identical with seq (float,
// float16, bfloat16 keys; partial 256-token tiles; head dims not a multiple of the 16-element
// staging; token-major strides; small grid caps).
template <class KE>
void key_norm_on_executor(std::mt19937_64& g, int trial) {
  CAPTURE(trial);
  const index_t H = 1 + static_cast<index_t>(g() % 3), T = 1 + static_cast<index_t>(g() % 700);
  const index_t d = 1 + static_cast<index_t>(g() % 70);
  const kv_layout layout = trial % 2 ? kv_layout::token_major : kv_layout::head_major;
  std::vector<KE> k;
  for (float x : kvtest::random_floats(g, static_cast<std::size_t>(H * T * d), -3.f, 3.f)) k.push_back(from_f<KE>(x));
  const auto kv = *make_kv_view(static_cast<const KE*>(k.data()), H, T, d, layout);
  std::vector<float> expect(static_cast<std::size_t>(H * T)), got(expect.size(), -1.0f);
  REQUIRE(key_norm_scores(seq, kv, *make_matrix_view(expect.data(), H, T)).ok());
  detail::simt_executor ex(static_cast<std::uint64_t>(trial));
  detail::simt_launcher<detail::simt_executor> l{ex};
  l.run<detail::key_norm_op<KE>>(detail::key_norm_shape(kv, trial % 3 == 0 ? 2 : index_t(1) << 20), kv, got.data(), T,
                                 index_t(1));
  REQUIRE_MESSAGE(l.ok, ex.error());
  CHECK(std::memcmp(got.data(), expect.data(), got.size() * sizeof(float)) == 0);
}

TEST_CASE("cuda score logic: key_norm and position kernel bodies under the SIMT executor equal seq bit for bit") {
  auto g = kvtest::rng(2105);
  for (int trial = 0; trial < 4; ++trial) {
    key_norm_on_executor<float>(g, trial);
    key_norm_on_executor<float16>(g, trial + 4);
    key_norm_on_executor<bfloat16>(g, trial + 8);
  }
  for (int trial = 0; trial < 4; ++trial) {
    const index_t R = 1 + static_cast<index_t>(g() % 4), T = 1 + static_cast<index_t>(g() % 900);
    std::vector<float> expect(static_cast<std::size_t>(R * T)), got(expect.size(), -1.0f);
    REQUIRE(position_scores(seq, *make_matrix_view(expect.data(), R, T)).ok());
    detail::simt_executor ex(static_cast<std::uint64_t>(trial));
    detail::simt_launcher<detail::simt_executor> l{ex};
    l.run<detail::position_op>(detail::position_shape(R, T, trial % 2 ? 3 : index_t(1) << 20), got.data(), T, index_t(1), R, T);
    REQUIRE_MESSAGE(l.ok, ex.error());
    CHECK(std::memcmp(got.data(), expect.data(), got.size() * sizeof(float)) == 0);
  }
}

// The CUDA paged window scores (cs_paged_rows_op, then the score ops with the paged key accessor) on
// the executor: each row's scores bit-identical to the same kernels' dense window scores of a copy of
// the row (both on the executor), the host paged_window_scores' within a loose tolerance; NHD and
// HND pools, per-sequence and per-(sequence, head) tables, page sizes 1 / 5 / 16, GQA groups, with
// and without the window's columns, separately rounded and fused logits. Bad rows are skipped and
// counted.
TEST_CASE("cuda score logic: paged window scores on the executor equal dense window scores of each row") {
  using kvtest::paged_fixture;
  auto g = kvtest::rng(1307);
  int trial = 0;
  for (const index_t ps : {index_t(1), index_t(5), index_t(16)})
    for (const page_lists lists : {page_lists::per_sequence, page_lists::per_head})
      for (const page_layout layout : {page_layout::nhd, page_layout::hnd}) {
        ++trial;
        const bool include_window = trial % 2 == 0;
        CAPTURE(ps);
        CAPTURE(static_cast<int>(lists));
        CAPTURE(static_cast<int>(layout));
        CAPTURE(include_window);
        const index_t w = 1 + trial % 4, G = 1 + trial % 3, d = trial % 3 == 0 ? 37 : 6;
        paged_fixture f = kvtest::make_paged_fixture(g, 2, 2, d, ps, lists, layout, 80, 3, w);
        const index_t R = f.rows(), Hq = R * G;
        index_t C = 1;
        for (auto n : f.row_len) C = std::max<index_t>(C, include_window ? n : n - w);
        C += trial % 3;  // spare columns: the widest row's plan covers rows narrower than C
        const auto qdata = kvtest::random_floats(g, static_cast<std::size_t>(Hq * w * d));
        const auto q = value_of(make_kv_view<const float>(qdata.data(), Hq, w, d));
        score_options opt;
        opt.fused_multiply_add = trial % 3 == 1;
        opt.reduce = trial % 4 == 3 ? score_reduce::mean_plus_variance : score_reduce::mean;
        std::vector<float> paged(static_cast<std::size_t>(Hq * C), 3.f), ref(paged.size(), 3.f), host(paged.size(), 3.f);
        int bad = 0;
        const status st = detail::emulate_cuda_paged_window_scores(q, f.layer(), value_of(make_matrix_view(paged.data(), Hq, C)),
                                                                   include_window, opt, &bad, g(), trial_cap(g));
        REQUIRE_MESSAGE(st.ok(), st.message());
        CHECK(bad == 0);
        kvtest::dense_copy dense = kvtest::dense_of(f);
        for (index_t r = 0; r < R; ++r) {
          const index_t n = f.row_len[static_cast<std::size_t>(r)];
          const auto keys = value_of(make_kv_view<const float>(dense.keys.row(r, 0), 1, n, d));
          const auto split = value_of(split_window(keys, w));
          const auto qr = value_of(make_kv_view<const float>(qdata.data() + r * G * w * d, G, w, d));
          const auto out = value_of(make_matrix_view(ref.data() + r * G * C, G, include_window ? n : n - w, C));
          const status sr = detail::emulate_cuda_attention_scores(qr, split.prefix, split.window, out, matrix_view<float>{},
                                                                  gqa_op::mean, opt, g());
          REQUIRE_MESSAGE(sr.ok(), sr.message());
        }
        CHECK(std::memcmp(paged.data(), ref.data(), paged.size() * sizeof(float)) == 0);
        const auto hv = value_of(make_matrix_view(host.data(), Hq, C));
        REQUIRE(kvtest::two_phase([&](workspace& ws) { return paged_window_scores(seq, ws, q, f.layer(), hv, include_window, opt); }).ok());
        for (std::size_t i = 0; i < host.size(); ++i) {
          CAPTURE(i);
          CHECK(std::fabs(paged[i] - host[i]) <= 1e-5f * std::fabs(host[i]) + 1e-7f);
        }
      }
}

TEST_CASE("cuda score logic: paged window scores skip and count rows the table does not describe") {
  using kvtest::paged_fixture;
  auto g = kvtest::rng(1308);
  const index_t w = 3, G = 2, d = 5;
  paged_fixture f = kvtest::make_paged_fixture(g, 3, 2, d, 4, page_lists::per_head, page_layout::nhd, 30, 2, w + 1);
  const index_t R = f.rows(), Hq = R * G;
  index_t C = 0;
  for (auto n : f.row_len) C = std::max<index_t>(C, n - w);
  const auto qdata = kvtest::random_floats(g, static_cast<std::size_t>(Hq * w * d));
  const auto q = value_of(make_kv_view<const float>(qdata.data(), Hq, w, d));
  std::vector<float> good(static_cast<std::size_t>(Hq * C), 3.f), got(good.size(), 3.f);
  int bad = 0;
  REQUIRE(detail::emulate_cuda_paged_window_scores(q, f.layer(), value_of(make_matrix_view(good.data(), Hq, C)), false, {},
                                                   &bad, 1).ok());
  REQUIRE(bad == 0);
  // list 1: a page id outside the pool; list 4: fewer tokens than the window (a short last page)
  REQUIRE(f.indptr[2] > f.indptr[1]);
  f.indices[static_cast<std::size_t>(f.indptr[1])] = static_cast<std::int32_t>(f.pages);
  REQUIRE(f.indptr[5] - f.indptr[4] == (f.row_len[4] + 3) / 4);
  f.indptr.erase(f.indptr.begin() + 5, f.indptr.end());  // lists 4 and 5 keep only their first page
  const std::int32_t p4 = f.indices[static_cast<std::size_t>(f.indptr[4])];
  f.indices.resize(static_cast<std::size_t>(f.indptr[4]));
  f.indices.push_back(p4);
  f.indptr.push_back(static_cast<std::int32_t>(f.indices.size()));
  f.indices.push_back(p4);
  f.indptr.push_back(static_cast<std::int32_t>(f.indices.size()));
  f.last[4] = 2;  // 2 tokens < w
  f.last[5] = 4;  // list 5: a full page whose id list 4 also uses (reads are fine: 4 tokens >= w)
  REQUIRE(detail::emulate_cuda_paged_window_scores(q, f.layer(), value_of(make_matrix_view(got.data(), Hq, C)), false, {},
                                                   &bad, 2).ok());
  CHECK(bad == 2);
  for (index_t r = 0; r < R; ++r)
    for (index_t j = 0; j < G * C; ++j) {
      const std::size_t i = static_cast<std::size_t>(r * G * C + j);
      if (r == 1 || r == 4) CHECK(got[i] == 3.f);           // skipped: untouched
      else if (r != 5) CHECK(bits_of(got[i]) == bits_of(good[i]));
    }
  // host-side errors: a window longer than out's columns with include_window, an empty window
  std::vector<float> small(static_cast<std::size_t>(Hq * 2));
  require_error(detail::emulate_cuda_paged_window_scores(q, f.layer(), value_of(make_matrix_view(small.data(), Hq, 2)),
                                                         true, {}, &bad),
                errc::shape_mismatch, "out has 2 columns, fewer than the window's 3");
  const auto q_wrong = value_of(make_kv_view<const float>(qdata.data(), Hq - 1, w, d));
  require_error(detail::emulate_cuda_paged_window_scores(q_wrong, f.layer(), value_of(make_matrix_view(good.data(), Hq - 1, C)),
                                                         false, {}, &bad),
                errc::shape_mismatch, "not sequences (3) x a multiple of 2 KV heads");
}
