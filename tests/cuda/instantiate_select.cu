// Compiles the CUDA selection and compaction launchers under nvcc (sm_80 and sm_90, warnings as
// errors) and instantiates every kernel they launch: dense and ragged top-k with one and several
// blocks per row, the flattened selection, and every compaction (dense, ragged_view, ragged_cache,
// in place dense and ragged, append, paged) for each KV element type and every copy unit.
#include <kvevict/cuda/compact.cuh>
#include <kvevict/cuda/batch.cuh>
#include <kvevict/cuda/paged.cuh>
#include <kvevict/cuda/select.cuh>

namespace kvevict {
namespace instantiate_select {

status dense(workspace& ws, matrix_view<const float> scores, const std::int32_t* lengths, matrix_view<pos_t> kept) {
  return select_topk(cuda, ws, scores, lengths, kept, cuda_select_options{});
}
status ragged(workspace& ws, matrix_view<const float> scores, const std::int32_t* lengths, ragged_positions_out kept) {
  return select_topk(cuda, ws, scores, lengths, kept);
}
status flat(workspace& ws, matrix_view<const float> scores, const std::int32_t* lengths, index_t total,
            const std::int32_t* floors, std::int32_t* cu, pos_t* pos) {
  return select_topk_flat(cuda, ws, scores, lengths, total, floors, cu, pos);
}

}  // namespace instantiate_select

#define KVEVICT_INSTANTIATE_COMPACT(T)                                                                          \
  template status compact<const T, T>(cuda_t, kv_view<const T>, matrix_view<const pos_t>, kv_view<T>, int*);   \
  template status compact<const T, T>(cuda_t, kv_view<const T>, ragged_positions, ragged_view<T>, int*);       \
  template status compact<const T, T>(cuda_t, kv_view<const T>, ragged_positions, ragged_cache<T>, int*);      \
  template status compact_inplace<T>(cuda_t, workspace&, kv_view<T>, matrix_view<const pos_t>, int*);          \
  template status compact_inplace<T>(cuda_t, workspace&, ragged_cache<T>, ragged_positions, int*);             \
  template status append<T, const T>(cuda_t, ragged_cache<T>, kv_view<const T>, int*);                         \
  template status compact_paged<T>(cuda_t, workspace&, paged_layer<T>, ragged_positions, paged_compaction_out, int*);

#define KVEVICT_INSTANTIATE_PAGED_SCORES(T) \
  template status paged_key_norm_scores<T>(cuda_t, paged_layer<T>, matrix_view<float>, int*); \
  template status paged_weight_by_value_norm<T>(cuda_t, matrix_view<float>, paged_layer<T>, value_weight, int*);

KVEVICT_INSTANTIATE_PAGED_SCORES(float)
KVEVICT_INSTANTIATE_PAGED_SCORES(float16)
KVEVICT_INSTANTIATE_PAGED_SCORES(bfloat16)
KVEVICT_INSTANTIATE_PAGED_SCORES(const float16)
#undef KVEVICT_INSTANTIATE_PAGED_SCORES

namespace instantiate_select {
status batch(workspace& ws, batch_rows rows, const std::int32_t* budgets, std::int32_t* cu, pos_t* pos, index_t cap) {
  return select_topk_batch(cuda, ws, rows, budgets, batch_budget::per_head, cu, pos, cap);
}
}  // namespace instantiate_select

KVEVICT_INSTANTIATE_COMPACT(float)
KVEVICT_INSTANTIATE_COMPACT(float16)
KVEVICT_INSTANTIATE_COMPACT(bfloat16)
KVEVICT_INSTANTIATE_COMPACT(std::int8_t)

#undef KVEVICT_INSTANTIATE_COMPACT

}  // namespace kvevict
