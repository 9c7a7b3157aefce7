// Explicit instantiations of every CUDA scoring and post-processing launcher for every element type,
// compiled by nvcc for sm_80 and sm_90 with warnings as errors (nothing runs here).
#include <kvevict/cuda/postprocess.cuh>
#include <kvevict/cuda/score.cuh>

namespace kvevict {

#define KVEVICT_INSTANTIATE_SCORE(Q, K)                                                                            \
  template status attention_scores<const Q, const K>(cuda_t, workspace&, kv_view<const Q>, kv_view<const K>,       \
                                                     kv_view<const K>, matrix_view<float>, const score_options&);  \
  template status attention_scores_gqa<const Q, const K>(cuda_t, workspace&, kv_view<const Q>, kv_view<const K>,   \
                                                         kv_view<const K>, matrix_view<float>, gqa_op,             \
                                                         const score_options&, matrix_view<float>);                \
  template status window_scores<const Q, const K>(cuda_t, workspace&, kv_view<const Q>, kv_view<const K>,          \
                                                  matrix_view<float>, const score_options&);                       \
  template status window_scores_gqa<const Q, const K>(cuda_t, workspace&, kv_view<const Q>, kv_view<const K>,      \
                                                      matrix_view<float>, gqa_op, const score_options&,            \
                                                      matrix_view<float>);                                         \
  template status h2o_scores<const Q, const K>(cuda_t, workspace&, kv_view<const Q>, kv_view<const K>,             \
                                               matrix_view<float>, bool, float);                                   \
  template status tova_scores<const Q, const K>(cuda_t, workspace&, kv_view<const Q>, kv_view<const K>,            \
                                                matrix_view<float>, float);

KVEVICT_INSTANTIATE_SCORE(float, float)
KVEVICT_INSTANTIATE_SCORE(float16, float16)
KVEVICT_INSTANTIATE_SCORE(bfloat16, bfloat16)
KVEVICT_INSTANTIATE_SCORE(float, float16)
KVEVICT_INSTANTIATE_SCORE(float, bfloat16)
#undef KVEVICT_INSTANTIATE_SCORE

template status paged_window_scores<const float, const float>(cuda_t, workspace&, kv_view<const float>,
                                                              paged_layer<const float>, matrix_view<float>, bool,
                                                              const score_options&, int*);
template status paged_window_scores<const float16, const float16>(cuda_t, workspace&, kv_view<const float16>,
                                                                  paged_layer<const float16>, matrix_view<float>,
                                                                  bool, const score_options&, int*);
template status paged_window_scores<const bfloat16, const bfloat16>(cuda_t, workspace&, kv_view<const bfloat16>,
                                                                    paged_layer<const bfloat16>, matrix_view<float>,
                                                                    bool, const score_options&, int*);

template status key_norm_scores<const float>(cuda_t, kv_view<const float>, matrix_view<float>);
template status key_norm_scores<const float16>(cuda_t, kv_view<const float16>, matrix_view<float>);
template status key_norm_scores<const bfloat16>(cuda_t, kv_view<const bfloat16>, matrix_view<float>);

#define KVEVICT_INSTANTIATE_VALUES(V)                                                                              \
  template status weight_by_value_norm<const V>(cuda_t, workspace&, matrix_view<float>, kv_view<const V>,          \
                                                value_weight, const std::int32_t*, int*);                         \
  template status postprocess_scores<const V>(cuda_t, workspace&, matrix_view<const float>, matrix_view<float>,   \
                                              kv_view<const V>, const postprocess_options&, const std::int32_t*,  \
                                              const std::int32_t*, int*);

KVEVICT_INSTANTIATE_VALUES(float)
KVEVICT_INSTANTIATE_VALUES(float16)
KVEVICT_INSTANTIATE_VALUES(bfloat16)
#undef KVEVICT_INSTANTIATE_VALUES

// the non-template launchers, referenced so that their kernels are compiled
status (*instantiate_gqa)(cuda_t, matrix_view<const float>, matrix_view<float>, gqa_op) = &gqa_reduce;
status (*instantiate_pool)(cuda_t, matrix_view<const float>, matrix_view<float>, pool_kind, index_t,
                                 const std::int32_t*, pool_options, int*) = &pool1d;
status (*instantiate_protect)(cuda_t, matrix_view<float>, index_t, index_t, const std::int32_t*, int*) = &protect;
status (*instantiate_postprocess)(cuda_t, workspace&, matrix_view<const float>, matrix_view<float>,
                                        const postprocess_options&, const std::int32_t*, int*) = &postprocess_scores;

}  // namespace kvevict
