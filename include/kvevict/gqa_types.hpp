// kvevict/gqa_types.hpp: how the query heads of a GQA group are reduced to their KV head (gqa.hpp
// is the stage; this header is what other stages and detail/ need of it).
#pragma once

#include <kvevict/detail/base/enum_names.hpp>

namespace kvevict {

enum class gqa_op {
  mean,  ///< arithmetic mean over the group (default of kvpress's SnapKV)
  max,   ///< maximum in the total score order (LAVa); NaN only if the whole group is NaN
  sum,   ///< sum over the group, j ascending
};

/// Short name of a gqa_op ("mean", "max", "sum"; "unknown" for values outside the enum).
constexpr const char* gqa_op_name(gqa_op op) noexcept {
  constexpr const char* names[] = {"mean", "max", "sum"};
  return detail::enum_name(op, names);
}

}  // namespace kvevict
