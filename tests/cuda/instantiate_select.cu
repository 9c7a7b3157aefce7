// Compiles <kvevict/cuda/select.cuh> under nvcc (sm_80 and sm_90, warnings as errors) and
// instantiates every selection launcher and kernel: dense and ragged top-k with one and several
// blocks per row, and the flattened selection.
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
}  // namespace kvevict
