// Run-time CPU checks of the host kernels that have an AVX2 copy besides their baseline one
// (compaction's gather, the GQA max, pooling; pooling also has an AVX-512F one). Nothing here is API.
#pragma once

#if !defined(KVEVICT_NO_X86_DISPATCH) && (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && \
    !defined(__CUDACC__) && !defined(__NVCOMPILER)
#  define KVEVICT_HOST_X86_DISPATCH 1
#else
#  define KVEVICT_HOST_X86_DISPATCH 0
#endif

#if KVEVICT_HOST_X86_DISPATCH
namespace kvevict::detail {
/// Whether this CPU runs AVX2 code (asked once).
inline bool host_has_avx2() noexcept {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return yes;
}
/// Whether this CPU runs AVX-512F code (asked once).
inline bool host_has_avx512f() noexcept {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return yes;
}
}  // namespace kvevict::detail
#endif
