// Exhaustive check of average pooling's reciprocal quotient (detail/host/pool_host.hpp: quot_fma8, the
// AVX2 + FMA copy, and quot_fma16, the AVX-512F copy): for every divisor d = 1 .. recip_max_divisor and
// every one of the 2^32 float bit patterns s (zeros, subnormals, normals, infinities and NaNs of both
// signs), the bits the library's quotient gives against the bits of the IEEE division s / d (vdivps:
// correctly rounded, the operation the other copies and pool.hpp's row code use). Prints one line per
// copy and divisor (patterns, mismatches, seconds) and the first mismatches, if any; exits 1 on a
// mismatch (with --variant lanes: on a mismatch outside 0 < |s| < 2^-120, the sums the library
// divides). Not a CTest (about a second per divisor and copy, minutes for all, on one core);
// tests/test_pool.cpp keeps a sampled version. docs/PERFORMANCE.md ("Issue 18, round nine: average
// pooling") records a run.
//
//   pool_div_check [--copy avx512|avx2fma|all] [--divisors LO HI] [--variant library|lanes|product|corrected]
//
// The patterns run in order, 16 (8) consecutive ones per vector, so the vectors of tiny sums are
// divided whole by `library`; `lanes` runs every pattern, those included, through the per-lane quotient
// (the code a vector without a tiny sum runs), so the two together cover every sum on both sides of the
// test. `product` and `corrected` are not the library's quotient and are expected to fail: they show
// that the check sees the difference.
#include <kvevict/pool.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(KVEVICT_POOL_FAST_PATH) && KVEVICT_HOST_X86_DISPATCH
namespace {
using namespace kvevict::detail::pool_fast;

struct mismatch {
  std::uint32_t s, got, want;
};

constexpr std::uint64_t all_patterns = std::uint64_t{1} << 32;
constexpr std::uint64_t block = 4096;  // patterns per OR-fold of the differences
constexpr std::size_t keep_first = 8;  // mismatches printed per divisor

/// The quotient under test: the library's (apply: lanes, and the division for a vector with a tiny sum),
/// its per-lane quotient alone (lanes: every pattern through the reciprocal path, the tiny ones included),
/// or, to show what the check detects, q = RN(s * y) alone (product: multiplying by the reciprocal) or q'
/// alone (corrected: Markstein's correction without the lanes that keep q).
enum class variant { library = 0, lanes = 1, product = 2, corrected = 3 };

/// 0 < |s| < 2^-120: the sums for which the library divides.
bool tiny(std::uint32_t s) { return (s & 0x7fffffffu) - 1u < recip_tiny_bits - 1u; }

/// Every pattern through quot_fma16 (or a variant) and the division, 16 lanes at a time; mismatches
/// appended to bad.
template <variant V>
__attribute__((target("avx512f,avx2,fma"))) std::uint64_t check_avx512(float d, std::vector<mismatch>& bad, std::uint64_t& n_tiny) {
  const vf16 dv = vf16{} + d, yv = vf16{} + reciprocal(d);
  vu16 lane;
  for (std::uint32_t l = 0; l < 16; ++l) lane[l] = l;
  std::uint64_t n_bad = 0;
  for (std::uint64_t b0 = 0; b0 < all_patterns; b0 += block) {
    vu16 diff{};
    for (std::uint64_t p = b0; p < b0 + block; p += 16) {
      const vu16 sb = lane + static_cast<std::uint32_t>(p);
      vf16 s, q;
      std::memcpy(&s, &sb, sizeof s);
      if constexpr (V == variant::library) quot_fma16::apply(s, dv, yv, q);
      else if constexpr (V == variant::lanes) quot_fma16::lanes(s, dv, yv, q);
      else if constexpr (V == variant::product) q = s * yv;
      else q = _mm512_fmadd_ps(_mm512_fnmadd_ps(s * yv, dv, s), yv, s * yv);
      const vf16 want = s / dv;
      vu16 qb, wb;
      std::memcpy(&qb, &q, sizeof qb);
      std::memcpy(&wb, &want, sizeof wb);
      diff |= qb ^ wb;
    }
    std::uint32_t any = 0;
    for (int l = 0; l < 16; ++l) any |= diff[l];
    if (any == 0) continue;
    for (std::uint64_t p = b0; p < b0 + block; p += 16) {  // the block again, lane by lane
      const vu16 sb = lane + static_cast<std::uint32_t>(p);
      vf16 s, q;
      std::memcpy(&s, &sb, sizeof s);
      if constexpr (V == variant::library) quot_fma16::apply(s, dv, yv, q);
      else if constexpr (V == variant::lanes) quot_fma16::lanes(s, dv, yv, q);
      else if constexpr (V == variant::product) q = s * yv;
      else q = _mm512_fmadd_ps(_mm512_fnmadd_ps(s * yv, dv, s), yv, s * yv);
      const vf16 want = s / dv;
      vu16 qb, wb;
      std::memcpy(&qb, &q, sizeof qb);
      std::memcpy(&wb, &want, sizeof wb);
      for (int l = 0; l < 16; ++l)
        if (qb[l] != wb[l]) {
          ++n_bad;
          if (tiny(sb[l])) ++n_tiny;
          if (bad.size() < keep_first) bad.push_back({sb[l], qb[l], wb[l]});
        }
    }
  }
  return n_bad;
}

/// The same with quot_fma8, 8 lanes at a time.
template <variant V>
__attribute__((target("avx2,fma"))) std::uint64_t check_avx2fma(float d, std::vector<mismatch>& bad, std::uint64_t& n_tiny) {
  const vf8 dv = vf8{} + d, yv = vf8{} + reciprocal(d);
  vu8 lane;
  for (std::uint32_t l = 0; l < 8; ++l) lane[l] = l;
  std::uint64_t n_bad = 0;
  for (std::uint64_t b0 = 0; b0 < all_patterns; b0 += block) {
    vu8 diff{};
    for (std::uint64_t p = b0; p < b0 + block; p += 8) {
      const vu8 sb = lane + static_cast<std::uint32_t>(p);
      vf8 s, q;
      std::memcpy(&s, &sb, sizeof s);
      if constexpr (V == variant::library) quot_fma8::apply(s, dv, yv, q);
      else if constexpr (V == variant::lanes) quot_fma8::lanes(s, dv, yv, q);
      else if constexpr (V == variant::product) q = s * yv;
      else q = _mm256_fmadd_ps(_mm256_fnmadd_ps(s * yv, dv, s), yv, s * yv);
      const vf8 want = s / dv;
      vu8 qb, wb;
      std::memcpy(&qb, &q, sizeof qb);
      std::memcpy(&wb, &want, sizeof wb);
      diff |= qb ^ wb;
    }
    std::uint32_t any = 0;
    for (int l = 0; l < 8; ++l) any |= diff[l];
    if (any == 0) continue;
    for (std::uint64_t p = b0; p < b0 + block; p += 8) {
      const vu8 sb = lane + static_cast<std::uint32_t>(p);
      vf8 s, q;
      std::memcpy(&s, &sb, sizeof s);
      if constexpr (V == variant::library) quot_fma8::apply(s, dv, yv, q);
      else if constexpr (V == variant::lanes) quot_fma8::lanes(s, dv, yv, q);
      else if constexpr (V == variant::product) q = s * yv;
      else q = _mm256_fmadd_ps(_mm256_fnmadd_ps(s * yv, dv, s), yv, s * yv);
      const vf8 want = s / dv;
      vu8 qb, wb;
      std::memcpy(&qb, &q, sizeof qb);
      std::memcpy(&wb, &want, sizeof wb);
      for (int l = 0; l < 8; ++l)
        if (qb[l] != wb[l]) {
          ++n_bad;
          if (tiny(sb[l])) ++n_tiny;
          if (bad.size() < keep_first) bad.push_back({sb[l], qb[l], wb[l]});
        }
    }
  }
  return n_bad;
}

float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

int usage() {
  std::fprintf(stderr,
               "usage: pool_div_check [--copy avx512|avx2fma|all] [--divisors LO HI] [--variant library|product|corrected]"
               " (1 <= LO <= HI <= %d)\n",
               recip_max_divisor);
  return 2;
}
}  // namespace

