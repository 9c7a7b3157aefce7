// runner/ops.hpp: the few numeric kernels of the reference runner (matmul, RMSNorm, SwiGLU,
// softmax) and its OpenMP helper.
//
// Every output element is computed by one thread with the same summation order as llama2.c's
// run.c (a plain left-to-right sum over the reduction index, starting from 0.0f), so results do
// not depend on the thread count or on how a block of tokens is split, and the logits match
// run.c's bit for bit when both are compiled the same way (no -ffast-math, no FMA contraction).
#pragma once

#include <kvevict/config.hpp>

#include <algorithm>
#include <cmath>

#if defined(_OPENMP)
#  include <omp.h>
#endif

namespace kvrun {

/// The threads a `threads` option asks for: itself when > 0, otherwise every OpenMP thread (1
/// without OpenMP).
inline int thread_count(int threads) {
#if defined(_OPENMP)
  return threads > 0 ? threads : omp_get_max_threads();
#else
  (void)threads;
  return 1;
#endif
}

}  // namespace kvrun

namespace kvrun::detail {

using kvevict::index_t;

/// a * b and a + b into `out`; false if an operand is negative or the result overflows index_t.
inline bool checked_mul(index_t a, index_t b, index_t& out) { return a >= 0 && b >= 0 && !__builtin_mul_overflow(a, b, &out); }
inline bool checked_add(index_t a, index_t b, index_t& out) { return a >= 0 && b >= 0 && !__builtin_add_overflow(a, b, &out); }

/// Below this many multiply-adds (about half a millisecond on one core) a loop runs on the calling
/// thread: an OpenMP region costs microseconds on an idle machine and milliseconds when another
/// process holds a core the region waits for. stories260K decodes on one thread and prefills
/// blocks of more than a few dozen tokens on all of them.
inline constexpr index_t parallel_threshold = index_t(1) << 20;

/// Calls f(i, thread) for i in [0, n); `thread` is in [0, threads). Runs in parallel (static
/// schedule) when built with OpenMP, `threads` > 1 and `work` >= parallel_threshold.
template <class F>
void parallel_for(int threads, index_t n, index_t work, F&& f) {
#if defined(_OPENMP)
  if (threads > 1 && n > 1 && work >= parallel_threshold) {
#  pragma omp parallel for schedule(static) num_threads(threads)
    for (index_t i = 0; i < n; ++i) f(i, omp_get_thread_num());
    return;
  }
#else
  (void)work;
  (void)threads;
#endif
  for (index_t i = 0; i < n; ++i) f(i, 0);
}

/// Y[r][o] = sum_j X[r][j] * WT[j][o] for r < n, o < out, j < in: a block of rows times a weight
/// matrix stored transposed ([in][out], row-major). Rows of X are `x_stride` floats apart, rows of
/// Y `y_stride`. Tiles of 4 rows x 64 outputs; each output is a sequential sum over j.
inline void matmul(int threads, const float* x, index_t x_stride, index_t n, index_t in, const float* wt, index_t out,
                   float* y, index_t y_stride, index_t wt_stride = 0) {
  if (wt_stride == 0) wt_stride = out;  // a column block of a wider matrix (sharded/sharded.hpp)
  constexpr index_t rows_per_tile = 4, cols_per_tile = 64;
  const index_t row_tiles = (n + rows_per_tile - 1) / rows_per_tile;
  const index_t col_tiles = (out + cols_per_tile - 1) / cols_per_tile;
  parallel_for(threads, row_tiles * col_tiles, n * in * out, [&](index_t tile, int) {
    const index_t r0 = (tile / col_tiles) * rows_per_tile, o0 = (tile % col_tiles) * cols_per_tile;
    const index_t rn = std::min(rows_per_tile, n - r0), on = std::min(cols_per_tile, out - o0);
    float acc[rows_per_tile][cols_per_tile] = {};
    for (index_t j = 0; j < in; ++j) {
      const float* w = wt + j * wt_stride + o0;
      for (index_t r = 0; r < rn; ++r) {
        const float xv = x[(r0 + r) * x_stride + j];
        float* a = acc[r];
        for (index_t o = 0; o < on; ++o) a[o] += xv * w[o];
      }
    }
    for (index_t r = 0; r < rn; ++r) std::copy(acc[r], acc[r] + on, y + (r0 + r) * y_stride + o0);
  });
}

/// out[i] = weight[i] * (x[i] / sqrt(mean(x^2) + 1e-5)), computed as run.c does.
inline void rmsnorm(float* out, const float* x, const float* weight, index_t size) {
  float ss = 0.0f;
  for (index_t j = 0; j < size; ++j) ss += x[j] * x[j];
  ss /= static_cast<float>(size);
  ss += 1e-5f;
  ss = 1.0f / std::sqrt(ss);
  for (index_t j = 0; j < size; ++j) out[j] = weight[j] * (ss * x[j]);
}

/// In place: x = softmax(x) over `size` values (max subtracted, fp32), as run.c does.
inline void softmax(float* x, index_t size) {
  float max_val = x[0];
  for (index_t i = 1; i < size; ++i)
    if (x[i] > max_val) max_val = x[i];
  float sum = 0.0f;
  for (index_t i = 0; i < size; ++i) {
    x[i] = std::exp(x[i] - max_val);
    sum += x[i];
  }
  for (index_t i = 0; i < size; ++i) x[i] /= sum;
}

/// One query head's attention over `rows` cached keys/values (head_size floats each; key_of(t) /
/// value_of(t) the address of row t, e.g. through a page list): out = softmax(q . k_t /
/// sqrt(head_size)) . v, with run.c's order of operations. `att` is scratch for `rows` scores;
/// `out` must not overlap the inputs.
template <class KeyOf, class ValueOf>
void attend_rows(const float* __restrict q, KeyOf&& key_of, ValueOf&& value_of, index_t rows, index_t head_size,
                 float* __restrict att, float* __restrict out) {
  const float scale = std::sqrt(static_cast<float>(head_size));
  for (index_t t = 0; t < rows; ++t) {
    const float* k = key_of(t);
    float score = 0.0f;
    for (index_t e = 0; e < head_size; ++e) score += q[e] * k[e];
    att[t] = score / scale;
  }
  softmax(att, rows);
  std::fill(out, out + head_size, 0.0f);
  for (index_t t = 0; t < rows; ++t) {
    const float* v = value_of(t);
    const float a = att[t];
    for (index_t e = 0; e < head_size; ++e) out[e] += a * v[e];
  }
}

/// attend_rows over rows `stride` floats apart.
inline void attend(const float* __restrict q, const float* __restrict keys, const float* __restrict values,
                   index_t stride, index_t rows, index_t head_size, float* __restrict att, float* __restrict out) {
  attend_rows(q, [&](index_t t) { return keys + t * stride; }, [&](index_t t) { return values + t * stride; }, rows,
              head_size, att, out);
}

/// SwiGLU gate: gate[i] = silu(gate[i]) * up[i], silu(g) = g * sigmoid(g).
inline void swiglu(float* gate, const float* up, index_t size) {
  for (index_t i = 0; i < size; ++i) {
    const float g = gate[i] * (1.0f / (1.0f + std::exp(-gate[i])));
    gate[i] = g * up[i];
  }
}

}  // namespace kvrun::detail
