// Which x86 copy of a host kernel runs: the best level the CPU (and build) runs, capped by the
// process-wide limit of <kvevict/host_isa.hpp> (the API). Every dispatcher asks host_isa_now()
// at each call (one relaxed atomic load), so a new limit applies to the next call. Nothing here is API.
#pragma once

#include <atomic>

#if !defined(KVEVICT_NO_X86_DISPATCH) && (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && \
    !defined(__CUDACC__) && !defined(__NVCOMPILER)
#  define KVEVICT_HOST_X86_DISPATCH 1
#  include <cpuid.h>
#  include <immintrin.h>
#else
#  define KVEVICT_HOST_X86_DISPATCH 0
#endif

namespace kvevict {
/// The copies of the host kernels, in the order the dispatch prefers them (see <kvevict/host_isa.hpp>).
enum class host_isa : int { baseline = 0, avx2 = 1, avx512 = 2 };
}  // namespace kvevict

// What depends on the dispatch lives in an inline namespace named after it: a translation unit
// built without it (nvcc's, or KVEVICT_NO_X86_DISPATCH) and one built with it do not share differing
// definitions under one name. The limit itself is one variable for the whole process.
#if KVEVICT_HOST_X86_DISPATCH
#  define KVEVICT_ISA_ABI_BEGIN inline namespace isa_x86 {
#else
#  define KVEVICT_ISA_ABI_BEGIN inline namespace isa_generic {
#endif
#define KVEVICT_ISA_ABI_END }

namespace kvevict::detail {
/// The process-wide limit (set_host_isa_limit); avx512, the highest level, caps nothing.
inline std::atomic<int>& host_isa_limit_ref() noexcept {
  static std::atomic<int> limit{static_cast<int>(host_isa::avx512)};
  return limit;
}

KVEVICT_ISA_ABI_BEGIN
/// The best level this CPU and build run (asked once). avx2 needs AVX2 and F16C (every AVX2 CPU has
/// F16C; the score kernels widen fp16 with it), avx512 also AVX-512F.
inline host_isa host_isa_cpu() noexcept {
#if KVEVICT_HOST_X86_DISPATCH
  static const host_isa best = [] {
    __builtin_cpu_init();
    unsigned a = 0, b = 0, c = 0, d = 0;
    const bool f16c = __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & bit_F16C) != 0;
    if (!f16c || !__builtin_cpu_supports("avx2")) return host_isa::baseline;
    return __builtin_cpu_supports("avx512f") ? host_isa::avx512 : host_isa::avx2;
  }();
  return best;
#else
  return host_isa::baseline;
#endif
}

/// The level the dispatchers use now: the CPU's best, at most the limit.
inline host_isa host_isa_now() noexcept {
  const int best = static_cast<int>(host_isa_cpu()), cap = host_isa_limit_ref().load(std::memory_order_relaxed);
  return static_cast<host_isa>(best < cap ? best : cap);
}

/// Whether this is an AMD CPU of family 19h with AVX-512F (Zen 4 class), which executes 512-bit
/// operations as two 256-bit halves: there some AVX-512F copies measured slower than the AVX2 ones
/// (docs/PERFORMANCE.md, "Issue 18, round thirteen"), and a dispatcher may prefer the latter.
inline bool host_cpu_halves_512() noexcept {
#if KVEVICT_HOST_X86_DISPATCH
  static const bool yes = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (host_isa_cpu() != host_isa::avx512 || __get_cpuid(0, &a, &b, &c, &d) == 0) return false;
    const bool amd = b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;  // "AuthenticAMD"
    if (!amd || __get_cpuid(1, &a, &b, &c, &d) == 0) return false;
    const unsigned base = (a >> 8) & 0xfu, family = base == 0xfu ? base + ((a >> 20) & 0xffu) : base;
    return family == 0x19u;
  }();
  return yes;
#else
  return false;
#endif
}

/// Whether the copy of level `i` runs now (its level is supported and not above the limit).
inline bool host_isa_runs(host_isa i) noexcept { return host_isa_now() >= i; }
KVEVICT_ISA_ABI_END
}  // namespace kvevict::detail
