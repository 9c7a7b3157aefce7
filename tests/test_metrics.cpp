#include "support.hpp"

#include <kvevict/metrics.hpp>
#include <kvevict/numeric.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <limits>
#include <numeric>
#include <set>
#include <vector>

using namespace kvevict;
using kvtest::require_error;
using kvtest::value_of;

namespace {

constexpr float nan_f = std::numeric_limits<float>::quiet_NaN();
constexpr float inf_f = std::numeric_limits<float>::infinity();

/// Runs a two-phase call: size query, then the real call with exactly the queried bytes.
template <class F>
status two_phase(F&& f) {
  workspace ws;
  const status q = f(ws);
  if (!q.ok()) return q;
  std::vector<unsigned char> buf;
  ws = kvtest::shifted_workspace(buf, ws.bytes);
  return f(ws);
}

// ------------------------------------------------------------------------------------------------
// Footprint: naive references
// ------------------------------------------------------------------------------------------------

struct naive_usage {
  std::int64_t resident = 0, full = 0, peak = 0;
  index_t peak_query = 0;
};

/// By definition: at query i, key j is resident iff j <= i < end(j); summed over the given rows.
naive_usage naive_kv_usage(const std::vector<pos_t>& buf, index_t H, index_t C, index_t N,
                           const std::vector<std::pair<index_t, index_t>>& rows) {
  naive_usage u;
  u.peak = -1;
  for (index_t i = 0; i < N; ++i) {
    std::int64_t now = 0;
    for (auto [l, h] : rows)
      for (index_t j = 0; j <= i; ++j) {
        const pos_t e = buf[static_cast<std::size_t>((l * H + h) * C + j)];
        const index_t end = e == never_evicted ? N : e;
        if (i < end) ++now;
      }
    u.resident += now;
    u.full += static_cast<std::int64_t>(rows.size()) * (i + 1);
    if (now > u.peak) {
      u.peak = now;
      u.peak_query = i;
    }
  }
  return u;
}

kv_usage measure(eviction_schedule s) {
  kv_usage u;
  REQUIRE(two_phase([&](workspace& ws) { return measure_kv_usage(ws, s, u); }).ok());
  return u;
}
kv_usage measure(eviction_schedule s, index_t layer) {
  kv_usage u;
  REQUIRE(two_phase([&](workspace& ws) { return measure_kv_usage(ws, s, layer, u); }).ok());
  return u;
}
kv_usage measure(eviction_schedule s, index_t layer, index_t head) {
  kv_usage u;
  REQUIRE(two_phase([&](workspace& ws) { return measure_kv_usage(ws, s, layer, head, u); }).ok());
  return u;
}

void check_same(const kv_usage& u, const naive_usage& n) {
  CHECK(u.resident == n.resident);
  CHECK(u.full == n.full);
  CHECK(u.peak == n.peak);
  CHECK(u.peak_query == n.peak_query);
}

/// Closed form of StreamingLLM (derivation in docs/metrics.md): Σ_i min(i+1, s+w).
std::int64_t streaming_closed_form(std::int64_t N, std::int64_t s, std::int64_t w) {
  const std::int64_t sinks = std::min(s, N);
  const std::int64_t m = N - sinks;  // keys that can be evicted
  const std::int64_t sink_part = sinks * N - sinks * (sinks - 1) / 2;
  const std::int64_t rest = w >= m ? m * (m + 1) / 2 : w * (w + 1) / 2 + (m - w) * w;
  return sink_part + rest;
}

/// The same, derived per query: query i sees min(i+1, c) keys with c = s + w.
std::int64_t streaming_closed_form_by_query(std::int64_t N, std::int64_t s, std::int64_t w) {
  const std::int64_t c = s + w;
  return c >= N ? N * (N + 1) / 2 : c * (c + 1) / 2 + (N - c) * c;
}

/// Closed form of post-fill eviction: prompt P, budget B kept after the prefill, G decode tokens.
std::int64_t post_fill_closed_form(std::int64_t P, std::int64_t B, std::int64_t G) {
  return P * (P + 1) / 2 + G * B + G * (G + 1) / 2;
}

std::vector<pos_t> random_subset(std::mt19937_64& g, const std::vector<pos_t>& from, std::size_t k) {
  std::vector<pos_t> v = from;
  std::shuffle(v.begin(), v.end(), g);
  v.resize(k);
  std::sort(v.begin(), v.end());
  return v;
}

}  // namespace

TEST_CASE("footprint: the paper's Figure 1 example is 26/36 = 72.2%") {
  // The figure's image is not in our copy of the paper; the text gives N = 8 (36 = 8·9/2 causal
  // entries) and 26 un-evicted ones. A streaming head with 1 sink and a window of 3 recent keys
  // sees 1, 2, 3, 4, 4, 4, 4, 4 keys at queries 0..7: 26 entries.
  std::vector<pos_t> buf(8);
  auto rec = value_of(make_eviction_recorder(buf.data(), 1, 1, 8));
  REQUIRE(rec.set_streaming(0, 0, 8, 1, 3).ok());
  const kv_usage u = measure(value_of(rec.schedule(8)));
  CHECK(u.resident == 26);
  CHECK(u.full == 36);
  CHECK(u.footprint() == 26.0 / 36.0);
  CHECK(std::round(u.footprint() * 1000) / 10 == 72.2);
  CHECK(u.peak == 4);
  CHECK(u.peak_kv() == 0.5);
  CHECK(u.peak_query == 3);

  // the same schedule recorded step by step, as a decode-time driver would
  std::vector<pos_t> buf2(8);
  auto rec2 = value_of(make_eviction_recorder(buf2.data(), 1, 1, 8));
  for (pos_t step = 1; step <= 8; ++step) {
    const pos_t leaving = step - 3;  // the key leaving the 3-key window after `step` tokens
    if (leaving >= 1 && step < 8) REQUIRE(rec2.mark_evicted(0, 0, &leaving, 1, step).ok());
  }
  CHECK(buf2 == buf);
  // and by retain_only with the window each step (sink 0 + the last 2 keys survive)
  std::vector<pos_t> buf3(8);
  auto rec3 = value_of(make_eviction_recorder(buf3.data(), 1, 1, 8));
  for (pos_t step = 3; step < 8; ++step) {
    const pos_t keep[3] = {0, static_cast<pos_t>(step - 2), static_cast<pos_t>(step - 1)};
    REQUIRE(rec3.retain_only(0, 0, keep, 3, step).ok());
  }
  CHECK(buf3 == buf);
}

TEST_CASE("footprint: full attention is 100% footprint and 100% peak") {
  auto g = kvtest::rng(101);
  for (int trial = 0; trial < 50; ++trial) {
    const index_t L = kvtest::uniform_int(g, 1, 4), H = kvtest::uniform_int(g, 1, 4), N = kvtest::uniform_int(g, 1, 300);
    std::vector<pos_t> buf(static_cast<std::size_t>(L * H * N));
    auto rec = value_of(make_eviction_recorder(buf.data(), L, H, N));
    // fresh recorders are all never_evicted; also write some entries as N (the other spelling)
    for (std::size_t i = 0; i < buf.size(); i += 3) buf[i] = static_cast<pos_t>(N);
    for (std::size_t i = 0; i < buf.size(); i += 6) buf[i] = never_evicted;
    const auto s = value_of(rec.schedule(N));
    const kv_usage u = measure(s);
    CHECK(u.footprint() == 1.0);
    CHECK(u.peak_kv() == 1.0);
    CHECK(u.resident == L * H * N * (N + 1) / 2);
    CHECK(u.peak_query == N - 1);
    CHECK(measure(s, L - 1).footprint() == 1.0);
    CHECK(measure(s, 0, H - 1).peak_kv() == 1.0);
    REQUIRE(rec.set_full(0, 0).ok());
    CHECK(measure(s, 0, 0).footprint() == 1.0);
  }
}

TEST_CASE("footprint: StreamingLLM matches its closed form exactly") {
  for (index_t N = 1; N <= 70; ++N) {
    std::vector<pos_t> buf(static_cast<std::size_t>(N) + 5);
    auto rec = value_of(make_eviction_recorder(buf.data(), 1, 1, N + 5));
    for (index_t s = 0; s <= N + 1; ++s)
      for (index_t w = 1; w <= N + 1; ++w) {
        CAPTURE(N);
        CAPTURE(s);
        CAPTURE(w);
        REQUIRE(rec.set_streaming(0, 0, N, s, w).ok());
        const kv_usage u = measure(value_of(rec.schedule(N)));
        REQUIRE(u.resident == streaming_closed_form(N, s, w));
        REQUIRE(u.resident == streaming_closed_form_by_query(N, s, w));
        REQUIRE(u.full == N * (N + 1) / 2);
        REQUIRE(u.peak == std::min(N, s + w));
        if (N <= 20) check_same(u, naive_kv_usage(buf, 1, N + 5, N, {{0, 0}}));
      }
  }
  // a long sequence: 128 sinks + 1024 recent over 32K tokens, as in the paper's DuoAttention setup
  const index_t N = 32768;
  std::vector<pos_t> buf(static_cast<std::size_t>(N));
  auto rec = value_of(make_eviction_recorder(buf.data(), 1, 1, N));
  REQUIRE(rec.set_streaming(0, 0, N, 128, 1024).ok());
  const kv_usage u = measure(value_of(rec.schedule(N)));
  CHECK(u.resident == streaming_closed_form(N, 128, 1024));
  std::printf("streaming 128 sinks + 1024 recent over %lld tokens: footprint %.4f%%, peak %.4f%%\n",
              static_cast<long long>(N), 100 * u.footprint(), 100 * u.peak_kv());
}

