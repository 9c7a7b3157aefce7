// python/src/drivers.cpp: the post-fill driver (docs/drivers.md) on PyTorch / NumPy caches. The
// Python object owns the driver's state memory and a copy of its budgets; each layer's cache is a
// dense head-major [H][T][d] tensor viewed as the driver's ragged cache (ragged_from_dense), with
// the original position of every row ([H][T] int32, default 0..T-1).
#include "common.hpp"

#include <mutex>

namespace kvevict::python {

namespace {

/// A layer's cache for a driver: keys and values [H][C][d] head-major (C = capacity, >= the rows a
/// head holds; padded strides allowed), lens [H] int32 (default: every head holds C rows) and the
/// original positions [H][C] int32 (default 0..C-1). Calls f(layer_kv<T>, T{}) while the views live.
template <class F>
void with_layer(py::handle k_, py::handle v_, py::handle lens_, py::handle pos_,
                std::initializer_list<const tensor*> more, F&& f) {
  const tensor k = as_tensor(k_, "keys", 3), v = as_tensor(v_, "values", 3);
  std::vector<const tensor*> all{&k, &v};
  all.insert(all.end(), more.begin(), more.end());
  for (const tensor* t : all) require_kv({&k, t});
  const index_t H = k.shape[0], C = k.shape[1];
  const tensor lens = as_optional(lens_, "lens", 1);
  const std::int32_t* held = int32_array(lens, H);
  const tensor p = as_optional(pos_, "positions", 2);
  if (p.data != nullptr) {
    require_dtype(p, {dtype::i32});
    require_host(p);
    if (p.shape[0] != H || p.shape[1] != C)
      raise(errc::shape_mismatch, "positions is " + p.shape_string() + " but must be [" + std::to_string(H) + ", " +
                                      std::to_string(C) + "]");
  }
  dispatch_kv(k, [&](auto e) {
    using T = decltype(e);
    std::vector<std::int32_t> kcu(static_cast<std::size_t>(H) + 1), klen(static_cast<std::size_t>(H));
    std::vector<std::int32_t> vcu(kcu.size()), vlen(klen.size());
    auto keys = value_or_raise(ragged_from_dense(kv<const T>(k), kcu.data(), klen.data()));
    auto values = value_or_raise(ragged_from_dense(kv<const T>(v), vcu.data(), vlen.data()));
    if (held != nullptr) {
      std::copy_n(held, H, klen.begin());
      std::copy_n(held, H, vlen.begin());
    }
    // the rows' original positions, laid out like the key rows (head h from kcu[h])
    std::vector<pos_t> pos(static_cast<std::size_t>(H > 0 ? kcu[static_cast<std::size_t>(H)] : 0), 0);
    for (index_t h = 0; h < H; ++h)
      for (index_t j = 0; j < C && kcu[static_cast<std::size_t>(h)] + j < kcu[static_cast<std::size_t>(h) + 1]; ++j)
        pos[static_cast<std::size_t>(kcu[static_cast<std::size_t>(h)] + j)] =
            p.data != nullptr ? static_cast<const pos_t*>(p.data)[h * p.strides[0] + j * p.strides[1]]
                              : static_cast<pos_t>(j);
    f(make_layer_kv(keys, values, pos.data()), e);
  });
}

matrix_view<const float> score_view(const tensor& scores) {
  require_dtype(scores, {dtype::f32});
  require_host(scores);
  return mat<const float>(scores);
}

/// A driver's kept rows of one layer as new (positions, cu) NumPy arrays.
py::tuple kept_arrays(const ragged_positions& k) {
  tensor like;
  const tensor cu = output(py::none(), "cu", like, {k.heads + 1}, dtype::i32);
  const tensor pos = output(py::none(), "positions", like, {k.total()}, dtype::i32);
  std::copy_n(k.cu, k.heads + 1, static_cast<std::int32_t*>(cu.data));
  std::copy_n(k.pos, k.total(), static_cast<pos_t*>(pos.data));
  return py::make_tuple(pos.object, cu.object);
}

/// A named scheme's allocation into `budgets` ([L][H], the caller's vector).
allocation make_budgets(budget_scheme scheme, const recipe& r, index_t layers, index_t kv_heads, index_t prompt,
                        index_t budget, py::handle retrieval_, std::vector<std::int32_t>& budgets) {
  if (layers <= 0 || kv_heads <= 0) raise(errc::invalid_argument, "drivers: layers and kv_heads must be positive");
  budgets.assign(static_cast<std::size_t>(layers * kv_heads), 0);
  allocation_request req;
  req.budget = budget;
  req.prompt = prompt;
  req.prot = protection{r.n_sink, r.n_recent};
  const tensor retrieval = as_optional(retrieval_, "retrieval", 2);
  if (retrieval.data != nullptr) {
    require_dtype(retrieval, {dtype::u8, dtype::boolean});
    require_host(retrieval);
    req.retrieval = mat<const std::uint8_t>(retrieval);
  }
  allocation a;
  throw_if(make_allocation(scheme, req, value_or_raise(make_matrix_view(budgets.data(), layers, kv_heads)), &a));
  return a;
}

/// A prefill driver's add_layer (queries and block keys) or add_layer_scores (scores), `extra` its
/// trailing arguments (the layer's weight; none for the chunked driver).
template <class Driver, class... Extra>
void add_prefill_layer(Driver& d, std::mutex& mu, index_t layer, py::handle k_, py::handle v_, py::handle lens_,
                       py::handle pos_, py::handle q_, py::handle s_, py::handle bk_, const char* bk_name,
                       Extra... extra) {
  const tensor q = as_optional(q_, "queries", 3), bk = as_optional(bk_, bk_name, 3);
  const tensor scores = as_optional(s_, "scores", 2);
  std::lock_guard<std::mutex> lock(mu);
  with_layer(k_, v_, lens_, pos_, {&q, &bk}, [&](const auto& kvl, auto e) {
    using T = decltype(e);
    if (scores.data != nullptr) {
      const auto sv = score_view(scores);
      run_ws([&](workspace& ws) { return d.add_layer_scores(backend(), ws, layer, kvl, sv, extra...); });
    } else {
      const auto qv = optional_kv<T>(q);
      const auto bv = optional_kv<T>(bk);
      run_ws([&](workspace& ws) { return d.add_layer(backend(), ws, layer, kvl, qv, bv, extra...); });
    }
  });
}

/// What every bound driver holds: its configuration, a copy of its budgets, its state memory (owned
/// here) and a lock (one call at a time per driver; the work runs without the GIL). A public base,
/// so pybind11 binds the methods the drivers share (decide, ready, kept_decided) from here.
template <class Driver, class Config>
struct bound_driver {
  Config cfg_;
  std::vector<std::int32_t> budgets_;
  std::vector<unsigned char> state_;
  Driver driver_;
  std::mutex mutex_;

