// The fused post-processing's per-chunk loops on contiguous rows (host code, postprocess.hpp): the
// GQA combine of one query head's pooled chunk into the output chunk, and the finish of a chunk (the
// GQA division, the value-norm weight, the protection). Each has a baseline copy and an AVX2 one
// chosen at run time (cpu_x86.hpp); both run the same IEEE operations per element in the same order,
// so the same bits. Nothing here is API.
#pragma once

#include <kvevict/detail/base/score_order.hpp>
#include <kvevict/detail/host/cpu_x86.hpp>
#include <kvevict/view.hpp>

#include <cstdint>

namespace kvevict::detail {

#if defined(__GNUC__) || defined(__clang__)
#  define KVEVICT_POST_INLINE __attribute__((always_inline)) inline
#else
#  define KVEVICT_POST_INLINE inline
#endif

/// o[p] = gqa_combine(op, o[p], x[p]) for p < n: the sum, or the total-order maximum as the larger
/// total_order_key turned back into a float (total_order_max keeps the operand with the larger key,
/// and equal keys are equal bits), in integer operations that vectorise.
KVEVICT_POST_INLINE void post_combine_body(bool is_max, float* o, const float* x, index_t n) noexcept {
  if (is_max) {
    for (index_t p = 0; p < n; ++p) {
      const std::uint32_t a = total_order_key(o[p]), b = total_order_key(x[p]);
      o[p] = total_order_from_key(b > a ? b : a);
    }
  } else {
    for (index_t p = 0; p < n; ++p) o[p] = o[p] + x[p];
  }
}

/// The GQA mean's division v / g, and v * (1 / g) for g a power of two: the same bits (v / 2^k and
/// v * 2^-k are the same exact real, rounded once; NaNs come out quieted alike), without the divider;
/// post_keep when there is no mean (div_g = 0).
struct post_div_by {
  float g;
  KVEVICT_POST_INLINE float operator()(float v) const noexcept { return v / g; }
};
struct post_mul_by {
  float inv;
  KVEVICT_POST_INLINE float operator()(float v) const noexcept { return v * inv; }
};
struct post_keep {
  KVEVICT_POST_INLINE float operator()(float v) const noexcept { return v; }
};

/// post_finish_body's positions [s, r), the GQA mean's division being `div`.
template <class Div>
KVEVICT_POST_INLINE void post_finish_range(float* o, index_t s, index_t e, index_t r, Div div, const float* w,
                                           float factor) noexcept {
  const float inf = bits_float(0x7f800000u), top = bits_float(0x7f7fffffu);
  if (w != nullptr) {
    for (index_t p = s; p < e; ++p) {
      const float v = div(o[p]) * w[p];
      o[p] = v == inf ? top : v;
    }
  } else {
    for (index_t p = s; p < e; ++p) {
      const float v = div(o[p]) * factor;
      o[p] = v == inf ? top : v;
    }
  }
  for (index_t p = e; p < r; ++p) {
    const float v = div(o[p]);
    o[p] = v == inf ? top : v;
  }
}

/// The finish of a chunk of n positions, in chunk coordinates: [0, s) and [r, n) are the sinks and
/// the recent window (+inf whatever the score); each p in [s, r) becomes
///   v = o[p] / div_g (when div_g > 0: the GQA mean's gqa_finish), then v * w[p] (per-token weights,
///   w non-null) or v * factor (w null) when p < e, then protect_value's v == +inf ? FLT_MAX : v.
/// Requires 0 <= s <= e <= r <= n. The operations of postprocess_finish per element, so its bits.
KVEVICT_POST_INLINE void post_finish_body(float* o, index_t n, index_t s, index_t e, index_t r, index_t div_g,
                                          const float* w, float factor) noexcept {
  const float inf = bits_float(0x7f800000u);
  for (index_t p = 0; p < s; ++p) o[p] = inf;
  if (div_g > 0 && (div_g & (div_g - 1)) == 0)
    post_finish_range(o, s, e, r, post_mul_by{1.0f / static_cast<float>(div_g)}, w, factor);
  else if (div_g > 0)
    post_finish_range(o, s, e, r, post_div_by{static_cast<float>(div_g)}, w, factor);
  else
    post_finish_range(o, s, e, r, post_keep{}, w, factor);
  for (index_t p = r; p < n; ++p) o[p] = inf;
}

#if KVEVICT_HOST_X86_DISPATCH
__attribute__((target("avx2"))) inline void post_combine_avx2(bool is_max, float* o, const float* x,
                                                              index_t n) noexcept {
  post_combine_body(is_max, o, x, n);
}
__attribute__((target("avx2"))) inline void post_finish_avx2(float* o, index_t n, index_t s, index_t e, index_t r,
                                                             index_t div_g, const float* w, float factor) noexcept {
  post_finish_body(o, n, s, e, r, div_g, w, factor);
}
#endif
/// The baseline copies, not inlined into their callers (the tests call each copy directly).
inline void post_combine_base(bool is_max, float* o, const float* x, index_t n) noexcept {
  post_combine_body(is_max, o, x, n);
}
inline void post_finish_base(float* o, index_t n, index_t s, index_t e, index_t r, index_t div_g, const float* w,
                             float factor) noexcept {
  post_finish_body(o, n, s, e, r, div_g, w, factor);
}

/// post_combine_body, the AVX2 copy when the CPU has it.
inline void post_combine(bool is_max, float* o, const float* x, index_t n) noexcept {
#if KVEVICT_HOST_X86_DISPATCH
  if (host_isa_runs(host_isa::avx2)) return post_combine_avx2(is_max, o, x, n);
#endif
  post_combine_base(is_max, o, x, n);
}
/// post_finish_body, the AVX2 copy when the CPU has it.
inline void post_finish(float* o, index_t n, index_t s, index_t e, index_t r, index_t div_g, const float* w,
                        float factor) noexcept {
#if KVEVICT_HOST_X86_DISPATCH
  if (host_isa_runs(host_isa::avx2)) return post_finish_avx2(o, n, s, e, r, div_g, w, factor);
#endif
  post_finish_base(o, n, s, e, r, div_g, w, factor);
}
#undef KVEVICT_POST_INLINE

}  // namespace kvevict::detail
