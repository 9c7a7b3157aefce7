// The baselines an engine author would otherwise write, shared by the benchmark binaries. Each
// computes the same output as the kvevict stage it is compared with (checked by the benchmarks),
// written the obvious way, without kvevict's code.
#pragma once

#include "harness.hpp"

#if defined(KVEVICT_BENCH_CBLAS)
#  include <cblas.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

namespace kvb::baseline {

inline float widen(float x) { return x; }
inline float widen(kvevict::float16 x) { return to_float(x); }
inline float widen(kvevict::bfloat16 x) { return to_float(x); }

// ------------------------------------------------------------------------------------------------
// window scores (SnapKV): out[h][j] = mean over the w window rows of softmax(scale q_i . k)[j],
// j < P = T - w, rows causal inside the window (row i sees P + i + 1 keys).

/// Naive: per query head, the whole [w][T] probability matrix, scalar loops, std::exp. `att` is
/// scratch of w * T floats.
template <class K>
void naive_window_scores(const model_shape& s, index_t T, const K* q, const K* k, float* out, std::vector<float>& att) {
  const index_t w = s.window, P = T - w, d = s.dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  att.resize(static_cast<std::size_t>(w * T));
  for (index_t h = 0; h < s.hq; ++h) {
    const index_t kvh = h / s.group();
    for (index_t i = 0; i < w; ++i) {
      const K* qi = q + (h * w + i) * d;
      float* row = att.data() + i * T;
      const index_t vis = P + i + 1;
      float m = -INFINITY;
      for (index_t j = 0; j < vis; ++j) {
        const K* kj = k + (kvh * T + j) * d;
        float acc = 0.f;
        for (index_t e = 0; e < d; ++e) acc += widen(qi[e]) * widen(kj[e]);
        row[j] = acc * scale;
        m = std::max(m, row[j]);
      }
      float sum = 0.f;
      for (index_t j = 0; j < vis; ++j) sum += (row[j] = std::exp(row[j] - m));
      for (index_t j = 0; j < vis; ++j) row[j] /= sum;
      for (index_t j = vis; j < T; ++j) row[j] = 0.f;
    }
    for (index_t j = 0; j < P; ++j) {
      float acc = 0.f;
      for (index_t i = 0; i < w; ++i) acc += att[static_cast<std::size_t>(i * T + j)];
      out[h * P + j] = acc / static_cast<float>(w);
    }
  }
}

#if defined(KVEVICT_BENCH_CBLAS)
inline void blas_threads(int n) { openblas_set_num_threads(n); }

/// Q.K^T alone, fp32 (the compute bound of any exact scorer): per KV head one sgemm
/// C[g w][T] = Q_group[g w][d] . K_head[T][d]^T. `c` holds g * w * T floats.
inline void sgemm_qk(const model_shape& s, index_t T, const float* q, const float* k, float* c) {
  const index_t rows = s.group() * s.window, d = s.dim;
  for (index_t g = 0; g < s.hkv; ++g)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows), static_cast<int>(T),
                static_cast<int>(d), 1.0f, q + g * rows * d, static_cast<int>(d), k + g * T * d, static_cast<int>(d),
                0.0f, c, static_cast<int>(T));
}

/// What an engine author with BLAS writes: per KV head the group's logits by one sgemm (the whole
/// [g w][T] attention block materialised), then per row a masked softmax with std::exp, then the
/// mean over the window rows. fp32 inputs; `threads` OpenMP threads for the softmax and the mean.
inline void blas_window_scores(const model_shape& s, index_t T, const float* q, const float* k, float* out,
                               std::vector<float>& c, int threads) {
  const index_t w = s.window, P = T - w, g = s.group(), rows = g * w;
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.dim));
  c.resize(static_cast<std::size_t>(rows * T));
  for (index_t kvh = 0; kvh < s.hkv; ++kvh) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows), static_cast<int>(T),
                static_cast<int>(s.dim), scale, q + kvh * rows * s.dim, static_cast<int>(s.dim), k + kvh * T * s.dim,
                static_cast<int>(s.dim), 0.0f, c.data(), static_cast<int>(T));
    float* cd = c.data();
#pragma omp parallel for schedule(static) num_threads(threads)
    for (index_t r = 0; r < rows; ++r) {
      float* row = cd + r * T;
      const index_t vis = P + r % w + 1;
      float m = -INFINITY;
      for (index_t j = 0; j < vis; ++j) m = std::max(m, row[j]);
      float sum = 0.f;
      for (index_t j = 0; j < vis; ++j) sum += (row[j] = std::exp(row[j] - m));
      const float inv = 1.0f / sum;
      for (index_t j = 0; j < P; ++j) row[j] *= inv;
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (index_t hh = 0; hh < g; ++hh) {
      float* o = out + (kvh * g + hh) * P;
      for (index_t j = 0; j < P; ++j) o[j] = 0.f;
      for (index_t i = 0; i < w; ++i) {
        const float* row = cd + (hh * w + i) * T;
        for (index_t j = 0; j < P; ++j) o[j] += row[j];
      }
      for (index_t j = 0; j < P; ++j) o[j] /= static_cast<float>(w);
    }
  }
}
#endif

// ------------------------------------------------------------------------------------------------
// post-processing: direct (O(T k)) pooling, GQA mean / max, protection

