// kvevict/weight_types.hpp: the value-norm weighting modes (weight.hpp is the stage).
#pragma once

namespace kvevict {

enum class value_weight : int {
  per_token = 0,  ///< VATP: score_j * ||v_j||_1
  head_max = 1,   ///< LAVa: score_j * max_k ||v_k||_1 over the head's value tokens
};

}  // namespace kvevict
