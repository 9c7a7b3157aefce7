// Compiles every public kvevict header, host and CUDA, under nvcc (for sm_80 and sm_90, warnings
// as errors), and instantiates each CUDA launcher for every element type.
#include <kvevict/kvevict.hpp>
#include <kvevict/train/lookahead.hpp>
#include <kvevict/train/prulong.hpp>
#include <kvevict/cuda/compact.cuh>

namespace kvevict {
template status compact<float, float>(cuda_t, kv_view<float>, matrix_view<const pos_t>, kv_view<float>, int*);
template status compact<const float16, float16>(cuda_t, kv_view<const float16>, matrix_view<const pos_t>, kv_view<float16>, int*);
template status compact<const bfloat16, bfloat16>(cuda_t, kv_view<const bfloat16>, matrix_view<const pos_t>,
                                                  kv_view<bfloat16>, int*);
}  // namespace kvevict
