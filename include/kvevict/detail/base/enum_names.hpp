// kvevict/detail/base/enum_names.hpp: the one way a public enum's short name is looked up
// (gqa_op_name, pool_kind_name, recipe_name, allocator_name, budget_scheme_name): a table in the
// enum's order (internal).
#pragma once

#include <cstddef>

namespace kvevict::detail {

/// names[v] for an enum whose values are 0, 1, ..., N - 1 in the order of `names` (the enum's
/// declaration order); "unknown" for any other value (a cast from an out-of-range integer).
template <class E, std::size_t N>
constexpr const char* enum_name(E v, const char* const (&names)[N]) noexcept {
  const auto i = static_cast<long long>(v);
  return i >= 0 && i < static_cast<long long>(N) ? names[i] : "unknown";
}

}  // namespace kvevict::detail