  /// Binds the driver to its state memory once cfg_ is complete.
  void start() {
    state_.resize(value_or_raise(Driver::state_bytes(cfg_)));
    throw_if(driver_.init(cfg_, state_.data(), state_.size()));
  }

  /// The all-layer decision (post-fill and chunked drivers).
  void decide() {
    std::lock_guard<std::mutex> lock(mutex_);
    run_ws([&](workspace& ws) { return driver_.decide(backend(), ws); });
  }

  bool ready(index_t layer) const { return driver_.ready(layer); }

  /// A decided layer's kept rows; `name` and `hint` make the error of an undecided one.
  py::tuple kept_decided(index_t layer, const char* name, const char* hint) const {
    if (!driver_.ready(layer))
      raise(errc::invalid_argument, std::string(name) + ".kept: layer " + std::to_string(layer) + hint);
    return kept_arrays(driver_.kept(layer));
  }
};

class post_fill : public bound_driver<post_fill_driver, post_fill_config> {
 public:
  post_fill(const recipe& r, index_t layers, index_t kv_heads, index_t query_heads, index_t head_dim, index_t tokens,
            budget_scheme scheme, index_t budget, py::handle retrieval_, index_t query_rows) {
    cfg_.model = model_shape{layers, kv_heads, query_heads, head_dim};
    cfg_.tokens = tokens;
    cfg_.query_rows = query_rows;
    cfg_.rec = r;
    cfg_.alloc = make_budgets(scheme, r, layers, kv_heads, tokens, budget, retrieval_, budgets_);
    start();
  }

  void add_layer(index_t layer, py::handle k_, py::handle v_, py::handle q_, py::handle s_, py::handle pos_,
                 py::handle bk_, double weight) {
    add_prefill_layer(driver_, mutex_, layer, k_, v_, py::none(), pos_, q_, s_, bk_, "block_keys", weight);
  }