/// Direct max pooling: out[t] = max of in[t - r .. t + r] inside [0, L) (no NaN handling needed for
/// the benchmark's finite data). One row.
inline void max_pool_row(const float* in, float* out, index_t L, index_t kernel) {
  const index_t r = kernel / 2;
  for (index_t t = 0; t < L; ++t) {
    const index_t b = std::max<index_t>(0, t - r), e = std::min<index_t>(L, t + r + 1);
    float m = in[b];
    for (index_t u = b + 1; u < e; ++u) m = std::max(m, in[u]);
    out[t] = m;
  }
}
/// Direct avg pooling with zero padding counted (PyTorch's avg_pool1d default). One row.
inline void avg_pool_row(const float* in, float* out, index_t L, index_t kernel) {
  const index_t r = kernel / 2;
  for (index_t t = 0; t < L; ++t) {
    const index_t b = std::max<index_t>(0, t - r), e = std::min<index_t>(L, t + r + 1);
    float acc = 0.f;
    for (index_t u = b; u < e; ++u) acc += in[u];
    out[t] = acc / static_cast<float>(kernel);
  }
}

// ------------------------------------------------------------------------------------------------
// selection: the standard library's way, same output as kvevict (ascending positions; ties to the
// lower position; finite scores only)

struct by_score {
  const float* s;
  bool operator()(pos_t a, pos_t b) const { return s[a] > s[b] || (s[a] == s[b] && a < b); }
};

enum class select_algo { nth_element, partial_sort };

/// One row: the k best of n scores, ascending positions. `idx` is scratch of n positions.
inline void select_row(select_algo a, const float* s, index_t n, index_t k, pos_t* idx, pos_t* out) {
  std::iota(idx, idx + n, 0);
  if (a == select_algo::nth_element) {
    if (k < n && k > 0) std::nth_element(idx, idx + k, idx + n, by_score{s});
  } else {
    std::partial_sort(idx, idx + k, idx + n, by_score{s});
  }
  std::sort(idx, idx + k);
  std::copy(idx, idx + k, out);
}

/// Rows r of [R][T] scores, row r keeps k(r) positions written at out(r); one thread per row.
template <class KOf, class OutOf>
void select_rows(select_algo a, const float* s, index_t R, index_t T, KOf k_of, OutOf out_of, std::vector<pos_t>& idx,
                 int threads) {
  idx.resize(static_cast<std::size_t>(threads * T));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (index_t r = 0; r < R; ++r) {
#if defined(_OPENMP)
    const int t = omp_get_thread_num();
#else
    const int t = 0;
#endif
    select_row(a, s + r * T, T, k_of(r), idx.data() + t * T, out_of(r));
  }
}

/// Flattened (AdaKV / LAVa) selection, the obvious way: each row's best floors[r] first (per-row
/// nth_element), then the best `total - sum(floors)` of every remaining (row, position) entry by
/// nth_element over the flattened layer (score descending, then row, then position), then each
/// row's positions sorted. Outputs kept_cu[R + 1] and kept_pos, like select_topk_flat.
struct flat_scratch {
  std::vector<std::int64_t> flat;
  std::vector<pos_t> idx;
  std::vector<unsigned char> taken;
};
inline void select_flat(const float* s, index_t R, index_t T, index_t total, const std::int32_t* floors,
                        std::int32_t* kept_cu, pos_t* kept_pos, flat_scratch& w) {
  w.idx.resize(static_cast<std::size_t>(T));
  w.taken.assign(static_cast<std::size_t>(R * T), 0);
  index_t floor_sum = 0;
  for (index_t r = 0; r < R; ++r) {
    const index_t f = floors != nullptr ? floors[r] : 0;
    floor_sum += f;
    if (f == 0) continue;
    const float* row = s + r * T;
    std::iota(w.idx.begin(), w.idx.end(), 0);
    if (f < T) std::nth_element(w.idx.begin(), w.idx.begin() + f, w.idx.end(), by_score{row});
    for (index_t j = 0; j < f; ++j) w.taken[static_cast<std::size_t>(r * T + w.idx[j])] = 1;
  }
  w.flat.clear();
  for (index_t e = 0; e < R * T; ++e)
    if (!w.taken[static_cast<std::size_t>(e)]) w.flat.push_back(e);
  const index_t rest = total - floor_sum;
  auto better = [s](std::int64_t a, std::int64_t b) { return s[a] > s[b] || (s[a] == s[b] && a < b); };
  if (rest > 0 && rest < static_cast<index_t>(w.flat.size()))
    std::nth_element(w.flat.begin(), w.flat.begin() + rest, w.flat.end(), better);
  for (index_t j = 0; j < rest; ++j) w.taken[static_cast<std::size_t>(w.flat[j])] = 1;
  // taken[] in row-major order = per row, ascending positions
  kept_cu[0] = 0;
  index_t n = 0;
  for (index_t r = 0; r < R; ++r) {
    for (index_t t = 0; t < T; ++t)
      if (w.taken[static_cast<std::size_t>(r * T + t)]) kept_pos[n++] = static_cast<pos_t>(t);
    kept_cu[r + 1] = static_cast<std::int32_t>(n);
  }
}

// ------------------------------------------------------------------------------------------------
// gather: one memcpy per kept row (what compact does by hand)

template <class T>
void gather_rows(const T* src, index_t tokens, index_t dim, const pos_t* kept, const std::int32_t* cu, index_t heads,
                 T* dst, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (index_t h = 0; h < heads; ++h)
    for (index_t j = cu[h]; j < cu[h + 1]; ++j)
      std::memcpy(dst + j * dim, src + (h * tokens + kept[j]) * dim, static_cast<std::size_t>(dim) * sizeof(T));
}

}  // namespace kvb::baseline
