// kvevict/gqa.hpp: reduce per-query-head scores to one score per KV head (grouped-query attention).
//
//   gqa_reduce(be, in /*[H_q][T]*/, out /*[H_kv][T]*/, op)
//       out[h][t] = op over j in [0, g) of in[h*g + j][t],   g = H_q / H_kv
//
// Query head q belongs to KV head q / g (consecutive groups, as in LLaMA and HF transformers).
// One selection per KV head keeps the cache at KV-head granularity: the scores of the g query
// heads sharing a KV head are reduced before selection (never replicate KV per query head).
// Recipes choose whether this runs before or after pooling; the stages are independent.
//
// Ops (all fp32, deterministic, the same on every backend):
//   sum   in[h*g][t] + in[h*g+1][t] + ... + in[h*g+g-1][t], added left to right (j ascending)
//   mean  that sum divided by (float)g (one rounded division)          [kvpress: mean]
//   max   the largest in the total score order (detail/base/score_order.hpp)  [LAVa: max]
// NaN: sum and mean propagate NaN (IEEE arithmetic). max ranks NaN below everything, as
// selection does, so a NaN of one query head does not hide the others' scores; the result is
// NaN only when all g values are NaN. (PyTorch's max would propagate the NaN instead.)
//
// In place: `out` may be the first H_kv rows of `in` (same data pointer and the same strides); the
// group of KV head h only reads rows >= h, so writing row h after reading its group is safe.
// Any other overlap of in and out is an error. Nothing here allocates.
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/detail/base/checks.hpp>
#include <kvevict/detail/base/parallel.hpp>
#include <kvevict/detail/base/score_order.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>
#include <kvevict/gqa_types.hpp>
#include <kvevict/detail/base/stage_math.hpp>
#include <kvevict/detail/host/cpu_x86.hpp>

#include <algorithm>
#include <cstdint>

