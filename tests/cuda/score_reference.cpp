// score_reference.hpp's functions, compiled by the host compiler (see there).
#include "score_reference.hpp"

#include <kvevict/detail/block/score_emulation.hpp>

namespace kvgpu {

template <class QE, class KE>
kvevict::status score_reference(kvevict::kv_view<const QE> q, kvevict::kv_view<const KE> prefix,
                                kvevict::kv_view<const KE> block, kvevict::matrix_view<float> out_h,
                                kvevict::matrix_view<float> out_kv, kvevict::gqa_op op,
                                const kvevict::score_options& opt) {
  return kvevict::detail::emulate_cuda_attention_scores(q, prefix, block, out_h, out_kv, op, opt);
}

template kvevict::status score_reference<float, float>(kvevict::kv_view<const float>, kvevict::kv_view<const float>,
                                                       kvevict::kv_view<const float>, kvevict::matrix_view<float>,
                                                       kvevict::matrix_view<float>, kvevict::gqa_op,
                                                       const kvevict::score_options&);
template kvevict::status score_reference<kvevict::float16, kvevict::float16>(
    kvevict::kv_view<const kvevict::float16>, kvevict::kv_view<const kvevict::float16>,
    kvevict::kv_view<const kvevict::float16>, kvevict::matrix_view<float>, kvevict::matrix_view<float>,
    kvevict::gqa_op, const kvevict::score_options&);
template kvevict::status score_reference<kvevict::bfloat16, kvevict::bfloat16>(
    kvevict::kv_view<const kvevict::bfloat16>, kvevict::kv_view<const kvevict::bfloat16>,
    kvevict::kv_view<const kvevict::bfloat16>, kvevict::matrix_view<float>, kvevict::matrix_view<float>,
    kvevict::gqa_op, const kvevict::score_options&);
template kvevict::status score_reference<float, kvevict::bfloat16>(
    kvevict::kv_view<const float>, kvevict::kv_view<const kvevict::bfloat16>, kvevict::kv_view<const kvevict::bfloat16>,
    kvevict::matrix_view<float>, kvevict::matrix_view<float>, kvevict::gqa_op, const kvevict::score_options&);

kvevict::status paged_score_reference(kvevict::kv_view<const float> q, kvevict::paged_layer<const float> layer,
                                      kvevict::matrix_view<float> out, bool include_window,
                                      const kvevict::score_options& opt, int* bad) {
  return kvevict::detail::emulate_cuda_paged_window_scores(q, layer, out, include_window, opt, bad);
}

}  // namespace kvgpu
