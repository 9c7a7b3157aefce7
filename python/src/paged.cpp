// python/src/paged.cpp: paged KV caches (kvevict/paged.hpp) and batched selection
// (kvevict/batch.hpp) on PyTorch / NumPy tensors: page pools are the caller's 4-D tensors (NHD
// [pages][page_size][H][d] or HND [pages][H][page_size][d], any strides with contiguous rows) and
// the block tables FlashInfer-style CSR int32 arrays (indptr, indices, last_page_len), read and
// written in place without copies (docs/paged.md, docs/python.md).
#include "common.hpp"

namespace kvevict::python {

namespace {

/// A page table's int32 array: on the host, also for CUDA pools (validated there; the bridge copies it).
tensor int32_1d(py::handle obj, const char* name, bool writable = false) {
  tensor t = as_tensor(obj, name, 1, writable);
  require_dtype(t, {dtype::i32});
  if (t.cuda)
    raise(errc::unsupported, t.name + " is a CUDA tensor: page tables are read on the host (validated there, copied "
                                      "to the device for CUDA pools); pass CPU tensors");
  return t;
}

/// One layer's pools and table, as the binding reads them.
struct paged_args {
  tensor keys, values, indptr, indices, last;
  index_t lists = 0;
  index_t kv_heads = 0;
  page_lists kind = page_lists::per_sequence;
  page_layout layout = page_layout::nhd;
  bool writable = false;

  paged_args(py::handle k, py::handle v, py::handle ip, py::handle ix, py::handle lp, index_t heads, page_lists lk,
             page_layout lay, bool write)
      : kv_heads(heads), kind(lk), layout(lay), writable(write) {
    keys = as_tensor(k, "key_pages", 4, write);
    values = as_tensor(v, "value_pages", 4, write);
    require_kv_type({&keys, &values});  // on either device; the tables on the host
    indptr = int32_1d(ip, "indptr");
    indices = int32_1d(ix, "indices");
    last = int32_1d(lp, "last_page_len");
    lists = indptr.shape[0] - 1;
    if (lists < 0) raise(errc::invalid_argument, "indptr needs lists + 1 entries (got none)");
    if (last.shape[0] != lists)
      raise(errc::shape_mismatch, "last_page_len has " + std::to_string(last.shape[0]) + " entries but indptr lists " +
                                      std::to_string(lists));
    if (kv_heads <= 0) raise(errc::invalid_argument, "kv_heads must be positive");
  }

  template <class T>
  page_pool<T> pool(const tensor& t) const {
    // NHD: [pages][page_size][heads][dim]; HND: [pages][heads][page_size][dim]
    const bool nhd = layout == page_layout::nhd;
    page_pool<T> p;
    p.data = static_cast<T*>(t.data);
    p.pages = t.shape[0];
    p.page_size = nhd ? t.shape[1] : t.shape[2];
    p.heads = nhd ? t.shape[2] : t.shape[1];
    p.dim = t.shape[3];
    p.page_stride = t.strides[0];
    p.token_stride = nhd ? t.strides[1] : t.strides[2];
    p.head_stride = nhd ? t.strides[2] : t.strides[1];
    if (p.dim > 1 && t.strides[3] != 1)
      raise(errc::invalid_argument, t.name + ": the head dim must be contiguous (stride 1), got stride " +
                                        std::to_string(t.strides[3]));
    return p;
  }

