// python/src/module.cpp: the kvevict._core extension: enums (which also accept their names as
// strings), option structs, recipes, and the registration of every other binding file.
#include "common.hpp"

#include <string>
#include <utility>

namespace kvevict::python {

// metrics.cpp, paged.cpp, distributed.cpp, ragged.cpp (declared here: common.hpp lists the older files)
void bind_metrics(py::module_& m);
void bind_paged(py::module_& m);
void bind_distributed(py::module_& m);
void bind_ragged(py::module_& m);

namespace {

/// A pybind11 enum that also converts from its name: gqa_reduce(s, 2, "max") == gqa_reduce(s, 2, GqaOp.max).
template <class E>
void bind_enum(py::module_& m, const char* name, std::vector<std::pair<const char*, E>> values) {
  py::enum_<E> e(m, name);
  for (const auto& [n, v] : values) e.value(n, v);
  e.def(py::init([name, values](const std::string& s) {
    std::string known;
    for (const auto& [n, v] : values) {
      if (s == n) return v;
      known += (known.empty() ? "" : ", ") + std::string(n);
    }
    raise(errc::invalid_argument, std::string("unknown ") + name + " '" + s + "' (" + known + ")");
  }));
  py::implicitly_convertible<py::str, E>();
}

py::object recipe_scores_py(const recipe& r, py::handle q_, py::handle k_, py::handle v_, py::handle b_,
                            py::handle out_) {
  const tensor k = as_tensor(k_, "keys", 3);
  const tensor q = as_optional(q_, "queries", 3), v = as_optional(v_, "values", 3), b = as_optional(b_, "block_keys", 3);
  require_kv_type({&k, &q, &v, &b});
  if (k.cuda && b.data != nullptr) raise(errc::unsupported, "recipe_scores: block_keys on CUDA are not bound");
  const tensor out = output(out_, "out", k, {k.shape[0], k.shape[1]}, dtype::f32);
  on_device(
      "recipe_scores", {&k, &q, &v, &b, &out},
      [&] {
        dispatch_kv(k, [&](auto e) {
          using T = decltype(e);
          const auto kv_ = kv<const T>(k), qv = optional_kv<T>(q), vv = optional_kv<T>(v), bv = optional_kv<T>(b);
          const auto ov = mat<float>(out);
          run_ws([&](workspace& ws) { return recipe_scores(backend(), ws, r, qv, kv_, vv, ov, bv); });
        });
      },
      [&](gpu::stream_t st) { return gpu::recipe_scores(r, raw_of(q), raw_of(k), raw_of(v), raw_of(out), st); });
  return out.object;
}

py::object recipe_select_py(const recipe& r, py::handle s_, py::handle budget, py::handle out_) {
  const tensor s = score_matrix(s_, "scores");
  if (py::isinstance<py::int_>(budget)) {
    const auto k = budget.cast<index_t>();
    if (k < 0) raise(errc::invalid_argument, "recipe_select: budget " + std::to_string(k) + " is negative");
    const tensor out = output(out_, "out", s, {s.shape[0], k}, dtype::i32);
    on_device(
        "recipe_select", {&s, &out},
        [&] {
          const auto sv = mat<const float>(s);
          const auto ov = mat<pos_t>(out);
          run_ws([&](workspace& ws) { return recipe_select(backend(), ws, r, sv, ov); });
        },
        [&](gpu::stream_t st) { return gpu::recipe_select(r, raw_of(s), raw_of(out), st); });
    return out.object;
  }
  const bool gpu = runs_on_gpu("recipe_select", {&s});
  std::vector<std::int32_t> cu = host_offsets(budget, s.shape[0]);
  // the library checks each budget against the protected tokens and the row on the host only: here
  // for both devices (the CUDA selection would skip a head whose budget exceeds its row)
  for (std::size_t h = 0; h + 1 < cu.size(); ++h) {
    const index_t k = cu[h + 1] - cu[h];
    throw_if(check_budget("recipe_select", k, s.shape[1], r.n_sink, r.n_recent));
    if (k > s.shape[1])
      raise(errc::invalid_argument, "recipe_select: head " + std::to_string(h) + "'s budget " + std::to_string(k) +
                                        " is above the " + std::to_string(s.shape[1]) + " tokens");
  }
  const ragged_outputs o(out_, s, std::move(cu), gpu);
  auto* cup = static_cast<std::int32_t*>(o.cu.data);
  auto* pp = static_cast<pos_t*>(o.positions.data);
  on_device(
      "recipe_select", {&s, &o.positions, &o.cu},
      [&] {
        const auto sv = mat<const float>(s);
        const ragged_positions_out kept{pp, cup, s.shape[0]};
        run_ws([&](workspace& ws) { return recipe_select(backend(), ws, r, sv, kept); });
      },
      [&](gpu::stream_t st) { return gpu::recipe_select_ragged(r, raw_of(s), o.host_cu.data(), cup, pp, st); });
  return py::make_tuple(o.positions.object, o.cu.object);
}

}  // namespace

void bind_enums(py::module_& m) {
  bind_enum<score_reduce>(m, "ScoreReduce", {{"mean", score_reduce::mean}, {"sum", score_reduce::sum},
                                             {"mean_visible", score_reduce::mean_visible},
                                             {"mean_plus_variance", score_reduce::mean_plus_variance}});
  bind_enum<variance_estimator>(m, "VarianceEstimator",
                                {{"unbiased", variance_estimator::unbiased}, {"biased", variance_estimator::biased}});
  bind_enum<gqa_op>(m, "GqaOp", {{"mean", gqa_op::mean}, {"max", gqa_op::max}, {"sum", gqa_op::sum}});
  bind_enum<gqa_order>(m, "GqaOrder", {{"pool_first", gqa_order::pool_first}, {"gqa_first", gqa_order::gqa_first}});
  bind_enum<pool_kind>(m, "PoolKind", {{"none", pool_kind::none}, {"max", pool_kind::max}, {"avg", pool_kind::avg}});
  bind_enum<avg_divisor>(m, "AvgDivisor", {{"kernel", avg_divisor::kernel}, {"valid", avg_divisor::valid}});
  bind_enum<value_weight>(m, "ValueWeight", {{"per_token", value_weight::per_token}, {"head_max", value_weight::head_max}});
  bind_enum<host_isa>(m, "HostIsa", {{"baseline", host_isa::baseline}, {"avx2", host_isa::avx2},
                                     {"avx512", host_isa::avx512}});
  bind_enum<recipe_kind>(m, "RecipeKind",
                         {{"streaming_llm", recipe_kind::streaming_llm}, {"h2o", recipe_kind::h2o},
                          {"tova", recipe_kind::tova}, {"snapkv", recipe_kind::snapkv}, {"knorm", recipe_kind::knorm},
                          {"vatp", recipe_kind::vatp}, {"lava", recipe_kind::lava}, {"cake", recipe_kind::cake}});
  bind_enum<query_source>(m, "QuerySource", {{"prompt_window", query_source::prompt_window},
                                             {"external_block", query_source::external_block}});
  bind_enum<adakv_floor>(m, "AdakvFloor", {{"budget", adakv_floor::budget}, {"evictable", adakv_floor::evictable}});
  bind_enum<entropy_norm>(m, "EntropyNorm", {{"log_count", entropy_norm::log_count}, {"count", entropy_norm::count}});
  bind_enum<pyramid_rounding>(m, "PyramidRounding", {{"exact", pyramid_rounding::exact},
                                                     {"kvcache_factory", pyramid_rounding::kvcache_factory}});
  bind_enum<budget_scheme>(m, "BudgetScheme",
                           {{"uniform", budget_scheme::uniform}, {"pyramid", budget_scheme::pyramid},
                            {"adakv", budget_scheme::adakv}, {"lava", budget_scheme::lava},
                            {"cake", budget_scheme::cake}, {"duo", budget_scheme::duo}});
  bind_enum<cascade_split>(m, "CascadeSplit",
                           {{"flattened", cascade_split::flattened}, {"per_head", cascade_split::per_head}});
  bind_enum<weight_source>(m, "WeightSource",
                           {{"lava_entropy", weight_source::lava_entropy}, {"caller", weight_source::caller}});
  bind_enum<chunk_queries>(m, "ChunkQueries", {{"naive", chunk_queries::naive}, {"patched", chunk_queries::patched}});
  bind_enum<chunk_target>(m, "ChunkTarget", {{"budget", chunk_target::budget}, {"fraction", chunk_target::fraction}});
  bind_enum<lp_norm>(m, "LpNorm", {{"l1", lp_norm::l1}, {"l2", lp_norm::l2}, {"linf", lp_norm::linf}});
  bind_enum<wo_layout>(m, "WoLayout", {{"in_out", wo_layout::in_out}, {"out_in", wo_layout::out_in}});
  bind_enum<empty_head>(m, "EmptyHead", {{"zero_output", empty_head::zero_output}, {"error", empty_head::error}});
  bind_enum<crossing_rule>(m, "CrossingRule",
                           {{"first_reach", crossing_rule::first_reach}, {"stays_above", crossing_rule::stays_above}});
  bind_enum<critical_kind>(m, "CriticalKind", {{"interpolated", critical_kind::interpolated},
                                               {"at_or_below_min", critical_kind::at_or_below_min},
                                               {"above_max", critical_kind::above_max}});
  bind_enum<page_layout>(m, "PageLayout", {{"nhd", page_layout::nhd}, {"hnd", page_layout::hnd}});
  bind_enum<page_lists>(m, "PageLists", {{"per_sequence", page_lists::per_sequence}, {"per_head", page_lists::per_head}});
  bind_enum<batch_budget>(m, "BatchBudget", {{"per_head", batch_budget::per_head}, {"flattened", batch_budget::flattened}});
  bind_enum<allocator>(m, "Allocator", {{"per_head", allocator::per_head}, {"flattened", allocator::flattened},
                                        {"adakv", allocator::adakv}, {"lava", allocator::lava}, {"cake", allocator::cake}});
}

namespace {

template <class C>
void def_postprocess_fields(C& c) {
  c.def_readwrite("gqa", &postprocess_options::gqa)
      .def_readwrite("order", &postprocess_options::order)
      .def_readwrite("pool", &postprocess_options::pool)
      .def_readwrite("kernel", &postprocess_options::kernel)
      .def_readwrite("divisor", &postprocess_options::divisor)
      .def_readwrite("weight_values", &postprocess_options::weight_values)
      .def_readwrite("weight", &postprocess_options::weight)
      .def_readwrite("n_sink", &postprocess_options::n_sink)
      .def_readwrite("n_recent", &postprocess_options::n_recent)
      .def_readwrite("unpooled_tail", &postprocess_options::unpooled_tail);
}

/// Keyword construction: Struct(field=value, ...) for every field (unknown names refused).
template <class S>
S from_kwargs(const py::kwargs& kw, const char* type) {
  S s{};
  py::object obj = py::cast(s);
  for (const auto& [key, value] : kw) {
    const std::string k = py::str(key);
    if (!py::hasattr(obj, k.c_str()) || k.rfind("_", 0) == 0)
      raise(errc::invalid_argument, std::string(type) + " has no field '" + k + "'");
    obj.attr(k.c_str()) = value;
  }
  return obj.cast<S>();
}

}  // namespace

void bind_recipes(py::module_& m) {
  using namespace pybind11::literals;
  py::class_<score_options>(m, "ScoreOptions", "Options of the attention-score stage (docs/score.md).")
      .def(py::init([](const py::kwargs& kw) { return from_kwargs<score_options>(kw, "ScoreOptions"); }))
      .def_readwrite("reduce", &score_options::reduce)
      .def_readwrite("scale", &score_options::scale)
      .def_readwrite("gamma", &score_options::gamma)
      .def_readwrite("variance", &score_options::variance)
      .def_readwrite("fused_multiply_add", &score_options::fused_multiply_add);
  py::class_<postprocess_options> pp(m, "PostprocessOptions", "Options of postprocess_scores (docs/postprocess.md).");
  pp.def(py::init([](const py::kwargs& kw) { return from_kwargs<postprocess_options>(kw, "PostprocessOptions"); }));
  def_postprocess_fields(pp);

  py::class_<recipe, postprocess_options> rc(m, "Recipe",
                                             "A published eviction method as data (docs/recipes.md): every field public.");
  rc.def(py::init([](const py::kwargs& kw) { return from_kwargs<recipe>(kw, "Recipe"); }))
      .def_readwrite("kind", &recipe::kind)
      .def_readwrite("source", &recipe::source)
      .def_readwrite("window", &recipe::window)
      .def_readwrite("score", &recipe::score)
      .def_static("snapkv", &recipe::snapkv)
      .def_static("streaming_llm", &recipe::streaming_llm, "sinks"_a = 4)
      .def_static("h2o", &recipe::h2o)
      .def_static("tova", &recipe::tova)
      .def_static("knorm", &recipe::knorm)
      .def_static("vatp", &recipe::vatp)
      .def_static("lava", &recipe::lava)
      .def_static("cake", &recipe::cake)
      .def_static("from_name", [](const std::string& n) { return value_or_raise(recipe_from_name(n)); }, "name"_a)
      .def_property_readonly("name", [](const recipe& r) { return recipe_name(r.kind); })
      .def_property_readonly("uses_attention", [](const recipe& r) { return uses_attention(r.kind); })
      .def("__repr__", [](const recipe& r) {
        return "Recipe(" + std::string(recipe_name(r.kind)) + ", window=" + std::to_string(r.window) +
               ", pool=" + pool_kind_name(r.pool) + " " + std::to_string(r.kernel) + ", gqa=" + gqa_op_name(r.gqa) +
               ", n_sink=" + std::to_string(r.n_sink) + ", n_recent=" + std::to_string(r.n_recent) + ")";
      });
  m.def("recipe_scores", &recipe_scores_py, "recipe"_a, "queries"_a, "keys"_a, "values"_a = py::none(),
        "block_keys"_a = py::none(), "out"_a = py::none(),
        "A recipe's final per-KV-head scores [H_kv][T] (protected positions +inf); queries per the recipe's source.");
  m.def("recipe_select", &recipe_select_py, "recipe"_a, "scores"_a, "budget"_a, "out"_a = py::none(),
        "budget int: dense kept [H_kv][budget]; budget array of per-head budgets (a CPU int32 tensor, also for CUDA "
        "scores): ragged (positions, cu), or into out=(positions, cu).");
  m.def(
      "recipe_scores_workspace_bytes",
      [](const recipe& r, index_t hq, index_t rows, index_t hkv, index_t T, index_t d, index_t block_rows) {
        return value_or_raise(recipe_scores_workspace_bytes(backend(), r, hq, rows, hkv, T, d, block_rows));
      },
      "recipe"_a, "query_heads"_a, "query_rows"_a, "kv_heads"_a, "tokens"_a, "dim"_a, "block_key_rows"_a = 0);
}

}  // namespace kvevict::python