TEST_CASE("footprint: post-fill eviction matches its closed form exactly") {
  auto g = kvtest::rng(202);
  for (int trial = 0; trial < 400; ++trial) {
    const index_t P = kvtest::uniform_int(g, 1, 60), B = kvtest::uniform_int(g, 0, P), G = kvtest::uniform_int(g, 0, 40);
    const index_t N = P + G;
    CAPTURE(P);
    CAPTURE(B);
    CAPTURE(G);
    std::vector<pos_t> prompt(static_cast<std::size_t>(P));
    std::iota(prompt.begin(), prompt.end(), 0);
    const auto kept = random_subset(g, prompt, static_cast<std::size_t>(B));
    std::vector<pos_t> buf(static_cast<std::size_t>(2 * N));
    auto rec = value_of(make_eviction_recorder(buf.data(), 2, 1, N));
    REQUIRE(rec.set_post_fill(0, 0, P, kept.data(), B).ok());
    // the same through the driver-side API: full attention, then retain_only at step P
    REQUIRE(rec.retain_only(1, 0, kept.data(), B, P).ok());
    const auto s = value_of(rec.schedule(N));
    const kv_usage u = measure(s, 0, 0);
    REQUIRE(u.resident == post_fill_closed_form(P, B, G));
    REQUIRE(u.peak == std::max(P, B + G));
    // equivalently: full attention minus the G(P - B) entries the evicted prompt keys would have used
    REQUIRE(u.full - u.resident == G * (P - B));
    check_same(measure(s, 1, 0), naive_kv_usage(buf, 1, N, N, {{1, 0}}));
    CHECK(measure(s, 1, 0).resident == u.resident);
  }
}

TEST_CASE("footprint: random schedules match the definition per head, per layer and overall") {
  auto g = kvtest::rng(303);
  for (int trial = 0; trial < 200; ++trial) {
    const index_t L = kvtest::uniform_int(g, 1, 3), H = kvtest::uniform_int(g, 1, 3), N = kvtest::uniform_int(g, 1, 40);
    const index_t C = N + kvtest::uniform_int(g, 0, 3);
    CAPTURE(trial);
    std::vector<pos_t> buf(static_cast<std::size_t>(L * H * C));
    auto rec = value_of(make_eviction_recorder(buf.data(), L, H, C));
    for (index_t l = 0; l < L; ++l)
      for (index_t h = 0; h < H; ++h)
        for (index_t j = 0; j < N; ++j) {
          const auto r = kvtest::uniform_int(g, 0, 9);
          buf[static_cast<std::size_t>((l * H + h) * C + j)] =
              r == 0 ? never_evicted : static_cast<pos_t>(kvtest::uniform_int(g, j + 1, N));
        }
    const auto s = value_of(rec.schedule(N));
    std::vector<std::pair<index_t, index_t>> all;
    for (index_t l = 0; l < L; ++l) {
      std::vector<std::pair<index_t, index_t>> layer;
      for (index_t h = 0; h < H; ++h) {
        layer.push_back({l, h});
        all.push_back({l, h});
        check_same(measure(s, l, h), naive_kv_usage(buf, H, C, N, {{l, h}}));
      }
      check_same(measure(s, l), naive_kv_usage(buf, H, C, N, layer));
    }
    const kv_usage u = measure(s);
    check_same(u, naive_kv_usage(buf, H, C, N, all));
    // overall footprint = mean of the per-head footprints (shared denominator)
    double mean = 0;
    for (auto [l, h] : all) mean += measure(s, l, h).footprint();
    CHECK(u.footprint() == doctest::Approx(mean / static_cast<double>(all.size())).epsilon(1e-12));
    CHECK(u.rows == L * H);
    CHECK(u.tokens == N);
  }
}

TEST_CASE("footprint: a chunked-prefill + decode driver recorded with retain_only matches a set simulation") {
  auto g = kvtest::rng(404);
  for (int trial = 0; trial < 60; ++trial) {
    const index_t L = kvtest::uniform_int(g, 1, 2), H = kvtest::uniform_int(g, 1, 3);
    const index_t P = kvtest::uniform_int(g, 1, 50), G = kvtest::uniform_int(g, 0, 20), N = P + G;
    const index_t chunk = kvtest::uniform_int(g, 1, 16), budget = kvtest::uniform_int(g, 1, 12);
    const int api = trial % 3;  // per-head pointers, ragged lists, dense matrix
    CAPTURE(trial);
    std::vector<pos_t> buf(static_cast<std::size_t>(L * H * N));
    auto rec = value_of(make_eviction_recorder(buf.data(), L, H, N));
    // the simulation: resident sets per (layer, head), and the count each query sees
    std::vector<std::set<pos_t>> live(static_cast<std::size_t>(L * H));
    std::int64_t resident = 0;
    std::vector<std::int64_t> at(static_cast<std::size_t>(N), 0);
    auto evict_to_budget = [&](index_t step) {
      // pick `budget` survivors per head (dense API needs equal counts: min(budget, |live|) is equal
      // across heads because every head holds the same number of keys in this driver)
      for (index_t l = 0; l < L; ++l) {
        std::vector<std::vector<pos_t>> keep(static_cast<std::size_t>(H));
        for (index_t h = 0; h < H; ++h) {
          auto& s = live[static_cast<std::size_t>(l * H + h)];
          const std::vector<pos_t> cur(s.begin(), s.end());
          keep[h] = random_subset(g, cur, std::min<std::size_t>(cur.size(), static_cast<std::size_t>(budget)));
          s = std::set<pos_t>(keep[h].begin(), keep[h].end());
        }
        if (api == 0) {
          for (index_t h = 0; h < H; ++h)
            REQUIRE(rec.retain_only(l, h, keep[h].data(), static_cast<index_t>(keep[h].size()), step).ok());
        } else if (api == 1) {
          std::vector<pos_t> flat;
          std::vector<std::int32_t> cu{0};
          for (auto& k : keep) {
            flat.insert(flat.end(), k.begin(), k.end());
            cu.push_back(static_cast<std::int32_t>(flat.size()));
          }
          REQUIRE(rec.retain_only(l, ragged_positions{flat.data(), cu.data(), H}, step).ok());
        } else {
          const index_t k = static_cast<index_t>(keep[0].size());
          std::vector<pos_t> dense;
          for (auto& kk : keep) {
            REQUIRE(static_cast<index_t>(kk.size()) == k);
            dense.insert(dense.end(), kk.begin(), kk.end());
          }
          dense.push_back(0);  // never read; keeps data() non-null when k = 0
          REQUIRE(rec.retain_only(l, value_of(make_matrix_view<const pos_t>(dense.data(), H, k)), step).ok());
        }
      }
    };
    for (index_t c0 = 0; c0 < P; c0 += chunk) {
      const index_t c1 = std::min(P, c0 + chunk);
      for (index_t i = c0; i < c1; ++i) {
        for (auto& s : live) s.insert(static_cast<pos_t>(i));
        for (auto& s : live) at[i] += static_cast<std::int64_t>(s.size());
      }
      evict_to_budget(c1);
    }
    for (index_t i = P; i < N; ++i) {
      for (auto& s : live) s.insert(static_cast<pos_t>(i));
      for (auto& s : live) at[i] += static_cast<std::int64_t>(s.size());
      if (i + 1 < N) evict_to_budget(i + 1);
    }
    for (auto x : at) resident += x;
    const kv_usage u = measure(value_of(rec.schedule(N)));
    CHECK(u.resident == resident);
    CHECK(u.peak == *std::max_element(at.begin(), at.end()));
    CHECK(u.footprint() < 1.0 + 1e-15);
  }
}