  using bound_driver::decide;
  using bound_driver::ready;
  py::tuple kept(index_t layer) const {
    return kept_decided(layer, "PostFillDriver", " is not decided yet (add it; lava and cake: call decide())");
  }

  index_t layer_total(index_t layer) const { return driver_.layer_total(layer); }
  allocator kind() const { return cfg_.alloc.kind; }
  py::object budgets() const {
    tensor like;
    const tensor b = output(py::none(), "budgets", like, {cfg_.model.layers, cfg_.model.kv_heads}, dtype::i32);
    std::copy(budgets_.begin(), budgets_.end(), static_cast<std::int32_t*>(b.data));
    return b.object;
  }
};

/// What a cascade (CascadeDriver, LayerCascade) answers after each layer, from Derived::state()
/// (a cascade_driver or layer_cascade) and Derived::name.
template <class Derived>
class cascade_answers {
 public:
  bool changed(index_t layer) const { return state().changed(layer); }
  py::tuple kept(index_t layer) const { return held(layer, state().kept(layer)); }
  py::tuple positions(index_t layer) const { return held(layer, state().positions(layer)); }
  index_t layer_total(index_t layer) const { return state().layer_total(layer); }

 private:
  const auto& state() const { return static_cast<const Derived&>(*this).state(); }
  static py::tuple held(index_t layer, const ragged_positions& k) {
    if (k.cu == nullptr)
      raise(errc::invalid_argument, std::string(Derived::name) + ": layer " + std::to_string(layer) + " holds nothing yet");
    return kept_arrays(k);
  }
};

class cascade : public bound_driver<cascade_driver, cascade_driver_config>, public cascade_answers<cascade> {
 public:
  cascade(const recipe& r, index_t layers, index_t kv_heads, index_t query_heads, index_t head_dim, index_t tokens,
          index_t total, cascade_split split, weight_source weight, entropy_norm norm, index_t query_rows) {
    cfg_.model = model_shape{layers, kv_heads, query_heads, head_dim};
    cfg_.tokens = tokens;
    cfg_.query_rows = query_rows;
    cfg_.rec = r;
    cfg_.total = total;
    cfg_.split = split;
    cfg_.weight = weight;
    cfg_.norm = norm;
    start();
  }

  void add_layer(index_t layer, py::handle k_, py::handle v_, py::handle q_, py::handle s_, py::handle pos_,
                 py::handle bk_, double weight) {
    add_prefill_layer(driver_, mutex_, layer, k_, v_, py::none(), pos_, q_, s_, bk_, "block_keys", weight);
  }

  index_t held_rows() const { return driver_.held_rows(); }
  index_t peak_rows() const { return driver_.peak_rows(); }
  static constexpr const char* name = "CascadeDriver";
  const cascade_driver& state() const { return driver_; }
};

/// kvevict::layer_cascade on its own (the budget rule under CascadeDriver): the caller computes each
/// layer's protected scores and weight; the object owns the state memory.
class cascade_state : public cascade_answers<cascade_state> {
 public:
  cascade_state(index_t layers, index_t heads, index_t prompt, index_t total, index_t n_sink, index_t n_recent,
                cascade_split split) {
    cfg_.layers = layers;
    cfg_.heads = heads;
    cfg_.prompt_length = prompt;
    cfg_.prot = protection{n_sink, n_recent};
    cfg_.total = total;
    cfg_.split = split;
    const std::size_t bytes = value_or_raise(layer_cascade::state_bytes(cfg_));
    memory_.resize(bytes);
    throw_if(state_.init(cfg_, memory_.data(), bytes));
  }

  void add_layer(index_t layer, py::handle scores_, double weight) {
    const tensor scores = float_matrix(scores_, "scores");
    const auto sv = mat<const float>(scores);
    std::lock_guard<std::mutex> lock(mutex_);
    run_ws([&](workspace& ws) { return state_.add_layer(backend(), ws, layer, sv, weight); });
  }
  void add_remote_layer(index_t layer, double weight) {
    std::lock_guard<std::mutex> lock(mutex_);
    run_ws([&](workspace& ws) { return state_.add_remote_layer(backend(), ws, layer, weight); });
  }

  index_t held_total() const { return state_.held_total(); }
  index_t layers_added() const { return state_.layers_added(); }
  static constexpr const char* name = "LayerCascade";
  const layer_cascade& state() const { return state_; }

