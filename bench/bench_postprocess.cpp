// GQA reduction, pooling and the fused post-processing (gqa.hpp, pool.hpp, postprocess.hpp) on
// per-query-head window scores [H_q][T], against
//   naive    the direct loops (pooling: the max / sum over each window, O(T k))
//   chain    (for the fused op) the individual kvevict stages one after the other
//   memcpy   the bandwidth bound: memcpy moving the stage's traffic (harness.hpp)
// Ops: gqa_mean, gqa_max; pool_max7, pool_avg5 (every query head); snapkv (pool max 7 per query
// head, then GQA mean, protect the window: recipe::snapkv's post-processing); lava (GQA max, then
// pool max 7, weight by the head's max value L1 norm over fp16 values [H_kv][T][d], protect); cake
// (avg pool 5 per query head, GQA mean, protect: recipe::cake's post-processing); vatp (snapkv's,
// then weight by each token's value L1 norm: recipe::vatp's); h2o (GQA mean, no pooling, protect the
// window: recipe::h2o's) and tova (GQA mean, no pooling, nothing protected: recipe::tova's), fused and
// chain; alone, in place on [H_kv][T] rows (each timed call applies the stage again to the previous
// result, from +inf rows for the weighting; one call on fresh rows is checked): protect (4 sinks and the window: StreamingLLM's and
// Knorm's whole post-processing is protect), weight_tok / weight_max (weight_by_value_norm per token
// / head max).
#include <kvevict/gqa.hpp>
#include <kvevict/pool.hpp>
#include <kvevict/postprocess.hpp>
#include <kvevict/protect.hpp>
#include <kvevict/weight.hpp>

#include "baselines.hpp"
#include "harness.hpp"

#include <algorithm>
#include <cfloat>
#include <tuple>

