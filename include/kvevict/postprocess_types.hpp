// kvevict/postprocess_types.hpp: the options of the fused post-processing (postprocess.hpp is the
// stage; recipes derive from postprocess_options).
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/gqa_types.hpp>
#include <kvevict/pool_types.hpp>
#include <kvevict/weight_types.hpp>

namespace kvevict {

/// Whether the group's query heads are reduced after pooling each of them (pool_first, as kvpress's
/// SnapKV: pool per query head, then mean over the group) or before pooling once (gqa_first).
enum class gqa_order : int {
  pool_first = 0,
  gqa_first = 1,
};

struct postprocess_options {
  gqa_op gqa = gqa_op::mean;                  ///< mean (kvpress, LookaheadKV), max (LAVa) or sum
  gqa_order order = gqa_order::pool_first;
  pool_kind pool = pool_kind::max;            ///< max 7: LookaheadKV, LAVa; KVCache-Factory: avg 5
  index_t kernel = 7;                         ///< odd, >= 1
  avg_divisor divisor = avg_divisor::kernel;  ///< avg pooling's border divisor (pool_options)
  bool weight_values = false;                 ///< multiply by value norms (needs values)
  value_weight weight = value_weight::per_token;  ///< VATP per token, LAVa head max
  index_t n_sink = 0;                         ///< protected first positions of each row
  index_t n_recent = 0;                       ///< protected last positions of each row
  /// The last unpooled_tail positions of each row skip pooling: they keep their (GQA-reduced) scores
  /// and pooling sees the row as ending before them. The SnapKV-family recipes set it to the window w,
  /// as KVCache-Factory pools attn[..., -w:, :-w] only; weighting and protection still cover them.
  index_t unpooled_tail = 0;
};

/// Positions of a row of L that are pooled (the rest is the unpooled tail).
KVEVICT_HOST_DEVICE inline index_t pooled_length(index_t L, index_t unpooled_tail) noexcept {
  return unpooled_tail < L ? L - unpooled_tail : 0;
}

}  // namespace kvevict
