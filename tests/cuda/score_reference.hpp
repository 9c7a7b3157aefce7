// The reference of the CUDA score GPU test: the kernels' own bodies run on the host SIMT executor
// (include/kvevict/detail/block/score_emulation.hpp). Defined in score_reference.cpp, compiled by the
// host compiler: the executor instantiates the host-device bodies with its host context, which nvcc
// would diagnose as host calls from host-device code.
#pragma once

#include <kvevict/numeric.hpp>
#include <kvevict/paged_types.hpp>
#include <kvevict/score_types.hpp>
#include <kvevict/gqa_types.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>

namespace kvgpu {

/// attention_scores (out_kv with 0 rows) or attention_scores_gqa of the CUDA backend, on the executor.
/// Instantiated for (float, float), (float16, float16), (bfloat16, bfloat16), (float, bfloat16).
template <class QE, class KE>
kvevict::status score_reference(kvevict::kv_view<const QE> q, kvevict::kv_view<const KE> prefix,
                                kvevict::kv_view<const KE> block, kvevict::matrix_view<float> out_h,
                                kvevict::matrix_view<float> out_kv, kvevict::gqa_op op,
                                const kvevict::score_options& opt);

/// paged_window_scores of the CUDA backend on the executor (float).
kvevict::status paged_score_reference(kvevict::kv_view<const float> q, kvevict::paged_layer<const float> layer,
                                      kvevict::matrix_view<float> out, bool include_window,
                                      const kvevict::score_options& opt, int* bad);

}  // namespace kvgpu