namespace {
using namespace kvb;

struct pp_case {
  model_shape s;
  index_t T;
  std::vector<float> in;       // [hq][T] attention-like scores
  std::vector<float16> values; // [hkv][T][d]
  pp_case(const model_shape& shape, index_t tokens) : s(shape), T(tokens) {
    in.resize(static_cast<std::size_t>(s.hq * T));
    fill_attention_like(in, 21);
    values.resize(static_cast<std::size_t>(s.hkv * T * s.dim));
    fill_normal(values, 22);
  }
  matrix_view<const float> in_view() const { return *make_matrix_view(in.data(), s.hq, T); }
  kv_view<const float16> values_view() const { return *make_kv_view(values.data(), s.hkv, T, s.dim); }
};

const pp_case& get_case(const model_shape& s, index_t T) {
  return cached<pp_case>(std::make_tuple(std::string(s.name), T), [&] { return std::make_unique<pp_case>(s, T); });
}

enum class op { gqa_mean, gqa_max, pool_max7, pool_avg5, snapkv, lava, cake, vatp, h2o, tova, protect, weight_tok, weight_max };
const char* op_name(op o) {
  switch (o) {
    case op::gqa_mean: return "gqa_mean";
    case op::gqa_max: return "gqa_max";
    case op::pool_max7: return "pool_max7";
    case op::pool_avg5: return "pool_avg5";
    case op::snapkv: return "snapkv";
    case op::lava: return "lava";
    case op::cake: return "cake";
    case op::vatp: return "vatp";
    case op::h2o: return "h2o";
    case op::tova: return "tova";
    case op::protect: return "protect";
    case op::weight_tok: return "weight_tok";
    case op::weight_max: return "weight_max";
  }
  return "?";
}
bool is_pool(op o) { return o == op::pool_max7 || o == op::pool_avg5; }
bool is_fused(op o) {
  return o == op::snapkv || o == op::lava || o == op::cake || o == op::vatp || o == op::h2o || o == op::tova;
}
bool in_place(op o) { return o == op::protect || o == op::weight_tok || o == op::weight_max; }
bool reads_values(op o) { return o == op::lava || o == op::vatp || o == op::weight_tok || o == op::weight_max; }
constexpr index_t protect_sinks = 4;  // op::protect: StreamingLLM's sinks, and the window
index_t out_rows(const model_shape& s, op o) { return is_pool(o) ? s.hq : s.hkv; }

postprocess_options fused_options(const model_shape& s, op o) {
  postprocess_options opt;
  opt.pool = pool_kind::max;
  opt.kernel = 7;
  opt.n_recent = s.window;
  if (o == op::h2o || o == op::tova) {
    opt.gqa = gqa_op::mean;
    opt.pool = pool_kind::none;
    opt.kernel = 1;
    if (o == op::tova) opt.n_recent = 0;
    return opt;
  }
  if (o == op::snapkv || o == op::cake || o == op::vatp) {
    opt.gqa = gqa_op::mean;
    opt.order = gqa_order::pool_first;
    if (o == op::cake) {
      opt.pool = pool_kind::avg;
      opt.kernel = 5;
    }
    if (o == op::vatp) {
      opt.weight_values = true;
      opt.weight = value_weight::per_token;
    }
  } else {
    opt.gqa = gqa_op::max;
    opt.order = gqa_order::gqa_first;
    opt.weight_values = true;
    opt.weight = value_weight::head_max;
  }
  return opt;
}

/// Bytes a stage must read and write (scores fp32; lava also reads the values once).
std::pair<std::size_t, std::size_t> traffic(const pp_case& c, op o) {
  const std::size_t in = static_cast<std::size_t>((in_place(o) ? c.s.hkv : c.s.hq) * c.T) * 4;
  const std::size_t out = static_cast<std::size_t>(out_rows(c.s, o) * c.T) * 4;
  const std::size_t vals = reads_values(o) ? c.values.size() * sizeof(float16) : 0;
  return {in + vals, out};
}

/// kvevict, one call (gqa_reduce, pool1d or postprocess_scores).
template <class Backend>
status run_fused(Backend be, workspace& ws, const pp_case& c, op o, matrix_view<float> out) {
  switch (o) {
    case op::gqa_mean: return gqa_reduce(be, c.in_view(), out, gqa_op::mean);
    case op::gqa_max: return gqa_reduce(be, c.in_view(), out, gqa_op::max);
    case op::pool_max7: return pool1d(be, c.in_view(), out, pool_kind::max, 7);
    case op::pool_avg5: return pool1d(be, c.in_view(), out, pool_kind::avg, 5);
    case op::snapkv:
    case op::cake: return postprocess_scores(be, ws, c.in_view(), out, fused_options(c.s, o));
    case op::h2o:
    case op::tova: return postprocess_scores(be, ws, c.in_view(), out, fused_options(c.s, o));
    case op::lava:
    case op::vatp: return postprocess_scores(be, ws, c.in_view(), out, c.values_view(), fused_options(c.s, o));
    case op::protect: return protect(be, out, protect_sinks, c.s.window);
    case op::weight_tok: return weight_by_value_norm(be, out, c.values_view(), value_weight::per_token);
    case op::weight_max: return weight_by_value_norm(be, out, c.values_view(), value_weight::head_max);
  }
  return status::error(errc::invalid_argument, "unknown op");
}

/// kvevict, the chain of stages the fused op replaces (docs/postprocess.md).
template <class Backend>
status run_chain(Backend be, const pp_case& c, op o, float* tmp, matrix_view<float> out) {
  if (o == op::h2o || o == op::tova) {
    KVEVICT_TRY(gqa_reduce(be, c.in_view(), out, gqa_op::mean));
    return protect(be, out, 0, fused_options(c.s, o).n_recent);
  }
  if (o != op::lava) {
    const auto t = *make_matrix_view(tmp, c.s.hq, c.T);
    if (o == op::cake) KVEVICT_TRY(pool1d(be, c.in_view(), t, pool_kind::avg, 5));
    else KVEVICT_TRY(pool1d(be, c.in_view(), t, pool_kind::max, 7));
    KVEVICT_TRY(gqa_reduce(be, matrix_view<const float>(t), out, gqa_op::mean));
    if (o == op::vatp) KVEVICT_TRY(weight_by_value_norm(be, out, c.values_view(), value_weight::per_token));
  } else {
    const auto t = *make_matrix_view(tmp, c.s.hkv, c.T);
    KVEVICT_TRY(gqa_reduce(be, c.in_view(), t, gqa_op::max));
    KVEVICT_TRY(pool1d(be, matrix_view<const float>(t), out, pool_kind::max, 7));
    KVEVICT_TRY(weight_by_value_norm(be, out, c.values_view(), value_weight::head_max));
  }
  return protect(be, out, 0, c.s.window);
}

/// The direct loops, parallel over output rows with `threads` threads.
void run_naive_once(const pp_case& c, op o, float* tmp, float* out, int threads) {
  const index_t T = c.T, g = c.s.group(), hkv = c.s.hkv, hq = c.s.hq;
  const float* in = c.in.data();
  auto reduce = [&](const float* src, float* dst, bool mean) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (index_t h = 0; h < hkv; ++h)
      for (index_t t = 0; t < T; ++t) {
        float acc = src[(h * g) * T + t];
        for (index_t j = 1; j < g; ++j) {
          const float x = src[(h * g + j) * T + t];
          acc = mean ? acc + x : std::max(acc, x);
        }
        dst[h * T + t] = mean ? acc / static_cast<float>(g) : acc;
      }
  };
  auto pool = [&](const float* src, float* dst, index_t rows, bool max, index_t kernel) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (index_t r = 0; r < rows; ++r) {
      if (max)
        baseline::max_pool_row(src + r * T, dst + r * T, T, kernel);
      else
        baseline::avg_pool_row(src + r * T, dst + r * T, T, kernel);
    }
  };
  auto protect_rows = [&](float* dst) {
    for (index_t h = 0; h < hkv; ++h)
      for (index_t t = std::max<index_t>(0, T - c.s.window); t < T; ++t) dst[h * T + t] = INFINITY;
  };
  auto value_norm = [&](index_t h, index_t t) {
    float n = 0.f;
    for (index_t e = 0; e < c.s.dim; ++e)
      n += std::fabs(to_float(c.values[static_cast<std::size_t>((h * T + t) * c.s.dim + e)]));
    return n;
  };
  switch (o) {
    case op::gqa_mean: return reduce(in, out, true);
    case op::gqa_max: return reduce(in, out, false);
    case op::pool_max7: return pool(in, out, hq, true, 7);
    case op::pool_avg5: return pool(in, out, hq, false, 5);
    case op::snapkv:
    case op::cake:
      pool(in, tmp, hq, o == op::snapkv, o == op::snapkv ? 7 : 5);
      reduce(tmp, out, true);
      return protect_rows(out);
    case op::vatp: {
      pool(in, tmp, hq, true, 7);
      reduce(tmp, out, true);
      const index_t d = c.s.dim;
#pragma omp parallel for schedule(static) num_threads(threads)
      for (index_t h = 0; h < hkv; ++h)
        for (index_t t = 0; t < T; ++t) {
          float n = 0.f;
          for (index_t e = 0; e < d; ++e) n += std::fabs(to_float(c.values[static_cast<std::size_t>((h * T + t) * d + e)]));
          out[h * T + t] *= n;
        }
      return protect_rows(out);
    }
    case op::lava: {
      reduce(in, tmp, false);
      pool(tmp, out, hkv, true, 7);
      const index_t d = c.s.dim;
#pragma omp parallel for schedule(static) num_threads(threads)
      for (index_t h = 0; h < hkv; ++h) {
        float mx = 0.f;
        for (index_t t = 0; t < T; ++t) {
          float n = 0.f;
          for (index_t e = 0; e < d; ++e) n += std::fabs(to_float(c.values[static_cast<std::size_t>((h * T + t) * d + e)]));
          mx = std::max(mx, n);
        }
        for (index_t t = 0; t < T; ++t) out[h * T + t] *= mx;
      }
      return protect_rows(out);
    }
    case op::h2o:
    case op::tova:
      reduce(in, out, true);
      if (o == op::h2o) protect_rows(out);
      return;
    case op::protect:  // in place on out
      for (index_t h = 0; h < hkv; ++h)
        for (index_t t = 0; t < T; ++t) {
          float& v = out[h * T + t];
          v = t < protect_sinks || t >= T - c.s.window ? INFINITY : v == INFINITY ? FLT_MAX : v;
        }
      return;
    case op::weight_tok:
    case op::weight_max:  // in place on out
#pragma omp parallel for schedule(static) num_threads(threads)
      for (index_t h = 0; h < hkv; ++h) {
        float mx = 0.f;
        if (o == op::weight_max)
          for (index_t t = 0; t < T; ++t) mx = std::max(mx, value_norm(h, t));
        for (index_t t = 0; t < T; ++t) out[h * T + t] *= o == op::weight_max ? mx : value_norm(h, t);
      }
      return;
  }
}