PYBIND11_MODULE(_core, m) {
  using namespace kvevict::python;
  m.doc() = "kvevict: KV-cache eviction building blocks on PyTorch / NumPy tensors (docs/python.md)";
  register_errors(m);
  m.def("set_num_threads", &set_num_threads, "OpenMP threads of every call (0 = OpenMP's default).");
  m.def("num_threads", &num_threads);
  // CUDA tensors: the functions of kvevict.cuda_functions run them on cuda_t when built with CUDA
  m.attr("has_cuda") = static_cast<bool>(KVEVICT_PYTHON_CUDA);
  bind_enums(m);
  // the x86 kernel copies (docs/backends.md, "Kernel copies"): a limit changes the speed, never the bits
  m.def("host_isa_supported", &kvevict::host_isa_supported, "The best host kernel copy this CPU and build run.");
  m.def(
      "set_host_isa_limit",
      [](py::handle limit) {  // (a name goes through HostIsa(name): an unknown one raises kvevict.Error)
        const py::type type = py::type::of<kvevict::host_isa>();
        if (py::isinstance<py::str>(limit)) return kvevict::set_host_isa_limit(type(limit).cast<kvevict::host_isa>());
        if (!py::isinstance(limit, type))
          raise(kvevict::errc::invalid_argument, "set_host_isa_limit: limit must be a HostIsa or 'baseline', 'avx2', 'avx512'");
        kvevict::set_host_isa_limit(limit.cast<kvevict::host_isa>());
      },
      py::arg("limit"), "Caps the host kernel copies of every later call (HostIsa or 'baseline' / 'avx2' / 'avx512').");
  m.def("host_isa_limit", &kvevict::host_isa_limit);
  m.def("host_isa_active", &kvevict::host_isa_active, "min(host_isa_supported(), host_isa_limit()).");
  bind_recipes(m);
  bind_stages(m);
  bind_budget(m);
  bind_extras(m);
  bind_drivers(m);
  bind_metrics(m);
  bind_paged(m);
  bind_distributed(m);
  bind_ragged(m);
}
