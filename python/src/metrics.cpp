// python/src/metrics.cpp: the footprint metrics and the eviction recorder
// (kvevict/metrics/footprint.hpp) and LAVa's layer output loss and its bound
// (kvevict/metrics/lava_loss.hpp), on PyTorch / NumPy tensors (docs/metrics.md, docs/python.md).
#include "common.hpp"

#include <mutex>

namespace kvevict::python {

namespace {

/// A host int32 tensor of rank `rank` (schedules, recorder storage, position lists).
tensor int32_tensor(py::handle obj, const char* name, int rank, bool writable = false) {
  tensor t = as_tensor(obj, name, rank, writable);
  require_dtype(t, {dtype::i32});
  require_host(t);
  return t;
}

template <class T, int N>
strided_view<T, N> strided(const tensor& t) {
  index_t ext[N], str[N];
  for (int i = 0; i < N; ++i) {
    ext[i] = t.shape[static_cast<std::size_t>(i)];
    str[i] = t.strides[static_cast<std::size_t>(i)];
  }
  return value_or_raise(detail::make_strided<T, N>(t.name.c_str(), static_cast<T*>(t.data), ext, str));
}

/// A 1-D int32 position list, contiguous: (pointer, count).
std::pair<const pos_t*, index_t> position_list(py::handle obj, const char* name) {
  const tensor t = int32_tensor(obj, name, 1);
  return {int32_array(t, t.shape[0]), t.shape[0]};
}

py::dict usage_dict(const kv_usage& u) {
  py::dict d;
  d["tokens"] = u.tokens;
  d["rows"] = u.rows;
  d["resident"] = u.resident;
  d["full"] = u.full;
  d["peak"] = u.peak;
  d["peak_query"] = u.peak_query;
  d["footprint"] = u.footprint();
  d["peak_kv"] = u.peak_kv();
  return d;
}

/// measure_kv_usage over every row, one layer, or one (layer, head) of a schedule view.
py::dict measure(const eviction_schedule& s, py::object layer, py::object head) {
  if (layer.is_none() && !head.is_none()) raise(errc::invalid_argument, "measure_kv_usage: head needs a layer");
  kv_usage u;
  if (layer.is_none()) {
    run_ws([&](workspace& ws) { return measure_kv_usage(ws, s, u); });
  } else if (head.is_none()) {
    const auto l = layer.cast<index_t>();
    run_ws([&](workspace& ws) { return measure_kv_usage(ws, s, l, u); });
  } else {
    const auto l = layer.cast<index_t>(), h = head.cast<index_t>();
    run_ws([&](workspace& ws) { return measure_kv_usage(ws, s, l, h, u); });
  }
  return usage_dict(u);
}

py::dict measure_py(py::handle schedule_, py::object layer, py::object head) {
  const tensor s = int32_tensor(schedule_, "schedule", 3);
  return measure(strided<const pos_t, 3>(s), std::move(layer), std::move(head));
}

/// The recorder over a [layers][heads][capacity] int32 tensor: its own NumPy array, or the
/// caller's `storage` (any strides the views accept; written in place).
class recorder {
 public:
  recorder(index_t layers, index_t heads, index_t capacity, py::handle storage_) {
    if (storage_.is_none()) {
      if (layers <= 0 || heads <= 0 || capacity <= 0)
        raise(errc::invalid_argument, "EvictionRecorder: layers, heads and capacity must be positive (" +
                                          std::to_string(layers) + ", " + std::to_string(heads) + ", " +
                                          std::to_string(capacity) + ")");
      storage_t_ = output(py::none(), "storage", tensor{}, {layers, heads, capacity}, dtype::i32);
    } else {
      storage_t_ = int32_tensor(storage_, "storage", 3, true);
    }
    rec_ = value_or_raise(make_eviction_recorder(strided<pos_t, 3>(storage_t_)));
  }

  void mark_evicted(index_t layer, py::handle head_or_ragged, py::handle positions_, index_t step) {
    std::lock_guard<std::mutex> lock(mu_);
    if (py::isinstance<py::tuple>(head_or_ragged)) {  // (positions, cu): every head of the layer
      const auto r = ragged(head_or_ragged);
      run([&] { return rec_.mark_evicted(layer, r, step); });
    } else {
      const auto [p, n] = position_list(positions_, "positions");
      const auto head = head_or_ragged.cast<index_t>();
      run([&, p = p, n = n] { return rec_.mark_evicted(layer, head, p, n, step); });
    }
  }

