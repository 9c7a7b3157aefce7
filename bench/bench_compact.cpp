// Compaction (compact.hpp) against
//   gather   one memcpy per kept row, written by hand (what compact does, without its checks)
//   memcpy   the bandwidth bound: one memcpy of the bytes the stage moves (harness.hpp): kept rows x
//            row bytes summed over the heads, from a contiguous source into a 64-byte aligned buffer
//   kvevict_r8  the round-eight kernel (dense, ragged, in place): the same checks (the positions'
//            check as round eight wrote it), 128-row blocks of AVX2 copies with ordinary
//            stores, so that before and after are measured in one run
// Outputs and in-place caches are 64-byte aligned buffers, as an engine's allocator gives them.
// Ops on one KV tensor [H_kv][T][d] (head-major):
//   dense    compact(src, kept [H][k], dst [H][k][d])
//   ragged   compact(src, ragged kept, ragged_cache dst): per-head budgets around k
//   inplace  compact_inplace(cache [H][T][d], kept [H][k]) (ascending positions)
//   append   append(ragged_cache, rows [H][n][d]): a decode step adding n rows per head
// Kept positions: k distinct random positions per head, ascending (scattered like SnapKV's).
#include <kvevict/compact.hpp>

#include "baselines.hpp"
#include "harness.hpp"

#include <tuple>

