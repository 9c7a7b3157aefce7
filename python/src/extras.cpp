// python/src/extras.cpp: the metrics (recall@k, Kendall's tau-b) and the training math
// (LookaheadKV's LoRA layer, window scores and KL loss; PruLong's hard-concrete gates and
// Lagrangian) in float32 or float64 (one type per call, outputs of the inputs' type) (docs/metrics.md, docs/lookahead.md, docs/prulong.md).
#include "common.hpp"

#include <kvevict/train/lookahead.hpp>
#include <kvevict/train/prulong.hpp>

namespace kvevict::python {

namespace {

tensor f32(py::handle obj, const char* name, int rank) {
  tensor t = as_tensor(obj, name, rank);
  require_dtype(t, {dtype::f32});
  require_host(t);
  return t;
}

py::tuple with_rows(double mean, const tensor& rows) { return py::make_tuple(mean, rows.object); }

py::tuple recall(py::handle est_, py::handle truth_, index_t k) {
  const tensor est = f32(est_, "estimate", 2), truth = f32(truth_, "truth", 2);
  const tensor rows = output(py::none(), "per_row", tensor{}, {truth.shape[0]}, dtype::f64);
  const auto ev = mat<const float>(est), tv = mat<const float>(truth);
  double mean = 0;
  run_ws([&](workspace& ws) { return recall_at_k(ws, ev, tv, k, mean, static_cast<double*>(rows.data)); });
  return with_rows(mean, rows);
}

py::tuple kept_recall(py::handle kept_, py::handle truth_, index_t k) {
  const tensor truth = f32(truth_, "truth", 2);
  const tensor rows = output(py::none(), "per_row", tensor{}, {truth.shape[0]}, dtype::f64);
  const auto tv = mat<const float>(truth);
  double mean = 0;
  if (py::isinstance<py::tuple>(kept_)) {  // ragged (positions, cu)
    const auto t = kept_.cast<py::tuple>();
    const tensor pos = as_tensor(t[0], "positions", 1), cu = as_tensor(t[1], "cu", 1);
    const std::int32_t* cup = int32_array(cu, truth.shape[0] + 1);
    const ragged_positions kept{int32_array(pos, pos.shape[0]), cup, truth.shape[0]};
    run_ws([&](workspace& ws) { return kept_recall_at_k(ws, kept, tv, k, mean, static_cast<double*>(rows.data)); });
  } else {
    const tensor kept = as_tensor(kept_, "kept", 2);
    require_dtype(kept, {dtype::i32});
    require_host(kept);
    const auto kv_ = mat<const pos_t>(kept);
    run_ws([&](workspace& ws) { return kept_recall_at_k(ws, kv_, tv, k, mean, static_cast<double*>(rows.data)); });
  }
  return with_rows(mean, rows);
}

py::tuple kendall(py::handle a_, py::handle b_) {
  const tensor a = f32(a_, "a", 2), b = f32(b_, "b", 2);
  const tensor rows = output(py::none(), "per_row", tensor{}, {a.shape[0]}, dtype::f64);
  const auto av = mat<const float>(a), bv = mat<const float>(b);
  double mean = 0;
  run_ws([&](workspace& ws) { return kendall_tau_b(ws, av, bv, mean, static_cast<double*>(rows.data)); });
  return with_rows(mean, rows);
}

// ---- the training math: float32 or float64 ------------------------------------------------------

/// The training math's real tensors: float32 or float64 on the host, one type per call (the first's).
struct reals {
  dtype type = dtype::other;
  const char* fn;
  explicit reals(const char* f) : fn(f) {}
  tensor operator()(py::handle obj, const char* name, int rank) {
    tensor t = as_tensor(obj, name, rank);
    require_dtype(t, {dtype::f32, dtype::f64});
    require_host(t);
    if (type == dtype::other) type = t.type;
    else if (t.type != type)
      raise(errc::invalid_argument, std::string(fn) + ": " + name + " is " + dtype_name(t.type) + " but the first tensor is " +
                                        dtype_name(type) + " (one element type per call)");
    return t;
  }
  /// Calls f(R{}) with R float or double.
  template <class F>
  decltype(auto) dispatch(F&& f) const {
    if (type == dtype::f64) return f(double{});
    return f(float{});
  }
};

tensor real_like(const tensor& like, const char* name, std::vector<index_t> shape) {
  return output(py::none(), name, like, std::move(shape), like.type);
}

template <class R>
vector_view<R> vec(const tensor& t) {
  const index_t ext[1] = {t.shape[0]};
  const index_t str[1] = {t.strides[0]};
  return value_or_raise(detail::make_strided<R, 1>(t.name.c_str(), static_cast<R*>(t.data), ext, str));
}

template <class R>
lora_adapter<R> adapter(const tensor& a, const tensor& b, double alpha) {
  return lora_adapter<R>{mat<const R>(a), mat<const R>(b), static_cast<R>(alpha)};
}

py::object linear(py::handle x_, py::handle w_) {
  reals in("linear_forward");
  const tensor x = in(x_, "x", 2), w = in(w_, "w", 2);
  const tensor y = real_like(x, "y", {x.shape[0], w.shape[0]});
  in.dispatch([&](auto e) {
    using R = decltype(e);
    const auto xv = mat<const R>(x), wv = mat<const R>(w);
    const auto yv = mat<R>(y);
    run([&] { return linear_forward(backend(), xv, wv, yv); });
  });
  return y.object;
}

py::tuple lora_forward(py::handle x_, py::handle w_, py::handle a_, py::handle b_, double alpha, index_t begin,
                       index_t end) {
  reals in("lora_linear_forward");
  const tensor x = in(x_, "x", 2), w = in(w_, "w", 2), a = in(a_, "a", 2), b = in(b_, "b", 2);
  if (end < begin) raise(errc::invalid_argument, "lora_linear_forward: rows end before they begin");
  const tensor y = real_like(x, "y", {x.shape[0], w.shape[0]});
  const tensor xa = real_like(x, "xa", {end - begin, a.shape[1]});
  in.dispatch([&](auto e) {
    using R = decltype(e);
    const auto ad = adapter<R>(a, b, alpha);
    const auto xv = mat<const R>(x), wv = mat<const R>(w);
    const auto xav = mat<R>(xa), yv = mat<R>(y);
    run([&] { return lora_linear_forward(backend(), xv, wv, ad, row_range{begin, end}, xav, yv); });
  });
  return py::make_tuple(y.object, xa.object);
}

py::tuple lora_backward(py::handle x_, py::handle w_, py::handle a_, py::handle b_, double alpha, index_t begin,
                        index_t end, py::handle xa_, py::handle dy_) {
  reals in("lora_linear_backward");
  const tensor x = in(x_, "x", 2), w = in(w_, "w", 2), a = in(a_, "a", 2), b = in(b_, "b", 2);
  const tensor xa = in(xa_, "xa", 2), dy = in(dy_, "dy", 2);
  const tensor da = real_like(a, "da", {a.shape[0], a.shape[1]}), db = real_like(b, "db", {b.shape[0], b.shape[1]});
  const tensor dx = real_like(x, "dx", {end > begin ? end - begin : 0, x.shape[1]});
  in.dispatch([&](auto e) {
    using R = decltype(e);
    // the backward adds into the adapter's gradients: start them at zero
    std::fill_n(static_cast<R*>(da.data), da.numel(), R(0));
    std::fill_n(static_cast<R*>(db.data), db.numel(), R(0));
    const auto ad = adapter<R>(a, b, alpha);
    const lora_adapter_grad<R> grad{mat<R>(da), mat<R>(db)};
    const auto xv = mat<const R>(x), wv = mat<const R>(w), xav = mat<const R>(xa), dyv = mat<const R>(dy);
    const auto dxv = mat<R>(dx);
    run_ws([&](workspace& ws) {
      return lora_linear_backward(backend(), ws, xv, wv, ad, row_range{begin, end}, xav, dyv, grad, dxv);
    });
  });
  return py::make_tuple(da.object, db.object, dx.object);
}

lookahead_window_options window_opts(double scale, const std::string& reduce) {
  lookahead_window_options o;
  o.scale = scale;
  if (reduce == "mean") o.reduce = lookahead_reduce::mean;
  else if (reduce == "sum") o.reduce = lookahead_reduce::sum;
  else raise(errc::invalid_argument, "lookahead_window_scores: reduce must be 'mean' or 'sum', got '" + reduce + "'");
  return o;
}

py::object lookahead_scores(py::handle q_, py::handle kp_, py::handle kb_, double scale, const std::string& reduce) {
  reals in("lookahead_window_scores");
  const tensor q = in(q_, "q", 2), kp = in(kp_, "k_prefix", 2), kb = in(kb_, "k_block", 2);
  const tensor s = real_like(q, "s", {kp.shape[0]});
  const auto opt = window_opts(scale, reduce);
  in.dispatch([&](auto e) {
    using R = decltype(e);
    const auto qv = mat<const R>(q), kpv = mat<const R>(kp), kbv = mat<const R>(kb);
    const auto sv = vec<R>(s);
    run_ws([&](workspace& ws) { return lookahead_window_scores(backend(), ws, qv, kpv, kbv, sv, opt); });
  });
  return s.object;
}

py::tuple lookahead_scores_backward(py::handle q_, py::handle kp_, py::handle kb_, py::handle ds_, double scale,
                                    const std::string& reduce) {
  reals in("lookahead_window_scores_backward");
  const tensor q = in(q_, "q", 2), kp = in(kp_, "k_prefix", 2), kb = in(kb_, "k_block", 2), ds = in(ds_, "ds", 1);
  const tensor dq = real_like(q, "dq", {q.shape[0], q.shape[1]}), dkb = real_like(kb, "dk_block", {kb.shape[0], kb.shape[1]});
  const auto opt = window_opts(scale, reduce);
  in.dispatch([&](auto e) {
    using R = decltype(e);
    const auto qv = mat<const R>(q), kpv = mat<const R>(kp), kbv = mat<const R>(kb);
    const auto dsv = vector_view<const R>(vec<R>(ds));
    const auto dqv = mat<R>(dq), dkbv = mat<R>(dkb);
    run_ws([&](workspace& ws) {
      return lookahead_window_scores_backward(backend(), ws, qv, kpv, kbv, dsv, dqv, dkbv, opt);
    });
  });
  return py::make_tuple(dq.object, dkb.object);
}

py::tuple kl_loss(py::handle gt_, py::handle est_, double eps, const std::string& kind) {
  reals in("lookahead_kl_loss");
  const tensor gt = in(gt_, "gt", 2), est = in(est_, "est", 2);
  lookahead_loss_options o;
  o.eps = eps;
  if (kind == "kl") o.kind = lookahead_loss_kind::kl;
  else if (kind == "listnet") o.kind = lookahead_loss_kind::listnet;
  else raise(errc::invalid_argument, "lookahead_kl_loss: kind must be 'kl' or 'listnet', got '" + kind + "'");
  const tensor grad = real_like(est, "grad_est", {est.shape[0], est.shape[1]});
  double loss = 0;
  in.dispatch([&](auto e) {
    using R = decltype(e);
    const auto gv = mat<const R>(gt), ev = mat<const R>(est);
    const auto grv = mat<R>(grad);
    run_ws([&](workspace& ws) { return lookahead_kl_loss(backend(), ws, gv, ev, &loss, grv, o); });
  });
  return py::make_tuple(loss, grad.object);
}

// ---- PruLong -----------------------------------------------------------------------------------

template <class R>
hard_concrete_params<R> hc(double l, double r, double beta) {
  return hard_concrete_params<R>{static_cast<R>(l), static_cast<R>(r), static_cast<R>(beta)};
}

py::tuple sample_gates(py::handle la_, py::handle u_, double l, double r, double beta) {
  reals in("prulong_sample_gates");
  const tensor la = in(la_, "log_alpha", 2), u = in(u_, "u", 2);
  const tensor z = real_like(la, "z", {la.shape[0], la.shape[1]}), dz = real_like(la, "dz", {la.shape[0], la.shape[1]});
  in.dispatch([&](auto e) {
    using R = decltype(e);
    const auto lav = mat<const R>(la), uv = mat<const R>(u);
    const auto zv = mat<R>(z), dzv = mat<R>(dz);
    run([&] { return prulong_sample_gates(lav, uv, zv, dzv, hc<R>(l, r, beta)); });
  });
  return py::make_tuple(z.object, dz.object);
}

py::object deterministic_gates(py::handle la_, double l, double r, double beta) {
  reals in("prulong_deterministic_gates");
  const tensor la = in(la_, "log_alpha", 2);
  const tensor z = real_like(la, "z", {la.shape[0], la.shape[1]});
  in.dispatch([&](auto e) {
    using R = decltype(e);
    const auto lav = mat<const R>(la);
    const auto zv = mat<R>(z);
    run([&] { return prulong_deterministic_gates(lav, zv, hc<R>(l, r, beta)); });
  });
  return z.object;
}

py::tuple expected_sparsity(py::handle la_, double l, double r, double beta) {
  reals in("prulong_expected_sparsity");
  const tensor la = in(la_, "log_alpha", 2);
  const tensor grad = real_like(la, "grad", {la.shape[0], la.shape[1]});
  double s = 0;
  in.dispatch([&](auto e) {
    using R = decltype(e);
    const auto lav = mat<const R>(la);
    const auto gv = mat<R>(grad);
    run([&] { return prulong_expected_sparsity(lav, &s, gv, hc<R>(l, r, beta)); });
  });
  return py::make_tuple(s, grad.object);
}

py::dict lagrangian(py::handle la_, double target, double lambda1, double lambda2, double l, double r, double beta) {
  reals in("prulong_lagrangian");
  const tensor la = in(la_, "log_alpha", 2);
  const tensor grad = real_like(la, "grad_log_alpha", {la.shape[0], la.shape[1]});
  prulong_lagrangian_result res;
  in.dispatch([&](auto e) {
    using R = decltype(e);
    const auto lav = mat<const R>(la);
    const auto gv = mat<R>(grad);
    run([&] {
      return prulong_lagrangian(lav, target, lambda1, lambda2, &res, gv, prulong_grad_options{}, hc<R>(l, r, beta));
    });
  });
  py::dict d;
  d["sparsity"] = res.sparsity;
  d["target"] = res.target;
  d["value"] = res.penalty.value;
  d["grad_sparsity"] = res.penalty.grad_sparsity;
  d["grad_lambda1"] = res.penalty.grad_lambda1;
  d["grad_lambda2"] = res.penalty.grad_lambda2;
  d["grad_log_alpha"] = grad.object;
  return d;
}

py::object topk_mask(py::handle la_, index_t k) {
  reals in("prulong_topk_mask");
  const tensor la = in(la_, "log_alpha", 2);
  const tensor mask = output(py::none(), "mask", la, {la.shape[0], la.shape[1]}, dtype::u8);
  const auto mv = mat<std::uint8_t>(mask);
  in.dispatch([&](auto e) {
    using R = decltype(e);
    const auto lav = mat<const R>(la);
    run([&] { return prulong_topk_mask(lav, k, mv); });
  });
  return mask.object;
}

py::object binarize(py::handle v_, double threshold) {
  reals in("binarize_head_mask");
  const tensor v = in(v_, "values", 2);
  const tensor mask = output(py::none(), "mask", v, {v.shape[0], v.shape[1]}, dtype::u8);
  const auto mv = mat<std::uint8_t>(mask);
  in.dispatch([&](auto e) {
    using R = decltype(e);
    const auto vv = mat<const R>(v);
    run([&] { return binarize_head_mask(vv, threshold, mv); });
  });
  return mask.object;
}

/// A head-mask TSV (DuoAttention / PruLong, docs/prulong.md) as float64 [layers][heads]: from a
/// text (shape read from it) or a file of the expected shape (the library's reader).
py::object parse_mask_py(const std::string& text, bool clip) {
  head_mask_tsv_options o;
  o.range = clip ? head_mask_range::clip : head_mask_range::strict;
  index_t L = 0, H = 0;
  throw_if(head_mask_tsv_shape(text.data(), text.size(), &L, &H, o));
  tensor like;
  const tensor out = output(py::none(), "mask", like, {L, H}, dtype::f64);
  const auto ov = value_or_raise(make_matrix_view<double>(static_cast<double*>(out.data), L, H));
  throw_if(parse_head_mask_tsv(text.data(), text.size(), ov, o));
  return out.object;
}

py::object read_mask_py(const std::string& path, index_t layers, index_t heads, bool clip) {
  head_mask_tsv_options o;
  o.range = clip ? head_mask_range::clip : head_mask_range::strict;
  if (layers < 0 || heads < 0) raise(errc::invalid_argument, "read_head_mask_tsv: layers and heads must be >= 0");
  tensor like;
  const tensor out = output(py::none(), "mask", like, {layers, heads}, dtype::f64);
  const auto ov = value_or_raise(make_matrix_view<double>(static_cast<double*>(out.data), layers, heads));
  run([&] { return read_head_mask_tsv(path.c_str(), ov, o); });
  return out.object;
}

}  // namespace

void bind_extras(py::module_& m) {
  using namespace pybind11::literals;
  m.def("parse_head_mask_tsv", &parse_mask_py, "text"_a, "clip"_a = false,
        "A head-mask TSV text (one line per layer, one tab-separated value in [0, 1] per KV head) -> float64 "
        "[layers][heads]; clip=True clamps finite values to [0, 1] as DuoAttention's loader does.");
  m.def("read_head_mask_tsv", &read_mask_py, "path"_a, "layers"_a, "heads"_a, "clip"_a = false,
        "A head-mask TSV file of the model's [layers][heads] shape -> float64 [layers][heads] (binarize_head_mask "
        "or duo_budgets take it from there).");
  m.def("recall_at_k", &recall, "estimate"_a, "truth"_a, "k"_a,
        "(mean, per_row): |top-k(estimate) & top-k(truth)| / k per row (docs/metrics.md).");
  m.def("kept_recall_at_k", &kept_recall, "kept"_a, "truth"_a, "k"_a,
        "(mean, per_row): |kept & top-k(truth)| / k; kept dense [R][k'] or ragged (positions, cu).");
  m.def("kendall_tau_b", &kendall, "a"_a, "b"_a, "(mean, per_row): Kendall's tau-b between the rows of a and b.");
  m.def("linear_forward", &linear, "x"_a, "w"_a, "y = x w^T: x [n][in], w [out][in] (LookaheadKV's frozen projection).");
  m.def("lora_linear_forward", &lora_forward, "x"_a, "w"_a, "a"_a, "b"_a, "alpha"_a = 32.0, "begin"_a = 0,
        "end"_a = 0, "(y, xa): y = x w^T + (alpha / r) x A B on rows [begin, end) (the lookahead tokens).");
  m.def("lora_linear_backward", &lora_backward, "x"_a, "w"_a, "a"_a, "b"_a, "alpha"_a, "begin"_a, "end"_a, "xa"_a,
        "dy"_a, "(da, db, dx) of the LoRA layer's rows [begin, end), given dy.");
  m.def("lookahead_window_scores", &lookahead_scores, "q"_a, "k_prefix"_a, "k_block"_a, "scale"_a = 0.0,
        "reduce"_a = "mean", "One head's lookahead window scores [P] (LookaheadKV §3.1).");
  m.def("lookahead_window_scores_backward", &lookahead_scores_backward, "q"_a, "k_prefix"_a, "k_block"_a, "ds"_a,
        "scale"_a = 0.0, "reduce"_a = "mean", "(dq, dk_block) of lookahead_window_scores given ds.");
  m.def("lookahead_kl_loss", &kl_loss, "gt"_a, "est"_a, "eps"_a = 1e-8, "kind"_a = "kl",
        "(loss, grad_est): mean over rows of KL(norm(gt) || norm(est)) (LookaheadKV Eq. 5).");
  m.def("prulong_sample_gates", &sample_gates, "log_alpha"_a, "u"_a, "l"_a = -0.1, "r"_a = 1.1, "beta"_a = 2.0 / 3.0,
        "(z, dz/dlog_alpha): hard-concrete gates of uniform noise u.");
  m.def("prulong_deterministic_gates", &deterministic_gates, "log_alpha"_a, "l"_a = -0.1, "r"_a = 1.1,
        "beta"_a = 2.0 / 3.0, "The deterministic (test-time) hard-concrete gates.");
  m.def("prulong_expected_sparsity", &expected_sparsity, "log_alpha"_a, "l"_a = -0.1, "r"_a = 1.1,
        "beta"_a = 2.0 / 3.0, "(s, ds/dlog_alpha): the expected fraction of streaming heads.");
  m.def("prulong_lagrangian", &lagrangian, "log_alpha"_a, "target"_a, "lambda1"_a, "lambda2"_a, "l"_a = -0.1,
        "r"_a = 1.1, "beta"_a = 2.0 / 3.0, "PruLong's sparsity Lagrangian, its derivatives and dL/dlog_alpha.");
  m.def(
      "prulong_retrieval_heads",
      [](index_t heads, double sparsity) { return value_or_raise(prulong_retrieval_heads(heads, sparsity)); },
      "heads"_a, "sparsity"_a, "floor(heads (1 - sparsity)): retrieval heads for a head sparsity.");
  m.def("prulong_topk_mask", &topk_mask, "log_alpha"_a, "k"_a, "The k largest log_alpha as retrieval heads: uint8 mask.");
  m.def("binarize_head_mask", &binarize, "values"_a, "threshold"_a, "mask = values >= threshold (uint8).");
}

}  // namespace kvevict::python