 private:
  cascade_config cfg_;
  std::vector<unsigned char> memory_;
  layer_cascade state_;
  std::mutex mutex_;
};

class chunked : public bound_driver<chunked_driver, chunked_config> {
 public:
  chunked(const recipe& r, index_t layers, index_t kv_heads, index_t query_heads, index_t head_dim, index_t tokens,
          index_t capacity, chunk_queries queries, chunk_target target, double fraction, budget_scheme scheme,
          index_t budget) {
    if (scheme == budget_scheme::cake)
      raise(errc::invalid_argument, "ChunkedDriver: the cake scheme is post-fill only (uniform, pyramid, adakv, lava, duo)");
    cfg_.model = model_shape{layers, kv_heads, query_heads, head_dim};
    cfg_.tokens = tokens;
    cfg_.capacity = capacity;
    cfg_.rec = r;
    cfg_.queries = queries;
    cfg_.target = target;
    cfg_.fraction = fraction;
    cfg_.alloc = make_budgets(scheme, r, layers, kv_heads, tokens, budget, py::none(), budgets_);
    start();
  }

  void begin_chunk(index_t begin, index_t end) {
    std::lock_guard<std::mutex> lock(mutex_);
    throw_if(driver_.begin_chunk(begin, end));
  }

  void add_layer(index_t layer, py::handle k_, py::handle v_, py::handle lens_, py::handle pos_, py::handle q_,
                 py::handle s_, py::handle pk_) {
    add_prefill_layer(driver_, mutex_, layer, k_, v_, lens_, pos_, q_, s_, pk_, "patch_keys");
  }

  using bound_driver::decide;
  using bound_driver::ready;

  py::tuple patch() const {
    const patch_block p = driver_.patch();
    return py::make_tuple(static_cast<index_t>(p.first), p.count);
  }
  index_t query_rows() const { return driver_.query_rows(); }
  bool final_chunk() const { return driver_.final_chunk(); }
  py::tuple kept(index_t layer) const {
    return kept_decided(layer, "ChunkedDriver", " has not been decided for this chunk (add it; lava: call decide())");
  }
  index_t held(index_t layer, index_t head) const { return driver_.held(layer, head); }
};

class decode : public bound_driver<decode_driver, decode_config> {
 public:
  decode(const recipe& r, index_t layers, index_t kv_heads, index_t query_heads, index_t head_dim, index_t capacity,
         index_t interval, budget_scheme scheme, index_t budget, index_t prompt_length, index_t query_rows) {
    if (scheme != budget_scheme::uniform && scheme != budget_scheme::pyramid && scheme != budget_scheme::adakv)
      raise(errc::invalid_argument, std::string("DecodeDriver: scheme '") + budget_scheme_name(scheme) +
                                        "' is not a per-layer scheme (uniform, pyramid, adakv)");
    cfg_.model = model_shape{layers, kv_heads, query_heads, head_dim};
    cfg_.capacity = capacity;
    cfg_.interval = interval;
    cfg_.query_rows = query_rows;
    cfg_.rec = r;
    cfg_.alloc = make_budgets(scheme, r, layers, kv_heads, prompt_length > 0 ? prompt_length : capacity, budget,
                              py::none(), budgets_);
    start();
  }

  void begin(index_t layer, py::handle k_, py::handle v_, py::handle lens_, py::handle pos_, index_t tokens,
             py::handle initial_) {
    const tensor initial = as_optional(initial_, "initial", 2);
    with_layer(k_, v_, lens_, pos_, {}, [&](const auto& kvl, auto) {
      const auto iv = initial.data != nullptr ? score_view(initial) : matrix_view<const float>{};
      std::lock_guard<std::mutex> lock(mutex_);
      run([&] { return driver_.begin(layer, kvl, tokens, iv); });
    });
  }

  py::object step(index_t layer, py::handle k_, py::handle v_, py::handle lens_, py::handle pos_, py::handle q_,
                  py::handle s_, py::handle bk_) {
    const tensor q = as_optional(q_, "queries", 3), bk = as_optional(bk_, "block_keys", 3);
    const tensor scores = as_optional(s_, "scores", 2);
    std::lock_guard<std::mutex> lock(mutex_);
    with_layer(k_, v_, lens_, pos_, {&q, &bk}, [&](const auto& kvl, auto e) {
      using T = decltype(e);
      if (scores.data != nullptr) {
        const auto sv = score_view(scores);
        run_ws([&](workspace& ws) { return driver_.step_scores(backend(), ws, layer, kvl, sv); });
      } else {
        const auto qv = optional_kv<T>(q);
        const auto bv = optional_kv<T>(bk);
        run_ws([&](workspace& ws) { return driver_.step(backend(), ws, layer, kvl, qv, bv); });
      }
    });
    if (!driver_.evicted(layer)) return py::none();
    return kept_arrays(driver_.kept(layer));
  }

