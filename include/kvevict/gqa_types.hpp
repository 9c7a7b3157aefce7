// kvevict/gqa_types.hpp: how the query heads of a GQA group are reduced to their KV head (gqa.hpp
// is the stage; this header is what other stages and detail/ need of it).
#pragma once

namespace kvevict {

enum class gqa_op {
  mean,  ///< arithmetic mean over the group (default of kvpress's SnapKV)
  max,   ///< maximum in the total score order (LAVa); NaN only if the whole group is NaN
  sum,   ///< sum over the group, j ascending
};

/// Short name of a gqa_op ("mean", "max", "sum"; "unknown" for values outside the enum).
constexpr const char* gqa_op_name(gqa_op op) noexcept {
  switch (op) {
    case gqa_op::mean: return "mean";
    case gqa_op::max: return "max";
    case gqa_op::sum: return "sum";
  }
  return "unknown";
}

}  // namespace kvevict
