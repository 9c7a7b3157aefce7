// Fuzzes the budget allocators with arbitrary shapes, budgets, weights (NaN, infinities, negative,
// zero), masks and score bit patterns, valid or not. A call must either fail cleanly, writing
// nothing, or satisfy its invariants: exact totals, budgets within [protected, prompt], PyramidKV
// non-increasing, AdaKV equal to a naive sort with floors, the cascade equal at every step to
// selecting each layer's budget from its original scores.
#include <kvevict/budget.hpp>
#include <kvevict/protect.hpp>

#include "fuzz_input.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

using namespace kvevict;
using kvfuzz::require;

namespace {

struct input : kvfuzz::input {
  index_t small(index_t mod) { return static_cast<index_t>(take(2) % static_cast<std::uint32_t>(mod)); }
  float score() {
    const std::uint32_t kind = take(1);
    if (kind < 200) return static_cast<float>(kind % 7);  // many ties
    const std::uint32_t b = take(4);
    float f;
    std::memcpy(&f, &b, sizeof f);
    return f;
  }
  double weight() {
    const std::uint32_t k = take(1);
    if (k < 230) return static_cast<double>(k % 9);
    const std::uint64_t b = static_cast<std::uint64_t>(take(4)) << 32 | take(4);
    double d;
    std::memcpy(&d, &b, sizeof d);
    return d;
  }
};

bool ranks_before(float a, index_t ra, index_t pa, float b, index_t rb, index_t pb) {
  const bool a_nan = std::isnan(a), b_nan = std::isnan(b);
  if (a_nan != b_nan) return b_nan;
  if (!a_nan && a != b) return a > b;
  if (ra != rb) return ra < rb;
  return pa < pb;
}

// Each row's best floors[r], then the best of the rest jointly; per-row ascending kept lists.
std::vector<std::vector<pos_t>> naive_flat(const std::vector<float>& s, index_t R, index_t T, index_t total,
                                           const std::vector<index_t>& floors) {
  struct entry {
    float s;
    index_t r;
    pos_t p;
  };
  std::vector<std::vector<bool>> taken(static_cast<std::size_t>(R), std::vector<bool>(static_cast<std::size_t>(T)));
  index_t left = total;
  for (index_t r = 0; r < R; ++r) {
    std::vector<entry> row;
    for (index_t t = 0; t < T; ++t) row.push_back({s[static_cast<std::size_t>(r * T + t)], r, static_cast<pos_t>(t)});
    std::sort(row.begin(), row.end(), [](const entry& a, const entry& b) { return ranks_before(a.s, a.r, a.p, b.s, b.r, b.p); });
    const index_t f = floors.empty() ? 0 : floors[static_cast<std::size_t>(r)];
    for (index_t i = 0; i < f; ++i) taken[static_cast<std::size_t>(r)][static_cast<std::size_t>(row[static_cast<std::size_t>(i)].p)] = true;
    left -= f;
  }
  std::vector<entry> rest;
  for (index_t r = 0; r < R; ++r)
    for (index_t t = 0; t < T; ++t)
      if (!taken[static_cast<std::size_t>(r)][static_cast<std::size_t>(t)])
        rest.push_back({s[static_cast<std::size_t>(r * T + t)], r, static_cast<pos_t>(t)});
  std::sort(rest.begin(), rest.end(), [](const entry& a, const entry& b) { return ranks_before(a.s, a.r, a.p, b.s, b.r, b.p); });
  for (index_t i = 0; i < left; ++i)
    taken[static_cast<std::size_t>(rest[static_cast<std::size_t>(i)].r)][static_cast<std::size_t>(rest[static_cast<std::size_t>(i)].p)] = true;
  std::vector<std::vector<pos_t>> kept(static_cast<std::size_t>(R));
  for (index_t r = 0; r < R; ++r)
    for (index_t t = 0; t < T; ++t)
      if (taken[static_cast<std::size_t>(r)][static_cast<std::size_t>(t)]) kept[static_cast<std::size_t>(r)].push_back(static_cast<pos_t>(t));
  return kept;
}

matrix_view<std::int32_t> mat(std::vector<std::int32_t>& v, index_t r, index_t c) {
  return *make_matrix_view(v.data(), r, c);
}

void fuzz_apportion(input& in) {
  const index_t n = in.small(9);
  std::vector<double> w(static_cast<std::size_t>(n));
  std::vector<index_t> caps(static_cast<std::size_t>(n));
  for (auto& x : w) x = in.weight();
  for (auto& c : caps) c = static_cast<index_t>(in.take(2)) - 100;
  const index_t target = static_cast<index_t>(in.take(2)) - 50;
  const bool capped = in.take(1) & 1;
  std::vector<index_t> out(static_cast<std::size_t>(n) + 1, -77);
  const status st = apportion(target, w.data(), capped ? caps.data() : nullptr, n, out.data());
  if (!st.ok()) {
    for (auto v : out) require(v == -77);
    return;
  }
  index_t sum = 0;
  for (index_t i = 0; i < n; ++i) {
    require(out[static_cast<std::size_t>(i)] >= 0);
    if (capped) require(out[static_cast<std::size_t>(i)] <= caps[static_cast<std::size_t>(i)]);
    sum += out[static_cast<std::size_t>(i)];
  }
  require(sum == target);
}

void fuzz_pyramid_uniform(input& in) {
  const index_t L = in.small(40), H = in.small(5), N = static_cast<index_t>(in.take(2)) - 2;
  pyramid_options opt;
  opt.beta = static_cast<index_t>(in.take(1)) - 2;
  opt.prot = {static_cast<index_t>(in.take(1) % 20) - 1, static_cast<index_t>(in.take(1) % 70) - 1};
  opt.rounding = static_cast<pyramid_rounding>(in.take(1) % 3);
  const index_t B = static_cast<index_t>(in.take(2)) - 5;
  std::vector<std::int32_t> out(static_cast<std::size_t>(L * H) + 1, -77);
  status st = pyramid_budgets(B, N, opt, mat(out, L, H));
  if (!st.ok()) {
    for (auto v : out) require(v == -77);
  } else {
    const index_t W = protected_count(N, opt.prot.n_sink, opt.prot.n_recent);
    index_t sum = 0;
    for (index_t l = 0; l < L; ++l)
      for (index_t h = 0; h < H; ++h) {
        const std::int32_t b = out[static_cast<std::size_t>(l * H + h)];
        require(b == out[static_cast<std::size_t>(l * H)]);
        require(b >= std::min(W, N) && b <= N);
        if (l > 0) require(b <= out[static_cast<std::size_t>((l - 1) * H + h)]);
        sum += b;
      }
    if (opt.rounding == pyramid_rounding::exact) require(sum == B * H * L);
  }
  std::fill(out.begin(), out.end(), -77);
  const index_t total = static_cast<index_t>(in.take(3)) - 10;
  st = uniform_budgets(total, N, opt.prot, mat(out, L, H));
  if (!st.ok()) {
    for (auto v : out) require(v == -77);
    return;
  }
  index_t sum = 0;
  for (index_t i = 0; i < L * H; ++i) sum += out[static_cast<std::size_t>(i)];
  require(sum == total);
}

void fuzz_adakv(input& in) {
  const index_t H = in.small(6), T = in.small(60);
  const protection p{in.small(4), in.small(12)};
  std::vector<float> s(static_cast<std::size_t>(H * T) + 1);
  for (auto& x : s) x = in.score();
  const bool prot_ok = in.take(1) % 4 != 0;
  if (prot_ok && H > 0 && T > 0) (void)protect(seq, *make_matrix_view(s.data(), H, T), p.n_sink, p.n_recent);
  adakv_options opt;
  opt.prot = p;
  opt.alpha = static_cast<double>(in.take(1)) / 200.0;
  opt.floor = static_cast<adakv_floor>(in.take(1) % 3);
  const index_t B = static_cast<index_t>(in.take(1)) - 3;
  std::vector<std::int32_t> cu(static_cast<std::size_t>(H) + 1, -77);
  std::vector<pos_t> pos(static_cast<std::size_t>(std::max<index_t>(B, 0) * H) + 1, -77);
  const auto view = *make_matrix_view<const float>(s.data(), H, T);
  workspace ws;
  status st = adakv_budgets(seq, ws, view, nullptr, B, opt, cu.data(), pos.data());
  std::vector<unsigned char> mem;
  if (st.ok()) {
    mem.resize(ws.bytes + 1);
    ws.data = mem.data();
    st = adakv_budgets(seq, ws, view, nullptr, B, opt, cu.data(), pos.data());
  }
  if (!st.ok()) {
    for (auto v : cu) require(v == -77);
    for (auto v : pos) require(v == -77);
    return;
  }
  std::vector<index_t> floors(static_cast<std::size_t>(H));
  for (index_t h = 0; h < H; ++h)
    floors[static_cast<std::size_t>(h)] = adakv_head_floor(B, T, protected_count(T, p.n_sink, p.n_recent), opt.alpha, opt.floor);
  const auto ref = naive_flat(s, H, T, B * H, floors);
  require(cu[static_cast<std::size_t>(H)] == B * H);
  for (index_t h = 0; h < H; ++h) {
    const auto& r = ref[static_cast<std::size_t>(h)];
    require(static_cast<std::size_t>(cu[static_cast<std::size_t>(h + 1)] - cu[static_cast<std::size_t>(h)]) == r.size());
    require(std::equal(r.begin(), r.end(), pos.begin() + cu[static_cast<std::size_t>(h)]));
  }
}

void fuzz_cascade(input& in) {
  cascade_config cfg;
  cfg.layers = in.small(6);
  cfg.heads = in.small(4);
  cfg.prompt_length = in.small(40);
  cfg.prot = {in.small(3), in.small(6)};
  cfg.split = static_cast<cascade_split>(in.take(1) % 3);
  cfg.total = static_cast<index_t>(in.take(2)) - 5;
  const auto bytes = layer_cascade::state_bytes(cfg);
  if (!bytes.ok()) return;
  std::vector<unsigned char> mem(*bytes);
  layer_cascade c;
  if (!c.init(cfg, mem.data(), mem.size()).ok()) return;
  const index_t L = cfg.layers, H = cfg.heads, N = cfg.prompt_length;
  std::vector<std::vector<float>> orig(static_cast<std::size_t>(L));
  std::vector<index_t> prev(static_cast<std::size_t>(L), 0);
  std::vector<unsigned char> wsmem;
  for (index_t m = 0; m < L; ++m) {
    auto& s = orig[static_cast<std::size_t>(m)];
    s.resize(static_cast<std::size_t>(H * N));
    for (auto& x : s) x = in.score();
    if (in.take(1) % 8 != 0) (void)protect(seq, *make_matrix_view(s.data(), H, N), cfg.prot.n_sink, cfg.prot.n_recent);
    const double w = in.weight();
    const auto view = *make_matrix_view<const float>(s.data(), H, N);
    workspace ws;
    if (!c.add_layer(seq, ws, m, view, w).ok()) return;
    wsmem.resize(ws.bytes + 1);
    ws.data = wsmem.data();
    if (!c.add_layer(seq, ws, m, view, w).ok()) {
      require(c.layers_added() == m);  // nothing happened
      return;
    }
    for (index_t j = 0; j <= m; ++j) {
      const index_t tot = c.layer_total(j);
      if (j < m) require(tot <= prev[static_cast<std::size_t>(j)]);
      prev[static_cast<std::size_t>(j)] = tot;
      const ragged_positions held = c.positions(j);
      if (cfg.split == cascade_split::flattened) {
        const auto ref = naive_flat(orig[static_cast<std::size_t>(j)], H, N, tot, {});
        for (index_t h = 0; h < H; ++h) {
          const auto& r = ref[static_cast<std::size_t>(h)];
          require(static_cast<std::size_t>(held.length(h)) == r.size());
          require(std::equal(r.begin(), r.end(), held.pos + held.cu[h]));
        }
      } else {
        for (index_t h = 0; h < H; ++h) {
          std::vector<float> row(orig[static_cast<std::size_t>(j)].begin() + h * N,
                                 orig[static_cast<std::size_t>(j)].begin() + (h + 1) * N);
          const auto ref = naive_flat(row, 1, N, tot / H, {});
          require(held.length(h) == tot / H);
          require(std::equal(ref[0].begin(), ref[0].end(), held.pos + held.cu[h]));
        }
      }
    }
  }
  if (L > 0) require(c.held_total() == cfg.total);
}

void fuzz_duo(input& in) {
  const index_t L = in.small(5), H = in.small(4), N = static_cast<index_t>(in.take(2)) - 2;
  std::vector<float> mask(static_cast<std::size_t>(L * H) + 1);
  for (auto& m : mask) {
    const std::uint32_t k = in.take(1);
    m = k < 120 ? 0.0f : (k < 240 ? 1.0f : in.score());
  }
  duo_options opt;
  opt.streaming = {static_cast<index_t>(in.take(1) % 20) - 1, static_cast<index_t>(in.take(1) % 90) - 1};
  opt.retrieval_budget = in.take(1) % 2 ? -1 : static_cast<index_t>(in.take(2)) - 3;
  std::vector<std::int32_t> out(static_cast<std::size_t>(L * H) + 1, -77);
  index_t total = -77;
  const status st = duo_budgets(*make_matrix_view<const float>(mask.data(), L, H), N, opt, mat(out, L, H), &total);
  if (!st.ok()) {
    for (auto v : out) require(v == -77);
    require(total == -77);
    return;
  }
  index_t sum = 0;
  for (index_t i = 0; i < L * H; ++i) sum += out[static_cast<std::size_t>(i)];
  require(sum == total);
  std::vector<pos_t> sp(static_cast<std::size_t>(N) + 1);
  const auto n = streaming_positions(N, opt.streaming, sp.data());
  require(n.ok() && *n == protected_count(N, opt.streaming.n_sink, opt.streaming.n_recent));
  for (index_t i = 1; i < *n; ++i) require(sp[static_cast<std::size_t>(i)] > sp[static_cast<std::size_t>(i - 1)]);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  input in{data, size};
  switch (in.take(1) % 5) {
    case 0: fuzz_apportion(in); break;
    case 1: fuzz_pyramid_uniform(in); break;
    case 2: fuzz_adakv(in); break;
    case 3: fuzz_cascade(in); break;
    default: fuzz_duo(in); break;
  }
  return 0;
}