TEST_CASE("footprint: workspace protocol and mark_evicted semantics") {
  std::vector<pos_t> buf(2 * 3 * 10);
  auto rec = value_of(make_eviction_recorder(buf.data(), 2, 3, 10));
  CHECK(rec.layers() == 2);
  CHECK(rec.heads() == 3);
  CHECK(rec.capacity() == 10);
  const auto s = value_of(rec.schedule(10));
  workspace ws;
  kv_usage u;
  u.resident = -5;
  REQUIRE(measure_kv_usage(ws, s, u).ok());
  CHECK(ws.bytes >= 10 * sizeof(std::int64_t));
  CHECK(u.resident == -5);  // a query does no work
  std::vector<unsigned char> small(ws.bytes - 1);
  workspace tiny{small.data(), small.size()};
  require_error(measure_kv_usage(tiny, s, u), errc::workspace_too_small, "measure_kv_usage: workspace has");

  // duplicates at the same step are harmless; a second eviction at another step is an error
  const pos_t p[3] = {2, 4, 2};
  REQUIRE(rec.mark_evicted(1, 2, p, 3, 6).ok());
  REQUIRE(rec.mark_evicted(1, 2, p, 1, 6).ok());
  CHECK(buf[(1 * 3 + 2) * 10 + 2] == 6);
  CHECK(buf[(1 * 3 + 2) * 10 + 4] == 6);
  require_error(rec.mark_evicted(1, 2, p, 1, 7), errc::invalid_argument, "key 2 of layer 1 head 2 was already evicted at step 6");
  // ragged form: evicts per head, all-or-nothing
  const pos_t flat[3] = {0, 1, 9};
  const std::int32_t cu[4] = {0, 1, 2, 3};
  const auto before = buf;
  require_error(rec.mark_evicted(0, ragged_positions{flat, cu, 3}, 9), errc::out_of_range,
                "position 9 of layer 0 head 2 is outside [0, 9)");
  CHECK(buf == before);
  REQUIRE(rec.mark_evicted(0, ragged_positions{flat, cu, 3}, 10).ok());
  CHECK(buf[0] == 10);
  CHECK(buf[10 + 1] == 10);
  CHECK(buf[20 + 9] == 10);
  const kv_usage total = measure(s);
  // keys 2 and 4 of (1, 2) leave after 6 of 10 steps (4 queries each lost); evictions at step 10 cost nothing
  CHECK(total.resident == 6 * 55 - (10 - 6) - (10 - 6));
}

TEST_CASE("footprint: bad schedules and recorder misuse give specific errors") {
  std::vector<pos_t> buf(2 * 2 * 6);
  auto rec = value_of(make_eviction_recorder(buf.data(), 2, 2, 6));
  auto s = value_of(rec.schedule(6));
  kv_usage u;
  auto run = [&](eviction_schedule sch) { return two_phase([&](workspace& ws) { return measure_kv_usage(ws, sch, u); }); };

  buf[(1 * 2 + 0) * 6 + 3] = 3;  // evicted when created
  u.resident = -7;
  require_error(run(s), errc::out_of_range, "before the key was created");
  CHECK(u.resident == -7);  // nothing written on failure
  require_error(run(s), errc::out_of_range, "evicted_at[1][0][3] = 3 is before the key was created (it must be > 3)");
  buf[(1 * 2 + 0) * 6 + 3] = -1;
  require_error(run(s), errc::out_of_range, "evicted_at[1][0][3] = -1 is before the key was created");
  buf[(1 * 2 + 0) * 6 + 3] = 7;
  require_error(run(s), errc::out_of_range, "evicted_at[1][0][3] = 7 is past the end of the sequence (6 tokens");
  // the prefix view of 4 tokens rejects an eviction at step 5
  buf[(1 * 2 + 0) * 6 + 3] = 5;
  REQUIRE(run(s).ok());
  require_error(run(value_of(rec.schedule(4))), errc::out_of_range, "= 5 is past the end of the sequence (4 tokens");
  buf[(1 * 2 + 0) * 6 + 3] = never_evicted;

  require_error(two_phase([&](workspace& ws) { return measure_kv_usage(ws, s, 2, u); }), errc::out_of_range,
                "layer 2 is outside [0, 2)");
  require_error(two_phase([&](workspace& ws) { return measure_kv_usage(ws, s, 0, -1, u); }), errc::out_of_range,
                "head -1 is outside [0, 2)");
  require_error(run(eviction_schedule(buf.data(), cuda::std::layout_stride::mapping<cuda::std::dextents<index_t, 3>>(
                                                      cuda::std::dextents<index_t, 3>(0, 2, 6),
                                                      cuda::std::array<index_t, 3>{12, 6, 1}))),
                errc::invalid_argument, "no (layer, head) rows");
  require_error(run(eviction_schedule(buf.data(), cuda::std::layout_stride::mapping<cuda::std::dextents<index_t, 3>>(
                                                      cuda::std::dextents<index_t, 3>(2, 2, 0),
                                                      cuda::std::array<index_t, 3>{12, 6, 1}))),
                errc::invalid_argument, "covers no tokens");
  require_error(run(eviction_schedule(buf.data(), cuda::std::layout_stride::mapping<cuda::std::dextents<index_t, 3>>(
                                                      cuda::std::dextents<index_t, 3>(2, 2, 6),
                                                      cuda::std::array<index_t, 3>{12, 3, 1}))),
                errc::overlap, "alias");

  // recorder
  require_error(rec.schedule(0).error(), errc::out_of_range, "0 tokens is outside [1, 6]");
  require_error(rec.schedule(7).error(), errc::out_of_range, "7 tokens is outside [1, 6]");
  const pos_t p[2] = {1, 3};
  require_error(rec.mark_evicted(2, 0, p, 2, 4), errc::out_of_range, "layer 2 is outside [0, 2)");
  require_error(rec.mark_evicted(0, 2, p, 2, 4), errc::out_of_range, "head 2 is outside [0, 2)");
  require_error(rec.mark_evicted(0, 0, p, 2, 0), errc::out_of_range, "step 0 is outside [1, 6]");
  require_error(rec.mark_evicted(0, 0, p, 2, 7), errc::out_of_range, "step 7 is outside [1, 6]");
  require_error(rec.mark_evicted(0, 0, p, 2, 3), errc::out_of_range, "position 3 of layer 0 head 0 is outside [0, 3)");
  require_error(rec.mark_evicted(0, 0, nullptr, 2, 3), errc::null_pointer, "positions are null");
  require_error(rec.mark_evicted(0, 0, p, -1, 3), errc::invalid_argument, "negative position count");
  const pos_t unsorted[2] = {3, 1};
  require_error(rec.retain_only(0, 0, unsorted, 2, 5), errc::not_sorted, "strictly ascending");
  REQUIRE(rec.mark_evicted(0, 0, p, 1, 2).ok());  // key 1 leaves at step 2
  require_error(rec.retain_only(0, 0, p, 2, 5), errc::invalid_argument, "kept key 1 of layer 0 head 0 is not resident (evicted at step 2)");
  const pos_t flat[2] = {0, 1};
  const std::int32_t cu3[4] = {0, 1, 2, 2};
  require_error(rec.retain_only(0, ragged_positions{flat, cu3, 3}, 4), errc::shape_mismatch, "3 heads, the recorder 2");
  const std::int32_t bad_cu[3] = {0, 2, 1};
  require_error(rec.retain_only(0, ragged_positions{flat, bad_cu, 2}, 4), errc::invalid_argument, "decreases");
  const pos_t dense[2] = {0, 2};
  require_error(rec.retain_only(0, value_of(make_matrix_view(dense, 1, 2)), 4), errc::shape_mismatch,
                "kept has 1 heads, the recorder 2");
  require_error(rec.set_streaming(0, 0, 6, -1, 2), errc::invalid_argument, "n_sink must be >= 0");
  require_error(rec.set_streaming(0, 0, 6, 1, 0), errc::invalid_argument, "recent must be >= 1");
  require_error(rec.set_streaming(0, 0, 7, 1, 2), errc::out_of_range, "7 tokens is outside [1, 6]");
  require_error(rec.set_post_fill(0, 0, 3, p, 2), errc::out_of_range, "position 3 of layer 0 head 0 is outside [0, 3)");
  require_error(rec.set_post_fill(0, 0, 5, unsorted, 2), errc::not_sorted, "strictly ascending; 1 follows 3");
  require_error(rec.set_full(0, 5), errc::out_of_range, "head 5 is outside [0, 2)");
  require_error(make_eviction_recorder(buf.data(), 0, 2, 6).error(), errc::invalid_argument, "must be positive");
  require_error(make_eviction_recorder(nullptr, 1, 2, 6).error(), errc::null_pointer, "data is null");
}

// ------------------------------------------------------------------------------------------------
// Critical footprint
// ------------------------------------------------------------------------------------------------

