// Exhaustive check of a reciprocal-and-FMA quotient for average pooling's `sum / div` (issue 18, round
// nine; docs/PERFORMANCE.md, "Issue 18, round nine: average pooling"). The candidate, defined here:
// with y = RN(1/d) (once per divisor),
//   q  = RN(s * y)
//   r  = fma(-q, d, s)       the remainder s - q*d, exact
//   q' = fma(r, y, q)        Markstein's correction
// and q itself in the lanes where r == 0 (q*d == s: q is exact; q' would turn a -0 quotient into +0,
// as -0 + +0 = +0) or s is not finite (an infinite s: q = +-inf, the quotient, while r and q' are NaN;
// a NaN s: q is s quieted, as the division gives it); a vector holding a sum 0 < |s| < 2^-120 is
// divided instead (a quotient in the subnormal range can be an exact midpoint of its coarser grid,
// s = 9 * 2^-149, d = 6: 1.5 * 2^-149, rounded to even 2^-148, which the correction misses: it gives
// 2^-149; |s| >= 2^-120 = 64 * 2^-126 keeps every quotient the correction computes normal). Two
// copies: 16 lanes (AVX-512F) and 8 lanes (AVX2 + FMA), the fused operations as intrinsics.
//
// For every divisor d = 1 .. max_divisor (64: every kernel size and valid count up to the largest
// kernel a recipe or test uses, 9, with room) and every one of the 2^32 float bit patterns s (zeros,
// subnormals, normals, infinities and NaNs of both signs), the candidate's bits against the IEEE
// division s / d (vdivps: correctly rounded, what pool.hpp and pool_host.hpp compute). Prints one line
// per copy and divisor (patterns, mismatches, seconds) and the first mismatches; exits 1 on a mismatch
// (with --variant lanes: on a mismatch outside 0 < |s| < 2^-120, the sums the candidate divides).
//
// The candidate is NOT the library's quotient: it gives the division's bits (0 mismatches), but on the
// machine measured it made avg pooling slower (the kernel is bound by its phase-sum additions, not by
// the division: docs/PERFORMANCE.md), so pool_host.hpp keeps the division. This program is the proof
// kept for a CPU whose division is the bottleneck. Not a CTest (about a second per divisor and copy).
//
//   pool_div_check [--copy avx512|avx2fma|all] [--divisors LO HI] [--variant guarded|lanes|product|corrected]
//
// guarded: the candidate as above; lanes: its per-lane quotient without the tiny-sum division (the
// patterns run in order, 16 (8) consecutive ones per vector, so guarded divides the vectors of tiny sums
// whole; lanes runs every pattern through the reciprocal path, so the two cover every sum on both sides
// of the test); product: q = RN(s * y) alone (multiplying by 1/d); corrected: q' alone (Markstein's
// correction without the lanes that keep q). product and corrected are expected to fail: they show that
// the check sees the difference.
#include <kvevict/host_isa.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if KVEVICT_HOST_X86_DISPATCH
#  include <immintrin.h>