  void retain_only(index_t layer, py::handle kept_, py::object head, index_t step) {
    std::lock_guard<std::mutex> lock(mu_);
    if (py::isinstance<py::tuple>(kept_)) {
      const auto r = ragged(kept_);
      run([&] { return rec_.retain_only(layer, r, step); });
    } else if (!head.is_none()) {
      const auto [p, n] = position_list(kept_, "kept");
      const auto h = head.cast<index_t>();
      run([&, p = p, n = n] { return rec_.retain_only(layer, h, p, n, step); });
    } else {
      const tensor k = int32_tensor(kept_, "kept", 2);
      const auto kv_ = mat<const pos_t>(k);
      run([&] { return rec_.retain_only(layer, kv_, step); });
    }
  }

  void set_full(index_t layer, index_t head) {
    std::lock_guard<std::mutex> lock(mu_);
    throw_if(rec_.set_full(layer, head));
  }
  void set_streaming(index_t layer, index_t head, index_t tokens, index_t n_sink, index_t recent) {
    std::lock_guard<std::mutex> lock(mu_);
    throw_if(rec_.set_streaming(layer, head, tokens, n_sink, recent));
  }
  void set_post_fill(index_t layer, index_t head, index_t prompt, py::handle kept_) {
    const auto [p, n] = position_list(kept_, "kept");
    std::lock_guard<std::mutex> lock(mu_);
    throw_if(rec_.set_post_fill(layer, head, prompt, p, n));
  }

  /// The first `tokens` positions of the storage (a view of it, not a copy).
  py::object schedule(index_t tokens) const {
    (void)value_or_raise(rec_.schedule(tokens));  // the recorder's range check and message
    return py::object(storage_t_.object[py::make_tuple(py::slice(py::none(), py::none(), py::none()),
                                            py::slice(py::none(), py::none(), py::none()),
                                            py::slice(py::int_(0), py::int_(tokens), py::none()))]);
  }

  py::dict usage(index_t tokens, py::object layer, py::object head) {
    std::lock_guard<std::mutex> lock(mu_);
    return measure(value_or_raise(rec_.schedule(tokens)), std::move(layer), std::move(head));
  }

  py::object storage() const { return storage_t_.object; }
  index_t layers() const { return rec_.layers(); }
  index_t heads() const { return rec_.heads(); }
  index_t capacity() const { return rec_.capacity(); }

 private:
  /// (positions, cu) of every head of a layer: contiguous int32, cu[heads + 1].
  ragged_positions ragged(py::handle obj) const {
    const auto t = obj.cast<py::tuple>();
    if (t.size() != 2) raise(errc::invalid_argument, "EvictionRecorder: a ragged list is (positions, cu)");
    const tensor pos = int32_tensor(t[0], "positions", 1), cu = int32_tensor(t[1], "cu", 1);
    return ragged_positions{int32_array(pos, pos.shape[0]), int32_array(cu, rec_.heads() + 1), rec_.heads()};
  }