namespace {

/// Reference: explicit sort, merge equal footprints (best performance), then the rule.
critical_footprint_result naive_critical(std::vector<curve_point> pts, double p_full, double F, crossing_rule rule) {
  std::sort(pts.begin(), pts.end(), [](const curve_point& a, const curve_point& b) { return a.footprint < b.footprint; });
  std::vector<curve_point> m;
  for (const auto& p : pts) {
    if (!m.empty() && m.back().footprint == p.footprint) m.back().performance = std::max(m.back().performance, p.performance);
    else m.push_back(p);
  }
  const double tau = F * p_full;
  critical_footprint_result r;
  r.threshold = tau;
  auto interp = [&](std::size_t lo, std::size_t hi) {
    const double t = (tau - m[lo].performance) / (m[hi].performance - m[lo].performance);
    r.footprint = t >= 1 ? m[hi].footprint : m[lo].footprint + t * (m[hi].footprint - m[lo].footprint);
    r.kind = critical_kind::interpolated;
  };
  if (rule == crossing_rule::first_reach) {
    std::size_t k = 0;
    while (k < m.size() && m[k].performance < tau) ++k;
    if (k == m.size()) r = {m.back().footprint, tau, critical_kind::above_max};
    else if (k == 0) r = {m.front().footprint, tau, critical_kind::at_or_below_min};
    else interp(k - 1, k);
  } else {
    std::ptrdiff_t k = static_cast<std::ptrdiff_t>(m.size()) - 1;
    while (k >= 0 && m[static_cast<std::size_t>(k)].performance >= tau) --k;
    if (k == static_cast<std::ptrdiff_t>(m.size()) - 1) r = {m.back().footprint, tau, critical_kind::above_max};
    else if (k < 0) r = {m.front().footprint, tau, critical_kind::at_or_below_min};
    else interp(static_cast<std::size_t>(k), static_cast<std::size_t>(k) + 1);
  }
  return r;
}

critical_footprint_result crit(const std::vector<curve_point>& pts, double p_full, critical_footprint_options opt = {}) {
  critical_footprint_result r;
  REQUIRE(critical_footprint(pts.data(), static_cast<index_t>(pts.size()), p_full, r, opt).ok());
  return r;
}

}  // namespace

TEST_CASE("critical footprint: hand-computed curves") {
  const critical_footprint_options f75{0.75, crossing_rule::first_reach};
  // threshold 0.75 is crossed between (30, 0.625) and (40, 0.875): halfway -> 35 (exact in binary)
  const std::vector<curve_point> mono = {{10, 0.25}, {20, 0.5}, {30, 0.625}, {40, 0.875}, {50, 1.0}};
  auto r = crit(mono, 1.0, f75);
  CHECK(r.kind == critical_kind::interpolated);
  CHECK(r.footprint == 35.0);
  CHECK(r.threshold == 0.75);
  // input order does not matter
  const std::vector<curve_point> shuffled = {{40, 0.875}, {10, 0.25}, {50, 1.0}, {30, 0.625}, {20, 0.5}};
  CHECK(crit(shuffled, 1.0, f75).footprint == 35.0);
  // the default F = 0.9 with p_full = 50 (percent scores): threshold 45 between (20, 40) and (30, 60)
  r = crit({{30, 60}, {20, 40}, {10, 10}}, 50.0);
  CHECK(r.threshold == doctest::Approx(45.0));
  CHECK(r.footprint == doctest::Approx(22.5).epsilon(1e-12));
  // a point exactly at the threshold is the answer, exactly
  r = crit({{10, 0.5}, {25.3, 0.75}, {40, 1.0}}, 1.0, f75);
  CHECK(r.footprint == 25.3);
  CHECK(r.kind == critical_kind::interpolated);
  // every point meets the threshold: at or below the smallest footprint ("< x" in the paper's table)
  r = crit({{34, 0.95}, {60, 0.99}}, 1.0);
  CHECK(r.kind == critical_kind::at_or_below_min);
  CHECK(r.footprint == 34);
  // no point meets it: above the largest ("> x")
  r = crit({{50, 0.2}, {93, 0.8}, {70, 0.5}}, 1.0);
  CHECK(r.kind == critical_kind::above_max);
  CHECK(r.footprint == 93);
  // a single point
  CHECK(crit({{42, 1.0}}, 1.0).kind == critical_kind::at_or_below_min);
  CHECK(crit({{42, 0.1}}, 1.0).kind == critical_kind::above_max);

  // non-monotone: reaches at 10, dips, recovers at 40
  const std::vector<curve_point> bumpy = {{10, 0.875}, {20, 0.25}, {30, 0.5}, {40, 1.0}};
  r = crit(bumpy, 1.0, f75);
  CHECK(r.kind == critical_kind::at_or_below_min);
  CHECK(r.footprint == 10);
  r = crit(bumpy, 1.0, {0.75, crossing_rule::stays_above});
  CHECK(r.kind == critical_kind::interpolated);
  CHECK(r.footprint == 35.0);  // between (30, 0.5) and (40, 1.0)
  // stays_above with a final dip: never stays above
  r = crit({{10, 1.0}, {20, 1.0}, {30, 0.5}}, 1.0, {0.75, crossing_rule::stays_above});
  CHECK(r.kind == critical_kind::above_max);
  CHECK(r.footprint == 30);
  r = crit({{10, 0.875}, {20, 1.0}}, 1.0, {0.75, crossing_rule::stays_above});
  CHECK(r.kind == critical_kind::at_or_below_min);

  // equal footprints count once, with their best performance
  r = crit({{10, 0.5}, {20, 0.25}, {20, 1.0}, {30, 1.0}}, 1.0, f75);
  CHECK(r.footprint == 15.0);  // (10, 0.5) -> (20, 1.0)
  r = crit({{10, 0.5}, {20, 0.25}, {20, 1.0}, {30, 0.25}, {30, 0.5}, {40, 1.0}}, 1.0, {0.75, crossing_rule::stays_above});
  CHECK(r.footprint == 35.0);  // last footprint below: 30 (best 0.5)
}

TEST_CASE("critical footprint: random curves match a sort-based reference") {
  auto g = kvtest::rng(505);
  for (int trial = 0; trial < 3000; ++trial) {
    const auto n = kvtest::uniform_int(g, 1, 12);
    std::vector<curve_point> pts;
    for (index_t i = 0; i < n; ++i)  // coarse grids make duplicates and exact hits common
      pts.push_back({static_cast<double>(kvtest::uniform_int(g, 0, 10)) * 10,
                     static_cast<double>(kvtest::uniform_int(g, 0, 16)) / 16});
    const double F = trial % 2 ? 0.9 : 0.75;
    for (auto rule : {crossing_rule::first_reach, crossing_rule::stays_above}) {
      CAPTURE(trial);
      const auto want = naive_critical(pts, 1.0, F, rule);
      const auto got = crit(pts, 1.0, {F, rule});
      CHECK(got.kind == want.kind);
      CHECK(got.footprint == want.footprint);
      CHECK(got.threshold == want.threshold);
    }
  }
}

TEST_CASE("critical footprint: errors") {
  critical_footprint_result r;
  const std::vector<curve_point> ok = {{10, 0.5}, {20, 1.0}};
  require_error(critical_footprint(ok.data(), 0, 1.0, r), errc::invalid_argument, "critical_footprint: the curve is empty");
  require_error(critical_footprint(nullptr, 2, 1.0, r), errc::null_pointer, "points are null");
  std::vector<curve_point> bad = ok;
  bad[1].footprint = std::nan("");
  require_error(critical_footprint(bad.data(), 2, 1.0, r), errc::invalid_argument, "points[1].footprint = nan");
  bad[1].footprint = -1;
  require_error(critical_footprint(bad.data(), 2, 1.0, r), errc::invalid_argument, "points[1].footprint = -1");
  bad = ok;
  bad[0].performance = std::nan("");
  require_error(critical_footprint(bad.data(), 2, 1.0, r), errc::invalid_argument, "points[0].performance = nan is not finite");
  bad[0].performance = std::numeric_limits<double>::infinity();
  require_error(critical_footprint(bad.data(), 2, 1.0, r), errc::invalid_argument, "points[0].performance = inf");
  require_error(critical_footprint(ok.data(), 2, std::nan(""), r), errc::invalid_argument, "full_performance must be finite and > 0");
  require_error(critical_footprint(ok.data(), 2, 0.0, r), errc::invalid_argument, "full_performance must be finite and > 0 (got 0)");
  require_error(critical_footprint(ok.data(), 2, 1.0, r, {0.0}), errc::invalid_argument, "fraction must be in (0, 1]");
  require_error(critical_footprint(ok.data(), 2, 1.0, r, {1.5}), errc::invalid_argument, "fraction must be in (0, 1] (got 1.5)");
  require_error(critical_footprint(ok.data(), 2, 1.0, r, {std::nan("")}), errc::invalid_argument, "fraction");
  require_error(critical_footprint(ok.data(), 2, 1.0, r, {0.9, static_cast<crossing_rule>(7)}), errc::invalid_argument,
                "unknown crossing rule 7");
}

// ------------------------------------------------------------------------------------------------
// Ranking
// ------------------------------------------------------------------------------------------------