namespace kvevict {

namespace detail {

inline constexpr index_t gqa_chunk = 256;  // columns per work item (a stack accumulator)

/// H_q = hq rows reduced to H_kv = hkv rows, t_in and t_out columns.
inline status check_gqa_shapes(const char* fn, index_t hq, index_t hkv, index_t t_in, index_t t_out) {
  if (hkv == 0 && hq > 0)
    return status::error(errc::shape_mismatch, "%s: out has 0 KV heads but in has %lld query heads", fn,
                         static_cast<long long>(hq));
  if (hkv > 0 && hq == 0)
    return status::error(errc::shape_mismatch, "%s: in has 0 query heads but out has %lld KV heads", fn,
                         static_cast<long long>(hkv));
  if (hkv > 0 && hq % hkv != 0)
    return status::error(errc::shape_mismatch, "%s: %lld query heads are not a multiple of %lld KV heads", fn,
                         static_cast<long long>(hq), static_cast<long long>(hkv));
  if (t_out != t_in)
    return status::error(errc::shape_mismatch, "%s: in has %lld tokens per row but out has %lld", fn,
                         static_cast<long long>(t_in), static_cast<long long>(t_out));
  return {};
}

#if defined(__GNUC__) || defined(__clang__)
#  define KVEVICT_GQA_INLINE __attribute__((always_inline)) inline
#else
#  define KVEVICT_GQA_INLINE inline
#endif
/// dst[t] = the total-order maximum of rows x + j * xs (j < g) at t < n (n <= gqa_chunk), in head
/// order: the maximum of the rows' total_order_key, turned back into a float once. The same bits as
/// folding total_order_max (it keeps the operand with the larger key, and equal keys are equal
/// bits); integer operations that vectorise (unsigned max with AVX2).
/// (G: the group size as a constant, G > 1: one pass, the group's g loads per output in registers;
/// the same operations in the same order as the loops over a stack row below. dst may be one of the
/// group's rows at the same columns, as gqa_reduce in place writes it, but no other overlap: each
/// output is written after its column's loads.)
template <int G>
KVEVICT_GQA_INLINE void gqa_max_rows_fixed(float* dst, const float* x, index_t xs, index_t n) noexcept {
  for (index_t t = 0; t < n; ++t) {
    std::uint32_t key = total_order_key(x[t]);
    for (int j = 1; j < G; ++j) {
      const std::uint32_t k = total_order_key(x[j * xs + t]);
      key = k > key ? k : key;
    }
    dst[t] = total_order_from_key(key);
  }
}
KVEVICT_GQA_INLINE void gqa_max_rows_body(float* dst, const float* x, index_t xs, index_t g, index_t n) noexcept {
  switch (g) {
    case 2: return gqa_max_rows_fixed<2>(dst, x, xs, n);
    case 4: return gqa_max_rows_fixed<4>(dst, x, xs, n);
    case 8: return gqa_max_rows_fixed<8>(dst, x, xs, n);
    default: break;
  }
  std::uint32_t key[gqa_chunk];
  for (index_t t = 0; t < n; ++t) key[t] = total_order_key(x[t]);
  for (index_t j = 1; j < g; ++j) {
    const float* row = x + j * xs;
    for (index_t t = 0; t < n; ++t) {
      const std::uint32_t k = total_order_key(row[t]);
      key[t] = k > key[t] ? k : key[t];
    }
  }
  for (index_t t = 0; t < n; ++t) dst[t] = total_order_from_key(key[t]);
}
#if KVEVICT_HOST_X86_DISPATCH
__attribute__((target("avx2"))) inline void gqa_max_rows_avx2(float* dst, const float* x, index_t xs, index_t g,
                                                              index_t n) noexcept {
  gqa_max_rows_body(dst, x, xs, g, n);
}
__attribute__((target("avx512f,avx2"))) inline void gqa_max_rows_avx512(float* dst, const float* x, index_t xs,
                                                                        index_t g, index_t n) noexcept {
  gqa_max_rows_body(dst, x, xs, g, n);
}
#endif
inline void gqa_max_rows(float* dst, const float* x, index_t xs, index_t g, index_t n) noexcept {
#if KVEVICT_HOST_X86_DISPATCH
  if (host_isa_runs(host_isa::avx512)) return gqa_max_rows_avx512(dst, x, xs, g, n);
  if (host_isa_runs(host_isa::avx2)) return gqa_max_rows_avx2(dst, x, xs, g, n);
#endif
  gqa_max_rows_body(dst, x, xs, g, n);
}
/// dst[t] = the sum of rows x + j * xs (j < g) at t < n (n <= gqa_chunk), added in head order, then
/// divided by g when `mean`: gqa_combine / gqa_finish per element (mean and sum), in loops that
/// vectorise (8 lanes with AVX2, 16 with AVX-512F; the same operations, so the same bits on every
/// copy).
template <int G>
KVEVICT_GQA_INLINE void gqa_sum_rows_fixed(float* dst, const float* x, index_t xs, index_t n, bool mean) noexcept {
  const float gf = static_cast<float>(G);
  if (mean) {
    for (index_t t = 0; t < n; ++t) {
      float a = x[t];
      for (int j = 1; j < G; ++j) a = a + x[j * xs + t];
      dst[t] = a / gf;
    }
  } else {
    for (index_t t = 0; t < n; ++t) {
      float a = x[t];
      for (int j = 1; j < G; ++j) a = a + x[j * xs + t];
      dst[t] = a;
    }
  }
}
KVEVICT_GQA_INLINE void gqa_sum_rows_body(float* dst, const float* x, index_t xs, index_t g, index_t n,
                                          bool mean) noexcept {
  switch (g) {
    case 2: return gqa_sum_rows_fixed<2>(dst, x, xs, n, mean);
    case 4: return gqa_sum_rows_fixed<4>(dst, x, xs, n, mean);
    case 8: return gqa_sum_rows_fixed<8>(dst, x, xs, n, mean);
    default: break;
  }
  float acc[gqa_chunk];
  for (index_t t = 0; t < n; ++t) acc[t] = x[t];
  for (index_t j = 1; j < g; ++j) {
    const float* row = x + j * xs;
    for (index_t t = 0; t < n; ++t) acc[t] = acc[t] + row[t];
  }
  if (mean) {
    const float gf = static_cast<float>(g);
    for (index_t t = 0; t < n; ++t) dst[t] = acc[t] / gf;
  } else {
    for (index_t t = 0; t < n; ++t) dst[t] = acc[t];
  }
}
#if KVEVICT_HOST_X86_DISPATCH
__attribute__((target("avx2"))) inline void gqa_sum_rows_avx2(float* dst, const float* x, index_t xs, index_t g,
                                                              index_t n, bool mean) noexcept {
  gqa_sum_rows_body(dst, x, xs, g, n, mean);
}
__attribute__((target("avx512f,avx2"))) inline void gqa_sum_rows_avx512(float* dst, const float* x, index_t xs,
                                                                        index_t g, index_t n, bool mean) noexcept {
  gqa_sum_rows_body(dst, x, xs, g, n, mean);
}
#endif
inline void gqa_sum_rows(float* dst, const float* x, index_t xs, index_t g, index_t n, bool mean) noexcept {
#if KVEVICT_HOST_X86_DISPATCH
  if (host_isa_runs(host_isa::avx512)) return gqa_sum_rows_avx512(dst, x, xs, g, n, mean);
  if (host_isa_runs(host_isa::avx2)) return gqa_sum_rows_avx2(dst, x, xs, g, n, mean);
#endif
  gqa_sum_rows_body(dst, x, xs, g, n, mean);
}
/// One group's reduced row on contiguous rows (n <= gqa_chunk), any op: gqa_max_rows or
/// gqa_sum_rows, the bits of gqa_combine / gqa_finish per element.
inline void gqa_rows(gqa_op op, float* dst, const float* x, index_t xs, index_t g, index_t n) noexcept {
  if (op == gqa_op::max) return gqa_max_rows(dst, x, xs, g, n);
  gqa_sum_rows(dst, x, xs, g, n, op == gqa_op::mean);
}
#undef KVEVICT_GQA_INLINE

/// The checks of gqa_reduce, shared by every backend; in_place tells whether out is the first H_kv
/// rows of in (same pointer and strides).
inline status check_gqa_reduce(const char* fn, const matrix_view<const float>& in, const matrix_view<float>& out,
                               gqa_op op, bool& in_place) {
  KVEVICT_TRY(check_view(fn, "in", in));
  KVEVICT_TRY(check_view(fn, "out", out));
  KVEVICT_TRY(check_gqa_op(fn, op));
  KVEVICT_TRY(check_gqa_shapes(fn, in.extent(0), out.extent(0), in.extent(1), out.extent(1)));
  in_place = in.size() > 0 && static_cast<const void*>(in.data_handle()) == out.data_handle() &&
             in.stride(0) == out.stride(0) && in.stride(1) == out.stride(1);
  if (!in_place && range_of(in).intersects(range_of(out)))
    return status::error(errc::overlap,
                         "%s: in and out overlap in memory (allowed only in place: out = the first H_kv rows of in, "
                         "same pointer and strides)",
                         fn);
  return {};
}

}  // namespace detail

/// out[h][t] = op over the g = H_q / H_kv query heads of KV head h of in[q][t], for t < T.
/// `in` is [H_q][T], `out` is [H_kv][T] (any strides). `out` may be the first H_kv rows of `in`
/// (same pointer and strides): the reduction then runs in place.
/// Errors: invalid views (invalid_argument, null_pointer, size_overflow, overlap); H_kv == 0 with
/// H_q > 0, H_q == 0 with H_kv > 0, H_q not a multiple of H_kv, or different T (shape_mismatch); an op outside the enum
/// (invalid_argument); in and out overlapping other than in place (overlap).
/// Work: H_q * T reads, H_kv * T writes; parallel over column blocks (and KV heads when not in place).
template <class Backend>
status gqa_reduce(Backend be, matrix_view<const float> in, matrix_view<float> out, gqa_op op) {
  constexpr const char* fn = "gqa_reduce";
  bool in_place = false;
  KVEVICT_TRY(detail::check_gqa_reduce(fn, in, out, op, in_place));
  const index_t hq = in.extent(0), hkv = out.extent(0), T = in.extent(1);
  if (hkv == 0 || T == 0) return {};
  const index_t g = hq / hkv, chunks = (T + detail::gqa_chunk - 1) / detail::gqa_chunk;
  const float* ip = in.data_handle();
  float* op_ = out.data_handle();
  const index_t is0 = in.stride(0), is1 = in.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  // one work item: KV heads [h0, h1) of column block c (in place: all heads, ascending, per block)
  auto run = [&](index_t h0, index_t h1, index_t c) {
    const index_t t0 = c * detail::gqa_chunk, n = std::min(detail::gqa_chunk, T - t0);
    float acc[detail::gqa_chunk];
    if (is1 == 1 && os1 == 1) {  // contiguous rows (detail::gqa_rows)
      for (index_t h = h0; h < h1; ++h) detail::gqa_rows(op, op_ + h * os0 + t0, ip + (h * g) * is0 + t0, is0, g, n);
      return;
    }
    for (index_t h = h0; h < h1; ++h) {
      const float* row = ip + (h * g) * is0 + t0 * is1;
      for (index_t t = 0; t < n; ++t) acc[t] = row[t * is1];
      for (index_t j = 1; j < g; ++j) {
        row = ip + (h * g + j) * is0 + t0 * is1;
        for (index_t t = 0; t < n; ++t) acc[t] = detail::gqa_combine(op, acc[t], row[t * is1]);
      }
      float* dst = op_ + h * os0 + t0 * os1;
      for (index_t t = 0; t < n; ++t) dst[t * os1] = detail::gqa_finish(op, acc[t], g);
    }
  };
  if (in_place)
    detail::parallel_for(be, chunks, [&](index_t c) { run(0, hkv, c); });
  else
    detail::parallel_for(be, hkv * chunks, [&](index_t i) { run(i / chunks, i / chunks + 1, i % chunks); });
  return {};
}

}  // namespace kvevict
