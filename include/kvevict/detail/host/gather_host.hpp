// Host kernel of compaction (compact.hpp): copy kept rows of a head, whole rows, bit-exactly.
// Nothing here is API.
//
// The source rows of kept positions are scattered over a cache of up to hundreds of MiB: each row
// is a few cache lines on a page of its own, so the copy waits on memory (and page walks) unless the
// rows are requested well ahead. The kernel, row by row:
//   - prefetches every line of the source row gather_prefetch_bytes ahead (counted in kept rows;
//     the positions after the block's own are read when the caller says they exist, so a block's
//     first rows were already requested by the previous block of the same head);
//   - copies a row whose size is a multiple of 32 bytes inline (the usual sizes as constants), by
//     groups of up to 256 bytes loaded into registers before any of it is stored, groups in
//     ascending order: a forward copy, which is also memmove's result when the destination does
//     not lie above the source (in place: row j comes from row pos[j] >= j); 32-byte vectors when
//     the CPU has AVX2 (chosen at run time), 16-byte ones otherwise; other rows with memcpy /
//     memmove;
//   - when the caller asks to stream (an output of at least gather_stream_bytes) and the
//     destination rows are 32-byte aligned, with AVX2's non-temporal stores (no read for
//     ownership of the destination lines; one sfence at the end of the call). In place this is
//     safe too: a later row's source pos[j'] >= j' lies above every row already written.
// Measured (docs/PERFORMANCE.md, "Issue 18, round nine: compaction"): streaming takes the fp16
// d = 128, k = 4096 gather (8 MiB out) from 374 to 270 us, but slows 2 and 4 MiB outputs (whose
// rows stay in the 32 MiB L3) by 7-34%; 64-byte AVX-512F copies gave nothing without it and were slower with it.
// Runs of consecutive kept rows are not merged into one copy: detecting them costs a
// data-dependent branch per row, whose mispredictions on scattered positions (a run continues
// with probability k/T) squash the loads in flight; a run's rows are copied one by one at the
// speed of a streaming copy anyway (docs/PERFORMANCE.md, "Issue 18, round six").
#pragma once

#include <kvevict/config.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <kvevict/detail/host/cpu_x86.hpp>
#if KVEVICT_HOST_X86_DISPATCH
#  include <immintrin.h>
#endif

