// kvevict/host_isa.hpp: which x86 copy of the host kernels runs, and a process-wide limit on it.
//
// The host kernels (window scores, GQA reduction, pooling, the fused post-processing, value norms,
// the CAKE / LAVa entropies, compaction's row copies) come in a baseline copy (SSE2 on x86-64, the
// compiler's code elsewhere), an AVX2 copy and, for some, an AVX-512F copy, chosen at every call:
// the best the CPU runs, at most the limit (and where a lower copy measured faster on a CPU family,
// that one: the plain window-score panel on AMD family 19h). Every copy computes the same operations
// in the same order, so the limit changes the speed, never a bit of any result (tests/test_recipes.cpp,
// "host_isa"). The limit is for CPUs whose wide copy is not their fastest and for comparing copies.
// See docs/backends.md ("Kernel copies").
#pragma once

#include <kvevict/detail/base/enum_names.hpp>
#include <kvevict/detail/host/cpu_x86.hpp>

namespace kvevict {

KVEVICT_ISA_ABI_BEGIN
/// The best copy this CPU and build run: baseline off x86-64, with KVEVICT_NO_X86_DISPATCH or in a
/// translation unit nvcc compiles (its host stages have the baseline copy only); avx2 with AVX2 and
/// F16C; avx512 with AVX-512F too.
inline host_isa host_isa_supported() noexcept { return detail::host_isa_cpu(); }

/// The copy the host stages use now: min(host_isa_supported(), host_isa_limit()).
inline host_isa host_isa_active() noexcept { return detail::host_isa_now(); }
KVEVICT_ISA_ABI_END

/// Caps the copies every host stage uses from its next call on, process-wide (all threads; a call
/// already running finishes with the copy it chose). avx512, the default, caps nothing; a limit
/// above host_isa_supported() has the effect of none. Thread-safe.
inline void set_host_isa_limit(host_isa limit) noexcept {
  const int v = static_cast<int>(limit), top = static_cast<int>(host_isa::avx512);  // (clamped into the enum)
  detail::host_isa_limit_ref().store(v < 0 ? 0 : v > top ? top : v, std::memory_order_relaxed);
}

/// The limit set by set_host_isa_limit (avx512 until one is set).
inline host_isa host_isa_limit() noexcept {
  return static_cast<host_isa>(detail::host_isa_limit_ref().load(std::memory_order_relaxed));
}

/// Sets the limit for a scope and puts the previous one back at its end (also when the scope is left by
/// an exception): for tests and benchmarks that compare copies. The limit is process-wide, so guards on
/// different threads at once see each other's limits.
class host_isa_limit_guard {
 public:
  explicit host_isa_limit_guard(host_isa limit) noexcept : previous_(host_isa_limit()) { set_host_isa_limit(limit); }
  ~host_isa_limit_guard() { set_host_isa_limit(previous_); }
  host_isa_limit_guard(const host_isa_limit_guard&) = delete;
  host_isa_limit_guard& operator=(const host_isa_limit_guard&) = delete;

 private:
  host_isa previous_;
};

/// "baseline", "avx2" or "avx512" ("unknown" for a value outside the enum).
constexpr const char* host_isa_name(host_isa i) noexcept {
  constexpr const char* names[] = {"baseline", "avx2", "avx512"};
  return detail::enum_name(i, names);
}

}  // namespace kvevict