namespace {

/// The library's order, restated for the reference: is (a, i) ranked before (b, j)?
bool naive_before(float a, index_t i, float b, index_t j) {
  if (std::isnan(a) || std::isnan(b)) {
    if (std::isnan(a) && std::isnan(b)) return i < j;
    return std::isnan(b);
  }
  if (a > b) return true;
  if (a < b) return false;
  return i < j;
}

/// Top-k by counting, O(T²): j is in the top k iff fewer than k positions rank before it.
std::vector<bool> naive_top_k(const std::vector<float>& row, index_t k) {
  const index_t T = static_cast<index_t>(row.size());
  std::vector<bool> in(static_cast<std::size_t>(T));
  for (index_t j = 0; j < T; ++j) {
    index_t before = 0;
    for (index_t i = 0; i < T; ++i) before += i != j && naive_before(row[i], i, row[j], j);
    in[j] = before < k;
  }
  return in;
}

std::vector<float> tie_heavy_row(std::mt19937_64& g, index_t T, bool specials) {
  std::vector<float> v(static_cast<std::size_t>(T));
  for (auto& x : v) {
    const auto r = kvtest::uniform_int(g, 0, 19);
    if (specials && r == 0) x = nan_f;
    else if (specials && r == 1) x = inf_f;
    else if (specials && r == 2) x = -inf_f;
    else if (r == 3) x = -0.0f;
    else if (r == 4) x = 0.0f;
    else x = static_cast<float>(kvtest::uniform_int(g, -4, 4)) * 0.5f;
  }
  return v;
}

/// Kendall τ-b by its definition, O(n²).
double naive_tau_b(const std::vector<float>& x, const std::vector<float>& y) {
  std::int64_t nc = 0, nd = 0, tx = 0, ty = 0;
  const std::size_t n = x.size();
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = i + 1; j < n; ++j) {
      const int sx = (x[i] < x[j]) - (x[i] > x[j]), sy = (y[i] < y[j]) - (y[i] > y[j]);
      if (sx == 0) ++tx;
      if (sy == 0) ++ty;
      if (sx * sy > 0) ++nc;
      if (sx * sy < 0) ++nd;
    }
  const std::int64_t n0 = static_cast<std::int64_t>(n * (n - 1) / 2);
  return static_cast<double>(nc - nd) / std::sqrt(static_cast<double>(n0 - tx) * static_cast<double>(n0 - ty));
}

}  // namespace

TEST_CASE("recall@k: hand-computed cases and the tie rule") {
  // est top-2: position 0 (0.9) and position 2 (0.5 ties with position 3: lower position wins)
  // truth top-2: positions 0 and 3 -> recall 1/2
  const std::vector<float> est = {0.9f, 0.1f, 0.5f, 0.5f};
  const std::vector<float> truth = {1.f, 0.f, 0.f, 1.f};
  double mean = -1;
  double rows[1] = {-1};
  const auto e = value_of(make_matrix_view(est.data(), 1, 4));
  const auto t = value_of(make_matrix_view(truth.data(), 1, 4));
  REQUIRE(two_phase([&](workspace& ws) { return recall_at_k(ws, e, t, 2, mean, rows); }).ok());
  CHECK(mean == 0.5);
  CHECK(rows[0] == 0.5);
  REQUIRE(two_phase([&](workspace& ws) { return recall_at_k(ws, e, t, 4, mean); }).ok());
  CHECK(mean == 1.0);
  // NaN estimates rank last, as select does: with k = 3 the NaN token is not picked
  const std::vector<float> est_nan = {nan_f, 0.f, -inf_f, 1.f};
  const std::vector<float> truth2 = {4.f, 3.f, 2.f, 1.f};
  const auto en = value_of(make_matrix_view(est_nan.data(), 1, 4));
  const auto t2 = value_of(make_matrix_view(truth2.data(), 1, 4));
  REQUIRE(two_phase([&](workspace& ws) { return recall_at_k(ws, en, t2, 3, mean); }).ok());
  CHECK(mean == 2.0 / 3.0);  // est picks {3, 1, 2}; truth {0, 1, 2}
  // kept sets: {0, 3} against truth2's top-2 {0, 1} -> 1/2; a larger kept set {0, 1, 3} -> 2/2
  const std::vector<pos_t> kept = {3, 0, 0, 1, 3};
  const std::vector<std::int32_t> cu = {0, 2, 5};
  const std::vector<float> truth22 = {4.f, 3.f, 2.f, 1.f, 4.f, 3.f, 2.f, 1.f};
  const auto t22 = value_of(make_matrix_view(truth22.data(), 2, 4));
  double per[2];
  REQUIRE(two_phase([&](workspace& ws) {
            return kept_recall_at_k(ws, ragged_positions{kept.data(), cu.data(), 2}, t22, 2, mean, per);
          }).ok());
  CHECK(per[0] == 0.5);
  CHECK(per[1] == 1.0);
  CHECK(mean == 0.75);
}

TEST_CASE("recall@k: random scores with ties, NaN and infinities match the O(T^2) reference") {
  auto g = kvtest::rng(606);
  for (int trial = 0; trial < 300; ++trial) {
    const index_t R = kvtest::uniform_int(g, 1, 4), T = kvtest::uniform_int(g, 1, 40), k = kvtest::uniform_int(g, 1, T);
    const index_t pad = kvtest::uniform_int(g, 0, 3);
    CAPTURE(trial);
    std::vector<float> est(static_cast<std::size_t>(R * (T + pad))), truth(static_cast<std::size_t>(R * T));
    std::vector<std::vector<float>> est_rows, truth_rows;
    for (index_t r = 0; r < R; ++r) {
      est_rows.push_back(tie_heavy_row(g, T, true));
      truth_rows.push_back(tie_heavy_row(g, T, false));
      std::copy(est_rows[r].begin(), est_rows[r].end(), est.begin() + r * (T + pad));
      std::copy(truth_rows[r].begin(), truth_rows[r].end(), truth.begin() + r * T);
    }
    const auto e = value_of(make_matrix_view(est.data(), R, T, T + pad));  // padded rows
    const auto t = value_of(make_matrix_view(truth.data(), R, T));
    std::vector<double> per(static_cast<std::size_t>(R));
    double mean = 0;
    REQUIRE(two_phase([&](workspace& ws) { return recall_at_k(ws, e, t, k, mean, per.data()); }).ok());
    // kept sets: the estimate's top-k as ragged lists (any order) and as a dense matrix
    std::vector<pos_t> flat, dense;
    std::vector<std::int32_t> cu{0};
    double want_mean = 0;
    for (index_t r = 0; r < R; ++r) {
      const auto te = naive_top_k(est_rows[r], k), tt = naive_top_k(truth_rows[r], k);
      index_t hits = 0;
      std::vector<pos_t> mine;
      for (index_t j = 0; j < T; ++j) {
        hits += te[j] && tt[j];
        if (te[j]) mine.push_back(static_cast<pos_t>(j));
      }
      REQUIRE(static_cast<index_t>(mine.size()) == k);
      CHECK(per[r] == static_cast<double>(hits) / static_cast<double>(k));
      want_mean += static_cast<double>(hits) / static_cast<double>(k);
      std::shuffle(mine.begin(), mine.end(), g);
      flat.insert(flat.end(), mine.begin(), mine.end());
      dense.insert(dense.end(), mine.begin(), mine.end());
      cu.push_back(static_cast<std::int32_t>(flat.size()));
    }
    CHECK(mean == doctest::Approx(want_mean / static_cast<double>(R)).epsilon(1e-15));
    std::vector<double> per2(static_cast<std::size_t>(R));
    double mean2 = 0;
    REQUIRE(two_phase([&](workspace& ws) {
              return kept_recall_at_k(ws, ragged_positions{flat.data(), cu.data(), R}, t, k, mean2, per2.data());
            }).ok());
    CHECK(per2 == per);
    CHECK(mean2 == mean);
    REQUIRE(two_phase([&](workspace& ws) {
              return kept_recall_at_k(ws, value_of(make_matrix_view<const pos_t>(dense.data(), R, k)), t, k, mean2,
                                      per2.data());
            }).ok());
    CHECK(per2 == per);
  }
}

