// Host kernels of attention_scores (seq and par): packing, the logit micro-kernel, the per-row
// softmax and the per-column accumulation. Nothing here is API; see <kvevict/score.hpp>.
//
// Work decomposition (docs/score.md, "Algorithm"): a task owns some query heads of one GQA group
// and all their w rows. Its rows are processed in blocks of `score_rows`; for a block, every visible
// key is converted to fp32 once into a packed tile and serves every row of the block (rows of
// several query heads of the group included) through a register-blocked micro-kernel that writes
// the block's logits into a per-thread buffer [rows][visible columns] (memory linear in the prompt
// length, never [w x P] for the whole block). Each row is then turned into probabilities in
// chunks (chunk max, e^(x - chunk max), chunk sum, chunks merged with softmax_merge) and added,
// row by row in query order, to the task's per-head column accumulators.
//
// Determinism: every logit is one sequential fp32 dot product over d (vectorised across keys, never
// across d); row statistics use explicit lanes and fixed chunk boundaries; each column sums its rows
// in order 0..w-1. Nothing depends on the blocking, the task partition or the thread count, so seq
// and par give identical bits for any number of threads.
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/config.hpp>
#include <kvevict/detail/softmax.hpp>
#include <kvevict/numeric.hpp>
#include <kvevict/view.hpp>

#include <cstdint>

#if defined(__GNUC__) || defined(__clang__) || defined(_MSC_VER)
#  define KVEVICT_RESTRICT __restrict
#else
#  define KVEVICT_RESTRICT
#endif

