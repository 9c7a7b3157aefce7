// python/src/drivers.cpp: the post-fill driver (docs/drivers.md) on PyTorch / NumPy caches. The
// Python object owns the driver's state memory and a copy of its budgets; each layer's cache is a
// dense head-major [H][T][d] tensor viewed as the driver's ragged cache (ragged_from_dense), with
// the original position of every row ([H][T] int32, default 0..T-1).
#include "common.hpp"

#include <mutex>

namespace kvevict::python {

namespace {

class post_fill {
 public:
  post_fill(const recipe& r, index_t layers, index_t kv_heads, index_t query_heads, index_t head_dim, index_t tokens,
            budget_scheme scheme, index_t budget, py::handle retrieval_, index_t query_rows)
      : budgets_(static_cast<std::size_t>(layers > 0 && kv_heads > 0 ? layers * kv_heads : 0), 0) {
    cfg_.model = model_shape{layers, kv_heads, query_heads, head_dim};
    cfg_.tokens = tokens;
    cfg_.query_rows = query_rows;
    cfg_.rec = r;
    allocation_request req;
    req.budget = budget;
    req.prompt = tokens;
    req.prot = protection{r.n_sink, r.n_recent};
    const tensor retrieval = as_optional(retrieval_, "retrieval", 2);
    if (retrieval.data != nullptr) {
      require_dtype(retrieval, {dtype::u8, dtype::boolean});
      require_host(retrieval);
      req.retrieval = mat<const std::uint8_t>(retrieval);
    }
    if (budgets_.empty()) raise(errc::invalid_argument, "PostFillDriver: layers and kv_heads must be positive");
    const auto bv = value_or_raise(make_matrix_view(budgets_.data(), layers, kv_heads));
    throw_if(make_allocation(scheme, req, bv, &cfg_.alloc));
    state_.resize(value_or_raise(post_fill_driver::state_bytes(cfg_)));
    throw_if(driver_.init(cfg_, state_.data(), state_.size()));
  }

  void add_layer(index_t layer, py::handle k_, py::handle v_, py::handle q_, py::handle s_, py::handle pos_,
                 py::handle bk_, double weight) {
    const tensor k = as_tensor(k_, "keys", 3), v = as_tensor(v_, "values", 3);
    const tensor q = as_optional(q_, "queries", 3), bk = as_optional(bk_, "block_keys", 3);
    require_kv({&k, &v, &q, &bk});
    const tensor scores = as_optional(s_, "scores", 2);
    const index_t H = k.shape[0], T = k.shape[1];
    // the rows' original positions, laid out like the key rows (head h at h * capacity)
    std::vector<pos_t> pos;
    const tensor p = as_optional(pos_, "positions", 2);
    if (p.data != nullptr) {
      require_dtype(p, {dtype::i32});
      require_host(p);
      if (p.shape[0] != H || p.shape[1] != T)
        raise(errc::shape_mismatch, "positions is " + p.shape_string() + " but must be [" + std::to_string(H) + ", " +
                                        std::to_string(T) + "]");
    }
    dispatch_kv(k, [&](auto e) {
      using T_ = decltype(e);
      std::vector<std::int32_t> kcu(static_cast<std::size_t>(H) + 1), klen(static_cast<std::size_t>(H));
      std::vector<std::int32_t> vcu(kcu.size()), vlen(klen.size());
      const auto keys = value_or_raise(ragged_from_dense(kv<const T_>(k), kcu.data(), klen.data()));
      const auto values = value_or_raise(ragged_from_dense(kv<const T_>(v), vcu.data(), vlen.data()));
      pos.assign(static_cast<std::size_t>(H > 0 ? kcu[static_cast<std::size_t>(H)] : 0), 0);
      for (index_t h = 0; h < H; ++h)
        for (index_t j = 0; j < T; ++j)
          pos[static_cast<std::size_t>(kcu[static_cast<std::size_t>(h)] + j)] =
              p.data != nullptr ? static_cast<const pos_t*>(p.data)[h * p.strides[0] + j * p.strides[1]]
                                : static_cast<pos_t>(j);
      const auto kvl = make_layer_kv(keys, values, pos.data());
      std::lock_guard<std::mutex> lock(mutex_);
      if (scores.data != nullptr) {
        require_dtype(scores, {dtype::f32});
        require_host(scores);
        const auto sv = mat<const float>(scores);
        run_ws([&](workspace& ws) { return driver_.add_layer_scores(backend(), ws, layer, kvl, sv, weight); });
      } else {
        const auto qv = optional_kv<T_>(q);
        const auto bv = optional_kv<T_>(bk);
        run_ws([&](workspace& ws) { return driver_.add_layer(backend(), ws, layer, kvl, qv, bv, weight); });
      }
    });
  }

  void decide() {
    std::lock_guard<std::mutex> lock(mutex_);
    run_ws([&](workspace& ws) { return driver_.decide(backend(), ws); });
  }

  bool ready(index_t layer) const { return driver_.ready(layer); }

  py::tuple kept(index_t layer) const {
    if (!driver_.ready(layer))
      raise(errc::invalid_argument, "PostFillDriver.kept: layer " + std::to_string(layer) +
                                        " is not decided yet (add it; lava and cake: call decide())");
    const ragged_positions k = driver_.kept(layer);
    tensor like;
    const tensor cu = output(py::none(), "cu", like, {k.heads + 1}, dtype::i32);
    const tensor pos = output(py::none(), "positions", like, {k.cu[k.heads]}, dtype::i32);
    std::copy_n(k.cu, k.heads + 1, static_cast<std::int32_t*>(cu.data));
    std::copy_n(k.pos, k.cu[k.heads], static_cast<pos_t*>(pos.data));
    return py::make_tuple(pos.object, cu.object);
  }

  index_t layer_total(index_t layer) const { return driver_.layer_total(layer); }
  allocator kind() const { return cfg_.alloc.kind; }
  py::object budgets() const {
    tensor like;
    const tensor b = output(py::none(), "budgets", like, {cfg_.model.layers, cfg_.model.kv_heads}, dtype::i32);
    std::copy(budgets_.begin(), budgets_.end(), static_cast<std::int32_t*>(b.data));
    return b.object;
  }

 private:
  post_fill_config cfg_;
  std::vector<std::int32_t> budgets_;
  std::vector<unsigned char> state_;
  post_fill_driver driver_;
  std::mutex mutex_;
};

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
}

}  // namespace kvevict::python
