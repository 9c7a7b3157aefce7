// python/src/extras.cpp: the metrics (recall@k, Kendall's tau-b) and the training math
// (LookaheadKV's LoRA layer, window scores and KL loss; PruLong's hard-concrete gates and
// Lagrangian), float32 tensors (docs/metrics.md, docs/lookahead.md, docs/prulong.md).
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

tensor f32_like(const tensor& like, const char* name, std::vector<index_t> shape) {
  return output(py::none(), name, like, std::move(shape), dtype::f32);
}

vector_view<float> vec(const tensor& t) {
  const index_t ext[1] = {t.shape[0]};
  const index_t str[1] = {t.strides[0]};
  return value_or_raise(detail::make_strided<float, 1>(t.name.c_str(), static_cast<float*>(t.data), ext, str));
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

// ---- LookaheadKV -------------------------------------------------------------------------------

lora_adapter<float> adapter(const tensor& a, const tensor& b, double alpha) {
  return lora_adapter<float>{mat<const float>(a), mat<const float>(b), static_cast<float>(alpha)};
}

py::object linear(py::handle x_, py::handle w_) {
  const tensor x = f32(x_, "x", 2), w = f32(w_, "w", 2);
  const tensor y = f32_like(x, "y", {x.shape[0], w.shape[0]});
  const auto xv = mat<const float>(x), wv = mat<const float>(w);
  const auto yv = mat<float>(y);
  run([&] { return linear_forward(backend(), xv, wv, yv); });
  return y.object;
}

py::tuple lora_forward(py::handle x_, py::handle w_, py::handle a_, py::handle b_, double alpha, index_t begin,
                       index_t end) {
  const tensor x = f32(x_, "x", 2), w = f32(w_, "w", 2), a = f32(a_, "a", 2), b = f32(b_, "b", 2);
  if (end < begin) raise(errc::invalid_argument, "lora_linear_forward: rows end before they begin");
  const tensor y = f32_like(x, "y", {x.shape[0], w.shape[0]});
  const tensor xa = f32_like(x, "xa", {end - begin, a.shape[1]});
  const auto ad = adapter(a, b, alpha);
  const auto xv = mat<const float>(x), wv = mat<const float>(w);
  const auto xav = mat<float>(xa), yv = mat<float>(y);
  run([&] { return lora_linear_forward(backend(), xv, wv, ad, row_range{begin, end}, xav, yv); });
  return py::make_tuple(y.object, xa.object);
}

py::tuple lora_backward(py::handle x_, py::handle w_, py::handle a_, py::handle b_, double alpha, index_t begin,
                        index_t end, py::handle xa_, py::handle dy_) {
  const tensor x = f32(x_, "x", 2), w = f32(w_, "w", 2), a = f32(a_, "a", 2), b = f32(b_, "b", 2);
  const tensor xa = f32(xa_, "xa", 2), dy = f32(dy_, "dy", 2);
  const tensor da = f32_like(a, "da", {a.shape[0], a.shape[1]}), db = f32_like(b, "db", {b.shape[0], b.shape[1]});
  const tensor dx = f32_like(x, "dx", {end > begin ? end - begin : 0, x.shape[1]});
  // the backward adds into the adapter's gradients: start them at zero
  std::fill_n(static_cast<float*>(da.data), da.numel(), 0.0f);
  std::fill_n(static_cast<float*>(db.data), db.numel(), 0.0f);
  const auto ad = adapter(a, b, alpha);
  const lora_adapter_grad<float> grad{mat<float>(da), mat<float>(db)};
  const auto xv = mat<const float>(x), wv = mat<const float>(w), xav = mat<const float>(xa), dyv = mat<const float>(dy);
  const auto dxv = mat<float>(dx);
  run_ws([&](workspace& ws) {
    return lora_linear_backward(backend(), ws, xv, wv, ad, row_range{begin, end}, xav, dyv, grad, dxv);
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
  const tensor q = f32(q_, "q", 2), kp = f32(kp_, "k_prefix", 2), kb = f32(kb_, "k_block", 2);
  const tensor s = f32_like(q, "s", {kp.shape[0]});
  const auto opt = window_opts(scale, reduce);
  const auto qv = mat<const float>(q), kpv = mat<const float>(kp), kbv = mat<const float>(kb);
  const auto sv = vec(s);
  run_ws([&](workspace& ws) { return lookahead_window_scores(backend(), ws, qv, kpv, kbv, sv, opt); });
  return s.object;
}

py::tuple lookahead_scores_backward(py::handle q_, py::handle kp_, py::handle kb_, py::handle ds_, double scale,
                                    const std::string& reduce) {
  const tensor q = f32(q_, "q", 2), kp = f32(kp_, "k_prefix", 2), kb = f32(kb_, "k_block", 2), ds = f32(ds_, "ds", 1);
  const tensor dq = f32_like(q, "dq", {q.shape[0], q.shape[1]}), dkb = f32_like(kb, "dk_block", {kb.shape[0], kb.shape[1]});
  const auto opt = window_opts(scale, reduce);
  const auto qv = mat<const float>(q), kpv = mat<const float>(kp), kbv = mat<const float>(kb);
  const index_t ext[1] = {ds.shape[0]};
  const index_t str[1] = {ds.strides[0]};
  const auto dsv = value_or_raise(detail::make_strided<const float, 1>("ds", static_cast<const float*>(ds.data), ext, str));
  const auto dqv = mat<float>(dq), dkbv = mat<float>(dkb);
  run_ws([&](workspace& ws) {
    return lookahead_window_scores_backward(backend(), ws, qv, kpv, kbv, dsv, dqv, dkbv, opt);
  });
  return py::make_tuple(dq.object, dkb.object);
}

py::tuple kl_loss(py::handle gt_, py::handle est_, double eps, const std::string& kind) {
  const tensor gt = f32(gt_, "gt", 2), est = f32(est_, "est", 2);
  lookahead_loss_options o;
  o.eps = eps;
  if (kind == "kl") o.kind = lookahead_loss_kind::kl;
  else if (kind == "listnet") o.kind = lookahead_loss_kind::listnet;
  else raise(errc::invalid_argument, "lookahead_kl_loss: kind must be 'kl' or 'listnet', got '" + kind + "'");
  const tensor grad = f32_like(est, "grad_est", {est.shape[0], est.shape[1]});
  const auto gv = mat<const float>(gt), ev = mat<const float>(est);
  const auto grv = mat<float>(grad);
  double loss = 0;
  run_ws([&](workspace& ws) { return lookahead_kl_loss(backend(), ws, gv, ev, &loss, grv, o); });
  return py::make_tuple(loss, grad.object);
}

// ---- PruLong -----------------------------------------------------------------------------------

hard_concrete_params<float> hc(double l, double r, double beta) {
  return hard_concrete_params<float>{static_cast<float>(l), static_cast<float>(r), static_cast<float>(beta)};
}

py::tuple sample_gates(py::handle la_, py::handle u_, double l, double r, double beta) {
  const tensor la = f32(la_, "log_alpha", 2), u = f32(u_, "u", 2);
  const tensor z = f32_like(la, "z", {la.shape[0], la.shape[1]}), dz = f32_like(la, "dz", {la.shape[0], la.shape[1]});
  const auto lav = mat<const float>(la), uv = mat<const float>(u);
  const auto zv = mat<float>(z), dzv = mat<float>(dz);
  run([&] { return prulong_sample_gates(lav, uv, zv, dzv, hc(l, r, beta)); });
  return py::make_tuple(z.object, dz.object);
}

py::object deterministic_gates(py::handle la_, double l, double r, double beta) {
  const tensor la = f32(la_, "log_alpha", 2);
  const tensor z = f32_like(la, "z", {la.shape[0], la.shape[1]});
  const auto lav = mat<const float>(la);
  const auto zv = mat<float>(z);
  run([&] { return prulong_deterministic_gates(lav, zv, hc(l, r, beta)); });
  return z.object;
}

py::tuple expected_sparsity(py::handle la_, double l, double r, double beta) {
  const tensor la = f32(la_, "log_alpha", 2);
  const tensor grad = f32_like(la, "grad", {la.shape[0], la.shape[1]});
  const auto lav = mat<const float>(la);
  const auto gv = mat<float>(grad);
  double s = 0;
  run([&] { return prulong_expected_sparsity(lav, &s, gv, hc(l, r, beta)); });
  return py::make_tuple(s, grad.object);
}

py::dict lagrangian(py::handle la_, double target, double lambda1, double lambda2, double l, double r, double beta) {
  const tensor la = f32(la_, "log_alpha", 2);
  const tensor grad = f32_like(la, "grad_log_alpha", {la.shape[0], la.shape[1]});
  const auto lav = mat<const float>(la);
  const auto gv = mat<float>(grad);
  prulong_lagrangian_result res;
  run([&] { return prulong_lagrangian(lav, target, lambda1, lambda2, &res, gv, prulong_grad_options{}, hc(l, r, beta)); });
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
  const tensor la = f32(la_, "log_alpha", 2);
  const tensor mask = output(py::none(), "mask", la, {la.shape[0], la.shape[1]}, dtype::u8);
  const auto lav = mat<const float>(la);
  const auto mv = mat<std::uint8_t>(mask);
  run([&] { return prulong_topk_mask(lav, k, mv); });
  return mask.object;
}

py::object binarize(py::handle v_, double threshold) {
  const tensor v = f32(v_, "values", 2);
  const tensor mask = output(py::none(), "mask", v, {v.shape[0], v.shape[1]}, dtype::u8);
  const auto vv = mat<const float>(v);
  const auto mv = mat<std::uint8_t>(mask);
  run([&] { return binarize_head_mask(vv, threshold, mv); });
  return mask.object;
}

}  // namespace

void bind_extras(py::module_& m) {
  using namespace pybind11::literals;
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