namespace kvevict::detail {

/// Bytes of source rows the gathers request ahead of the row they copy.
#if !defined(KVEVICT_GATHER_PREFETCH_BYTES)
#  define KVEVICT_GATHER_PREFETCH_BYTES 8192
#endif
inline constexpr std::size_t gather_prefetch_bytes = KVEVICT_GATHER_PREFETCH_BYTES;
/// Rows of one head an out-of-place gather hands to one parallel iteration (compact_stream_block
/// when it streams: each call ends with an sfence, whose wait costs ~0.1 us).
inline constexpr index_t compact_block = 128;
inline constexpr index_t compact_stream_block = 1024;

/// Output bytes of one compaction from which the gathers stream their stores (non-temporal: the
/// output goes to memory, not the caches); 0 never streams. 8 MiB: smaller outputs were faster with
/// ordinary stores on the measured machine (32 MiB L3).
#if !defined(KVEVICT_GATHER_STREAM_BYTES)
#  define KVEVICT_GATHER_STREAM_BYTES (std::size_t{8} << 20)
#endif
inline constexpr std::size_t gather_stream_bytes = KVEVICT_GATHER_STREAM_BYTES;
/// Whether a compaction writing out_bytes streams its stores.
inline bool gather_streams(std::size_t out_bytes) noexcept {
  return gather_stream_bytes > 0 && out_bytes >= gather_stream_bytes;
}
/// Rows of one head per parallel iteration of an out-of-place gather.
inline index_t gather_block(bool stream) noexcept { return stream ? compact_stream_block : compact_block; }

/// Kept rows the gathers prefetch ahead for rows of row_bytes bytes (4 .. 32; 0 when prefetching is
/// switched off).
inline index_t gather_prefetch_rows(std::size_t row_bytes) noexcept {
  if (gather_prefetch_bytes == 0 || row_bytes == 0) return 0;
  return std::clamp<index_t>(static_cast<index_t>(gather_prefetch_bytes / row_bytes), 4, 32);
}

#if defined(__GNUC__) || defined(__clang__)
#  define KVEVICT_GATHER_INLINE __attribute__((always_inline)) inline
#else
#  define KVEVICT_GATHER_INLINE inline
#endif

/// The gather (see gather_rows_host) on bytes, rows of row_bytes bytes (RB when RB > 0). Copy: a
/// copy_forward_* (rows of a multiple of 32 bytes) or void (memcpy / memmove).
template <class Copy, std::size_t RB>
KVEVICT_GATHER_INLINE void gather_rows_body(unsigned char* dst, std::size_t dst_rs, const unsigned char* src,
                                            std::size_t src_rs, const pos_t* pos, index_t ps, index_t n,
                                            index_t ahead, std::size_t row_bytes_in, bool in_place) noexcept {
  const std::size_t row_bytes = RB > 0 ? RB : row_bytes_in;
  const index_t pf = gather_prefetch_rows(row_bytes), reach = n + ahead;
  for (index_t j = 0; j < n; ++j) {
#if defined(__GNUC__) || defined(__clang__)
    if (pf > 0 && j + pf < reach) {  // the row pf kept positions ahead
      const unsigned char* q = src + static_cast<std::size_t>(pos[(j + pf) * ps]) * src_rs;
      for (std::size_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(q + b);
    }
#endif
    unsigned char* d = dst + static_cast<std::size_t>(j) * dst_rs;
    const unsigned char* s = src + static_cast<std::size_t>(pos[j * ps]) * src_rs;
    if constexpr (std::is_void_v<Copy>) {
      if (!in_place) std::memcpy(d, s, row_bytes);
      else if (d != s) std::memmove(d, s, row_bytes);
    } else if (!in_place || d != s) {
      Copy::copy(d, s, row_bytes);
    }
  }
}

/// gather_rows_body with the row sizes of the usual KV rows (head dims 64 / 128 / 256 of 2- and
/// 4-byte elements) as constants.
template <class Copy>
KVEVICT_GATHER_INLINE void gather_rows_sized(unsigned char* dst, std::size_t dst_rs, const unsigned char* src,
                                             std::size_t src_rs, const pos_t* pos, index_t ps, index_t n,
                                             index_t ahead, std::size_t row_bytes, bool in_place) noexcept {
  switch (row_bytes) {
    case 128: return gather_rows_body<Copy, 128>(dst, dst_rs, src, src_rs, pos, ps, n, ahead, row_bytes, in_place);
    case 256: return gather_rows_body<Copy, 256>(dst, dst_rs, src, src_rs, pos, ps, n, ahead, row_bytes, in_place);
    case 512: return gather_rows_body<Copy, 512>(dst, dst_rs, src, src_rs, pos, ps, n, ahead, row_bytes, in_place);
    case 1024: return gather_rows_body<Copy, 1024>(dst, dst_rs, src, src_rs, pos, ps, n, ahead, row_bytes, in_place);
    default: return gather_rows_body<Copy, 0>(dst, dst_rs, src, src_rs, pos, ps, n, ahead, row_bytes, in_place);
  }
}

#if KVEVICT_HOST_X86_DISPATCH
/// Copies `bytes` (a multiple of 32) forward by groups of up to 256 bytes, each group loaded into
/// registers before any of it is stored: memmove's result when dst <= src or the spans are disjoint.
/// SSE2: 16-byte vectors (every x86-64 CPU); AVX2: 32-byte vectors (chosen at run time); Stream:
/// AVX2's non-temporal stores (dst aligned to 32 bytes; the caller fences).
struct copy_forward_sse2 {
  static KVEVICT_GATHER_INLINE void copy(unsigned char* dst, const unsigned char* src, std::size_t bytes) noexcept {
    for (std::size_t b = 0; b < bytes; b += 32) {
      const __m128i a0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + b));
      const __m128i a1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + b + 16));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + b), a0);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + b + 16), a1);
    }
  }
};
template <bool Stream>
struct copy_forward_avx2 {
  __attribute__((target("avx2"))) static inline void store(unsigned char* dst, __m256i v) noexcept {
    if constexpr (Stream)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), v);
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), v);
  }
  __attribute__((target("avx2"))) static inline void copy(unsigned char* dst, const unsigned char* src,
                                                          std::size_t bytes) noexcept {
    std::size_t b = 0;
    for (; b + 256 <= bytes; b += 256) {
      const auto* s = reinterpret_cast<const __m256i*>(src + b);
      unsigned char* d = dst + b;
      const __m256i a0 = _mm256_loadu_si256(s), a1 = _mm256_loadu_si256(s + 1), a2 = _mm256_loadu_si256(s + 2),
                    a3 = _mm256_loadu_si256(s + 3), a4 = _mm256_loadu_si256(s + 4), a5 = _mm256_loadu_si256(s + 5),
                    a6 = _mm256_loadu_si256(s + 6), a7 = _mm256_loadu_si256(s + 7);
      store(d, a0);
      store(d + 32, a1);
      store(d + 64, a2);
      store(d + 96, a3);
      store(d + 128, a4);
      store(d + 160, a5);
      store(d + 192, a6);
      store(d + 224, a7);
    }
    for (; b < bytes; b += 32) store(dst + b, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + b)));
  }
};
template <bool Stream>
__attribute__((target("avx2"))) inline void gather_rows_avx2(unsigned char* dst, std::size_t dst_rs,
                                                             const unsigned char* src, std::size_t src_rs,
                                                             const pos_t* pos, index_t ps, index_t n, index_t ahead,
                                                             std::size_t row_bytes, bool in_place) noexcept {
  gather_rows_sized<copy_forward_avx2<Stream>>(dst, dst_rs, src, src_rs, pos, ps, n, ahead, row_bytes, in_place);
  if constexpr (Stream) _mm_sfence();
}
#endif

