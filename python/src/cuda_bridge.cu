// python/src/cuda_bridge.cu: the library's cuda_t stages for the bindings (cuda_bridge.hpp).
// Compiled for the build's CUDA architectures; not run on this machine (no GPU).
#include "cuda_bridge.hpp"

#include <kvevict/cuda/batch.cuh>
#include <kvevict/cuda/compact.cuh>
#include <kvevict/cuda/gqa.cuh>
#include <kvevict/cuda/paged.cuh>
#include <kvevict/cuda/pool.cuh>
#include <kvevict/cuda/recipes.cuh>
#include <kvevict/cuda/score.cuh>
#include <kvevict/cuda/weight.cuh>

#include <cuda_runtime.h>

#include <vector>

namespace kvevict::python::gpu {

namespace {

template <class T, std::size_t Rank>
result<strided_view<T, Rank>> view(const char* name, const raw& t) {
  if (t.ndim != static_cast<int>(Rank))
    return status::error(errc::shape_mismatch, "%s must have rank %zu, got %d", name, Rank, t.ndim);
  index_t ext[Rank], str[Rank];
  for (std::size_t i = 0; i < Rank; ++i) {
    ext[i] = t.shape[i];
    str[i] = t.strides[i];
  }
  return detail::make_strided<T, Rank>(name, static_cast<T*>(t.data), ext, str);
}

/// Views of several raw tensors at once: f(views...) once every one was made, else the first error.
#define KVEVICT_BRIDGE_VIEW(var, T, Rank, name, raw_) \
  const auto var##_r = view<T, Rank>(name, raw_);     \
  if (!var##_r) return var##_r.error();               \
  const auto var = *var##_r

/// An optional KV view (empty when the tensor is absent).
template <class T>
result<kv_view<const T>> optional_kv(const char* name, const raw& t) {
  if (t.data == nullptr) return kv_view<const T>{};
  return view<const T, 3>(name, t);
}

status cuda_status(const char* fn, cudaError_t e) {
  if (e == cudaSuccess) return {};
  return status::error(errc::cuda_error, "%s: %s", fn, cudaGetErrorString(e));
}

/// f(workspace&) -> status twice: the size query, then the call on device scratch from the stream.
template <class F>
status with_device_workspace(const char* fn, cudaStream_t stream, F&& f) {
  workspace q{};
  KVEVICT_TRY(f(q));
  void* p = nullptr;
  const std::size_t bytes = q.bytes > 0 ? q.bytes : 64;  // null data would be another size query
  KVEVICT_TRY(cuda_status(fn, cudaMallocAsync(&p, bytes, stream)));
  workspace ws{p, bytes};
  const status st = f(ws);
  const status freed = cuda_status(fn, cudaFreeAsync(p, stream));
  return st.ok() ? freed : st;
}

/// f(int* bad) -> status with a zeroed device counter of rows the kernels skipped (device data
/// checked on the device), then the count read back, the stream synchronised: nonzero fails.
template <class F>
status with_bad_count(const char* fn, cudaStream_t stream, F&& f) {
  int* bad = nullptr;
  KVEVICT_TRY(cuda_status(fn, cudaMallocAsync(reinterpret_cast<void**>(&bad), sizeof(int), stream)));
  int count = 0;
  status st = cuda_status(fn, cudaMemsetAsync(bad, 0, sizeof(int), stream));
  if (st.ok()) st = f(bad);
  if (st.ok()) st = cuda_status(fn, cudaMemcpyAsync(&count, bad, sizeof(int), cudaMemcpyDeviceToHost, stream));
  if (st.ok()) st = cuda_status(fn, cudaStreamSynchronize(stream));
  const status freed = cuda_status(fn, cudaFreeAsync(bad, stream));
  if (!st.ok()) return st;
  if (count != 0)
    return status::error(errc::out_of_range,
                         "%s: %d rows skipped: their lengths, offsets or positions (device data, checked on the "
                         "GPU) are out of range; nothing was written for them",
                         fn, count);
  return freed;
}

/// Both: a workspace and the bad-row counter.
template <class F>
status with_workspace_and_count(const char* fn, cudaStream_t stream, F&& f) {
  return with_bad_count(fn, stream,
                        [&](int* bad) { return with_device_workspace(fn, stream, [&](workspace& ws) { return f(ws, bad); }); });
}

/// f(std::int32_t* dev) -> status with the host arrays `parts` (pointer, count) copied one after
/// another into one device block of their total plus `extra` ints (uninitialised), freed after.
/// Pageable host memory: each copy returns once the source was staged, so the caller's arrays may go.
template <class F>
status with_device_ints(const char* fn, cudaStream_t stream,
                        std::initializer_list<std::pair<const std::int32_t*, index_t>> parts, index_t extra, F&& f) {
  index_t n = extra;
  for (const auto& p : parts) n += p.second;
  std::int32_t* dev = nullptr;
  const std::size_t bytes = static_cast<std::size_t>(n > 0 ? n : 1) * sizeof(std::int32_t);
  KVEVICT_TRY(cuda_status(fn, cudaMallocAsync(reinterpret_cast<void**>(&dev), bytes, stream)));
  status st;
  index_t at = 0;
  for (const auto& p : parts) {
    if (st.ok() && p.second > 0)
      st = cuda_status(fn, cudaMemcpyAsync(dev + at, p.first, static_cast<std::size_t>(p.second) * sizeof(std::int32_t),
                                           cudaMemcpyHostToDevice, stream));
    at += p.second;
  }
  if (st.ok()) st = f(dev);
  const status freed = cuda_status(fn, cudaFreeAsync(dev, stream));
  return st.ok() ? freed : st;
}

/// A device int32 read back to the host (the stream synchronised).
status read_back(const char* fn, cudaStream_t stream, const std::int32_t* dev, std::int32_t* host, index_t n) {
  if (n <= 0) return {};
  KVEVICT_TRY(cuda_status(fn, cudaMemcpyAsync(host, dev, static_cast<std::size_t>(n) * sizeof(std::int32_t),
                                             cudaMemcpyDeviceToHost, stream)));
  return cuda_status(fn, cudaStreamSynchronize(stream));
}

/// A ragged cache's cu_capacity (device) read back and checked against the buffer's rows: the
/// kernels trust it to bound their writes.
template <class T>
status check_capacity(const char* fn, cudaStream_t stream, const ragged_cache<T>& cache, index_t buffer_rows) {
  if (cache.heads <= 0) return {};
  if (cache.cu_capacity == nullptr) return status::error(errc::null_pointer, "%s: cu_capacity is null", fn);
  std::vector<std::int32_t> cu(static_cast<std::size_t>(cache.heads) + 1);
  KVEVICT_TRY(read_back(fn, stream, cache.cu_capacity, cu.data(), cache.heads + 1));
  return detail::check_offsets(fn, "cu_capacity", cu.data(), cache.heads, buffer_rows);
}

/// f(layer with its table on the device, extra ints) -> status: the validated host table copied.
template <class T, class F>
status with_device_table(const char* fn, cudaStream_t stream, paged_layer<T> layer, index_t extra, F&& f) {
  const page_table& t = layer.table;
  const index_t listed = t.lists > 0 ? t.indptr[t.lists] : 0;
  return with_device_ints(fn, stream, {{t.indptr, t.lists + 1}, {t.indices, listed}, {t.last_page_len, t.lists}},
                          extra, [&](std::int32_t* dev) {
                            layer.table.indptr = dev;
                            layer.table.indices = dev + t.lists + 1;
                            layer.table.last_page_len = dev + t.lists + 1 + listed;
                            return f(layer, dev + 2 * t.lists + 1 + listed);
                          });
}

template <class F>
status dispatch(const char* fn, int elem, F&& f) {
  switch (elem) {
    case 0: return f(float{});
    case 1: return f(float16{});
    case 2: return f(bfloat16{});
    default: return status::error(errc::invalid_argument, "%s: not a KV element type", fn);
  }
}

/// The score stages' shared shape: queries and keys of one KV type, out [rows][cols] float32.
template <class F>
status scores_call(const char* fn, const raw& queries, const raw& keys, const raw& out, stream_t s, F&& f) {
  return dispatch(fn, keys.elem, [&](auto e) -> status {
    using T = decltype(e);
    KVEVICT_BRIDGE_VIEW(q, const T, 3, "queries", queries);
    KVEVICT_BRIDGE_VIEW(k, const T, 3, "keys", keys);
    KVEVICT_BRIDGE_VIEW(o, float, 2, "out", out);
    return with_device_workspace(fn, s, [&](workspace& ws) { return f(cuda_t{s}, ws, q, k, o); });
  });
}

}  // namespace

status attention_scores(const raw& queries, const raw& prefix_keys, const raw& block_keys, const raw& out,
                        const score_options& opt, stream_t s) {
  constexpr const char* fn = "attention_scores(cuda)";
  return dispatch(fn, prefix_keys.elem, [&](auto e) -> status {
    using T = decltype(e);
    KVEVICT_BRIDGE_VIEW(q, const T, 3, "queries", queries);
    KVEVICT_BRIDGE_VIEW(k, const T, 3, "prefix_keys", prefix_keys);
    const auto b = optional_kv<T>("block_keys", block_keys);
    if (!b) return b.error();
    KVEVICT_BRIDGE_VIEW(o, float, 2, "out", out);
    return with_device_workspace(fn, s, [&](workspace& ws) { return kvevict::attention_scores(cuda_t{s}, ws, q, k, *b, o, opt); });
  });
}

status window_scores(const raw& queries, const raw& keys, const raw& out, const score_options& opt, stream_t s) {
  return scores_call("window_scores(cuda)", queries, keys, out, s, [&](cuda_t be, workspace& ws, auto q, auto k, auto o) {
    return kvevict::window_scores(be, ws, q, k, o, opt);
  });
}

status h2o_scores(const raw& queries, const raw& keys, const raw& out, bool normalised, float scale, stream_t s) {
  return scores_call("h2o_scores(cuda)", queries, keys, out, s, [&](cuda_t be, workspace& ws, auto q, auto k, auto o) {
    return kvevict::h2o_scores(be, ws, q, k, o, normalised, scale);
  });
}

status tova_scores(const raw& queries, const raw& keys, const raw& out, float scale, stream_t s) {
  return scores_call("tova_scores(cuda)", queries, keys, out, s, [&](cuda_t be, workspace& ws, auto q, auto k, auto o) {
    return kvevict::tova_scores(be, ws, q, k, o, scale);
  });
}

status key_norm_scores(const raw& keys, const raw& out, stream_t s) {
  constexpr const char* fn = "key_norm_scores(cuda)";
  return dispatch(fn, keys.elem, [&](auto e) -> status {
    using T = decltype(e);
    KVEVICT_BRIDGE_VIEW(k, const T, 3, "keys", keys);
    KVEVICT_BRIDGE_VIEW(o, float, 2, "out", out);
    return kvevict::key_norm_scores(cuda_t{s}, k, o);
  });
}

status position_scores(const raw& out, stream_t s) {
  KVEVICT_BRIDGE_VIEW(o, float, 2, "out", out);
  return kvevict::position_scores(cuda_t{s}, o);
}

status gqa_reduce(const raw& in, const raw& out, gqa_op op, stream_t s) {
  KVEVICT_BRIDGE_VIEW(i, const float, 2, "scores", in);
  KVEVICT_BRIDGE_VIEW(o, float, 2, "out", out);
  return kvevict::gqa_reduce(cuda_t{s}, i, o, op);
}

status pool1d(const raw& in, const raw& out, pool_kind kind, index_t kernel, const std::int32_t* row_lengths,
              avg_divisor divisor, stream_t s) {
  KVEVICT_BRIDGE_VIEW(i, const float, 2, "scores", in);
  KVEVICT_BRIDGE_VIEW(o, float, 2, "out", out);
  pool_options po;
  po.divisor = divisor;
  return with_bad_count("pool1d(cuda)", s,
                        [&](int* bad) { return kvevict::pool1d(cuda_t{s}, i, o, kind, kernel, row_lengths, po, bad); });
}

status weight_by_value_norm(const raw& scores, const raw& values, value_weight mode, const std::int32_t* lengths,
                            stream_t s) {
  constexpr const char* fn = "weight_by_value_norm(cuda)";
  KVEVICT_BRIDGE_VIEW(sv, float, 2, "scores", scores);
  return dispatch(fn, values.elem, [&](auto e) -> status {
    using T = decltype(e);
    KVEVICT_BRIDGE_VIEW(v, const T, 3, "values", values);
    return with_workspace_and_count(fn, s, [&](workspace& ws, int* bad) {
      return kvevict::weight_by_value_norm(cuda_t{s}, ws, sv, v, mode, lengths, bad);
    });
  });
}

status protect(const raw& scores, index_t n_sink, index_t n_recent, const std::int32_t* row_lengths, stream_t s) {
  KVEVICT_BRIDGE_VIEW(sv, float, 2, "scores", scores);
  return with_bad_count("protect(cuda)", s,
                        [&](int* bad) { return kvevict::protect(cuda_t{s}, sv, n_sink, n_recent, row_lengths, bad); });
}

status postprocess_scores(const raw& in, const raw& out, const raw& values, const postprocess_options& opt,
                          const std::int32_t* row_lengths, const std::int32_t* value_lengths, stream_t s) {
  constexpr const char* fn = "postprocess_scores(cuda)";
  KVEVICT_BRIDGE_VIEW(i, const float, 2, "scores", in);
  KVEVICT_BRIDGE_VIEW(o, float, 2, "out", out);
  if (values.data == nullptr)
    return with_workspace_and_count(fn, s, [&](workspace& ws, int* bad) {
      return kvevict::postprocess_scores(cuda_t{s}, ws, i, o, opt, row_lengths, bad);
    });
  return dispatch(fn, values.elem, [&](auto e) -> status {
    using T = decltype(e);
    KVEVICT_BRIDGE_VIEW(v, const T, 3, "values", values);
    return with_workspace_and_count(fn, s, [&](workspace& ws, int* bad) {
      return kvevict::postprocess_scores(cuda_t{s}, ws, i, o, v, opt, row_lengths, value_lengths, bad);
    });
  });
}

status select_topk(const raw& scores, const std::int32_t* row_lengths, const raw& kept, stream_t s) {
  KVEVICT_BRIDGE_VIEW(sv, const float, 2, "scores", scores);
  KVEVICT_BRIDGE_VIEW(k, pos_t, 2, "kept", kept);
  return with_workspace_and_count("select_topk(cuda)", s, [&](workspace& ws, int* bad) {
    cuda_select_options o;
    o.bad_rows = bad;
    return kvevict::select_topk(cuda_t{s}, ws, sv, row_lengths, k, o);
  });
}

status select_topk_flat(const raw& scores, const std::int32_t* row_lengths, index_t total, const std::int32_t* floors,
                        std::int32_t* cu, pos_t* positions, stream_t s) {
  KVEVICT_BRIDGE_VIEW(sv, const float, 2, "scores", scores);
  return with_workspace_and_count("select_topk_flat(cuda)", s, [&](workspace& ws, int* bad) {
    cuda_select_options o;
    o.bad_rows = bad;
    return kvevict::select_topk_flat(cuda_t{s}, ws, sv, row_lengths, total, floors, cu, positions, o);
  });
}

status compact(const raw& src, const raw& kept, const raw& dst, stream_t s) {
  constexpr const char* fn = "compact(cuda)";
  KVEVICT_BRIDGE_VIEW(k, const pos_t, 2, "kept", kept);
  return dispatch(fn, src.elem, [&](auto e) -> status {
    using T = decltype(e);
    KVEVICT_BRIDGE_VIEW(sv, const T, 3, "src", src);
    KVEVICT_BRIDGE_VIEW(d, T, 3, "out", dst);
    return with_bad_count(fn, s, [&](int* bad) { return kvevict::compact(cuda_t{s}, sv, k, d, bad); });
  });
}

status compact_ragged(const raw& src, const pos_t* positions, const std::int32_t* cu, const raw& dst, stream_t s) {
  constexpr const char* fn = "compact_ragged(cuda)";
  return dispatch(fn, src.elem, [&](auto e) -> status {
    using T = decltype(e);
    KVEVICT_BRIDGE_VIEW(sv, const T, 3, "src", src);
    const ragged_positions kept{positions, cu, sv.extent(0)};
    const ragged_view<T> d{static_cast<T*>(dst.data), cu, sv.extent(0), sv.extent(2), dst.strides[0]};
    return with_bad_count(fn, s, [&](int* bad) { return kvevict::compact(cuda_t{s}, sv, kept, d, bad); });
  });
}

status compact_inplace(const raw& cache, const raw& kept, stream_t s) {
  constexpr const char* fn = "compact_inplace(cuda)";
  KVEVICT_BRIDGE_VIEW(k, const pos_t, 2, "kept", kept);
  return dispatch(fn, cache.elem, [&](auto e) -> status {
    using T = decltype(e);
    KVEVICT_BRIDGE_VIEW(c, T, 3, "cache", cache);
    return with_workspace_and_count(fn, s, [&](workspace& ws, int* bad) {
      return kvevict::compact_inplace(cuda_t{s}, ws, c, k, bad);
    });
  });
}

status recipe_scores(const recipe& r, const raw& queries, const raw& keys, const raw& values, const raw& scores,
                     stream_t s) {
  constexpr const char* fn = "recipe_scores(cuda)";
  return dispatch(fn, keys.elem, [&](auto e) -> status {
    using T = decltype(e);
    KVEVICT_BRIDGE_VIEW(k, const T, 3, "keys", keys);
    const auto q = optional_kv<T>("queries", queries);
    if (!q) return q.error();
    const auto v = optional_kv<T>("values", values);
    if (!v) return v.error();
    KVEVICT_BRIDGE_VIEW(o, float, 2, "scores", scores);
    return with_device_workspace(fn, s, [&](workspace& ws) { return kvevict::recipe_scores(cuda_t{s}, ws, r, *q, k, *v, o); });
  });
}

status recipe_select(const recipe& r, const raw& scores, const raw& kept, stream_t s) {
  KVEVICT_BRIDGE_VIEW(sv, const float, 2, "scores", scores);
  KVEVICT_BRIDGE_VIEW(k, pos_t, 2, "kept", kept);
  return with_device_workspace("recipe_select(cuda)", s,
                               [&](workspace& ws) { return kvevict::recipe_select(cuda_t{s}, ws, r, sv, k); });
}

status select_topk_ragged(const raw& scores, const std::int32_t* row_lengths, const std::int32_t* host_cu,
                          std::int32_t* cu, pos_t* positions, stream_t s) {
  constexpr const char* fn = "select_topk_ragged(cuda)";
  KVEVICT_BRIDGE_VIEW(sv, const float, 2, "scores", scores);
  const index_t R = sv.extent(0);
  KVEVICT_TRY(cuda_status(fn, cudaMemcpyAsync(cu, host_cu, static_cast<std::size_t>(R + 1) * sizeof(std::int32_t),
                                              cudaMemcpyHostToDevice, s)));
  return with_workspace_and_count(fn, s, [&](workspace& ws, int* bad) {
    cuda_select_options o;
    o.bad_rows = bad;
    o.pos_capacity = host_cu[R];
    return kvevict::select_topk(cuda_t{s}, ws, sv, row_lengths, ragged_positions_out{positions, cu, R}, o);
  });
}

status recipe_select_ragged(const recipe& r, const raw& scores, const std::int32_t* host_cu, std::int32_t* cu,
                            pos_t* positions, stream_t s) {
  constexpr const char* fn = "recipe_select(cuda)";
  KVEVICT_BRIDGE_VIEW(sv, const float, 2, "scores", scores);
  const index_t R = sv.extent(0);
  KVEVICT_TRY(cuda_status(fn, cudaMemcpyAsync(cu, host_cu, static_cast<std::size_t>(R + 1) * sizeof(std::int32_t),
                                              cudaMemcpyHostToDevice, s)));
  return with_device_workspace(fn, s, [&](workspace& ws) {
    return kvevict::recipe_select(cuda_t{s}, ws, r, sv, ragged_positions_out{positions, cu, R});
  });
}

status select_topk_batch(const raw& scores, index_t sequences, index_t kv_heads, const std::int32_t* row_lengths,
                         const std::int32_t* cu_seqlens, const std::int32_t* budgets, batch_budget kind, std::int32_t* cu,
                         pos_t* positions, index_t capacity, std::int32_t* total, stream_t s) {
  constexpr const char* fn = "select_topk_batch(cuda)";
  KVEVICT_BRIDGE_VIEW(sv, const float, 2, "scores", scores);
  const batch_rows rows = cu_seqlens != nullptr ? batch_varlen(sv, cu_seqlens, sequences)
                                                : batch_padded(sv, sequences, kv_heads, row_lengths);
  KVEVICT_TRY(with_workspace_and_count(fn, s, [&](workspace& ws, int* bad) {
    return kvevict::select_topk_batch(cuda_t{s}, ws, rows, budgets, kind, cu, positions, capacity, bad);
  }));
  return read_back(fn, s, cu + sequences * kv_heads, total, 1);
}

template <class T>
status append(ragged_cache<T> cache, index_t buffer_rows, const raw& rows, stream_t s) {
  constexpr const char* fn = "append(cuda)";
  KVEVICT_BRIDGE_VIEW(rv, const T, 3, "rows", rows);
  KVEVICT_TRY(check_capacity(fn, s, cache, buffer_rows));
  return with_bad_count(fn, s, [&](int* bad) { return kvevict::append(cuda_t{s}, cache, rv, bad); });
}

template <class T>
status compact_ragged_inplace(ragged_cache<T> cache, index_t buffer_rows, ragged_positions kept, stream_t s) {
  constexpr const char* fn = "compact_ragged_inplace(cuda)";
  KVEVICT_TRY(check_capacity(fn, s, cache, buffer_rows));
  return with_workspace_and_count(fn, s, [&](workspace& ws, int* bad) {
    return kvevict::compact_inplace(cuda_t{s}, ws, cache, kept, bad);
  });
}

template <class T>
status compact_into_ragged_cache(const raw& src, ragged_positions kept, ragged_cache<T> cache, index_t buffer_rows,
                                 stream_t s) {
  constexpr const char* fn = "compact_into_ragged_cache(cuda)";
  KVEVICT_BRIDGE_VIEW(sv, const T, 3, "src", src);
  KVEVICT_TRY(check_capacity(fn, s, cache, buffer_rows));
  return with_bad_count(fn, s, [&](int* bad) { return kvevict::compact(cuda_t{s}, sv, kept, cache, bad); });
}

template <class T>
status paged_key_norm_scores(paged_layer<T> layer, const raw& out, stream_t s) {
  constexpr const char* fn = "paged_key_norm_scores(cuda)";
  KVEVICT_BRIDGE_VIEW(o, float, 2, "out", out);
  return with_device_table(fn, s, layer, 0, [&](const paged_layer<T>& L, std::int32_t*) {
    return with_bad_count(fn, s, [&](int* bad) { return kvevict::paged_key_norm_scores(cuda_t{s}, L, o, bad); });
  });
}

template <class T>
status paged_weight_by_value_norm(const raw& scores, paged_layer<T> layer, value_weight mode, stream_t s) {
  constexpr const char* fn = "paged_weight_by_value_norm(cuda)";
  KVEVICT_BRIDGE_VIEW(sv, float, 2, "scores", scores);
  return with_device_table(fn, s, layer, 0, [&](const paged_layer<T>& L, std::int32_t*) {
    return with_bad_count(fn, s,
                          [&](int* bad) { return kvevict::paged_weight_by_value_norm(cuda_t{s}, sv, L, mode, bad); });
  });
}

template <class T>
status paged_window_scores(const raw& window_queries, paged_layer<T> layer, const raw& out, bool include_window,
                           const score_options& opt, stream_t s) {
  constexpr const char* fn = "paged_window_scores(cuda)";
  KVEVICT_BRIDGE_VIEW(qv, const T, 3, "window_queries", window_queries);
  KVEVICT_BRIDGE_VIEW(o, float, 2, "out", out);
  return with_device_table(fn, s, layer, 0, [&](const paged_layer<T>& L, std::int32_t*) {
    return with_workspace_and_count(fn, s, [&](workspace& ws, int* bad) {
      return kvevict::paged_window_scores(cuda_t{s}, ws, qv, L, o, include_window, opt, bad);
    });
  });
}

template <class T>
status compact_paged(paged_layer<T> layer, ragged_positions kept, std::int32_t* lengths, std::int32_t* freed_pages,
                     index_t freed_capacity, std::int32_t* freed_count, stream_t s) {
  constexpr const char* fn = "compact_paged(cuda)";
  return with_device_table(fn, s, layer, 1, [&](const paged_layer<T>& L, std::int32_t* count) {
    const paged_compaction_out out{lengths, freed_pages, freed_capacity, count};
    KVEVICT_TRY(with_workspace_and_count(fn, s, [&](workspace& ws, int* bad) {
      return kvevict::compact_paged(cuda_t{s}, ws, L, kept, out, bad);
    }));
    return read_back(fn, s, count, freed_count, 1);
  });
}

#define KVEVICT_BRIDGE_TYPES(T)                                                                                      \
  template status append<T>(ragged_cache<T>, index_t, const raw&, stream_t);                                        \
  template status compact_ragged_inplace<T>(ragged_cache<T>, index_t, ragged_positions, stream_t);                  \
  template status compact_into_ragged_cache<T>(const raw&, ragged_positions, ragged_cache<T>, index_t, stream_t);   \
  template status paged_key_norm_scores<T>(paged_layer<T>, const raw&, stream_t);                                   \
  template status paged_weight_by_value_norm<T>(const raw&, paged_layer<T>, value_weight, stream_t);                \
  template status paged_window_scores<T>(const raw&, paged_layer<T>, const raw&, bool, const score_options&,         \
                                         stream_t);                                                                 \
  template status compact_paged<T>(paged_layer<T>, ragged_positions, std::int32_t*, std::int32_t*, index_t,         \
                                   std::int32_t*, stream_t);
KVEVICT_BRIDGE_TYPES(float)
KVEVICT_BRIDGE_TYPES(float16)
KVEVICT_BRIDGE_TYPES(bfloat16)
#undef KVEVICT_BRIDGE_TYPES

#undef KVEVICT_BRIDGE_VIEW

}  // namespace kvevict::python::gpu
