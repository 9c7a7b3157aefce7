// recipe_scores and recipe_select instantiated on cuda_t for every element type, compiled by nvcc
// for sm_80 and sm_90 with warnings as errors (nothing runs here): the recipe pipeline has no
// host-only step left.
#include <kvevict/cuda/recipes.cuh>

namespace kvevict {

#define KVEVICT_INSTANTIATE_RECIPE(Q, K, V)                                                                       \
  template status recipe_scores<cuda_t, const Q, const K, const V>(cuda_t, workspace&, const recipe&,             \
                                                                   kv_view<const Q>, kv_view<const K>,            \
                                                                   kv_view<const V>, matrix_view<float>,          \
                                                                   kv_view<const K>);

KVEVICT_INSTANTIATE_RECIPE(float, float, float)
KVEVICT_INSTANTIATE_RECIPE(float16, float16, float16)
KVEVICT_INSTANTIATE_RECIPE(bfloat16, bfloat16, bfloat16)
#undef KVEVICT_INSTANTIATE_RECIPE

template result<std::size_t> recipe_scores_workspace_bytes<cuda_t>(cuda_t, const recipe&, index_t, index_t, index_t,
                                                                  index_t, index_t, index_t);
template status recipe_select<cuda_t>(cuda_t, workspace&, const recipe&, matrix_view<const float>, matrix_view<pos_t>);
template status recipe_select<cuda_t>(cuda_t, workspace&, const recipe&, matrix_view<const float>,
                                      ragged_positions_out);

}  // namespace kvevict
