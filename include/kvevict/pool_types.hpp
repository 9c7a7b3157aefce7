// kvevict/pool_types.hpp: the kinds and options of 1-D pooling (pool.hpp is the stage).
#pragma once

#include <kvevict/detail/base/enum_names.hpp>

namespace kvevict {

enum class pool_kind {
  none,  ///< copy
  max,   ///< max over the window, out-of-range positions ignored (-inf padding)
  avg,   ///< mean over the window with zero padding (divisor per pool_options)
};

/// Divisor of avg pooling at the borders of a row.
enum class avg_divisor {
  kernel,  ///< always k: zero padding counted (PyTorch count_include_pad=True, KVCache-Factory)
  valid,   ///< the number of in-range positions of the window (count_include_pad=False)
};

struct pool_options {
  avg_divisor divisor = avg_divisor::kernel;
};

/// Short name of a pool_kind ("none", "max", "avg"; "unknown" for values outside the enum).
constexpr const char* pool_kind_name(pool_kind k) noexcept {
  constexpr const char* names[] = {"none", "max", "avg"};
  return detail::enum_name(k, names);
}

}  // namespace kvevict