TEST_CASE("Kendall tau-b: hand-computed values, +-1, and the O(n^2) reference with heavy ties") {
  auto tau = [](const std::vector<float>& x, const std::vector<float>& y) {
    const auto a = value_of(make_matrix_view(x.data(), 1, static_cast<index_t>(x.size())));
    const auto b = value_of(make_matrix_view(y.data(), 1, static_cast<index_t>(y.size())));
    double t = 0;
    REQUIRE(two_phase([&](workspace& ws) { return kendall_tau_b(ws, a, b, t); }).ok());
    return t;
  };
  CHECK(tau({1, 2, 3, 4}, {1, 3, 2, 4}) == doctest::Approx(4.0 / 6.0).epsilon(1e-15));  // one discordant pair of 6
  CHECK(tau({1, 1, 2, 3}, {1, 2, 2, 3}) == doctest::Approx(0.8).epsilon(1e-15));  // 4 / sqrt(5·5)
  CHECK(tau({1, 2, 3}, {1, 2, 3}) == 1.0);
  CHECK(tau({1, 2, 3}, {3, 2, 1}) == -1.0);
  CHECK(tau({1, 1, 2, 2, 5}, {0, 0, 3, 3, 4}) == 1.0);    // identical order with ties
  CHECK(tau({1, 1, 2}, {-1, -1, -2}) == -1.0);            // reversed with ties
  CHECK(tau({0.0f, -0.0f, 1}, {5, 5, 6}) == 1.0);         // -0.0 == +0.0

  auto g = kvtest::rng(707);
  for (int trial = 0; trial < 400; ++trial) {
    const index_t R = kvtest::uniform_int(g, 1, 3), n = kvtest::uniform_int(g, 2, trial < 20 ? 2000 : 60);
    CAPTURE(trial);
    std::vector<float> a, b;
    std::vector<std::vector<float>> ra, rb;
    for (index_t r = 0; r < R; ++r) {
      std::vector<float> x, y;
      do {
        x = tie_heavy_row(g, n, false);
        if (trial % 3 == 0) x = kvtest::random_floats(g, static_cast<std::size_t>(n));
      } while (std::all_of(x.begin(), x.end(), [&](float v) { return v == x[0]; }));
      do {
        y = tie_heavy_row(g, n, false);
        if (trial % 5 == 0) {  // correlated with x
          for (index_t i = 0; i < n; ++i) y[i] = x[i] + (kvtest::uniform_int(g, 0, 3) == 0 ? y[i] : 0.f);
        }
      } while (std::all_of(y.begin(), y.end(), [&](float v) { return v == y[0]; }));
      ra.push_back(x);
      rb.push_back(y);
      a.insert(a.end(), x.begin(), x.end());
      b.insert(b.end(), y.begin(), y.end());
    }
    std::vector<double> per(static_cast<std::size_t>(R));
    double mean = 0;
    const auto va = value_of(make_matrix_view(a.data(), R, n)), vb = value_of(make_matrix_view(b.data(), R, n));
    REQUIRE(two_phase([&](workspace& ws) { return kendall_tau_b(ws, va, vb, mean, per.data()); }).ok());
    double want_mean = 0;
    for (index_t r = 0; r < R; ++r) {
      const double want = naive_tau_b(ra[r], rb[r]);
      CHECK(per[r] == doctest::Approx(want).epsilon(1e-14));
      CHECK(per[r] >= -1.0);
      CHECK(per[r] <= 1.0);
      want_mean += want;
    }
    CHECK(mean == doctest::Approx(want_mean / static_cast<double>(R)).epsilon(1e-14));
  }
}

TEST_CASE("ranking metrics: errors") {
  const std::vector<float> x = {1, 2, 3, 4, 5, 6};
  std::vector<float> y = {1, 2, 3, 4, 5, 6};
  const auto a = value_of(make_matrix_view(x.data(), 2, 3));
  auto b = value_of(make_matrix_view(y.data(), 2, 3));
  const auto a23 = value_of(make_matrix_view(x.data(), 3, 2));
  const auto a16 = value_of(make_matrix_view(x.data(), 1, 6));
  const auto a03 = value_of(make_matrix_view(x.data(), 0, 3));
  double mean = 0;
  auto recall = [&](matrix_view<const float> e, matrix_view<const float> t, index_t k, double* per = nullptr) {
    return two_phase([&](workspace& ws) { return recall_at_k(ws, e, t, k, mean, per); });
  };
  require_error(recall(a, a23, 1), errc::shape_mismatch, "recall_at_k: estimate is [2][3] but truth is [3][2]");
  require_error(recall(a, a, 0), errc::invalid_argument, "k = 0 is outside [1, 3]");
  require_error(recall(a, a, 4), errc::invalid_argument, "k = 4 is outside [1, 3]");
  require_error(recall(a03, a03, 1), errc::invalid_argument, "no rows");
  y[4] = nan_f;
  require_error(recall(a, b, 1), errc::invalid_argument, "truth[1][1] is NaN");
  CHECK(recall(b, a, 1).ok());  // NaN in the estimate is ranked, not rejected
  y[4] = 5;
  auto* alias = reinterpret_cast<double*>(y.data());
  require_error(recall(a, b, 1, alias), errc::overlap, "per_row and truth overlap");
  workspace tiny{y.data(), 4};
  require_error(recall_at_k(tiny, a, a, 1, mean), errc::workspace_too_small, "recall_at_k: workspace has 4 bytes");

  const pos_t kept[4] = {0, 0, 1, 3};
  const std::int32_t cu[3] = {0, 2, 4};
  auto krec = [&](ragged_positions k) { return two_phase([&](workspace& ws) { return kept_recall_at_k(ws, k, a, 1, mean); }); };
  require_error(krec({kept, cu, 2}), errc::invalid_argument, "kept_recall_at_k: kept position 0 of row 0 is listed twice");
  const std::int32_t cu2[3] = {0, 1, 4};
  require_error(krec({kept, cu2, 2}), errc::out_of_range, "kept position 3 of row 1 is outside [0, 3)");
  require_error(krec({kept, cu2, 1}), errc::shape_mismatch, "kept has 1 rows, truth 2");
  const std::int32_t cu_bad[3] = {1, 1, 4};
  require_error(krec({kept, cu_bad, 2}), errc::invalid_argument, "kept.cu[0] must be 0");
  std::vector<double> shared(4, 0.0);  // kept positions stored inside the per-row output
  auto* shared_pos = reinterpret_cast<pos_t*>(shared.data());
  shared_pos[0] = 0;
  shared_pos[1] = 1;
  require_error(two_phase([&](workspace& ws) {
                  return kept_recall_at_k(ws, ragged_positions{shared_pos, cu2, 2}, a, 1, mean, shared.data());
                }),
                errc::overlap, "per_row and kept overlap");
  require_error(two_phase([&](workspace& ws) {
                  return kept_recall_at_k(ws, value_of(make_matrix_view(kept, 1, 4)), a, 1, mean);
                }),
                errc::shape_mismatch, "kept has 1 rows, truth 2");

  auto tau = [&](matrix_view<const float> p, matrix_view<const float> q) {
    return two_phase([&](workspace& ws) { return kendall_tau_b(ws, p, q, mean); });
  };
  require_error(tau(a, a23), errc::shape_mismatch, "kendall_tau_b: a is [2][3] but b is [3][2]");
  require_error(tau(a03, a03), errc::invalid_argument, "no rows");
  const auto a61 = value_of(make_matrix_view(x.data(), 6, 1));
  require_error(tau(a61, a61), errc::invalid_argument, "rows of 1 values have no pairs");
  y[2] = nan_f;
  require_error(tau(a, b), errc::invalid_argument, "b[0][2] is NaN");
  y = {1, 1, 1, 4, 5, 6};
  require_error(tau(a, b), errc::invalid_argument, "row 0 of b is constant: tau-b is undefined");
  CHECK(tau(a16, a16).ok());
}

// ------------------------------------------------------------------------------------------------
// LAVa loss and bound
// ------------------------------------------------------------------------------------------------

namespace {

/// A layer instance with owning buffers; W_O stored [H_q·d][D] (in_out) plus its transpose.
struct lava_case {
  index_t hq = 1, hkv = 1, n = 1, d = 1, D = 1;
  std::vector<float> att, v, wo, wo_t;
  std::vector<std::uint8_t> keep;
  index_t keep_rows = 1;