  tensor storage_t_;
  eviction_recorder rec_;
  std::mutex mu_;
};

py::tuple critical(py::handle footprints_, py::handle performances_, double full, double fraction, crossing_rule rule) {
  std::vector<double> f = footprints_.cast<std::vector<double>>(), p = performances_.cast<std::vector<double>>();
  if (f.size() != p.size())
    raise(errc::shape_mismatch, "critical_footprint: " + std::to_string(f.size()) + " footprints but " +
                                    std::to_string(p.size()) + " performances");
  std::vector<curve_point> pts(f.size());
  for (std::size_t i = 0; i < f.size(); ++i) pts[i] = curve_point{f[i], p[i]};
  critical_footprint_result r;
  critical_footprint_options o;
  o.fraction = fraction;
  o.rule = rule;
  throw_if(critical_footprint(pts.data(), static_cast<index_t>(pts.size()), full, r, o));
  return py::make_tuple(r.footprint, r.threshold, r.kind);
}

/// The LAVa loss's inputs: attention [H_q][N] float32, values [H_kv][N][d] (KV types), W_O float32,
/// keep [H_kv or H_q][N] uint8 / bool. Calls f(attention, values, w_o, keep).
template <class F>
void with_lava_inputs(py::handle a_, py::handle v_, py::handle w_, py::handle keep_, F&& f) {
  const tensor a = float_matrix(a_, "attention"), w = float_matrix(w_, "w_o");
  const tensor v = as_tensor(v_, "values", 3);
  require_kv({&v});
  const tensor keep = as_tensor(keep_, "keep", 2);
  require_dtype(keep, {dtype::u8, dtype::boolean});
  require_host(keep);
  const auto av = mat<const float>(a), wv = mat<const float>(w);
  const auto kv_ = mat<const std::uint8_t>(keep);
  dispatch_kv(v, [&](auto e) {
    using T = decltype(e);
    f(av, kv<const T>(v), wv, kv_);
  });
}

double lava_loss_py(py::handle a_, py::handle v_, py::handle w_, py::handle keep_, lp_norm norm, wo_layout layout,
                    empty_head on_empty) {
  double loss = 0;
  with_lava_inputs(a_, v_, w_, keep_, [&](const auto& a, const auto& v, const auto& w, const auto& k) {
    run_ws([&](workspace& ws) { return lava_output_loss(ws, a, v, w, k, loss, lava_loss_options{norm, layout, on_empty}); });
  });
  return loss;
}

double lava_bound_py(py::handle a_, py::handle v_, py::handle w_, py::handle keep_, wo_layout layout) {
  double bound = 0;
  with_lava_inputs(a_, v_, w_, keep_, [&](const auto& a, const auto& v, const auto& w, const auto& k) {
    run([&] { return lava_loss_bound(a, v, w, k, bound, layout); });
  });
  return bound;
}

}  // namespace

void bind_metrics(py::module_& m) {
  using namespace pybind11::literals;
  m.attr("NEVER_EVICTED") = static_cast<std::int64_t>(never_evicted);
  m.def("measure_kv_usage", &measure_py, "schedule"_a, "layer"_a = py::none(), "head"_a = py::none(),
        "KV usage of an eviction schedule evicted_at[L][H][N] int32 (every row, one layer, or one head): dict of "
        "tokens, rows, resident, full, peak, peak_query, footprint, peak_kv (docs/metrics.md).");
  py::class_<recorder>(m, "EvictionRecorder",
                       "Records when each key leaves memory (kvevict::eviction_recorder) in an int32 storage "
                       "[layers][heads][capacity] (its own NumPy array, or the caller's `storage`, written in place); "
                       "`step` counts the tokens processed so far.")
      .def(py::init<index_t, index_t, index_t, py::handle>(), "layers"_a = 0, "heads"_a = 0, "capacity"_a = 0,
           "storage"_a = py::none())
      .def("mark_evicted", &recorder::mark_evicted, "layer"_a, "head"_a, "positions"_a = py::none(), "step"_a = 0,
           "Positions of one head evicted at `step`; or head=(positions, cu) for every head of the layer.")
      .def("retain_only", &recorder::retain_only, "layer"_a, "kept"_a, "head"_a = py::none(), "step"_a = 0,
           "Every resident key below `step` not in `kept` is evicted at `step`: kept a 1-D list of one head (head=), "
           "dense [H][k], or (positions, cu).")
      .def("set_full", &recorder::set_full, "layer"_a, "head"_a)
      .def("set_streaming", &recorder::set_streaming, "layer"_a, "head"_a, "tokens"_a, "n_sink"_a, "recent"_a)
      .def("set_post_fill", &recorder::set_post_fill, "layer"_a, "head"_a, "prompt"_a, "kept"_a)
      .def("schedule", &recorder::schedule, "tokens"_a, "The schedule of the first `tokens` positions (a view).")
      .def("usage", &recorder::usage, "tokens"_a, "layer"_a = py::none(), "head"_a = py::none(),
           "measure_kv_usage of schedule(tokens).")
      .def_property_readonly("storage", &recorder::storage)
      .def_property_readonly("layers", &recorder::layers)
      .def_property_readonly("heads", &recorder::heads)
      .def_property_readonly("capacity", &recorder::capacity);
  m.def("critical_footprint", &critical, "footprints"_a, "performances"_a, "full_performance"_a, "fraction"_a = 0.9,
        "rule"_a = crossing_rule::first_reach,
        "(footprint, threshold, kind) of a performance-vs-footprint curve, linearly interpolated (docs/metrics.md).");
  m.def("lava_output_loss", &lava_loss_py, "attention"_a, "values"_a, "w_o"_a, "keep"_a, "norm"_a = lp_norm::l1,
        "layout"_a = wo_layout::in_out, "on_empty"_a = empty_head::zero_output,
        "LAVa's layer output loss ||y - y_hat||_p of one query (Lemma 1): attention [H_q][N], values [H_kv][N][d], "
        "w_o [H_q d][D] (in_out) or [D][H_q d] (out_in), keep [H_kv or H_q][N].");
  m.def("lava_loss_bound", &lava_bound_py, "attention"_a, "values"_a, "w_o"_a, "keep"_a, "layout"_a = wo_layout::in_out,
        "LAVa's upper bound of the L1 output loss (Theorem 1).");
}

}  // namespace kvevict::python