/// The kvevict seq result of the op (the reference every impl is checked against).
std::vector<float> reference(const pp_case& c, op o) {
  std::vector<float> out(static_cast<std::size_t>(out_rows(c.s, o) * c.T));
  if (in_place(o)) std::copy(c.in.begin(), c.in.begin() + static_cast<std::ptrdiff_t>(out.size()), out.begin());
  scratch sc;
  const auto ov = *make_matrix_view(out.data(), out_rows(c.s, o), c.T);
  (void)run_fused(seq, sc.ws(), c, o, ov);  // the size query (the in-place stages take no workspace: a call)
  sc.allocate();
  if (in_place(o)) std::copy(c.in.begin(), c.in.begin() + static_cast<std::ptrdiff_t>(out.size()), out.begin());
  if (!run_fused(seq, sc.ws(), c, o, ov).ok()) out.clear();
  return out;
}

/// exact: bit for bit; otherwise within 1e-6 relative (a different summation order in avg pooling).
void check(benchmark::State& st, const std::vector<float>& ref, const std::vector<float>& out, bool exact) {
  if (ref.size() != out.size() || ref.empty()) return fail(st, "no reference");
  if (exact && std::memcmp(ref.data(), out.data(), ref.size() * sizeof(float)) != 0)
    return fail(st, "output differs from kvevict's");
  if (exact) return;
  double worst = 0;
  for (std::size_t i = 0; i < ref.size(); ++i)
    if (ref[i] != out[i])
      worst = std::max(worst, std::fabs(static_cast<double>(ref[i]) - out[i]) / std::fabs(static_cast<double>(ref[i])));
  st.counters["max_rel_diff"] = worst;
  if (!(worst <= 1e-6)) fail(st, "output differs from kvevict's by " + std::to_string(worst) + " relative");
}