  bool evicts_next(index_t layer) const { return driver_.evicts_next(layer); }
  index_t tokens(index_t layer) const { return driver_.tokens(layer); }
  index_t held(index_t layer, index_t head) const { return driver_.held(layer, head); }
};

}  // namespace

namespace {

/// The answers of a cascade after each layer (cascade_answers), as Python methods.
template <class C>
void def_cascade_answers(py::class_<C>& c) {
  using namespace pybind11::literals;
  c.def("changed", &C::changed, "layer"_a, "Did the last step change what the layer holds?")
      .def("kept", &C::kept, "layer"_a,
           "(positions, cu) of the last step: the layer just added, its prompt positions; an earlier layer, the rows "
           "of what it held before the step.")
      .def("positions", &C::positions, "layer"_a, "(positions, cu): the original positions the layer holds.")
      .def("layer_total", &C::layer_total, "layer"_a);
}

}  // namespace

void bind_drivers(py::module_& m) {
  using namespace pybind11::literals;
  py::class_<post_fill>(m, "PostFillDriver",
                        "One-shot eviction after the prefill (kvevict::post_fill_driver): a recipe and a named budget "
                        "scheme over every layer; per-layer schemes decide in add_layer, lava and cake in decide().")
      .def(py::init<const recipe&, index_t, index_t, index_t, index_t, index_t, budget_scheme, index_t, py::handle,
                    index_t>(),
           "recipe"_a, "layers"_a, "kv_heads"_a, "query_heads"_a, "head_dim"_a, "tokens"_a, "scheme"_a = budget_scheme::uniform,
           "budget"_a = 64, "retrieval"_a = py::none(), "query_rows"_a = 0)
      .def("add_layer", &post_fill::add_layer, "layer"_a, "keys"_a, "values"_a, "queries"_a = py::none(),
           "scores"_a = py::none(), "positions"_a = py::none(), "block_keys"_a = py::none(), "cake_preference"_a = 0.0,
           "Layer `layer` (in order) was prefilled: keys, values [H][T][d] head-major; queries the recipe's block, or "
           "scores [H][T] instead; positions [H][T] int32 (default 0..T-1).")
      .def("decide", &post_fill::decide, "After every layer: the all-layer schemes (lava, cake) select.")
      .def("ready", &post_fill::ready, "layer"_a)
      .def("kept", &post_fill::kept, "layer"_a, "(positions, cu): the rows each head of the layer keeps, ascending.")
      .def("layer_total", &post_fill::layer_total, "layer"_a)
      .def_property_readonly("allocator", &post_fill::kind)
      .def_property_readonly("budgets", &post_fill::budgets);
  py::class_<cascade> cascade_driver_class(m, "CascadeDriver",
                      "Layer-by-layer prefill with cascading budgets (kvevict::cascade_driver: LAVa Algorithm 2, "
                      "CAKE): after add_layer(l), compact layer l with kept(l) and every earlier layer j with "
                      "changed(j) with kept(j).");
  cascade_driver_class
      .def(py::init<const recipe&, index_t, index_t, index_t, index_t, index_t, index_t, cascade_split, weight_source,
                    entropy_norm, index_t>(),
           "recipe"_a, "layers"_a, "kv_heads"_a, "query_heads"_a, "head_dim"_a, "tokens"_a, "total"_a,
           "split"_a = cascade_split::flattened, "weight"_a = weight_source::lava_entropy,
           "norm"_a = entropy_norm::log_count, "query_rows"_a = 0)
      .def("add_layer", &cascade::add_layer, "layer"_a, "keys"_a, "values"_a, "queries"_a = py::none(),
           "scores"_a = py::none(), "positions"_a = py::none(), "block_keys"_a = py::none(), "weight"_a = 0.0,
           "Layer `layer` (in order) was prefilled over the whole prompt: keys, values [H][N][d].")
      .def_property_readonly("held_rows", &cascade::held_rows)
      .def_property_readonly("peak_rows", &cascade::peak_rows);
  def_cascade_answers(cascade_driver_class);
  py::class_<cascade_state> layer_cascade_class(m, "LayerCascade",
                            "The cascading budget rule alone (kvevict::layer_cascade, docs/budget.md): per layer, in "
                            "order, add_layer(l, protected scores [H][N], weight) (or add_remote_layer(l, weight) for "
                            "a layer another pipeline stage holds); then layer l keeps kept(l) (prompt positions) and "
                            "every earlier layer j with changed(j) keeps the rows kept(j) of what it held.");
  layer_cascade_class
      .def(py::init<index_t, index_t, index_t, index_t, index_t, index_t, cascade_split>(), "layers"_a, "heads"_a,
           "prompt_length"_a, "total"_a, "n_sink"_a = 0, "n_recent"_a = 0, "split"_a = cascade_split::flattened)
      .def("add_layer", &cascade_state::add_layer, "layer"_a, "scores"_a, "weight"_a)
      .def("add_remote_layer", &cascade_state::add_remote_layer, "layer"_a, "weight"_a)
      .def_property_readonly("held_total", &cascade_state::held_total)
      .def_property_readonly("layers_added", &cascade_state::layers_added);
  def_cascade_answers(layer_cascade_class);
  py::class_<chunked>(m, "ChunkedDriver",
                      "Eviction during chunked prefill, naive or patched (kvevict::chunked_driver): per chunk "
                      "begin_chunk(s, e), add_layer for every layer with query_rows() queries (and the patch's keys), "
                      "decide(), then compact each layer with kept(l).")
      .def(py::init<const recipe&, index_t, index_t, index_t, index_t, index_t, index_t, chunk_queries, chunk_target,
                    double, budget_scheme, index_t>(),
           "recipe"_a, "layers"_a, "kv_heads"_a, "query_heads"_a, "head_dim"_a, "tokens"_a, "capacity"_a,
           "queries"_a = chunk_queries::patched, "target"_a = chunk_target::budget, "fraction"_a = 0.5,
           "scheme"_a = budget_scheme::uniform, "budget"_a = 64)
      .def("begin_chunk", &chunked::begin_chunk, "begin"_a, "end"_a)
      .def("add_layer", &chunked::add_layer, "layer"_a, "keys"_a, "values"_a, "lens"_a = py::none(),
           "positions"_a = py::none(), "queries"_a = py::none(), "scores"_a = py::none(), "patch_keys"_a = py::none(),
           "The layer's current cache (kept rows + the chunk) as a capacity buffer [H][C][d] with lens and positions.")
      .def("decide", &chunked::decide)
      .def("patch", &chunked::patch, "(first, count) of the extra query positions after this chunk (patched mode).")
      .def("query_rows", &chunked::query_rows)
      .def("final_chunk", &chunked::final_chunk)
      .def("ready", &chunked::ready, "layer"_a)
      .def("kept", &chunked::kept, "layer"_a, "(positions, cu): rows of the layer's current cache each head keeps.")
      .def("held", &chunked::held, "layer"_a, "head"_a);
  py::class_<decode>(m, "DecodeDriver",
                     "Decode-time eviction back to a budget every `interval` steps (kvevict::decode_driver). Each "
                     "layer's cache is a capacity buffer [H][C][d] with lens [H] rows held and positions [H][C].")
      .def(py::init<const recipe&, index_t, index_t, index_t, index_t, index_t, index_t, budget_scheme, index_t,
                    index_t, index_t>(),
           "recipe"_a, "layers"_a, "kv_heads"_a, "query_heads"_a, "head_dim"_a, "capacity"_a, "interval"_a = 1,
           "scheme"_a = budget_scheme::uniform, "budget"_a = 64, "prompt_length"_a = 0, "query_rows"_a = 0)
      .def("begin", &decode::begin, "layer"_a, "keys"_a, "values"_a, "lens"_a = py::none(), "positions"_a = py::none(),
           "tokens"_a = 0, "initial"_a = py::none(), "After the prefill: the layer's cache and the tokens processed.")
      .def("step", &decode::step, "layer"_a, "keys"_a, "values"_a, "lens"_a = py::none(), "positions"_a = py::none(),
           "queries"_a = py::none(), "scores"_a = py::none(), "block_keys"_a = py::none(),
           "After the engine appended the new token's row: None, or (positions, cu) of the rows each head keeps "
           "(compact the layer with them).")
      .def("evicts_next", &decode::evicts_next, "layer"_a)
      .def("tokens", &decode::tokens, "layer"_a)
      .def("held", &decode::held, "layer"_a, "head"_a);
}

}  // namespace kvevict::python