  template <class T>
  paged_layer<T> layer() const {
    paged_layer<T> L;
    L.keys = pool<T>(keys);
    L.values = pool<T>(values);
    L.table = page_table{int32_array(indptr, lists + 1), int32_array(indices, indices.shape[0]),
                         int32_array(last, lists), lists};
    L.kv_heads = kv_heads;
    L.sequences = kind == page_lists::per_head ? (lists % kv_heads == 0 ? lists / kv_heads : -1) : lists;
    if (L.sequences < 0)
      raise(errc::shape_mismatch, "per-head tables list sequences x kv_heads lists; " + std::to_string(lists) +
                                      " is not a multiple of " + std::to_string(kv_heads));
    L.lists = kind;
    return L;
  }
};

/// Calls f(paged_layer<T>) for the layer's element type, after the library validated its table
/// (on the host: a CUDA call's bridge copies the validated table to the device).
template <class F>
void with_paged(const paged_args& a, F&& f) {
  dispatch_kv(a.keys, [&](auto e) {
    using T = decltype(e);
    const paged_layer<T> L = a.layer<T>();
    run_ws([&](workspace& ws) { return validate_paged_layer(ws, L); }, 1);
    f(L);
  });
}

/// The longest row of a validated layer.
template <class T>
index_t longest_row(const paged_layer<T>& L) {
  index_t longest = 0;
  for (index_t r = 0; r < L.rows(); ++r) longest = std::max(longest, L.length(r));
  return longest;
}

py::object key_norms_py(py::handle k, py::handle v, py::handle ip, py::handle ix, py::handle lp, index_t heads,
                        page_lists lk, page_layout lay, py::handle out_) {
  constexpr const char* fn = "paged_key_norm_scores";
  const paged_args a(k, v, ip, ix, lp, heads, lk, lay, false);
  const bool gpu = runs_on_gpu(fn, {&a.keys, &a.values});
  py::object result;
  with_paged(a, [&](const auto& L) {
    using T = std::remove_pointer_t<decltype(L.keys.data)>;
    const tensor out = output(out_, "out", a.keys, {L.rows(), longest_row(L)}, dtype::f32);
    if (out_.is_none()) {  // columns past a row's length: 0
      if (gpu) out.object.attr("zero_")();
      else std::fill_n(static_cast<float*>(out.data), out.numel(), 0.0f);
    }
    on_device(
        fn, {&a.keys, &a.values, &out},
        [&] {
          const auto ov = mat<float>(out);
          run_ws([&](workspace& ws) { return paged_key_norm_scores(backend(), ws, L, ov); });
        },
        [&](gpu::stream_t st) { return gpu::paged_key_norm_scores<T>(L, raw_of(out), st); });
    result = out.object;
  });
  return result;
}

py::object window_scores_py(py::handle q_, py::handle k, py::handle v, py::handle ip, py::handle ix, py::handle lp,
                            index_t heads, page_lists lk, page_layout lay, bool include_window,
                            const score_options& opt, py::handle out_) {
  constexpr const char* fn = "paged_window_scores";
  const paged_args a(k, v, ip, ix, lp, heads, lk, lay, false);
  const tensor q = as_tensor(q_, "window_queries", 3);
  require_kv_type({&q, &a.keys, &a.values});
  const bool gpu = runs_on_gpu(fn, {&q, &a.keys, &a.values});
  py::object result;
  with_paged(a, [&](const auto& L) {
    using T = std::remove_pointer_t<decltype(L.keys.data)>;
    const index_t cols = std::max<index_t>(0, longest_row(L) - (include_window ? 0 : q.shape[1]));
    const tensor out = output(out_, "out", q, {q.shape[0], cols}, dtype::f32);
    if (out_.is_none()) {  // columns past a row's end: 0
      if (gpu) out.object.attr("zero_")();
      else std::fill_n(static_cast<float*>(out.data), out.numel(), 0.0f);
    }
    on_device(
        fn, {&q, &a.keys, &a.values, &out},
        [&] {
          const auto qv = kv<const T>(q);
          const auto ov = mat<float>(out);
          run_ws([&](workspace& ws) { return paged_window_scores(backend(), ws, qv, L, ov, include_window, opt); });
        },
        [&](gpu::stream_t st) {
          return gpu::paged_window_scores<T>(raw_of(q), L, raw_of(out), include_window, opt, st);
        });
    result = out.object;
  });
  return result;
}

py::object weight_py(py::handle scores_, py::handle k, py::handle v, py::handle ip, py::handle ix, py::handle lp,
                     index_t heads, value_weight mode, page_lists lk, page_layout lay) {
  constexpr const char* fn = "paged_weight_by_value_norm";
  const paged_args a(k, v, ip, ix, lp, heads, lk, lay, false);
  const tensor scores = score_matrix(scores_, "scores", true);
  runs_on_gpu(fn, {&scores, &a.keys, &a.values});  // refused before the table's validation
  with_paged(a, [&](const auto& L) {
    using T = std::remove_pointer_t<decltype(L.keys.data)>;
    on_device(
        fn, {&scores, &a.keys, &a.values},
        [&] {
          const auto sv = mat<float>(scores);
          run_ws([&](workspace& ws) { return paged_weight_by_value_norm(backend(), ws, sv, L, mode); });
        },
        [&](gpu::stream_t st) { return gpu::paged_weight_by_value_norm<T>(raw_of(scores), L, mode, st); });
  });
  return scores.object;
}

// compact_paged, or compact_layer (paged) when a position pool is given: its int32 [pages][...][1]
// tensor, laid out as the key pool, is compacted alike (on the host only: compact_layer has no
// cuda_t path)
py::tuple compact_paged_impl(py::handle k, py::handle v, py::handle ip, py::handle ix, py::handle lp, index_t heads,
                             py::handle kept_, page_lists lk, page_layout lay, py::handle positions_, py::handle out_) {
  constexpr const char* fn = "compact_paged";
  const paged_args a(k, v, ip, ix, lp, heads, lk, lay, true);
  const auto t = kept_.cast<py::tuple>();
  if (t.size() != 2) raise(errc::invalid_argument, "compact_paged: kept is (positions, cu)");
  const tensor pos = as_tensor(t[0], "kept positions", 1), cu = as_tensor(t[1], "kept cu", 1);
  for (const tensor* x : {&pos, &cu}) require_dtype(*x, {dtype::i32});
  tensor positions;
  if (!positions_.is_none()) {
    positions = as_tensor(positions_, "position_pool", 4, true);
    require_dtype(positions, {dtype::i32});
    for (const tensor* x : std::initializer_list<const tensor*>{&a.keys, &a.values, &positions, &pos, &cu})
      require_host(*x);
  }
  const bool gpu = runs_on_gpu(fn, {&a.keys, &a.values, &pos, &cu});
  py::tuple result;
  with_paged(a, [&](const auto& L) {
    using T = std::remove_pointer_t<decltype(L.keys.data)>;
    const page_pool<pos_t> position_pool = positions.data != nullptr ? a.pool<pos_t>(positions) : page_pool<pos_t>{};
    const index_t listed = L.table.indptr[a.lists];
    // new outputs like the table on the host, like the pools on a GPU (written there), or out=
    const auto out = out_pair(out_, "(lengths, freed_pages)");
    const tensor& like = gpu ? a.keys : a.indptr;
    const tensor lengths = int32_output(out.first, "lengths", like, a.lists);
    const tensor freed = int32_output(out.second, "freed_pages", like, listed);
    std::int32_t count = 0;
    const ragged_positions kept{int32_data(pos, pos.shape[0]), int32_data(cu, L.rows() + 1), L.rows()};
    auto* lp_ = static_cast<std::int32_t*>(lengths.data);
    auto* fp = static_cast<std::int32_t*>(freed.data);
    const paged_compaction_out o{lp_, fp, listed, &count};
    on_device(
        fn, {&a.keys, &a.values, &pos, &cu, &lengths, &freed},
        [&] {
          if (positions.data != nullptr)
            run_ws([&](workspace& ws) { return compact_layer(backend(), ws, L, position_pool, kept, o); });
          else
            run_ws([&](workspace& ws) { return compact_paged(backend(), ws, L, kept, o); });
        },
        [&](gpu::stream_t st) { return gpu::compact_paged<T>(L, kept, lp_, fp, listed, &count, st); });
    result = py::make_tuple(lengths.object, py::object(freed.object[py::slice(py::int_(0), py::int_(count), py::none())]));
  });
  return result;
}

py::tuple compact_paged_py(py::handle k, py::handle v, py::handle ip, py::handle ix, py::handle lp, index_t heads,
                           py::handle kept, page_lists lk, page_layout lay, py::handle out) {
  return compact_paged_impl(k, v, ip, ix, lp, heads, kept, lk, lay, py::none(), out);
}

py::tuple compact_layer_paged_py(py::handle k, py::handle v, py::handle positions, py::handle ip, py::handle ix,
                                 py::handle lp, index_t heads, py::handle kept, page_lists lk, page_layout lay) {
  if (positions.is_none()) raise(errc::null_pointer, "compact_layer_paged: position_pool is None");
  return compact_paged_impl(k, v, ip, ix, lp, heads, kept, lk, lay, positions, py::none());
}

void shrink_py(py::handle ip_, py::handle ix_, py::handle lp_, index_t page_size, py::handle lengths_) {
  const tensor ip = int32_1d(ip_, "indptr", true), ix = int32_1d(ix_, "indices", true);
  const tensor lp = int32_1d(lp_, "last_page_len", true), len = int32_1d(lengths_, "lengths");
  const index_t lists = ip.shape[0] - 1;
  if (lists < 0 || lp.shape[0] != lists || len.shape[0] != lists)
    raise(errc::shape_mismatch, "shrink_page_table: indptr [lists + 1], last_page_len [lists] and lengths [lists]");
  auto* ipp = const_cast<std::int32_t*>(int32_array(ip, lists + 1));
  auto* ixp = const_cast<std::int32_t*>(int32_array(ix, ix.shape[0]));
  auto* lpp = const_cast<std::int32_t*>(int32_array(lp, lists));
  const std::int32_t* lens = int32_array(len, lists);
  if (ix.shape[0] < ipp[lists])
    raise(errc::shape_mismatch, "shrink_page_table: indices has " + std::to_string(ix.shape[0]) + " entries, indptr lists " +
                                    std::to_string(ipp[lists]));
  run([&] { return shrink_page_table(ipp, ixp, lpp, lists, page_size, lens); });
}

py::tuple select_batch_py(py::handle scores_, py::handle budgets_, index_t kv_heads, batch_budget kind,
                          py::handle row_lengths_, py::handle cu_seqlens_, py::handle out_) {
  constexpr const char* fn = "select_topk_batch";
  const tensor scores = score_matrix(scores_, "scores");
  const tensor rl = as_optional(row_lengths_, "row_lengths", 1), cs = as_optional(cu_seqlens_, "cu_seqlens", 1);
  const tensor budgets = as_tensor(budgets_, "budgets", 1);
  require_dtype(budgets, {dtype::i32});
  if (rl.data != nullptr && cs.data != nullptr)
    raise(errc::invalid_argument, "select_topk_batch: row_lengths (padded) or cu_seqlens (varlen), not both");
  const bool gpu = runs_on_gpu(fn, {&scores, &rl, &cs, &budgets});
  if (!gpu) require_host(budgets);
  const auto sv = mat<const float>(scores);
  batch_rows rows;
  if (cs.data != nullptr) {
    require_dtype(cs, {dtype::i32});
    const index_t S = cs.shape[0] - 1;
    // on the GPU, cu_seqlens stays device memory: the library checks it there (all or nothing)
    rows = batch_varlen(sv, gpu ? int32_data(cs, cs.shape[0]) : int32_array(cs, cs.shape[0]), S);
  } else {
    if (kv_heads <= 0 || scores.shape[0] % kv_heads != 0)
      raise(errc::shape_mismatch, "select_topk_batch: padded scores have sequences x kv_heads rows; " +
                                      std::to_string(scores.shape[0]) + " is not a multiple of kv_heads " +
                                      std::to_string(kv_heads));
    if (rl.data != nullptr) require_dtype(rl, {dtype::i32});
    rows = batch_padded(sv, scores.shape[0] / kv_heads, kv_heads, int32_data(rl, scores.shape[0]));
  }
  const index_t capacity = scores.shape[0] * scores.shape[1];
  if (budgets.shape[0] != rows.sequences)
    raise(errc::shape_mismatch, "select_topk_batch: budgets has " + std::to_string(budgets.shape[0]) +
                                    " entries for " + std::to_string(rows.sequences) + " sequences");
  const index_t R = rows.sequences * rows.kv_heads;
  const auto out = out_pair(out_, "(positions [rows x T], cu [rows + 1])");
  const tensor cu = int32_output(out.second, "cu", scores, R + 1);
  const tensor pos = int32_output(out.first, "positions", scores, capacity);
  const std::int32_t* b = int32_data(budgets, rows.sequences);
  auto* cup = static_cast<std::int32_t*>(cu.data);
  auto* pp = static_cast<pos_t*>(pos.data);
  std::int32_t total = 0;
  on_device(
      fn, {&scores, &rl, &cs, &budgets, &cu, &pos},
      [&] {
        run_ws([&](workspace& ws) { return select_topk_batch(backend(), ws, rows, b, kind, cup, pp, capacity); });
        total = cup[R];
      },
      [&](gpu::stream_t st) {
        return gpu::select_topk_batch(raw_of(scores), rows.sequences, rows.kv_heads, rows.row_lengths,
                                      rows.cu_seqlens, b, kind, cup, pp, capacity, &total, st);
      });
  return py::make_tuple(py::object(pos.object[py::slice(py::int_(0), py::int_(total), py::none())]), cu.object);
}

}  // namespace

void bind_paged(py::module_& m) {
  using namespace pybind11::literals;
  m.def("paged_key_norm_scores", &key_norms_py, "key_pages"_a, "value_pages"_a, "indptr"_a, "indices"_a,
        "last_page_len"_a, "kv_heads"_a, "lists"_a = page_lists::per_sequence, "layout"_a = page_layout::nhd,
        "out"_a = py::none(),
        "Knorm over a paged layer: [rows][longest row] float32, rows r = s * kv_heads + h (columns past a row's "
        "length: 0 in a new tensor, untouched in out=).");
  m.def("compact_paged", &compact_paged_py, "key_pages"_a, "value_pages"_a, "indptr"_a, "indices"_a,
        "last_page_len"_a, "kv_heads"_a, "kept"_a, "lists"_a = page_lists::per_sequence, "layout"_a = page_layout::nhd,
        "out"_a = py::none(),
        "Moves each row's kept tokens (positions, cu) to the front of its list, in place in the pools: "
        "(lengths [lists], freed page ids), or into out=(lengths, freed_pages [indptr[-1]]) (the freed ids: a "
        "prefix of it). The table (CPU tensors, also for CUDA pools) is not written: shrink_page_table updates it.");
  m.def("compact_layer_paged", &compact_layer_paged_py, "key_pages"_a, "value_pages"_a, "position_pool"_a, "indptr"_a,
        "indices"_a, "last_page_len"_a, "kv_heads"_a, "kept"_a, "lists"_a = page_lists::per_sequence,
        "layout"_a = page_layout::nhd,
        "compact_layer on a paged layer: compact_paged of the key and value pools plus the rows' original positions "
        "(an int32 pool laid out as the key pool with dim 1), moved alike: (lengths [lists], freed page ids).");
  m.def("paged_window_scores", &window_scores_py, "window_queries"_a, "key_pages"_a, "value_pages"_a, "indptr"_a,
        "indices"_a, "last_page_len"_a, "kv_heads"_a, "lists"_a = page_lists::per_sequence,
        "layout"_a = page_layout::nhd, "include_window"_a = false, "options"_a = score_options{}, "out"_a = py::none(),
        "SnapKV's window scores over a paged layer: window_queries [S*H_q][w][d] (sequence s's query heads at rows "
        "s*H_q ..) -> [S*H_q][C], row s*H_q + q over its KV row's tokens [0, n - w) (C = longest row - w), or "
        "[0, n) with include_window (C = longest row); columns past a row's end 0 in a new tensor.");
  m.def("paged_weight_by_value_norm", &weight_py, "scores"_a, "key_pages"_a, "value_pages"_a, "indptr"_a, "indices"_a,
        "last_page_len"_a, "kv_heads"_a, "mode"_a = value_weight::per_token, "lists"_a = page_lists::per_sequence,
        "layout"_a = page_layout::nhd,
        "In place: scores [rows*group][>= longest row] (group query heads per layer row, consecutive) times the "
        "row's ||v_j||_1 (per_token) or max_j ||v_j||_1 (head_max); columns past a row's length untouched.");
  m.def("shrink_page_table", &shrink_py, "indptr"_a, "indices"_a, "last_page_len"_a, "page_size"_a, "lengths"_a,
        "The block table after compact_paged, in place (lists keep their first ceil(length / page_size) pages).");
  m.def("select_topk_batch", &select_batch_py, "scores"_a, "budgets"_a, "kv_heads"_a = 0, "kind"_a = batch_budget::per_head,
        "row_lengths"_a = py::none(), "cu_seqlens"_a = py::none(), "out"_a = py::none(),
        "One selection for a batch: padded scores [S*H][T] (row_lengths [S*H]) or varlen [H][total] (cu_seqlens "
        "[S+1]); budgets [S] tokens per KV head: (positions, cu) over rows r = s*H + h (or into out=(positions "
        "[rows x T], cu [rows + 1]); the positions returned are its first cu[-1]). CUDA tensors: per-head budgets, "
        "padded or varlen, every tensor on the GPU.");
}

}  // namespace kvevict::python