int main(int argc, char** argv) {
  std::string copy = "all", var = "library";
  int lo = 1, hi = recip_max_divisor;
  for (int a = 1; a < argc; ++a) {
    const std::string arg = argv[a];
    if (arg == "--copy" && a + 1 < argc) copy = argv[++a];
    else if (arg == "--variant" && a + 1 < argc) var = argv[++a];
    else if (arg == "--divisors" && a + 2 < argc) {
      lo = std::atoi(argv[a + 1]);
      hi = std::atoi(argv[a + 2]);
      a += 2;
    } else return usage();
  }
  if ((copy != "all" && copy != "avx512" && copy != "avx2fma") || lo < 1 || hi < lo || hi > recip_max_divisor ||
      (var != "library" && var != "lanes" && var != "product" && var != "corrected"))
    return usage();
  const int vi = var == "library" ? 0 : var == "lanes" ? 1 : var == "product" ? 2 : 3;
  struct copy_t {
    const char* name;
    bool runs;
    std::uint64_t (*fn)(float, std::vector<mismatch>&, std::uint64_t&);
  };
  using fn_t = std::uint64_t (*)(float, std::vector<mismatch>&, std::uint64_t&);
  const fn_t f512[] = {check_avx512<variant::library>, check_avx512<variant::lanes>, check_avx512<variant::product>,
                       check_avx512<variant::corrected>};
  const fn_t f256[] = {check_avx2fma<variant::library>, check_avx2fma<variant::lanes>, check_avx2fma<variant::product>,
                       check_avx2fma<variant::corrected>};
  const copy_t copies[] = {{"avx512", kvevict::detail::host_has_avx512f(), f512[vi]},
                           {"avx2fma", kvevict::detail::host_has_avx2() && kvevict::detail::host_has_fma(), f256[vi]}};
  std::printf("quotient checked: %s\n", var.c_str());
  std::uint64_t total_patterns = 0, total_bad = 0, total_tiny = 0;
  int divisors_run = 0;
  const auto t_all = std::chrono::steady_clock::now();
  for (const copy_t& c : copies) {
    if (copy != "all" && copy != c.name) continue;
    if (!c.runs) {
      std::printf("%s: this CPU does not run it, skipped\n", c.name);
      if (copy != "all") return 2;
      continue;
    }
    for (int d = lo; d <= hi; ++d) {
      std::vector<mismatch> bad;
      std::uint64_t n_tiny = 0;
      const auto t0 = std::chrono::steady_clock::now();
      const std::uint64_t n_bad = c.fn(static_cast<float>(d), bad, n_tiny);
      const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("%s d=%d patterns=%llu mismatches=%llu (of which 0 < |s| < 2^-120: %llu) %.1f s\n", c.name, d,
                  static_cast<unsigned long long>(all_patterns), static_cast<unsigned long long>(n_bad),
                  static_cast<unsigned long long>(n_tiny), sec);
      for (const mismatch& m : bad)
        std::printf("  s=0x%08x (%a): got 0x%08x (%a), s / d = 0x%08x (%a)\n", m.s, static_cast<double>(from_bits(m.s)),
                    m.got, static_cast<double>(from_bits(m.got)), m.want, static_cast<double>(from_bits(m.want)));
      std::fflush(stdout);
      total_patterns += all_patterns;
      total_bad += n_bad;
      total_tiny += n_tiny;
      ++divisors_run;
    }
  }
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_all).count();
  std::printf("total: %d (copy, divisor) pairs, %llu patterns, %llu mismatches (of which 0 < |s| < 2^-120: %llu), %.1f s\n",
              divisors_run, static_cast<unsigned long long>(total_patterns), static_cast<unsigned long long>(total_bad),
              static_cast<unsigned long long>(total_tiny), sec);
  // lanes: what the library computes for every sum it does not divide must match
  return (var == "lanes" ? total_bad - total_tiny : total_bad) == 0 ? 0 : 1;
}
#else
int main() {
  std::fprintf(stderr, "pool_div_check: the reciprocal quotient is not compiled in this build (no x86 dispatch)\n");
  return 2;
}
#endif