enum class impl { kvevict, chain, naive, memcpy };

template <class Backend>
void run(benchmark::State& st, const model_shape& s, index_t T, op o, impl which, Backend be) {
  const auto& c = get_case(s, T);
  const auto [rd, wr] = traffic(c, o);
  const bool parallel = std::is_same_v<Backend, par_t>;
  if (which == impl::memcpy) return run_memcpy_bound(st, rd, wr, parallel);
  const std::vector<float> ref = reference(c, o);
  std::vector<float> out(ref.size(), 0.f), tmp(static_cast<std::size_t>(s.hq * T));
  const auto ov = *make_matrix_view(out.data(), out_rows(s, o), T);
  scratch sc;
  if (which == impl::kvevict) {
    if (!ok(st, run_fused(be, sc.ws(), c, o, ov), "size query")) return;
    sc.allocate();
  }
  // the naive value norms use another summation order
  const bool exact = which != impl::naive || (o != op::pool_avg5 && o != op::cake && !reads_values(o));
  const auto once = [&] {  // one call, for the in-place stages on fresh rows
    if (in_place(o)) std::copy(c.in.begin(), c.in.begin() + static_cast<std::ptrdiff_t>(out.size()), out.begin());
    if (which == impl::kvevict) return ok(st, run_fused(be, sc.ws(), c, o, ov), op_name(o));
    if (which == impl::chain) return ok(st, run_chain(be, c, o, tmp.data(), ov), op_name(o));
    run_naive_once(c, o, tmp.data(), out.data(), parallel ? par_threads() : 1);
    return true;
  };
  if (in_place(o)) {
    if (!once()) return;
    check(st, ref, out, exact);
    // the timed weighting calls start from +inf rows, a fixed point (inf x norm = inf, inf x 0 = NaN):
    // the same work on every call, and no compounding into subnormal scores
    if (reads_values(o)) std::fill(out.begin(), out.end(), INFINITY);
  }
  for (auto _ : st) {
    if (which == impl::kvevict) {
      if (!ok(st, run_fused(be, sc.ws(), c, o, ov), op_name(o))) return;
    } else if (which == impl::chain) {
      if (!ok(st, run_chain(be, c, o, tmp.data(), ov), op_name(o))) return;
    } else {
      run_naive_once(c, o, tmp.data(), out.data(), parallel ? par_threads() : 1);
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  set_traffic(st, rd, wr);
  if (!in_place(o)) check(st, ref, out, exact);
}

void register_benchmarks() {
  for (const auto& mc : model_cases()) {
    const model_shape s = mc.shape;
    const index_t T = mc.tokens;
    for (op o : {op::gqa_mean, op::gqa_max, op::pool_max7, op::pool_avg5, op::snapkv, op::lava, op::cake, op::vatp,
                 op::h2o, op::tova, op::protect, op::weight_tok, op::weight_max}) {
      const params p = shape_params(s, T).add("w", s.window);
      auto reg = [&](const char* iname, impl which) {
        add(bench_name("postprocess", op_name(o), iname, "seq", p),
            [=](benchmark::State& st) { run(st, s, T, o, which, seq); });
        add(bench_name("postprocess", op_name(o), iname, "par", p),
            [=](benchmark::State& st) { run(st, s, T, o, which, par); });
      };
      reg("kvevict", impl::kvevict);
      add_avx2_twin("postprocess", op_name(o), "kvevict", p,
                    [=](benchmark::State& st) { run(st, s, T, o, impl::kvevict, seq); });
      // the same call on an engine's executor (harness.hpp): a pool of par_threads() workers, and
      // the trivial executor that runs every loop on the calling thread
      add(bench_name("postprocess", op_name(o), "kvevict", "exec", p),
          [=](benchmark::State& st) { run(st, s, T, o, impl::kvevict, on(bench_executor())); });
      add(bench_name("postprocess", op_name(o), "kvevict", "exec1", p),
          [=](benchmark::State& st) { run(st, s, T, o, impl::kvevict, on(bench_inline_executor())); });
      if (is_fused(o)) reg("kvevict_chain", impl::chain);
      reg("naive", impl::naive);
      reg("memcpy", impl::memcpy);
    }
  }
}
}  // namespace

KVB_MAIN(register_benchmarks)
