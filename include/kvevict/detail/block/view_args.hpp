// A strided view as the kernels' argument structs hold it (cuda_score_args, pp_params): its data
// pointer and strides (elements) in separate fields, filled here once. Host only. Nothing here is API.
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/view.hpp>

namespace kvevict::detail {

/// p, s0, s1 = v's pointer and strides; with use == false a null pointer and zero strides (an
/// output that was not asked for).
template <class T, class P>
inline void view_args(const strided_view<T, 2>& v, P*& p, index_t& s0, index_t& s1, bool use = true) {
  p = use ? v.data_handle() : nullptr;
  s0 = use ? v.stride(0) : 0;
  s1 = use ? v.stride(1) : 0;
}

/// p, s0, s1, s2 = v's pointer and strides.
template <class T, class P>
inline void view_args(const strided_view<T, 3>& v, P*& p, index_t& s0, index_t& s1, index_t& s2) {
  p = v.data_handle();
  s0 = v.stride(0);
  s1 = v.stride(1);
  s2 = v.stride(2);
}

}  // namespace kvevict::detail
