// python/src/budget.cpp: the budget allocators (uniform, PyramidKV, AdaKV, LAVa, CAKE, Duo) and
// the named schemes (docs/budget.md). Budget matrices are small host arrays: returned as NumPy
// int32 [L][H] unless a score tensor gives the library (AdaKV returns like its scores).
#include "common.hpp"

#include <pybind11/numpy.h>

namespace kvevict::python {

namespace {

tensor numpy_output(const char* name, std::vector<index_t> shape, dtype type) {
  tensor like;
  like.from = origin::numpy;
  return output(py::none(), name, like, std::move(shape), type);
}

protection prot_of(index_t n_sink, index_t n_recent) { return protection{n_sink, n_recent}; }

std::vector<double> doubles(py::handle seq, const char* name) {
  try {
    return seq.cast<std::vector<double>>();
  } catch (const py::cast_error&) {
    raise(errc::invalid_argument, std::string(name) + " must be a sequence of numbers");
  }
}

py::object uniform(index_t total, index_t prompt, index_t layers, index_t heads, index_t n_sink, index_t n_recent) {
  const tensor out = numpy_output("budgets", {layers, heads}, dtype::i32);
  const auto ov = mat<std::int32_t>(out);
  run([&] { return uniform_budgets(total, prompt, prot_of(n_sink, n_recent), ov); });
  return out.object;
}

py::object pyramid(index_t budget, index_t prompt, index_t layers, index_t heads, index_t beta, index_t n_sink,
                   index_t n_recent, pyramid_rounding rounding) {
  const tensor out = numpy_output("budgets", {layers, heads}, dtype::i32);
  const auto ov = mat<std::int32_t>(out);
  pyramid_options po;
  po.beta = beta;
  po.prot = prot_of(n_sink, n_recent);
  po.rounding = rounding;
  run([&] { return pyramid_budgets(budget, prompt, po, ov); });
  return out.object;
}

py::tuple adakv(py::handle s_, index_t budget, py::handle lengths_, double alpha, adakv_floor floor, index_t n_sink,
                index_t n_recent) {
  const tensor s = float_matrix(s_, "scores");
  const tensor lengths = as_optional(lengths_, "lengths", 1);
  const std::int32_t* len = int32_array(lengths, s.shape[0]);
  if (budget < 0 || budget > INT32_MAX / (s.shape[0] > 0 ? s.shape[0] : 1))
    raise(errc::invalid_argument, "adakv_budgets: budget " + std::to_string(budget) + " is out of range");
  const tensor cu = output(py::none(), "cu", s, {s.shape[0] + 1}, dtype::i32);
  const tensor pos = output(py::none(), "positions", s, {budget * s.shape[0]}, dtype::i32);
  const auto sv = mat<const float>(s);
  adakv_options opt;
  opt.alpha = alpha;
  opt.floor = floor;
  opt.prot = prot_of(n_sink, n_recent);
  run_ws([&](workspace& ws) {
    return adakv_budgets(backend(), ws, sv, len, budget, opt, static_cast<std::int32_t*>(cu.data),
                         static_cast<pos_t*>(pos.data));
  });
  return py::make_tuple(pos.object, cu.object);
}

double lava_entropy(py::handle s_, py::handle lengths_, entropy_norm norm, index_t n_sink, index_t n_recent) {
  const tensor s = float_matrix(s_, "scores");
  const tensor lengths = as_optional(lengths_, "lengths", 1);
  const std::int32_t* len = int32_array(lengths, s.shape[0]);
  const auto sv = mat<const float>(s);
  lava_entropy_options opt;
  opt.prot = prot_of(n_sink, n_recent);
  opt.norm = norm;
  double e = 0.0;
  run([&] { return lava_layer_entropy(backend(), sv, len, opt, &e); });
  return e;
}

py::object lava_budgets(py::handle entropies, index_t heads, index_t prompt, index_t total, index_t n_sink,
                        index_t n_recent) {
  const std::vector<double> e = doubles(entropies, "entropies");
  const tensor out = numpy_output("layer_totals", {static_cast<index_t>(e.size())}, dtype::i64);
  run([&] {
    return lava_layer_budgets(e.data(), static_cast<index_t>(e.size()), heads, prompt, prot_of(n_sink, n_recent),
                              total, static_cast<index_t*>(out.data));
  });
  return out.object;
}

py::tuple cake_stats_py(py::handle a_, variance_estimator var) {
  const tensor a = as_tensor(a_, "attention", 3);
  require_dtype(a, {dtype::f32});
  require_host(a);
  const auto av = kv<const float>(a);
  cake_stats st;
  run([&] { return cake_layer_stats(backend(), av, &st, var); });
  return py::make_tuple(st.entropy, st.variance);
}

double cake_pref(double entropy, double variance, double tau1, double tau2) {
  double p = 0.0;
  cake_options opt;
  opt.tau1 = tau1;
  opt.tau2 = tau2;
  throw_if(cake_preference(cake_stats{entropy, variance}, opt, &p));
  return p;
}

double cake_window_pref(py::handle q_, py::handle k_, double tau1, double tau2) {
  const cake_window_args a(q_, k_, tau1, tau2);
  double p = 0.0;
  run_ws([&](workspace& ws) { return cake_window_preference(backend(), ws, a.queries(), a.keys(), a.opt, &p); });
  return p;
}

py::object cake(py::handle prefs, index_t budget, index_t prompt, index_t heads, index_t n_sink, index_t n_recent) {
  const std::vector<double> p = doubles(prefs, "preferences");
  const tensor out = numpy_output("budgets", {static_cast<index_t>(p.size()), heads}, dtype::i32);
  const auto ov = mat<std::int32_t>(out);
  run([&] { return cake_budgets(p.data(), budget, prompt, prot_of(n_sink, n_recent), ov); });
  return out.object;
}

duo_options duo_opts(index_t n_sink, index_t n_recent, index_t retrieval_budget) {
  duo_options o;
  o.streaming = prot_of(n_sink, n_recent);
  o.retrieval_budget = retrieval_budget;
  return o;
}

py::tuple duo(py::handle mask_, index_t prompt, index_t n_sink, index_t n_recent, index_t retrieval_budget) {
  const tensor mask = as_tensor(mask_, "mask", 2);
  require_host(mask);
  require_dtype(mask, {dtype::f32, dtype::u8, dtype::boolean, dtype::i32});
  const tensor out = numpy_output("budgets", {mask.shape[0], mask.shape[1]}, dtype::i32);
  const auto ov = mat<std::int32_t>(out);
  const duo_options opt = duo_opts(n_sink, n_recent, retrieval_budget);
  index_t total = 0;
  auto go = [&](auto e) {
    using M = decltype(e);
    const auto mv = mat<const M>(mask);
    run([&] { return duo_budgets(mv, prompt, opt, ov, &total); });
  };
  if (mask.type == dtype::f32) go(float{});
  else if (mask.type == dtype::i32) go(std::int32_t{});
  else go(std::uint8_t{});
  return py::make_tuple(out.object, total);
}

py::object streaming(index_t prompt, index_t n_sink, index_t n_recent) {
  const index_t n = protected_count(prompt, n_sink, n_recent);
  const tensor out = numpy_output("positions", {n > 0 ? n : 0}, dtype::i32);
  value_or_raise(streaming_positions(prompt, prot_of(n_sink, n_recent), static_cast<pos_t*>(out.data)));
  return out.object;
}

py::tuple allocation_py(budget_scheme s, index_t budget, index_t prompt, index_t layers, index_t heads, index_t n_sink,
                        index_t n_recent, py::handle retrieval_) {
  const tensor out = numpy_output("budgets", {layers, heads}, dtype::i32);
  auto* p = static_cast<std::int32_t*>(out.data);
  for (index_t i = 0; i < layers * heads; ++i) p[i] = 0;
  allocation_request req;
  req.budget = budget;
  req.prompt = prompt;
  req.prot = prot_of(n_sink, n_recent);
  const tensor retrieval = as_optional(retrieval_, "retrieval", 2);
  if (retrieval.data != nullptr) {
    require_dtype(retrieval, {dtype::u8, dtype::boolean});
    require_host(retrieval);
    req.retrieval = mat<const std::uint8_t>(retrieval);
  }
  const auto ov = mat<std::int32_t>(out);
  allocation a;
  index_t kept = 0;
  run([&] { return make_allocation(s, req, ov, &a, &kept); });
  return py::make_tuple(a.kind, out.object, kept);
}

py::object offsets(py::handle budgets_) {
  const tensor b = as_tensor(budgets_, "budgets", 1);
  const std::int32_t* bp = int32_array(b, b.shape[0]);
  const tensor out = numpy_output("cu", {b.shape[0] + 1}, dtype::i32);
  run([&] { return budget_offsets(bp, b.shape[0], static_cast<std::int32_t*>(out.data)); });
  return out.object;
}

py::object apportion_py(index_t target, py::handle weights, py::object caps_) {
  const std::vector<double> w = doubles(weights, "weights");
  std::vector<index_t> caps;
  if (!caps_.is_none()) caps = caps_.cast<std::vector<index_t>>();
  if (!caps_.is_none() && caps.size() != w.size())
    raise(errc::shape_mismatch, "apportion: caps has " + std::to_string(caps.size()) + " entries, weights " +
                                    std::to_string(w.size()));
  const tensor out = numpy_output("shares", {static_cast<index_t>(w.size())}, dtype::i64);
  run([&] {
    return apportion(target, w.data(), caps_.is_none() ? nullptr : caps.data(), static_cast<index_t>(w.size()),
                     static_cast<index_t*>(out.data));
  });
  return out.object;
}

}  // namespace

void bind_budget(py::module_& m) {
  using namespace pybind11::literals;
  m.def("uniform_budgets", &uniform, "total"_a, "prompt_length"_a, "layers"_a, "heads"_a, "n_sink"_a = 0,
        "n_recent"_a = 0, "Every head floor(total / (L H)), the first total mod (L H) heads one more: int32 [L][H].");
  m.def("pyramid_budgets", &pyramid, "budget"_a, "prompt_length"_a, "layers"_a, "heads"_a, "beta"_a = 20,
        "n_sink"_a = 0, "n_recent"_a = 0, "rounding"_a = pyramid_rounding::exact,
        "PyramidKV per-head budgets [L][H] (exact totals, or KVCache-Factory's rounding).");
  m.def("adakv_budgets", &adakv, "scores"_a, "budget"_a, "lengths"_a = py::none(), "alpha"_a = 0.2,
        "floor"_a = adakv_floor::budget, "n_sink"_a = 0, "n_recent"_a = 0,
        "AdaKV for one layer: B x H tokens, each head its floor then the joint best: (positions, cu).");
  m.def("lava_layer_entropy", &lava_entropy, "scores"_a, "lengths"_a = py::none(), "norm"_a = entropy_norm::log_count,
        "n_sink"_a = 0, "n_recent"_a = 0, "LAVa Eq. 7-8: the normalised entropy of a layer's unprotected scores.");
  m.def("lava_layer_budgets", &lava_budgets, "entropies"_a, "heads"_a, "prompt_length"_a, "total"_a, "n_sink"_a = 0,
        "n_recent"_a = 0, "LAVa's layer totals [L] (int64) in proportion to the entropies, exact total.");
  m.def("cake_layer_stats", &cake_stats_py, "attention"_a, "variance"_a = variance_estimator::unbiased,
        "CAKE's (entropy, variance) of a layer's window attention probabilities [R][w][C].");
  m.def("cake_preference", &cake_pref, "entropy"_a, "variance"_a, "tau1"_a = 1.0, "tau2"_a = 1.0,
        "CAKE's layer preference entropy^(1/tau1) x variance^(1/tau2).");
  m.def("cake_window_preference", &cake_window_pref, "window_queries"_a, "keys"_a, "tau1"_a = 1.0, "tau2"_a = 1.0,
        "CAKE's layer preference from the window's queries [H_q][w][d] and the keys [H_kv][P][d] (float32, the last "
        "w keys the window's): the window's causal attention over the prefix, cake_layer_stats, cake_preference.");
  m.def("cake_budgets", &cake, "preferences"_a, "budget"_a, "prompt_length"_a, "heads"_a, "n_sink"_a = 0,
        "n_recent"_a = 0, "CAKE per-head budgets [L][H] in proportion to the layers' preferences (exact total).");
  m.def("duo_budgets", &duo, "mask"_a, "prompt_length"_a, "n_sink"_a = 0, "n_recent"_a = 0,
        "retrieval_budget"_a = -1, "DuoAttention / PruLong: (budgets [L][H], total) of a retrieval-head mask [L][H].");
  m.def("streaming_positions", &streaming, "prompt_length"_a, "n_sink"_a, "n_recent"_a,
        "The kept positions of a streaming head: sinks then the recent window.");
  m.def(
      "duo_retrieval_heads",
      [](index_t total, index_t layers, index_t heads, index_t prompt, index_t n_sink, index_t n_recent,
         index_t retrieval_budget) {
        return value_or_raise(
            duo_retrieval_heads(total, layers, heads, prompt, duo_opts(n_sink, n_recent, retrieval_budget)));
      },
      "total"_a, "layers"_a, "heads"_a, "prompt_length"_a, "n_sink"_a = 0, "n_recent"_a = 0, "retrieval_budget"_a = -1,
      "How many retrieval heads a total budget affords.");
  m.def("make_allocation", &allocation_py, "scheme"_a, "budget"_a, "prompt_length"_a, "layers"_a, "heads"_a,
        "n_sink"_a = 0, "n_recent"_a = 0, "retrieval"_a = py::none(),
        "A named scheme's allocation: (allocator, budgets [L][H] int32, tokens kept).");
  m.def("budget_offsets", &offsets, "budgets"_a, "Per-head budgets [H] -> select's offsets cu [H+1].");
  m.def("apportion", &apportion_py, "target"_a, "weights"_a, "caps"_a = py::none(),
        "Exact capped proportional shares (water-filling, largest remainder).");
}

}  // namespace kvevict::python