namespace {
using namespace kvb;

template <class E>
struct source {  // [H][T][d], shared by every budget of a context
  std::vector<E> data;
  source(index_t H, index_t T, index_t d) : data(static_cast<std::size_t>(H * T * d)) { fill_normal(data, 41); }
};

template <class E>
struct compact_case {
  index_t H, T, d, k;
  const std::vector<E>& src;
  std::vector<pos_t> kept;           // [H][k] ascending (dense) ...
  std::vector<std::int32_t> cu_k;    // ... as offsets (dense = ragged with equal budgets)
  std::vector<pos_t> rkept;          // ragged: per-head budgets around k, ascending
  std::vector<std::int32_t> rcu;
  compact_case(index_t heads, index_t tokens, index_t dim, index_t budget, const std::vector<E>& data)
      : H(heads), T(tokens), d(dim), k(budget), src(data) {
    cu_k.assign(static_cast<std::size_t>(H + 1), 0);
    rcu.assign(static_cast<std::size_t>(H + 1), 0);
    std::uint64_t s = 42;
    std::vector<pos_t> all(static_cast<std::size_t>(T));
    auto pick = [&](index_t n, std::vector<pos_t>& out) {  // n distinct positions, ascending
      std::iota(all.begin(), all.end(), 0);
      for (index_t i = 0; i < n; ++i) std::swap(all[i], all[i + static_cast<index_t>(splitmix64(s) % (T - i))]);
      std::sort(all.begin(), all.begin() + n);
      out.insert(out.end(), all.begin(), all.begin() + n);
    };
    for (index_t h = 0; h < H; ++h) {
      pick(k, kept);
      cu_k[h + 1] = static_cast<std::int32_t>((h + 1) * k);
      const index_t spread = (h % 2 == 0 ? 1 : -1) * (k * 3 / 4) * ((h / 2) % 4) / 3;
      const index_t kh = std::clamp<index_t>(k + spread, 0, T);
      pick(kh, rkept);
      rcu[h + 1] = static_cast<std::int32_t>(rcu[h] + kh);
    }
  }
  kv_view<const E> src_view() const { return *make_kv_view(src.data(), H, T, d); }
};

template <class E>
const compact_case<E>& get_case(index_t H, index_t T, index_t d, index_t k) {
  const auto& src =
      cached<source<E>>(std::make_tuple(H, T, d), [&] { return std::make_unique<source<E>>(H, T, d); });
  return cached<compact_case<E>>(std::make_tuple(H, T, d, k),
                                 [&] { return std::make_unique<compact_case<E>>(H, T, d, k, src.data); });
}

enum class op { dense, ragged, inplace, append };
const char* op_name(op o) {
  switch (o) {
    case op::dense: return "dense";
    case op::ragged: return "ragged";
    case op::inplace: return "inplace";
    case op::append: return "append";
  }
  return "?";
}
enum class impl { kvevict, kvevict_r8, gather, memcpy };
const char* impl_name(impl i) {
  switch (i) {
    case impl::kvevict: return "kvevict";
    case impl::kvevict_r8: return "kvevict_r8";
    case impl::gather: return "gather";
    case impl::memcpy: return "memcpy";
  }
  return "?";
}

/// Round eight's check of a dense kept matrix (range; ascent in place): a branch per position.
bool r8_kept_ok(const pos_t* kept, index_t H, index_t k, index_t T, bool ascending) {
  for (index_t h = 0; h < H; ++h)
    for (index_t j = 0; j < k; ++j) {
      const pos_t p = kept[h * k + j];
      if (p < 0 || p >= T) return false;
      if (ascending && j > 0 && p <= kept[h * k + j - 1]) return false;
    }
  return true;
}

/// Round eight's compaction of contiguous rows (dense, ragged, in place) on backend be.
template <class E, class Backend>
status r8_compact(Backend be, op o, const E* src, index_t H, index_t T, index_t d, index_t k, const pos_t* kept,
                  const std::int32_t* cu, std::int32_t* lens, E* out, E* cache) {
  constexpr index_t block = 128;
  constexpr auto c = detail::gather_copy::avx2;  // the bytes copy where unavailable
  switch (o) {
    case op::dense: {
      KVEVICT_TRY(detail::check_compact_dense_shapes("compact", *make_kv_view(src, H, T, d),
                                                     *make_matrix_view(kept, H, k), *make_kv_view(out, H, k, d)));
      if (!r8_kept_ok(kept, H, k, T, false)) return status::error(errc::out_of_range, "kept");
      const index_t blocks = (k + block - 1) / block;
      detail::parallel_for(be, H * blocks, [&](index_t i) {
        const index_t h = i / blocks, j0 = (i % blocks) * block, n = std::min(block, k - j0);
        detail::gather_rows_with(c, out + (h * k + j0) * d, d, src + h * T * d, d, kept + h * k + j0, 1, n, k - j0 - n,
                                 d, false);
      });
      return {};
    }
    case op::ragged: {  // into a ragged_cache: one parallel iteration per head
      KVEVICT_TRY(detail::check_ragged_gather("compact", *make_kv_view(src, H, T, d), ragged_positions{kept, cu, H},
                                              ragged_cache<E>{out, cu, lens, H, d, d}));
      detail::parallel_for(be, H, [&](index_t h) {
        const index_t n = cu[h + 1] - cu[h];
        detail::gather_rows_with(c, out + cu[h] * d, d, src + h * T * d, d, kept + cu[h], 1, n, 0, d, false);
        lens[h] = static_cast<std::int32_t>(n);
      });
      return {};
    }
    case op::inplace: {
      KVEVICT_TRY(detail::check_inplace_dense_shape("compact_inplace", *make_kv_view(cache, H, T, d),
                                                    *make_matrix_view(kept, H, k)));
      if (!r8_kept_ok(kept, H, k, T, true)) return status::error(errc::not_sorted, "kept");
      detail::parallel_for(be, H, [&](index_t h) {
        detail::gather_rows_with(c, cache + h * T * d, d, static_cast<const E*>(cache + h * T * d), d, kept + h * k, 1,
                                 k, 0, d, true);
      });
      return {};
    }
    case op::append: break;
  }
  return status::error(errc::invalid_argument, "kvevict_r8: not an op of round eight's gather");
}

/// Rows a call moves.
template <class E>
index_t rows_moved(const compact_case<E>& c, op o, index_t n_append) {
  switch (o) {
    case op::dense:
    case op::inplace: return c.H * c.k;
    case op::ragged: return c.rcu.back();
    case op::append: return c.H * n_append;
  }
  return 0;
}

template <class E, class Backend>
void run(benchmark::State& st, index_t H, index_t T, index_t d, index_t k, op o, index_t n_append, impl which,
         Backend be) {
  const auto& c = get_case<E>(H, T, d, k);
  const bool parallel = std::is_same_v<Backend, par_t>;
  const int threads = parallel ? par_threads() : 1;
  const std::size_t row_bytes = static_cast<std::size_t>(d) * sizeof(E);
  const std::size_t bytes = static_cast<std::size_t>(rows_moved(c, o, n_append)) * row_bytes;
  if (which == impl::memcpy) return run_memcpy_bound(st, bytes, bytes, parallel);

  const bool ragged = o == op::ragged;
  const pos_t* kept = ragged ? c.rkept.data() : c.kept.data();
  const std::int32_t* cu = ragged ? c.rcu.data() : c.cu_k.data();
  buffer<E> out;
  std::vector<E> expected;
  if (o == op::dense || o == op::ragged) {
    out.resize(static_cast<std::size_t>(cu[H] * d));
    expected.assign(out.size(), E{});
    baseline::gather_rows(c.src.data(), T, d, kept, cu, H, expected.data(), 1);
  }
  // in place: a private copy of the cache (the timed calls compact it again and again: the same
  // rows move every time, only their contents change)
  buffer<E> cache;
  if (o == op::inplace) {
    cache.resize(c.src.size());
    std::memcpy(static_cast<void*>(cache.data()), c.src.data(), c.src.size() * sizeof(E));
  }
  // append: a ragged cache of k + n rows per head holding k; each call appends n and is undone
  std::vector<E> rcache, rows;
  std::vector<std::int32_t> cap(static_cast<std::size_t>(H + 1)), lens(static_cast<std::size_t>(H), static_cast<std::int32_t>(k));
  if (o == op::append) {
    for (index_t h = 0; h <= H; ++h) cap[static_cast<std::size_t>(h)] = static_cast<std::int32_t>(h * (k + n_append));
    rcache.assign(static_cast<std::size_t>(cap.back() * d), E{});
    rows.assign(static_cast<std::size_t>(H * n_append * d), E{});
    for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = c.src[i];
  }
  auto call = [&]() -> status {
    switch (o) {
      case op::dense:
        return compact(be, c.src_view(), *make_matrix_view(kept, H, k), *make_kv_view(out.data(), H, k, d));
      case op::ragged:
        return compact(be, c.src_view(), ragged_positions{kept, cu, H},
                       ragged_cache<E>{out.data(), cu, lens.data(), H, d, d});
      case op::inplace: return compact_inplace(be, *make_kv_view(cache.data(), H, T, d), *make_matrix_view(kept, H, k));
      case op::append: {
        for (auto& l : lens) l = static_cast<std::int32_t>(k);
        return append(be, ragged_cache<E>{rcache.data(), cap.data(), lens.data(), H, d, d},
                      *make_kv_view(static_cast<const E*>(rows.data()), H, n_append, d));
      }
    }
    return status::error(errc::invalid_argument, "unknown op");
  };
  auto by_hand = [&]() {
    switch (o) {
      case op::dense:
      case op::ragged: return baseline::gather_rows(c.src.data(), T, d, kept, cu, H, out.data(), threads);
      case op::inplace: {
        E* base = cache.data();
#pragma omp parallel for schedule(static) num_threads(threads)
        for (index_t h = 0; h < H; ++h)
          for (index_t j = 0; j < k; ++j)
            if (kept[h * k + j] != j) std::memcpy(base + (h * T + j) * d, base + (h * T + kept[h * k + j]) * d, row_bytes);
        return;
      }
      case op::append: {
        E* base = rcache.data();
#pragma omp parallel for schedule(static) num_threads(threads)
        for (index_t h = 0; h < H; ++h) {
          std::memcpy(base + (cap[h] + k) * d, rows.data() + h * n_append * d, row_bytes * static_cast<std::size_t>(n_append));
          lens[static_cast<std::size_t>(h)] = static_cast<std::int32_t>(k + n_append);
        }
        return;
      }
    }
  };
  for (auto _ : st) {
    if (which == impl::kvevict) {
      if (!ok(st, call(), op_name(o))) return;
    } else if (which == impl::kvevict_r8) {
      if (!ok(st, r8_compact(be, o, c.src.data(), H, T, d, k, kept, cu, lens.data(), out.data(), cache.data()),
              op_name(o)))
        return;
    } else {
      by_hand();
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::DoNotOptimize(cache.data());
    benchmark::DoNotOptimize(rcache.data());
    benchmark::ClobberMemory();
  }
  set_traffic(st, bytes, bytes);
  // results: the gathered rows are bit-identical to the hand-written gather's
  if ((o == op::dense || o == op::ragged) && std::memcmp(out.data(), expected.data(), out.size() * sizeof(E)) != 0)
    fail(st, "compacted rows differ from the gathered rows");
  if (o == op::append) {
    for (index_t h = 0; h < H; ++h)
      if (lens[h] != k + n_append ||
          std::memcmp(rcache.data() + (cap[h] + k) * d, rows.data() + h * n_append * d, row_bytes * n_append) != 0)
        return fail(st, "appended rows differ");
  }
}

template <class E>
void reg_case(const std::string& shape, index_t H, index_t T, index_t d, index_t k, op o, index_t n_append = 0) {
  params p;
  p.add("shape", shape).add("hkv", H).add("d", d).add("T", T).add("k", k);
  if (o == op::append) p.add("n", n_append);
  p.add("kv", kv_type_name(E{}));
  for (impl i : {impl::kvevict, impl::kvevict_r8, impl::gather, impl::memcpy}) {
    if (i == impl::kvevict_r8 && o == op::append) continue;
    add(bench_name("compact", op_name(o), impl_name(i), "seq", p),
        [=](benchmark::State& st) { run<E>(st, H, T, d, k, o, n_append, i, seq); });
    add(bench_name("compact", op_name(o), impl_name(i), "par", p),
        [=](benchmark::State& st) { run<E>(st, H, T, d, k, o, n_append, i, par); });
  }
  // kvevict on an engine's executor (harness.hpp: par_threads() workers, or the calling thread)
  add(bench_name("compact", op_name(o), "kvevict", "exec", p),
      [=](benchmark::State& st) { run<E>(st, H, T, d, k, o, n_append, impl::kvevict, on(bench_executor())); });
  add(bench_name("compact", op_name(o), "kvevict", "exec1", p),
      [=](benchmark::State& st) { run<E>(st, H, T, d, k, o, n_append, impl::kvevict, on(bench_inline_executor())); });
}

/// fp16 (the usual KV dtype): dense over every context and budget; fp32 and the other ops at one
/// budget per context; append (independent of the context) once per shape.
template <class E>
void reg_type() {
  const bool sweep = std::is_same_v<E, float16>;
  for (const auto& mc : model_cases()) {
    const model_shape& s = mc.shape;
    const index_t T = mc.tokens;
    for (index_t k : budgets_for(T, sweep)) reg_case<E>(s.name, s.hkv, T, s.dim, k, op::dense);
    for (index_t k : budgets_for(T, false)) {
      reg_case<E>(s.name, s.hkv, T, s.dim, k, op::ragged);
      reg_case<E>(s.name, s.hkv, T, s.dim, k, op::inplace);
      if (T == 32768 || T == runner_context || smoke())
        for (index_t n : {1, 64}) reg_case<E>(s.name, s.hkv, T, s.dim, k, op::append, n);
    }
  }
}

void register_benchmarks() {
  reg_type<float16>();
  reg_type<float>();
}
}  // namespace

KVB_MAIN(register_benchmarks)
