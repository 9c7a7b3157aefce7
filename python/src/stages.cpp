// python/src/stages.cpp: the stages (score, gqa, pool, weight, protect, postprocess, select,
// compact) on PyTorch / NumPy tensors, without copies, the GIL released during the work.
#include "common.hpp"

namespace kvevict::python {

std::vector<std::int32_t> host_offsets(py::handle counts_, index_t rows) {
  const tensor counts = as_tensor(counts_, "budgets", 1);
  if (counts.cuda)
    raise(errc::unsupported, "budgets is a CUDA tensor: the ragged calls read the budgets on the host (they size "
                             "the output), pass a CPU tensor");
  const std::int32_t* c = int32_array(counts, rows);
  std::vector<std::int32_t> cu(static_cast<std::size_t>(rows) + 1, 0);
  index_t total = 0;
  for (index_t r = 0; r < rows; ++r) {
    if (c[r] < 0) raise(errc::invalid_argument, counts.name + "[" + std::to_string(r) + "] is negative");
    total += c[r];
    if (total > INT32_MAX) raise(errc::size_overflow, counts.name + ": the counts add up to more than INT32_MAX");
    cu[static_cast<std::size_t>(r) + 1] = static_cast<std::int32_t>(total);
  }
  return cu;
}

std::pair<py::handle, py::handle> out_pair(py::handle out, const char* what) {
  if (out.is_none()) return {py::none(), py::none()};
  const auto t = out.cast<py::tuple>();
  if (t.size() != 2) raise(errc::invalid_argument, std::string("out is ") + what);
  return {t[0], t[1]};  // borrowed from `out`, which the caller holds
}

tensor int32_output(py::handle out, const char* name, const tensor& like, index_t n) {
  tensor t = output(out, name, like, {n}, dtype::i32);
  if (n > 1 && t.strides[0] != 1) raise(errc::invalid_argument, t.name + " must be contiguous");
  return t;
}

ragged_outputs::ragged_outputs(py::handle out, const tensor& like, std::vector<std::int32_t> offsets, bool gpu)
    : host_cu(std::move(offsets)) {
  const auto o = out_pair(out, "(positions, cu)");
  positions = int32_output(o.first, "positions", like, host_cu.back());
  cu = int32_output(o.second, "cu", like, static_cast<index_t>(host_cu.size()));
  if (!gpu) std::copy(host_cu.begin(), host_cu.end(), static_cast<std::int32_t*>(cu.data));
}

namespace {

py::object attention(py::handle q_, py::handle k_, py::handle b_, const score_options& opt, bool all_columns,
                     py::handle out_) {
  const tensor q = as_tensor(q_, "queries", 3), k = as_tensor(k_, "prefix_keys", 3);
  const tensor b = as_optional(b_, "block_keys", 3);
  require_kv_type({&q, &k, &b});
  const index_t cols = k.shape[1] + (all_columns ? q.shape[1] : 0);
  const tensor out = output(out_, "out", q, {q.shape[0], cols}, dtype::f32);
  on_device(
      "attention_scores", {&q, &k, &b, &out},
      [&] {
        dispatch_kv(q, [&](auto e) {
          using T = decltype(e);
          const auto qv = kv<const T>(q), kv_ = kv<const T>(k), bv = optional_kv<T>(b);
          const auto ov = mat<float>(out);
          run_ws([&](workspace& ws) { return attention_scores(backend(), ws, qv, kv_, bv, ov, opt); });
        });
      },
      [&](gpu::stream_t st) { return gpu::attention_scores(raw_of(q), raw_of(k), raw_of(b), raw_of(out), opt, st); });
  return out.object;
}

// window_scores / h2o_scores / tova_scores: [H_q][rows][d] queries over [H_kv][T][d] keys -> [H_q][T]
// call(ws, queries, keys, out) on the host; on_cuda(queries, keys, out, stream) on the GPU
template <class Call, class CudaCall>
py::object scores_over_prompt(const char* fn, py::handle q_, py::handle k_, py::handle out_, Call call,
                              CudaCall on_cuda) {
  const tensor q = as_tensor(q_, "queries", 3), k = as_tensor(k_, "keys", 3);
  require_kv_type({&q, &k});
  const tensor out = output(out_, "out", q, {q.shape[0], k.shape[1]}, dtype::f32);
  on_device(
      fn, {&q, &k, &out},
      [&] {
        dispatch_kv(q, [&](auto e) {
          using T = decltype(e);
          const auto qv = kv<const T>(q), kv_ = kv<const T>(k);
          const auto ov = mat<float>(out);
          run_ws([&](workspace& ws) { return call(ws, qv, kv_, ov); });
        });
      },
      [&](gpu::stream_t st) { return on_cuda(raw_of(q), raw_of(k), raw_of(out), st); });
  return out.object;
}

py::object key_norms(py::handle k_, py::handle out_) {
  const tensor k = as_tensor(k_, "keys", 3);
  require_kv_type({&k});
  const tensor out = output(out_, "out", k, {k.shape[0], k.shape[1]}, dtype::f32);
  on_device(
      "key_norm_scores", {&k, &out},
      [&] {
        dispatch_kv(k, [&](auto e) {
          using T = decltype(e);
          const auto kv_ = kv<const T>(k);
          const auto ov = mat<float>(out);
          run([&] { return key_norm_scores(backend(), kv_, ov); });
        });
      },
      [&](gpu::stream_t st) { return gpu::key_norm_scores(raw_of(k), raw_of(out), st); });
  return out.object;
}

py::object positions(py::handle out_) {
  const tensor out = score_matrix(out_, "out", true);
  on_device(
      "position_scores", {&out}, [&] { run([&] { return position_scores(backend(), mat<float>(out)); }); },
      [&](gpu::stream_t st) { return gpu::position_scores(raw_of(out), st); });
  return out.object;
}

py::object gqa(py::handle in_, index_t kv_heads, gqa_op op, py::handle out_) {
  const tensor in = score_matrix(in_, "scores");
  const tensor out = output(out_, "out", in, {kv_heads, in.shape[1]}, dtype::f32);
  on_device(
      "gqa_reduce", {&in, &out},
      [&] { run([&] { return gqa_reduce(backend(), mat<const float>(in), mat<float>(out), op); }); },
      [&](gpu::stream_t st) { return gpu::gqa_reduce(raw_of(in), raw_of(out), op, st); });
  return out.object;
}

py::object pool(py::handle in_, pool_kind kind, index_t kernel, py::handle lengths_, avg_divisor divisor,
                py::handle out_) {
  const tensor in = score_matrix(in_, "scores");
  const tensor lengths = as_optional(lengths_, "row_lengths", 1);
  const std::int32_t* len = int32_data(lengths, in.shape[0]);
  const tensor out = output(out_, "out", in, {in.shape[0], in.shape[1]}, dtype::f32);
  on_device(
      "pool1d", {&in, &lengths, &out},
      [&] {
        pool_options po;
        po.divisor = divisor;
        run([&] { return pool1d(backend(), mat<const float>(in), mat<float>(out), kind, kernel, len, po); });
      },
      [&](gpu::stream_t st) { return gpu::pool1d(raw_of(in), raw_of(out), kind, kernel, len, divisor, st); });
  return out.object;
}

py::object weight(py::handle s_, py::handle v_, value_weight mode, py::handle lengths_) {
  const tensor s = score_matrix(s_, "scores", true);
  const tensor v = as_tensor(v_, "values", 3);
  require_kv_type({&v});
  const tensor lengths = as_optional(lengths_, "lengths", 1);
  const std::int32_t* len = int32_data(lengths, v.shape[0]);
  on_device(
      "weight_by_value_norm", {&s, &v, &lengths},
      [&] {
        dispatch_kv(v, [&](auto e) {
          using T = decltype(e);
          const auto sv = mat<float>(s);
          const auto vv = kv<const T>(v);
          run([&] { return weight_by_value_norm(backend(), sv, vv, mode, len); });
        });
      },
      [&](gpu::stream_t st) { return gpu::weight_by_value_norm(raw_of(s), raw_of(v), mode, len, st); });
  return s.object;
}

py::object protect_scores(py::handle s_, index_t n_sink, index_t n_recent, py::handle lengths_) {
  const tensor s = score_matrix(s_, "scores", true);
  const tensor lengths = as_optional(lengths_, "row_lengths", 1);
  const std::int32_t* len = int32_data(lengths, s.shape[0]);
  on_device(
      "protect", {&s, &lengths}, [&] { run([&] { return protect(backend(), mat<float>(s), n_sink, n_recent, len); }); },
      [&](gpu::stream_t st) { return gpu::protect(raw_of(s), n_sink, n_recent, len, st); });
  return s.object;
}

py::object postprocess(py::handle in_, index_t kv_heads, py::handle v_, const postprocess_options& opt,
                       py::handle lengths_, py::handle vlengths_, py::handle out_) {
  const tensor in = score_matrix(in_, "scores");
  const tensor v = as_optional(v_, "values", 3);
  require_kv_type({&v});
  const tensor lengths = as_optional(lengths_, "row_lengths", 1), vlengths = as_optional(vlengths_, "value_lengths", 1);
  const bool no_values = v.data == nullptr && v.ndim == 0;
  const std::int32_t* len = int32_data(lengths, kv_heads);
  const std::int32_t* vlen = no_values ? nullptr : int32_data(vlengths, v.shape[0]);
  const tensor out = output(out_, "out", in, {kv_heads, in.shape[1]}, dtype::f32);
  on_device(
      "postprocess_scores", {&in, &v, &lengths, &vlengths, &out},
      [&] {
        const auto iv = mat<const float>(in);
        const auto ov = mat<float>(out);
        if (no_values) {
          run_ws([&](workspace& ws) { return postprocess_scores(backend(), ws, iv, ov, opt, len); });
          return;
        }
        dispatch_kv(v, [&](auto e) {
          using T = decltype(e);
          const auto vv = kv<const T>(v);
          run_ws([&](workspace& ws) { return postprocess_scores(backend(), ws, iv, ov, vv, opt, len, vlen); });
        });
      },
      [&](gpu::stream_t st) {
        return gpu::postprocess_scores(raw_of(in), raw_of(out), raw_of(v), opt, len, vlen, st);
      });
  return out.object;
}

py::object select_dense(py::handle s_, index_t k, py::handle lengths_, py::handle out_) {
  const tensor s = score_matrix(s_, "scores");
  const tensor lengths = as_optional(lengths_, "row_lengths", 1);
  const std::int32_t* len = int32_data(lengths, s.shape[0]);
  if (k < 0) raise(errc::invalid_argument, "select_topk: k = " + std::to_string(k) + " is negative");
  const tensor out = output(out_, "out", s, {s.shape[0], k}, dtype::i32);
  on_device(
      "select_topk", {&s, &lengths, &out},
      [&] {
        const auto sv = mat<const float>(s);
        const auto ov = mat<pos_t>(out);
        run_ws([&](workspace& ws) { return select_topk(backend(), ws, sv, len, ov); });
      },
      [&](gpu::stream_t st) { return gpu::select_topk(raw_of(s), len, raw_of(out), st); });
  return out.object;
}

// ragged selection: per-row counts -> (positions [sum], cu [R+1])
py::tuple select_ragged(py::handle s_, py::handle counts, py::handle lengths_, py::handle out_) {
  constexpr const char* fn = "select_topk_ragged";
  const tensor s = score_matrix(s_, "scores");
  const tensor lengths = as_optional(lengths_, "row_lengths", 1);
  const bool gpu = runs_on_gpu(fn, {&s, &lengths});
  const std::int32_t* len = int32_data(lengths, s.shape[0]);
  const ragged_outputs o(out_, s, host_offsets(counts, s.shape[0]), gpu);
  auto* cup = static_cast<std::int32_t*>(o.cu.data);
  auto* pp = static_cast<pos_t*>(o.positions.data);
  on_device(
      fn, {&s, &lengths, &o.positions, &o.cu},
      [&] {
        const auto sv = mat<const float>(s);
        const ragged_positions_out kept{pp, cup, s.shape[0]};
        run_ws([&](workspace& ws) { return select_topk(backend(), ws, sv, len, kept); });
      },
      [&](gpu::stream_t st) { return gpu::select_topk_ragged(raw_of(s), len, o.host_cu.data(), cup, pp, st); });
  return py::make_tuple(o.positions.object, o.cu.object);
}

py::tuple select_flat(py::handle s_, index_t total, py::handle lengths_, py::handle floors_) {
  const tensor s = score_matrix(s_, "scores");
  const tensor lengths = as_optional(lengths_, "row_lengths", 1), floors = as_optional(floors_, "floors", 1);
  const std::int32_t* len = int32_data(lengths, s.shape[0]);
  const std::int32_t* fl = int32_data(floors, s.shape[0]);
  if (total < 0 || total > INT32_MAX) raise(errc::invalid_argument, "select_topk_flat: total = " + std::to_string(total) + " is outside [0, INT32_MAX]");
  const tensor cu = output(py::none(), "cu", s, {s.shape[0] + 1}, dtype::i32);
  const tensor pos = output(py::none(), "positions", s, {total}, dtype::i32);
  auto* cup = static_cast<std::int32_t*>(cu.data);
  auto* pp = static_cast<pos_t*>(pos.data);
  on_device(
      "select_topk_flat", {&s, &lengths, &floors, &cu, &pos},
      [&] {
        const auto sv = mat<const float>(s);
        run_ws([&](workspace& ws) { return select_topk_flat(backend(), ws, sv, len, total, fl, cup, pp); });
      },
      [&](gpu::stream_t st) { return gpu::select_topk_flat(raw_of(s), len, total, fl, cup, pp, st); });
  return py::make_tuple(pos.object, cu.object);
}

py::object compact_dense(py::handle src_, py::handle kept_, py::handle out_) {
  const tensor src = as_tensor(src_, "src", 3);
  require_kv_type({&src});
  const tensor kept = as_tensor(kept_, "kept", 2);
  require_dtype(kept, {dtype::i32});
  const tensor out = output(out_, "out", src, {src.shape[0], kept.shape[1], src.shape[2]}, src.type);
  on_device(
      "compact", {&src, &kept, &out},
      [&] {
        dispatch_kv(src, [&](auto e) {
          using T = decltype(e);
          const auto sv = kv<const T>(src);
          const auto kv_ = mat<const pos_t>(kept);
          const auto ov = kv<T>(out);
          run([&] { return compact(backend(), sv, kv_, ov); });
        });
      },
      [&](gpu::stream_t st) { return gpu::compact(raw_of(src), raw_of(kept), raw_of(out), st); });
  return out.object;
}

// ragged gather: src [H][T][d], positions + cu -> rows [total][d] (head h: rows cu[h] .. cu[h+1])
py::object compact_ragged(py::handle src_, py::handle pos_, py::handle cu_, py::handle out_) {
  const tensor src = as_tensor(src_, "src", 3);
  require_kv_type({&src});
  const tensor cu = as_tensor(cu_, "cu", 1);
  const std::int32_t* cup = int32_data(cu, src.shape[0] + 1);
  const tensor pos = as_tensor(pos_, "positions", 1);
  const pos_t* pp = int32_data(pos, pos.shape[0]);
  // the rows kept: cu[H] read on the host; on a GPU (not readable without a synchronisation) the
  // positions' length, which the device checks cu[H] against
  const index_t total = cu.cuda ? pos.shape[0] : cup[src.shape[0]];
  const tensor out = output(out_, "out", src, {total, src.shape[2]}, src.type);
  if (out.strides[1] != 1 && src.shape[2] > 1) raise(errc::invalid_argument, "out: rows must be contiguous");
  on_device(
      "compact_ragged", {&src, &pos, &cu, &out},
      [&] {
        dispatch_kv(src, [&](auto e) {
          using T = decltype(e);
          const auto sv = kv<const T>(src);
          const ragged_positions kept{pp, cup, src.shape[0]};
          const ragged_view<T> dst{static_cast<T*>(out.data), cup, src.shape[0], src.shape[2], out.strides[0]};
          run([&] { return compact(backend(), sv, kept, dst); });
        });
      },
      [&](gpu::stream_t st) { return gpu::compact_ragged(raw_of(src), pp, cup, raw_of(out), st); });
  return out.object;
}

void compact_in_place(py::handle cache_, py::handle kept_) {
  const tensor cache = as_tensor(cache_, "cache", 3, true);
  require_kv_type({&cache});
  const tensor kept = as_tensor(kept_, "kept", 2);
  require_dtype(kept, {dtype::i32});
  on_device(
      "compact_inplace", {&cache, &kept},
      [&] {
        dispatch_kv(cache, [&](auto e) {
          using T = decltype(e);
          const auto cv = kv<T>(cache);
          const auto kv_ = mat<const pos_t>(kept);
          run([&] { return compact_inplace(backend(), cv, kv_); });
        });
      },
      [&](gpu::stream_t st) { return gpu::compact_inplace(raw_of(cache), raw_of(kept), st); });
}

}  // namespace

void bind_stages(py::module_& m) {
  using namespace pybind11::literals;
  m.def("attention_scores", &attention, "queries"_a, "prefix_keys"_a, "block_keys"_a = py::none(),
        "options"_a = score_options{}, "all_columns"_a = false, "out"_a = py::none(),
        "Attention of a block of queries [H_q][w][d] over prefix keys [H_kv][P][d] (and the block's own keys, "
        "causally), reduced over the rows: [H_q][P], or [H_q][P + w] with all_columns (docs/score.md).");
  m.def(
      "window_scores",
      [](py::handle q, py::handle k, const score_options& opt, py::handle out) {
        return scores_over_prompt(
            "window_scores", q, k, out,
            [&](workspace& ws, auto qv, auto kv_, auto ov) { return window_scores(backend(), ws, qv, kv_, ov, opt); },
            [&](const gpu::raw& qr, const gpu::raw& kr, const gpu::raw& o, gpu::stream_t st) {
              return gpu::window_scores(qr, kr, o, opt, st);
            });
      },
      "window_queries"_a, "keys"_a, "options"_a = score_options{}, "out"_a = py::none(),
      "SnapKV's window scores: the last w prompt tokens' queries [H_q][w][d] over keys [H_kv][T][d] (their keys are "
      "the last w rows) -> [H_q][T].");
  m.def(
      "h2o_scores",
      [](py::handle q, py::handle k, bool normalised, float scale, py::handle out) {
        return scores_over_prompt(
            "h2o_scores", q, k, out,
            [&](workspace& ws, auto qv, auto kv_, auto ov) {
              return h2o_scores(backend(), ws, qv, kv_, ov, normalised, scale);
            },
            [&](const gpu::raw& qr, const gpu::raw& kr, const gpu::raw& o, gpu::stream_t st) {
              return gpu::h2o_scores(qr, kr, o, normalised, scale, st);
            });
      },
      "queries"_a, "keys"_a, "normalised"_a = false, "scale"_a = 0.0f, "out"_a = py::none(),
      "H2O's accumulated attention of every prompt query [H_q][T][d] (causal) -> [H_q][T].");
  m.def(
      "tova_scores",
      [](py::handle q, py::handle k, float scale, py::handle out) {
        return scores_over_prompt(
            "tova_scores", q, k, out,
            [&](workspace& ws, auto qv, auto kv_, auto ov) { return tova_scores(backend(), ws, qv, kv_, ov, scale); },
            [&](const gpu::raw& qr, const gpu::raw& kr, const gpu::raw& o, gpu::stream_t st) {
              return gpu::tova_scores(qr, kr, o, scale, st);
            });
      },
      "last_query"_a, "keys"_a, "scale"_a = 0.0f, "out"_a = py::none(),
      "TOVA: the last prompt token's attention [H_q][1][d] over keys [H_kv][T][d] -> [H_q][T].");
  m.def("key_norm_scores", &key_norms, "keys"_a, "out"_a = py::none(), "Knorm: -||k||_2 per token -> [H_kv][T].");
  m.def("position_scores", &positions, "out"_a, "StreamingLLM: each column's position, written into out [R][T].");
  m.def("gqa_reduce", &gqa, "scores"_a, "kv_heads"_a, "op"_a = gqa_op::mean, "out"_a = py::none(),
        "[H_q][T] -> [H_kv][T], mean | max | sum over each group of query heads.");
  m.def("pool1d", &pool, "scores"_a, "kind"_a = pool_kind::max, "kernel"_a = 7, "row_lengths"_a = py::none(),
        "divisor"_a = avg_divisor::kernel, "out"_a = py::none(), "1-D max/avg pooling of each row, odd kernel, stride 1.");
  m.def("weight_by_value_norm", &weight, "scores"_a, "values"_a, "mode"_a = value_weight::per_token,
        "lengths"_a = py::none(), "In place: scores [R][T] times ||v_j||_1 (per_token, VATP) or max_k ||v_k||_1 (head_max, LAVa).");
  m.def("protect", &protect_scores, "scores"_a, "n_sink"_a = 0, "n_recent"_a = 0, "row_lengths"_a = py::none(),
        "In place: the first n_sink and last n_recent positions of each row become +inf (other +inf become FLT_MAX).");
  m.def("postprocess_scores", &postprocess, "scores"_a, "kv_heads"_a, "values"_a = py::none(),
        "options"_a = postprocess_options{}, "row_lengths"_a = py::none(), "value_lengths"_a = py::none(),
        "out"_a = py::none(), "GQA reduce + pool (either order) + value weighting + protection in one pass: [H_q][T] -> [H_kv][T].");
  m.def("select_topk", &select_dense, "scores"_a, "k"_a, "row_lengths"_a = py::none(), "out"_a = py::none(),
        "Per row, the positions of the k highest scores, ascending: [R][k] int32.");
  m.def("select_topk_ragged", &select_ragged, "scores"_a, "budgets"_a, "row_lengths"_a = py::none(), "out"_a = py::none(),
        "Per row r, the budgets[r] best positions, ascending: (positions [sum], cu [R+1]) int32 (or into "
        "out=(positions, cu)). budgets: a CPU int32 tensor (it sizes the output), also for CUDA scores.");
  m.def("select_topk_flat", &select_flat, "scores"_a, "total"_a, "row_lengths"_a = py::none(), "floors"_a = py::none(),
        "The total best entries of all rows jointly (ties: lower row, then lower position), each row at least its "
        "floor: (positions, cu).");
  m.def("compact", &compact_dense, "src"_a, "kept"_a, "out"_a = py::none(),
        "Dense gather: out[h][j] = src[h][kept[h][j]]: [H][k][d].");
  m.def("compact_ragged", &compact_ragged, "src"_a, "positions"_a, "cu"_a, "out"_a = py::none(),
        "Ragged gather: head h's kept rows at out[cu[h]:cu[h+1]]: [total][d].");
  m.def("compact_inplace", &compact_in_place, "cache"_a, "kept"_a,
        "In place: the first k tokens of each head of cache [H][T][d] become the kept ones.");
}

}  // namespace kvevict::python