/// The row copies of the gather: bytes (memcpy / memmove, any row), sse2 and avx2 (rows of a
/// multiple of 32 bytes, x86-64; avx2 when the CPU has it). Every one gives the same bytes.
enum class gather_copy : int { bytes = 0, sse2 = 1, avx2 = 2 };

/// Whether `c` can copy rows of row_bytes bytes on this CPU and build.
inline bool gather_copy_available(gather_copy c, std::size_t row_bytes) noexcept {
  if (c == gather_copy::bytes) return true;
#if KVEVICT_HOST_X86_DISPATCH
  return row_bytes % 32 == 0 && (c == gather_copy::sse2 || host_isa_runs(host_isa::avx2));
#else
  (void)row_bytes;
  return false;
#endif
}

/// The fastest available copy for rows of row_bytes bytes.
inline gather_copy gather_copy_best(std::size_t row_bytes) noexcept {
  for (gather_copy c : {gather_copy::avx2, gather_copy::sse2})
    if (gather_copy_available(c, row_bytes)) return c;
  return gather_copy::bytes;
}

/// dst row j (j < n, rows dst_rs elements apart) = src row pos[j * ps] (rows src_rs apart), rows
/// of dim contiguous elements; pos[(n + i) * ps] for i < ahead are the next blocks' positions of the
/// same source (prefetched, never copied). in_place: dst and src are the same cache and every
/// pos[j] >= j (ascending): rows already in place are skipped. stream: non-temporal stores when
/// the copy is avx2 and every destination row is 32-byte aligned (else ordinary stores), fenced
/// before the return. Same bytes as one memcpy / memmove per row, whichever copy
/// `c` (an unavailable one falls back to bytes) and whether it streams.
template <class T>
void gather_rows_with(gather_copy c, T* dst, index_t dst_rs, const T* src, index_t src_rs, const pos_t* pos,
                      index_t ps, index_t n, index_t ahead, index_t dim, bool in_place, bool stream = false) noexcept {
  const std::size_t row_bytes = static_cast<std::size_t>(dim) * sizeof(T);
  auto* d = reinterpret_cast<unsigned char*>(dst);
  const auto* s = reinterpret_cast<const unsigned char*>(src);
  const std::size_t drs = static_cast<std::size_t>(dst_rs) * sizeof(T), srs = static_cast<std::size_t>(src_rs) * sizeof(T);
  if (!gather_copy_available(c, row_bytes)) c = gather_copy::bytes;
#if KVEVICT_HOST_X86_DISPATCH
  if (c == gather_copy::avx2) {
    // streaming needs every destination row aligned to the vector (the rows' stride too when n > 1)
    const bool aligned = reinterpret_cast<std::uintptr_t>(d) % 32 == 0 && (n <= 1 || drs % 32 == 0);
    if (stream && aligned) return gather_rows_avx2<true>(d, drs, s, srs, pos, ps, n, ahead, row_bytes, in_place);
    return gather_rows_avx2<false>(d, drs, s, srs, pos, ps, n, ahead, row_bytes, in_place);
  }
  if (c == gather_copy::sse2)
    return gather_rows_sized<copy_forward_sse2>(d, drs, s, srs, pos, ps, n, ahead, row_bytes, in_place);
#else
  (void)stream;
#endif
  gather_rows_sized<void>(d, drs, s, srs, pos, ps, n, ahead, row_bytes, in_place);
}

/// gather_rows_with the fastest copy for the rows.
template <class T>
void gather_rows_host(T* dst, index_t dst_rs, const T* src, index_t src_rs, const pos_t* pos, index_t ps, index_t n,
                      index_t ahead, index_t dim, bool in_place, bool stream = false) noexcept {
  gather_rows_with(gather_copy_best(static_cast<std::size_t>(dim) * sizeof(T)), dst, dst_rs, src, src_rs, pos, ps, n,
                   ahead, dim, in_place, stream);
}

}  // namespace kvevict::detail

#undef KVEVICT_GATHER_INLINE