namespace kvevict::detail {

inline constexpr index_t score_mr = 4;          ///< micro-kernel rows
inline constexpr index_t score_nr = 8;          ///< micro-kernel keys (two SSE vectors, one AVX vector)
inline constexpr index_t score_rows = 32;       ///< rows per block (multiple of score_mr)
inline constexpr index_t score_key_tile = 64;   ///< keys per packed tile (multiple of score_nr)
inline constexpr index_t score_chunk = 1024;    ///< columns per softmax-statistics chunk
inline constexpr int score_lanes = 8;           ///< explicit lanes of the row reductions

inline index_t round_up(index_t x, index_t m) { return (x + m - 1) / m * m; }

template <class T>
const T* kv_row(const kv_view<const T>& v, index_t h, index_t t) {
  return v.data_handle() + h * v.stride(0) + t * v.stride(1);
}

/// Packs `nrows` query rows into [row group of score_mr][d][score_mr] fp32, zero-padding the last
/// group. Row r of the task is query head head0 + (row0 + r) / w, position (row0 + r) % w.
template <class Q>
void score_pack_queries(float* KVEVICT_RESTRICT dst, const kv_view<const Q>& q, index_t head0, index_t w, index_t row0,
                        index_t nrows) {
  const index_t d = q.extent(2), ds = q.stride(2);
  const index_t groups = (nrows + score_mr - 1) / score_mr;
  for (index_t gi = 0; gi < groups; ++gi) {
    float* g = dst + gi * d * score_mr;
    for (index_t rr = 0; rr < score_mr; ++rr) {
      const index_t r = gi * score_mr + rr;
      if (r < nrows) {
        const index_t flat = row0 + r;
        const Q* src = kv_row(q, head0 + flat / w, flat % w);
        for (index_t k = 0; k < d; ++k) g[k * score_mr + rr] = to_float(src[k * ds]);
      } else {
        for (index_t k = 0; k < d; ++k) g[k * score_mr + rr] = 0.0f;
      }
    }
  }
}

/// Packs keys j0 .. j0+nb-1 of KV head g into [key group of score_nr][d][score_nr] fp32, zero
/// padding up to a multiple of score_nr. Column j < p is prefix key j, column j >= p block key j - p.
template <class K>
void score_pack_keys(float* KVEVICT_RESTRICT dst, const kv_view<const K>& prefix, const kv_view<const K>& block,
                     index_t g, index_t p, index_t j0, index_t nb, index_t d) {
  const index_t groups = (nb + score_nr - 1) / score_nr;
  for (index_t gi = 0; gi < groups; ++gi) {
    float* o = dst + gi * d * score_nr;
    for (index_t c = 0; c < score_nr; ++c) {
      const index_t jj = gi * score_nr + c;
      if (jj < nb) {
        const index_t j = j0 + jj;
        const K* src = j < p ? kv_row(prefix, g, j) : kv_row(block, g, j - p);
        const index_t ds = j < p ? prefix.stride(2) : block.stride(2);
        for (index_t k = 0; k < d; ++k) o[k * score_nr + c] = to_float(src[k * ds]);
      } else {
        for (index_t k = 0; k < d; ++k) o[k * score_nr + c] = 0.0f;
      }
    }
  }
}

/// out[r][c] = scale * sum_k q[r][k] * key[c][k] for a score_mr x score_nr tile. Each output is one
/// sequential sum over k (the vector lanes run across keys), so its bits do not depend on the
/// vector width the compiler picks.
inline void score_microkernel(const float* KVEVICT_RESTRICT qp, const float* KVEVICT_RESTRICT kp, index_t d,
                              float scale, float* KVEVICT_RESTRICT out, index_t ld) {
  float acc[score_mr][score_nr] = {};
  for (index_t k = 0; k < d; ++k) {
    const float* qk = qp + k * score_mr;
    const float* kk = kp + k * score_nr;
    for (index_t r = 0; r < score_mr; ++r)
      for (index_t c = 0; c < score_nr; ++c) acc[r][c] += qk[r] * kk[c];
  }
  for (index_t r = 0; r < score_mr; ++r)
    for (index_t c = 0; c < score_nr; ++c) out[r * ld + c] = acc[r][c] * scale;
}

/// Logits of a block: buf[r][j] for rows 0..rows_pad-1 and columns 0..round_up(cols, score_nr)-1
/// (padding rows/columns hold garbage-free zeros x keys and are never read as probabilities).
template <class K>
void score_block_logits(float* KVEVICT_RESTRICT buf, index_t ld, const float* KVEVICT_RESTRICT qpack, index_t rows_pad,
                        float* KVEVICT_RESTRICT kpack, const kv_view<const K>& prefix, const kv_view<const K>& block,
                        index_t g, index_t p, index_t cols, index_t d, float scale) {
  for (index_t j0 = 0; j0 < cols; j0 += score_key_tile) {
    const index_t nb = cols - j0 < score_key_tile ? cols - j0 : score_key_tile;
    score_pack_keys(kpack, prefix, block, g, p, j0, nb, d);
    const index_t nb_pad = round_up(nb, score_nr);
    for (index_t r0 = 0; r0 < rows_pad; r0 += score_mr)
      for (index_t c0 = 0; c0 < nb_pad; c0 += score_nr)
        score_microkernel(qpack + r0 * d, kpack + c0 * d, d, scale, buf + r0 * ld + j0 + c0, ld);
  }
}

/// Chunk statistics of s[0..n): the NaN-propagating max and, in place, e^(s - max) with its sum.
/// A chunk whose logits are all -inf gives {-inf, 0} and zeros.
inline softmax_stats score_chunk_exp(float* KVEVICT_RESTRICT s, index_t n) {
  float mx[score_lanes];
  for (int l = 0; l < score_lanes; ++l) mx[l] = neg_inf_f();
  index_t j = 0;
  for (; j + score_lanes <= n; j += score_lanes)
    for (int l = 0; l < score_lanes; ++l) mx[l] = max_nan(mx[l], s[j + l]);
  for (; j < n; ++j) mx[0] = max_nan(mx[0], s[j]);
  float m = mx[0];
  for (int l = 1; l < score_lanes; ++l) m = max_nan(m, mx[l]);
  if (m == neg_inf_f()) {  // every logit is -inf (no NaN: the max would be NaN): nothing visible
    for (index_t t = 0; t < n; ++t) s[t] = 0.0f;
    return softmax_empty();
  }
  float sm[score_lanes] = {};
  j = 0;
  for (; j + score_lanes <= n; j += score_lanes)
    for (int l = 0; l < score_lanes; ++l) {
      const float e = softmax_exp(s[j + l] - m);
      s[j + l] = e;
      sm[l] += e;
    }
  for (; j < n; ++j) {
    const float e = softmax_exp(s[j] - m);
    s[j] = e;
    sm[0] += e;
  }
  float sum = sm[0];
  for (int l = 1; l < score_lanes; ++l) sum += sm[l];
  return {m, sum};
}

/// Turns logits row s[0..vis) into unnormalised exponentials chunk by chunk; stores each chunk's
/// max in cmax[] and returns the row's merged statistics (chunks merged in column order).
inline softmax_stats score_row_exp(float* KVEVICT_RESTRICT s, index_t vis, float* KVEVICT_RESTRICT cmax) {
  softmax_stats st = softmax_empty();
  for (index_t c0 = 0, c = 0; c0 < vis; c0 += score_chunk, ++c) {
    const softmax_stats cs = score_chunk_exp(s + c0, vis - c0 < score_chunk ? vis - c0 : score_chunk);
    cmax[c] = cs.max;
    st = softmax_merge(st, cs);
  }
  return st;
}

/// The factor turning chunk c's exponentials into probabilities: e^(m_c - M) / L.
inline float score_chunk_factor(float chunk_max, softmax_stats row) {
  return softmax_exp(chunk_max - row.max) / row.sum;
}

/// acc[j] += p_j for j < n (n = visible output columns of the row).
inline void score_row_add(const float* KVEVICT_RESTRICT e, index_t n, const float* KVEVICT_RESTRICT cmax,
                          softmax_stats row, float* KVEVICT_RESTRICT acc) {
  for (index_t c0 = 0, c = 0; c0 < n; c0 += score_chunk, ++c) {
    const float f = score_chunk_factor(cmax[c], row);
    const index_t end = n - c0 < score_chunk ? n : c0 + score_chunk;
    for (index_t j = c0; j < end; ++j) acc[j] += e[j] * f;
  }
}

/// Welford update of every output column with this row's probability (0 for the columns in
/// [n_visible, n_out) the row does not see). inv_count = 1 / (rows pushed so far, this one included).
inline void score_row_welford(const float* KVEVICT_RESTRICT e, index_t n_visible, index_t n_out,
                              const float* KVEVICT_RESTRICT cmax, softmax_stats row, float inv_count,
                              float* KVEVICT_RESTRICT mean, float* KVEVICT_RESTRICT m2) {
  for (index_t c0 = 0, c = 0; c0 < n_visible; c0 += score_chunk, ++c) {
    const float f = score_chunk_factor(cmax[c], row);
    const index_t end = n_visible - c0 < score_chunk ? n_visible : c0 + score_chunk;
    for (index_t j = c0; j < end; ++j) welford_push(mean[j], m2[j], e[j] * f, inv_count);
  }
  for (index_t j = n_visible; j < n_out; ++j) welford_push(mean[j], m2[j], 0.0f, inv_count);
}

// ---- host threading with a per-thread scratch slot ---------------------------------------------
// Results never depend on the partition (see the file comment), so par may schedule dynamically.
#if defined(_OPENMP)
inline namespace par_openmp {
#else
inline namespace par_serial {
#endif

inline int score_threads(seq_t) { return 1; }
inline int score_threads(par_t p) {
#if defined(_OPENMP)
  return p.threads > 0 ? p.threads : omp_get_max_threads();
#else
  (void)p;
  return 1;
#endif
}

/// Calls f(task, slot) for task in [0, n), slot in [0, threads) unique among concurrent calls.
template <class F>
void score_parallel(seq_t, index_t n, int, F&& f) {
  for (index_t i = 0; i < n; ++i) f(i, 0);
}
template <class F>
void score_parallel(par_t, index_t n, int threads, F&& f) {
#if defined(_OPENMP)
  if (n > 1 && threads > 1) {
#  pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (index_t i = 0; i < n; ++i) f(i, omp_get_thread_num());
    return;
  }
#else
  (void)threads;
#endif
  for (index_t i = 0; i < n; ++i) f(i, 0);
}

}  // inline namespace
}  // namespace kvevict::detail