#  pragma GCC diagnostic ignored "-Wpsabi"
namespace {

typedef float vf8 __attribute__((vector_size(32)));
typedef std::uint32_t vu8 __attribute__((vector_size(32)));
typedef std::int32_t vi8 __attribute__((vector_size(32)));
typedef float vf16 __attribute__((vector_size(64)));
typedef std::uint32_t vu16 __attribute__((vector_size(64)));
typedef std::int32_t vi16 __attribute__((vector_size(64)));

constexpr int max_divisor = 64;
constexpr std::uint32_t tiny_bits = 0x03800000u;  // 2^-120

/// 0 < |s| < 2^-120: the sums the candidate divides.
bool tiny(std::uint32_t s) { return (s & 0x7fffffffu) - 1u < tiny_bits - 1u; }

/// The candidate on 8 lanes (AVX2 + FMA): lanes = q' or q per lane; apply = lanes, or the division
/// when a lane holds a tiny sum.
struct quot8 {
  __attribute__((target("avx2,fma"))) static inline void lanes(const vf8& s, const vf8& d, const vf8& y,
                                                              vf8& out) noexcept {
    const vf8 q = s * y;
    const vf8 rem = _mm256_fnmadd_ps(q, d, s);
    const vf8 c = _mm256_fmadd_ps(rem, y, q);
    vu8 sb;
    std::memcpy(&sb, &s, sizeof sb);
    const vi8 keep_q = (rem == 0.f) | ((sb & 0x7fffffffu) >= 0x7f800000u);
    out = keep_q ? q : c;
  }
  /// q' alone (not exact: the check's `corrected` variant)
  __attribute__((target("avx2,fma"))) static inline void corrected(const vf8& s, const vf8& d, const vf8& y,
                                                                  vf8& out) noexcept {
    const vf8 q = s * y;
    out = _mm256_fmadd_ps(_mm256_fnmadd_ps(q, d, s), y, q);
  }
  __attribute__((target("avx2,fma"))) static inline void apply(const vf8& s, const vf8& d, const vf8& y,
                                                              vf8& out) noexcept {
    lanes(s, d, y, out);
    vu8 sb;
    std::memcpy(&sb, &s, sizeof sb);
    const vi8 t = ((sb & 0x7fffffffu) - 1u) < (tiny_bits - 1u);
    if (_mm256_movemask_ps(reinterpret_cast<__m256>(t)) != 0) out = s / d;
  }
};
/// The same on 16 lanes (AVX-512F).
struct quot16 {
  __attribute__((target("avx512f,avx2,fma"))) static inline void lanes(const vf16& s, const vf16& d, const vf16& y,
                                                                      vf16& out) noexcept {
    const vf16 q = s * y;
    const vf16 rem = _mm512_fnmadd_ps(q, d, s);
    const vf16 c = _mm512_fmadd_ps(rem, y, q);
    vu16 sb;
    std::memcpy(&sb, &s, sizeof sb);
    const vi16 keep_q = (rem == 0.f) | ((sb & 0x7fffffffu) >= 0x7f800000u);
    out = keep_q ? q : c;
  }
  __attribute__((target("avx512f,avx2,fma"))) static inline void corrected(const vf16& s, const vf16& d,
                                                                          const vf16& y, vf16& out) noexcept {
    const vf16 q = s * y;
    out = _mm512_fmadd_ps(_mm512_fnmadd_ps(q, d, s), y, q);
  }
  __attribute__((target("avx512f,avx2,fma"))) static inline void apply(const vf16& s, const vf16& d, const vf16& y,
                                                                      vf16& out) noexcept {
    lanes(s, d, y, out);
    vu16 sb;
    std::memcpy(&sb, &s, sizeof sb);
    const vu16 t = (sb & 0x7fffffffu) - 1u;
    if (_mm512_cmplt_epu32_mask(reinterpret_cast<__m512i>(t), _mm512_set1_epi32(static_cast<int>(tiny_bits - 1u))) != 0)
      out = s / d;
  }
};

struct mismatch {
  std::uint32_t s, got, want;
};

constexpr std::uint64_t all_patterns = std::uint64_t{1} << 32;
constexpr std::uint64_t block = 4096;  // patterns per OR-fold of the differences
constexpr std::size_t keep_first = 8;  // mismatches printed per divisor

enum class variant { guarded = 0, lanes = 1, product = 2, corrected = 3 };

/// Every pattern through Q's quotient (or a variant: V) and the division, W lanes at a time (VF / VU:
/// W floats / uint32); mismatches counted, the first keep_first appended to bad. Inlined into the two
/// target copies below, so its vector operations and Q's calls compile for that ISA.
template <class VF, class VU, class Q, variant V>
__attribute__((always_inline)) inline std::uint64_t check_all(float d, std::vector<mismatch>& bad, std::uint64_t& n_tiny) {
  constexpr int W = static_cast<int>(sizeof(VF) / sizeof(float));
  const VF dv = VF{} + d, yv = VF{} + (1.f / d);
  VU lane;
  for (int l = 0; l < W; ++l) lane[l] = static_cast<std::uint32_t>(l);
  const auto both = [&](std::uint64_t p, VU& sb, VU& qb, VU& wb) {  // patterns p .. p + W - 1
    sb = lane + static_cast<std::uint32_t>(p);
    VF s, q;
    std::memcpy(&s, &sb, sizeof s);
    if constexpr (V == variant::guarded) Q::apply(s, dv, yv, q);
    else if constexpr (V == variant::lanes) Q::lanes(s, dv, yv, q);
    else if constexpr (V == variant::product) q = s * yv;
    else Q::corrected(s, dv, yv, q);
    const VF want = s / dv;
    std::memcpy(&qb, &q, sizeof qb);
    std::memcpy(&wb, &want, sizeof wb);
  };
  std::uint64_t n_bad = 0;
  for (std::uint64_t b0 = 0; b0 < all_patterns; b0 += block) {
    VU diff{}, sb, qb, wb;
    for (std::uint64_t p = b0; p < b0 + block; p += W) {
      both(p, sb, qb, wb);
      diff |= qb ^ wb;
    }
    std::uint32_t any = 0;
    for (int l = 0; l < W; ++l) any |= diff[l];
    if (any == 0) continue;
    for (std::uint64_t p = b0; p < b0 + block; p += W) {  // the block again, lane by lane
      both(p, sb, qb, wb);
      for (int l = 0; l < W; ++l)
        if (qb[l] != wb[l]) {
          ++n_bad;
          if (tiny(sb[l])) ++n_tiny;
          if (bad.size() < keep_first) bad.push_back({sb[l], qb[l], wb[l]});
        }
    }
  }
  return n_bad;
}

template <variant V>
__attribute__((target("avx512f,avx2,fma"))) std::uint64_t check_avx512(float d, std::vector<mismatch>& bad,
                                                                        std::uint64_t& n_tiny) {
  return check_all<vf16, vu16, quot16, V>(d, bad, n_tiny);
}
template <variant V>
__attribute__((target("avx2,fma"))) std::uint64_t check_avx2fma(float d, std::vector<mismatch>& bad, std::uint64_t& n_tiny) {
  return check_all<vf8, vu8, quot8, V>(d, bad, n_tiny);
}

float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

int usage() {
  std::fprintf(stderr,
               "usage: pool_div_check [--copy avx512|avx2fma|all] [--divisors LO HI] [--variant guarded|lanes|product|corrected]"
               " (1 <= LO <= HI <= %d)\n",
               max_divisor);
  return 2;
}
}  // namespace

