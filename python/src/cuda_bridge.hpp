// python/src/cuda_bridge.hpp: the CUDA path of the bindings, defined by nvcc (cuda_bridge.cu) only
// when the build has CUDA (KVEVICT_PYTHON_CUDA). Plain C++ on both sides: the pybind11 files never
// see CUDA headers, and cuda_bridge.cu never sees pybind11. Declared in every build so the
// bindings' CUDA lambdas parse everywhere; on_device (common.hpp) calls them only in CUDA builds.
//
// Every function runs one library stage on cuda_t{stream}: views of device memory built from `raw`
// (the library's view factories check shapes and strides), two-phase workspaces from
// cudaMallocAsync on the stream. Stages that check device data on the device (row lengths,
// offsets, positions) count bad rows into a device int that the bridge reads back after
// synchronising the stream: a nonzero count fails the call (errc::out_of_range).
//
// Host-side metadata: offsets the binding computes from host tensors (ragged budgets) and paged
// block tables it validates on the host are passed as host arrays (host_*); the bridge copies them
// to device scratch on the stream before the launch. A ragged cache's cu_capacity is device data
// that bounds the writes: the bridge reads it back (one synchronisation) and checks it against the
// buffer's rows before any launch.
#pragma once

#include <kvevict/batch.hpp>
#include <kvevict/compact.hpp>
#include <kvevict/paged_types.hpp>
#include <kvevict/recipes.hpp>

struct CUstream_st;

namespace kvevict::python::gpu {

/// A device tensor's data, shape and strides (elements); elem: 0 float32, 1 float16, 2 bfloat16,
/// 3 int32. An absent optional tensor has data null.
struct raw {
  void* data = nullptr;
  int ndim = 0;
  index_t shape[4] = {};
  index_t strides[4] = {};
  int elem = 0;
};
using stream_t = CUstream_st*;

// score.hpp: queries [H_q][w][d], keys [H_kv][T][d], out [H_q][cols] float32
status attention_scores(const raw& queries, const raw& prefix_keys, const raw& block_keys, const raw& out,
                        const score_options& opt, stream_t s);
status window_scores(const raw& queries, const raw& keys, const raw& out, const score_options& opt, stream_t s);
status h2o_scores(const raw& queries, const raw& keys, const raw& out, bool normalised, float scale, stream_t s);
status tova_scores(const raw& queries, const raw& keys, const raw& out, float scale, stream_t s);
status key_norm_scores(const raw& keys, const raw& out, stream_t s);
status position_scores(const raw& out, stream_t s);
// gqa.hpp, pool.hpp, weight.hpp, protect.hpp, postprocess.hpp (float32 scores; lengths device int32 or null)
status gqa_reduce(const raw& in, const raw& out, gqa_op op, stream_t s);
status pool1d(const raw& in, const raw& out, pool_kind kind, index_t kernel, const std::int32_t* row_lengths,
              avg_divisor divisor, stream_t s);
status weight_by_value_norm(const raw& scores, const raw& values, value_weight mode, const std::int32_t* lengths,
                            stream_t s);
status protect(const raw& scores, index_t n_sink, index_t n_recent, const std::int32_t* row_lengths, stream_t s);
status postprocess_scores(const raw& in, const raw& out, const raw& values, const postprocess_options& opt,
                          const std::int32_t* row_lengths, const std::int32_t* value_lengths, stream_t s);
// select.hpp: kept [R][k] int32; flattened: cu [R+1], positions [total]
status select_topk(const raw& scores, const std::int32_t* row_lengths, const raw& kept, stream_t s);
status select_topk_flat(const raw& scores, const std::int32_t* row_lengths, index_t total,
                        const std::int32_t* floors, std::int32_t* cu, pos_t* positions, stream_t s);
// compact.hpp
status compact(const raw& src, const raw& kept, const raw& dst, stream_t s);
status compact_ragged(const raw& src, const pos_t* positions, const std::int32_t* cu, const raw& dst, stream_t s);
status compact_inplace(const raw& cache, const raw& kept, stream_t s);
// recipes.hpp: scores [H_kv][T] float32 (queries / values may be absent); dense kept [H_kv][budget]
status recipe_scores(const recipe& r, const raw& queries, const raw& keys, const raw& values, const raw& scores,
                     stream_t s);
status recipe_select(const recipe& r, const raw& scores, const raw& kept, stream_t s);

// ragged selections: host_cu [R+1] (the budgets' prefix sums, checked by the binding) is copied to
// cu (device, [R+1]); positions [host_cu[R]] device
status select_topk_ragged(const raw& scores, const std::int32_t* row_lengths, const std::int32_t* host_cu,
                          std::int32_t* cu, pos_t* positions, stream_t s);
status recipe_select_ragged(const recipe& r, const raw& scores, const std::int32_t* host_cu, std::int32_t* cu,
                            pos_t* positions, stream_t s);
// batch.hpp with per-head or flattened budgets: padded rows (row_lengths [S*H] or null) or, when
// cu_seqlens [S+1] is given, varlen rows (scores [H][total]); budgets [S]; cu [R+1], positions
// [capacity]; every array device memory; *total receives cu[R] (read back)
status select_topk_batch(const raw& scores, index_t sequences, index_t kv_heads, const std::int32_t* row_lengths,
                         const std::int32_t* cu_seqlens, const std::int32_t* budgets, batch_budget kind, std::int32_t* cu,
                         pos_t* positions, index_t capacity, std::int32_t* total, stream_t s);

// ragged caches with capacity (T: float, float16, bfloat16): every array device memory;
// buffer_rows: the buffer's row count, checked against cu_capacity (read back) before any launch
template <class T>
status append(ragged_cache<T> cache, index_t buffer_rows, const raw& rows, stream_t s);
template <class T>
status compact_ragged_inplace(ragged_cache<T> cache, index_t buffer_rows, ragged_positions kept, stream_t s);
template <class T>
status compact_into_ragged_cache(const raw& src, ragged_positions kept, ragged_cache<T> cache, index_t buffer_rows,
                                 stream_t s);

// paged layers: pools device memory, layer.table host memory validated by the binding (copied to
// the device here); kept, outputs device; *freed_count receives the freed pages' count (read back)
template <class T>
status paged_key_norm_scores(paged_layer<T> layer, const raw& out, stream_t s);
template <class T>
status paged_weight_by_value_norm(const raw& scores, paged_layer<T> layer, value_weight mode, stream_t s);
template <class T>
status paged_window_scores(const raw& window_queries, paged_layer<T> layer, const raw& out, bool include_window,
                           const score_options& opt, stream_t s);
template <class T>
status compact_paged(paged_layer<T> layer, ragged_positions kept, std::int32_t* lengths, std::int32_t* freed_pages,
                     index_t freed_capacity, std::int32_t* freed_count, stream_t s);

}  // namespace kvevict::python::gpu