  matrix_view<const float> A() const { return value_of(make_matrix_view(att.data(), hq, n)); }
  kv_view<const float> V() const { return value_of(make_kv_view(v.data(), hkv, n, d)); }
  matrix_view<const float> W(wo_layout l = wo_layout::in_out) const {
    return l == wo_layout::in_out ? value_of(make_matrix_view(wo.data(), hq * d, D))
                                  : value_of(make_matrix_view(wo_t.data(), D, hq * d));
  }
  matrix_view<const std::uint8_t> I() const { return value_of(make_matrix_view(keep.data(), keep_rows, n)); }
  void transpose() {
    wo_t.assign(wo.size(), 0.f);
    for (index_t r = 0; r < hq * d; ++r)
      for (index_t c = 0; c < D; ++c) wo_t[static_cast<std::size_t>(c * hq * d + r)] = wo[static_cast<std::size_t>(r * D + c)];
  }
};

/// Lemma 1 computed the long way: y and ŷ separately, rows normalised, Â = A⊙I/‖A⊙I‖₁ (0 if empty).
double naive_lava_loss(const lava_case& c, lp_norm p) {
  const index_t group = c.hq / c.hkv;
  std::vector<double> y(static_cast<std::size_t>(c.D), 0.0), yh(static_cast<std::size_t>(c.D), 0.0);
  for (index_t h = 0; h < c.hq; ++h) {
    const index_t kvh = h / group, mr = c.keep_rows == c.hq ? h : kvh;
    double S = 0, K = 0;
    for (index_t i = 0; i < c.n; ++i) {
      S += c.att[h * c.n + i];
      if (c.keep[mr * c.n + i]) K += c.att[h * c.n + i];
    }
    for (index_t t = 0; t < c.d; ++t) {
      double o = 0, oh = 0;
      for (index_t i = 0; i < c.n; ++i) {
        const double a = c.att[h * c.n + i] / S, vv = c.v[(kvh * c.n + i) * c.d + t];
        o += a * vv;
        if (c.keep[mr * c.n + i] && K > 0) oh += (c.att[h * c.n + i] / K) * vv;
      }
      for (index_t col = 0; col < c.D; ++col) {
        const double w = c.wo[(h * c.d + t) * c.D + col];
        y[col] += o * w;
        yh[col] += oh * w;
      }
    }
  }
  double acc = 0;
  for (index_t col = 0; col < c.D; ++col) {
    const double m = std::fabs(y[col] - yh[col]);
    if (p == lp_norm::l1) acc += m;
    else if (p == lp_norm::l2) acc += m * m;
    else acc = std::max(acc, m);
  }
  return p == lp_norm::l2 ? std::sqrt(acc) : acc;
}

double loss_of(const lava_case& c, lava_loss_options opt = {}) {
  double loss = -1;
  const auto W = c.W(opt.layout);
  REQUIRE(two_phase([&](workspace& ws) { return lava_output_loss(ws, c.A(), c.V(), W, c.I(), loss, opt); }).ok());
  return loss;
}
double bound_of(const lava_case& c, wo_layout l = wo_layout::in_out) {
  double b = -1;
  REQUIRE(lava_loss_bound(c.A(), c.V(), c.W(l), c.I(), b, l).ok());
  return b;
}

lava_case random_lava_case(std::mt19937_64& g, bool adversarial) {
  lava_case c;
  c.hkv = kvtest::uniform_int(g, 1, 3);
  c.hq = c.hkv * kvtest::uniform_int(g, 1, 3);
  c.n = kvtest::uniform_int(g, 1, adversarial ? 3 : 12);
  c.d = kvtest::uniform_int(g, 1, adversarial ? 2 : 5);
  c.D = kvtest::uniform_int(g, 1, adversarial ? 2 : 6);
  // attention: a float softmax of random logits (some extreme: near one-hot rows, tiny weights)
  c.att.resize(static_cast<std::size_t>(c.hq * c.n));
  for (index_t h = 0; h < c.hq; ++h) {
    const float scale = adversarial ? 40.f : static_cast<float>(kvtest::uniform_int(g, 1, 8));
    std::vector<float> logit = kvtest::random_floats(g, static_cast<std::size_t>(c.n), -scale, scale);
    const float mx = *std::max_element(logit.begin(), logit.end());
    float sum = 0;
    for (auto& l : logit) sum += (l = std::exp(l - mx));
    for (index_t i = 0; i < c.n; ++i) c.att[h * c.n + i] = logit[i] / sum;
  }
  c.v.resize(static_cast<std::size_t>(c.hkv * c.n * c.d));
  for (auto& x : c.v)
    x = adversarial ? static_cast<float>(kvtest::uniform_int(g, -1, 1)) : kvtest::random_floats(g, 1, -2.f, 2.f)[0];
  c.wo.resize(static_cast<std::size_t>(c.hq * c.d * c.D));
  for (auto& x : c.wo)
    x = adversarial ? static_cast<float>(kvtest::uniform_int(g, -2, 2)) : kvtest::random_floats(g, 1, -1.f, 1.f)[0];
  c.transpose();
  c.keep_rows = kvtest::uniform_int(g, 0, 1) ? c.hkv : c.hq;
  c.keep.resize(static_cast<std::size_t>(c.keep_rows * c.n));
  const auto mode = kvtest::uniform_int(g, 0, 5);
  for (auto& k : c.keep)
    k = mode == 0 ? 1 : mode == 1 ? 0 : static_cast<std::uint8_t>(kvtest::uniform_int(g, 0, 1));
  return c;
}

}  // namespace

TEST_CASE("LAVa loss: hand-computed cases, including the bound's equality case") {
  // One head, N = 2, d = D = 1: A = [.5, .5], V = [1, -1], W_O = [2], keep {0}.
  // y = 2·(.5 - .5) = 0, ŷ = 2·1 = 2: loss 2 in every norm; bound = 2·Ĉ·V̄·(evicted mass) = 2·2·1·.5 = 2.
  lava_case c;
  c.n = 2;
  c.att = {0.5f, 0.5f};
  c.v = {1.f, -1.f};
  c.wo = {2.f};
  c.transpose();
  c.keep = {1, 0};
  CHECK(loss_of(c) == 2.0);
  CHECK(loss_of(c, {lp_norm::l2}) == 2.0);
  CHECK(loss_of(c, {lp_norm::linf}) == 2.0);
  CHECK(bound_of(c) == 2.0);

  // Two heads, N = 2, d = 1, D = 2. A_0 = [.75, .25] keeps {0}; A_1 = [.5, .5] keeps {1}.
  // V_0 = [2, 4], V_1 = [1, 3]; (A - Â)V: head 0: (.75 - 1)·2 + .25·4 = .5, head 1: .5·1 + (.5 - 1)·3 = -1.
  // W_O (in_out) = [[1, 2], [3, -1]]: y - ŷ = [.5·1 - 1·3, .5·2 + 1] = [-2.5, 2].
  // Ĉ = max(|1|+|2|, |3|+|-1|) = 4, V̄_0 = 4, V̄_1 = 3: bound = 2·4·(4·.25 + 3·.5) = 20.
  lava_case t;
  t.hq = t.hkv = 2;
  t.n = 2;
  t.D = 2;
  t.att = {0.75f, 0.25f, 0.5f, 0.5f};
  t.v = {2.f, 4.f, 1.f, 3.f};
  t.wo = {1.f, 2.f, 3.f, -1.f};
  t.transpose();
  t.keep_rows = 2;
  t.keep = {1, 0, 0, 1};
  CHECK(loss_of(t) == 4.5);
  CHECK(loss_of(t, {lp_norm::l2}) == std::sqrt(10.25));
  CHECK(loss_of(t, {lp_norm::linf}) == 2.5);
  CHECK(loss_of(t, {lp_norm::l1, wo_layout::out_in}) == 4.5);  // llama layout [D][H·d] = the transpose
  CHECK(bound_of(t) == 20.0);
  CHECK(bound_of(t, wo_layout::out_in) == 20.0);
  double c_hat = 0;
  REQUIRE(lava_wo_norm(t.W(), wo_layout::in_out, c_hat).ok());
  CHECK(c_hat == 4.0);
  REQUIRE(lava_wo_norm(t.W(wo_layout::out_in), wo_layout::out_in, c_hat).ok());
  CHECK(c_hat == 4.0);
  // un-normalised rows are divided by their sums first: scaling a row changes nothing
  lava_case s3 = t;
  for (auto& a : s3.att) a *= 3.f;
  CHECK(loss_of(s3) == doctest::Approx(4.5).epsilon(1e-15));
  CHECK(bound_of(s3) == doctest::Approx(20.0).epsilon(1e-15));
}

TEST_CASE("LAVa loss: a full mask gives exactly zero loss and zero bound") {
  auto g = kvtest::rng(808);
  for (int trial = 0; trial < 300; ++trial) {
    lava_case c = random_lava_case(g, trial % 2 == 0);
    std::fill(c.keep.begin(), c.keep.end(), std::uint8_t{1});
    for (auto p : {lp_norm::l1, lp_norm::l2, lp_norm::linf}) CHECK(loss_of(c, {p}) == 0.0);
    CHECK(loss_of(c, {lp_norm::l1, wo_layout::out_in}) == 0.0);
    CHECK(bound_of(c) == 0.0);
  }
}

TEST_CASE("LAVa loss: matches the two-output reference and Theorem 1 bounds it (random + adversarial)") {
  auto g = kvtest::rng(909);
  int tight = 0, empty_heads = 0;
  double worst_ratio = 0;
  for (int trial = 0; trial < 6000; ++trial) {
    const bool adversarial = trial % 2 == 1;
    const lava_case c = random_lava_case(g, adversarial);
    CAPTURE(trial);
    const double l1 = loss_of(c), l2 = loss_of(c, {lp_norm::l2}), li = loss_of(c, {lp_norm::linf});
    const double b = bound_of(c);
    const double scale = std::max(1.0, b);
    CHECK(l1 == doctest::Approx(naive_lava_loss(c, lp_norm::l1)).epsilon(1e-9).scale(scale));
    CHECK(l2 == doctest::Approx(naive_lava_loss(c, lp_norm::l2)).epsilon(1e-9).scale(scale));
    CHECK(li == doctest::Approx(naive_lava_loss(c, lp_norm::linf)).epsilon(1e-9).scale(scale));
    CHECK(loss_of(c, {lp_norm::l1, wo_layout::out_in}) == doctest::Approx(l1).epsilon(1e-12));
    CHECK(bound_of(c, wo_layout::out_in) == b);
    // the theorem holds in exact arithmetic; both sides are computed in double
    CHECK(l1 <= b * (1 + 1e-12) + 1e-300);
    CHECK(l2 <= l1 * (1 + 1e-12) + 1e-300);
    CHECK(li <= l2 * (1 + 1e-12) + 1e-300);
    if (b > 0) {
      worst_ratio = std::max(worst_ratio, l1 / b);
      if (l1 >= b * (1 - 1e-9)) ++tight;
    }
    for (index_t r = 0; r < c.keep_rows; ++r) {
      bool any = false;
      for (index_t i = 0; i < c.n; ++i) any = any || c.keep[r * c.n + i];
      empty_heads += !any;
    }
  }
  std::printf("LAVa Theorem 1: 6000 instances, max loss/bound = %.15f, %d tight (ratio >= 1 - 1e-9), %d empty mask rows\n",
              worst_ratio, tight, empty_heads);
  CHECK(worst_ratio <= 1 + 1e-12);
  CHECK(tight > 0);        // the adversarial instances reach the bound
  CHECK(empty_heads > 0);  // and the zero-output convention was exercised
}