int main(int argc, char** argv) {
  std::string copy = "all", var = "guarded";
  int lo = 1, hi = max_divisor;
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
  if ((copy != "all" && copy != "avx512" && copy != "avx2fma") || lo < 1 || hi < lo || hi > max_divisor ||
      (var != "guarded" && var != "lanes" && var != "product" && var != "corrected"))
    return usage();
  const int vi = var == "guarded" ? 0 : var == "lanes" ? 1 : var == "product" ? 2 : 3;
  struct copy_t {
    const char* name;
    bool runs;
    std::uint64_t (*fn)(float, std::vector<mismatch>&, std::uint64_t&);
  };
  using fn_t = std::uint64_t (*)(float, std::vector<mismatch>&, std::uint64_t&);
  const fn_t f512[] = {check_avx512<variant::guarded>, check_avx512<variant::lanes>, check_avx512<variant::product>,
                       check_avx512<variant::corrected>};
  const fn_t f256[] = {check_avx2fma<variant::guarded>, check_avx2fma<variant::lanes>, check_avx2fma<variant::product>,
                       check_avx2fma<variant::corrected>};
  __builtin_cpu_init();
  const bool fma = __builtin_cpu_supports("fma") != 0;
  const copy_t copies[] = {{"avx512", kvevict::host_isa_supported() >= kvevict::host_isa::avx512, f512[vi]},
                           {"avx2fma", kvevict::host_isa_supported() >= kvevict::host_isa::avx2 && fma, f256[vi]}};
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
  // lanes: the reciprocal path must match for every sum the candidate does not divide
  return (var == "lanes" ? total_bad - total_tiny : total_bad) == 0 ? 0 : 1;
}
#else
int main() {
  std::fprintf(stderr, "pool_div_check: needs x86-64 with GCC or clang (the candidate's AVX2 + FMA / AVX-512F copies)\n");
  return 2;
}
#endif
