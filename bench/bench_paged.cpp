// Paged caches and batches (paged.hpp, batch.hpp) against their dense / per-sequence counterparts:
//   compact/paged     compact_paged: keys and values of a batch in a shuffled NHD page pool (16-token
//                     pages), k kept tokens per head moved to the front of each page list
//   compact/dense     compact_inplace on head-major [H][T][d] keys and values, the same kept rows
//   compact/memcpy    the bandwidth bound of the bytes moved (harness.hpp)
//   select/batch      select_topk_batch: one call for S sequences x H KV heads of mixed lengths
//   select/loop       one select_topk call per sequence over the same scores
// Kept positions: k distinct random positions per head, ascending.
#include <kvevict/batch.hpp>
#include <kvevict/compact.hpp>
#include <kvevict/paged.hpp>
#include <kvevict/select.hpp>

#include "harness.hpp"

#include <algorithm>
#include <numeric>
#include <tuple>

namespace {
using namespace kvb;

constexpr index_t page_size = 16;

/// S sequences of T tokens x H heads x d, fp16, paged (pages shuffled) and dense, with kept lists.
struct compact_case {
  index_t S, H, T, d, k, pages;
  std::vector<float16> kpool, vpool, kdense, vdense;
  std::vector<std::int32_t> indptr, indices, last;
  std::vector<pos_t> kept;  // [S*H][k] ascending
  std::vector<std::int32_t> cu;
  compact_case(index_t s, index_t h, index_t t, index_t dim, index_t budget)
      : S(s), H(h), T(t), d(dim), k(budget), pages(s * ((t + page_size - 1) / page_size)) {
    kpool.resize(static_cast<std::size_t>(pages * page_size * H * d));
    fill_normal(kpool, 51);
    vpool = kpool;
    kdense.resize(static_cast<std::size_t>(S * H * T * d));
    fill_normal(kdense, 52);
    vdense = kdense;
    std::vector<std::int32_t> perm(static_cast<std::size_t>(pages));
    std::iota(perm.begin(), perm.end(), 0);
    std::uint64_t r = 7;
    for (index_t i = pages - 1; i > 0; --i) std::swap(perm[i], perm[static_cast<index_t>(splitmix64(r) % (i + 1))]);
    indptr.assign(1, 0);
    const index_t per = pages / S;
    for (index_t q = 0; q < S; ++q) {
      indices.insert(indices.end(), perm.begin() + q * per, perm.begin() + (q + 1) * per);
      indptr.push_back(static_cast<std::int32_t>(indices.size()));
      last.push_back(static_cast<std::int32_t>(T - (per - 1) * page_size));
    }
    std::vector<pos_t> all(static_cast<std::size_t>(T));
    cu.assign(1, 0);
    for (index_t row = 0; row < S * H; ++row) {
      std::iota(all.begin(), all.end(), 0);
      for (index_t i = 0; i < k; ++i) std::swap(all[i], all[i + static_cast<index_t>(splitmix64(r) % (T - i))]);
      std::sort(all.begin(), all.begin() + k);
      kept.insert(kept.end(), all.begin(), all.begin() + k);
      cu.push_back(static_cast<std::int32_t>(kept.size()));
    }
  }
  paged_layer<float16> layer() {
    return {*make_page_pool(kpool.data(), pages, page_size, H, d), *make_page_pool(vpool.data(), pages, page_size, H, d),
            page_table{indptr.data(), indices.data(), last.data(), S}, S, H, page_lists::per_sequence};
  }
};

enum class impl { paged, dense, memcpy };
const char* impl_name(impl i) { return i == impl::paged ? "paged" : i == impl::dense ? "dense" : "memcpy"; }

template <class Backend>
void run_compact(benchmark::State& st, index_t S, index_t H, index_t T, index_t d, index_t k, impl which, Backend be) {
  auto& c = const_cast<compact_case&>(cached<compact_case>(
      std::make_tuple(S, H, T, d, k), [&] { return std::make_unique<compact_case>(S, H, T, d, k); }));
  const std::size_t bytes = static_cast<std::size_t>(2 * S * H * k * d) * sizeof(float16);  // keys and values
  if (which == impl::memcpy) return run_memcpy_bound(st, bytes, bytes, std::is_same_v<Backend, par_t>);
  std::vector<std::int32_t> lengths(static_cast<std::size_t>(S)), freed(static_cast<std::size_t>(c.pages));
  std::int32_t count = 0;
  workspace q;
  (void)compact_paged(be, q, c.layer(), ragged_positions{c.kept.data(), c.cu.data(), S * H},
                      paged_compaction_out{lengths.data(), freed.data(), c.pages, &count});
  std::vector<unsigned char> mem(q.bytes + 1);
  const auto kept = *make_matrix_view<const pos_t>(c.kept.data(), S * H, k);
  for (auto _ : st) {
    status s;
    if (which == impl::paged) {
      workspace ws{mem.data(), q.bytes};
      s = compact_paged(be, ws, c.layer(), ragged_positions{c.kept.data(), c.cu.data(), S * H},
                        paged_compaction_out{lengths.data(), freed.data(), c.pages, &count});
    } else {
      s = compact_inplace(be, *make_kv_view(c.kdense.data(), S * H, T, d), kept);
      if (s.ok()) s = compact_inplace(be, *make_kv_view(c.vdense.data(), S * H, T, d), kept);
    }
    if (!ok(st, s, impl_name(which))) return;
    benchmark::ClobberMemory();
  }
  set_traffic(st, bytes, bytes);
  if (which == impl::paged && count != static_cast<std::int32_t>(c.pages - S * ((k + page_size - 1) / page_size)))
    fail(st, "freed pages miscounted");
}

/// S sequences x H heads, lengths spread over [lo, hi], scores padded to hi columns.
struct select_case {
  index_t S, H, T;
  std::vector<float> scores;
  std::vector<std::int32_t> lens, budgets;
  select_case(index_t s, index_t h, index_t lo, index_t hi) : S(s), H(h), T(hi) {
    scores.resize(static_cast<std::size_t>(S * H * T));
    fill_normal(scores, 61);
    std::uint64_t r = 9;
    for (index_t q = 0; q < S; ++q) {
      const index_t n = lo + static_cast<index_t>(splitmix64(r) % static_cast<std::uint64_t>(hi - lo + 1));
      for (index_t h2 = 0; h2 < H; ++h2) lens.push_back(static_cast<std::int32_t>(n));
      budgets.push_back(static_cast<std::int32_t>(n / 8));
    }
  }
};

enum class sel { batch, loop };

template <class Backend>
void run_select(benchmark::State& st, index_t S, index_t H, index_t lo, index_t hi, sel which, Backend be) {
  const auto& c = cached<select_case>(std::make_tuple(S, H, lo, hi),
                                      [&] { return std::make_unique<select_case>(S, H, lo, hi); });
  std::vector<std::int32_t> cu(static_cast<std::size_t>(S * H + 1)), loop_cu(static_cast<std::size_t>(H + 1));
  std::vector<pos_t> pos(static_cast<std::size_t>(S * H * hi / 8 + 1));
  const auto sv = *make_matrix_view<const float>(c.scores.data(), S * H, hi);
  const batch_rows rows = batch_padded(sv, S, H, c.lens.data());
  workspace q;
  (void)select_topk_batch(be, q, rows, c.budgets.data(), batch_budget::per_head, cu.data(), pos.data(),
                          static_cast<index_t>(pos.size()));
  std::vector<unsigned char> mem(std::max(q.bytes, select_topk_workspace_bytes(be, hi)) + 1);
  workspace ws{mem.data(), mem.size()};
  for (auto _ : st) {
    status s;
    if (which == sel::batch) {
      s = select_topk_batch(be, ws, rows, c.budgets.data(), batch_budget::per_head, cu.data(), pos.data(),
                            static_cast<index_t>(pos.size()));
    } else {
      std::int32_t at = 0;
      for (index_t q2 = 0; q2 < S && s.ok(); ++q2) {
        loop_cu[0] = 0;
        for (index_t h = 0; h < H; ++h) loop_cu[static_cast<std::size_t>(h + 1)] = loop_cu[static_cast<std::size_t>(h)] + c.budgets[q2];
        const auto one = *make_matrix_view<const float>(c.scores.data() + q2 * H * hi, H, c.lens[q2 * H], hi);
        s = select_topk(be, ws, one, nullptr, ragged_positions_out{pos.data() + at, loop_cu.data(), H});
        at += loop_cu.back();
      }
    }
    if (!ok(st, s, which == sel::batch ? "batch" : "loop")) return;
    benchmark::DoNotOptimize(pos.data());
    benchmark::ClobberMemory();
  }
}

void register_benchmarks() {
  const index_t H = smoke() ? 2 : 8, d = smoke() ? 16 : 128;
  for (const index_t T : smoke() ? std::vector<index_t>{256} : std::vector<index_t>{4096, 32768})
    for (const index_t S : {index_t(1), index_t(4)}) {
      params p;
      p.add("S", S).add("hkv", H).add("d", d).add("T", T).add("k", T / 8).add("page", page_size).add("kv", "fp16");
      for (impl i : {impl::paged, impl::dense, impl::memcpy}) {
        add(bench_name("paged", "compact", impl_name(i), "seq", p),
            [=](benchmark::State& st) { run_compact(st, S, H, T, d, T / 8, i, seq); });
        add(bench_name("paged", "compact", impl_name(i), "par", p),
            [=](benchmark::State& st) { run_compact(st, S, H, T, d, T / 8, i, par); });
      }
    }
  const index_t S = smoke() ? 4 : 64, lo = smoke() ? 64 : 1024, hi = smoke() ? 512 : 32768;
  params p;
  p.add("S", S).add("hkv", H).add("lo", lo).add("hi", hi);
  for (sel w : {sel::batch, sel::loop}) {
    const char* name = w == sel::batch ? "batch" : "loop";
    add(bench_name("paged", "select", name, "seq", p), [=](benchmark::State& st) { run_select(st, S, H, lo, hi, w, seq); });
    add(bench_name("paged", "select", name, "par", p), [=](benchmark::State& st) { run_select(st, S, H, lo, hi, w, par); });
  }
}
}  // namespace

KVB_MAIN(register_benchmarks)