TEST_CASE("LAVa loss: GQA masks, fp16 values and strided layouts") {
  auto g = kvtest::rng(1001);
  for (int trial = 0; trial < 200; ++trial) {
    lava_case c = random_lava_case(g, false);
    CAPTURE(trial);
    // a mask per KV head equals the same mask replicated over the group's query heads
    if (c.keep_rows == c.hkv && c.hq != c.hkv) {
      lava_case rep = c;
      rep.keep_rows = c.hq;
      rep.keep.clear();
      for (index_t h = 0; h < c.hq; ++h) {
        const index_t kvh = h / (c.hq / c.hkv);
        rep.keep.insert(rep.keep.end(), c.keep.begin() + kvh * c.n, c.keep.begin() + (kvh + 1) * c.n);
      }
      CHECK(loss_of(rep) == loss_of(c));
      CHECK(bound_of(rep) == bound_of(c));
    }
    // fp16 values: the same result as their fp32 conversions
    std::vector<float16> v16(c.v.size());
    lava_case c32 = c;
    for (std::size_t i = 0; i < c.v.size(); ++i) {
      v16[i] = to_float16(c.v[i]);
      c32.v[i] = to_float(v16[i]);
    }
    const auto V16 = value_of(make_kv_view(v16.data(), c.hkv, c.n, c.d));
    double l16 = 0, b16 = 0;
    REQUIRE(two_phase([&](workspace& ws) { return lava_output_loss(ws, c.A(), V16, c.W(), c.I(), l16); }).ok());
    REQUIRE(lava_loss_bound(c.A(), V16, c.W(), c.I(), b16).ok());
    CHECK(l16 == loss_of(c32));
    CHECK(b16 == bound_of(c32));
    // token-major values [N][H_kv][d]
    std::vector<float> tm(c.v.size());
    for (index_t h = 0; h < c.hkv; ++h)
      for (index_t i = 0; i < c.n; ++i)
        for (index_t t = 0; t < c.d; ++t) tm[(i * c.hkv + h) * c.d + t] = c.v[(h * c.n + i) * c.d + t];
    const auto Vtm = value_of(make_kv_view(tm.data(), c.hkv, c.n, c.d, kv_layout::token_major));
    double ltm = 0;
    REQUIRE(two_phase([&](workspace& ws) { return lava_output_loss(ws, c.A(), Vtm, c.W(), c.I(), ltm); }).ok());
    CHECK(ltm == loss_of(c));
  }
}

TEST_CASE("LAVa loss: empty heads, workspace protocol and errors") {
  lava_case c;
  c.hq = 2;
  c.hkv = 1;
  c.n = 3;
  c.d = 2;
  c.D = 2;
  c.att = {0.5f, 0.25f, 0.25f, 0.f, 0.5f, 0.5f};
  c.v = {1, 2, 3, 4, 5, 6};
  c.wo = {1, 0, 0, 1, 1, 1, -1, 2};
  c.transpose();
  c.keep_rows = 2;
  c.keep = {1, 1, 1, 1, 0, 0};  // query head 1 keeps only key 0, which it gives no attention
  // zero-output convention: head 1 contributes its whole output to y - ŷ
  const double l = loss_of(c);
  CHECK(l == doctest::Approx(naive_lava_loss(c, lp_norm::l1)).epsilon(1e-14));
  CHECK(l > 0);
  CHECK(l <= bound_of(c));
  double loss = -1;
  require_error(two_phase([&](workspace& ws) {
                  return lava_output_loss(ws, c.A(), c.V(), c.W(), c.I(), loss, {lp_norm::l1, wo_layout::in_out, empty_head::error});
                }),
                errc::invalid_argument, "query head 1 keeps no attention mass");

  // workspace: a query sets bytes and leaves the loss alone; too small is an error
  workspace ws;
  REQUIRE(lava_output_loss(ws, c.A(), c.V(), c.W(), c.I(), loss).ok());
  CHECK(ws.bytes >= 2 * 2 * sizeof(double));
  CHECK(loss == -1);
  std::vector<double> small(1);
  workspace tiny{small.data(), sizeof(double)};
  require_error(lava_output_loss(tiny, c.A(), c.V(), c.W(), c.I(), loss), errc::workspace_too_small,
                "lava_output_loss: workspace has 8 bytes");

  auto run = [&](const lava_case& x, lava_loss_options opt = {}) {
    double out = 0;
    const auto W = x.W(opt.layout);
    return two_phase([&](workspace& w) { return lava_output_loss(w, x.A(), x.V(), W, x.I(), out, opt); });
  };
  auto bound = [&](const lava_case& x) {
    double out = 0;
    return lava_loss_bound(x.A(), x.V(), x.W(), x.I(), out);
  };
  lava_case bad = c;
  bad.att[4] = -0.25f;
  require_error(run(bad), errc::invalid_argument, "attention[1][1] = -0.25 is not a finite, non-negative weight");
  require_error(bound(bad), errc::invalid_argument, "lava_loss_bound: attention[1][1]");
  bad.att[4] = nan_f;
  require_error(run(bad), errc::invalid_argument, "attention[1][1] = nan");
  bad = c;
  bad.att[3] = bad.att[4] = bad.att[5] = 0.f;
  require_error(run(bad), errc::invalid_argument, "attention row 1 sums to 0");
  bad = c;
  bad.v[3] = nan_f;
  require_error(run(bad), errc::invalid_argument, "values[0][1][1] is not finite");
  bad = c;
  bad.wo[5] = inf_f;
  bad.transpose();
  require_error(run(bad), errc::invalid_argument, "w_o[2][1] is not finite");
  require_error(bound(bad), errc::invalid_argument, "w_o[2][1] is not finite");

  // shapes
  double out = 0;
  std::vector<float> v4(4 * 3 * 2, 1.f);
  const auto V2heads = value_of(make_kv_view(v4.data(), 4, 3, 2));
  require_error(two_phase([&](workspace& w) { return lava_output_loss(w, c.A(), V2heads, c.W(), c.I(), out); }),
                errc::shape_mismatch, "2 query heads are not a multiple of 4 KV heads");
  const auto Vshort = value_of(make_kv_view(v4.data(), 1, 2, 2));
  require_error(two_phase([&](workspace& w) { return lava_output_loss(w, c.A(), Vshort, c.W(), c.I(), out); }),
                errc::shape_mismatch, "attention has 3 keys but values 2 tokens");
  const auto Wbad = value_of(make_matrix_view(c.wo.data(), 2, 4));
  require_error(two_phase([&](workspace& w) { return lava_output_loss(w, c.A(), c.V(), Wbad, c.I(), out); }),
                errc::shape_mismatch, "w_o takes 2 inputs but 2 heads x 2 dims = 4 (layout in_out");
  require_error(lava_loss_bound(c.A(), c.V(), Wbad, c.I(), out), errc::shape_mismatch, "w_o takes 2 inputs");
  std::vector<std::uint8_t> k9(9, 1);
  const auto I3 = value_of(make_matrix_view(k9.data(), 3, 3));
  require_error(two_phase([&](workspace& w) { return lava_output_loss(w, c.A(), c.V(), c.W(), I3, out); }),
                errc::shape_mismatch, "keep has 3 rows; expected 1 (KV heads) or 2 (query heads)");
  const auto I2x4 = value_of(make_matrix_view(k9.data(), 2, 4));
  require_error(two_phase([&](workspace& w) { return lava_output_loss(w, c.A(), c.V(), c.W(), I2x4, out); }),
                errc::shape_mismatch, "keep has 4 columns but attention 3 keys");
  const auto A0 = value_of(make_matrix_view(c.att.data(), 2, 0));
  const auto V0 = value_of(make_kv_view(v4.data(), 1, 0, 2));
  const auto I0 = value_of(make_matrix_view(k9.data(), 2, 0));
  require_error(two_phase([&](workspace& w) { return lava_output_loss(w, A0, V0, c.W(), I0, out); }),
                errc::invalid_argument, "the attention rows have no keys");
  require_error(run(c, {static_cast<lp_norm>(9)}), errc::invalid_argument, "unknown norm 9");
  require_error(run(c, {lp_norm::l1, wo_layout::in_out, static_cast<empty_head>(5)}), errc::invalid_argument,
                "unknown empty-head policy 5");
  require_error(lava_wo_norm(c.W(), static_cast<wo_layout>(3), out), errc::invalid_argument, "unknown w_o layout 3");
}
