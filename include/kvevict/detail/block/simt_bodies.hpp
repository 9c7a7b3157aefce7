// Kernel bodies written once over the SIMT execution context of detail/block/simt.hpp: the CUDA
// kernels are one-line wrappers (cuda/protect.cuh, cuda/gqa.cuh) and the host tests run the same
// bodies under simt_executor (real barriers, warps, race checks) with the same launch shapes. Not API.
//
// Converted so far: protect (protect_body), gqa_reduce (gqa_reduce_body), weight_by_value_norm
// (its four kernels as ops, launched by weight_launch on either launcher), key_norm_scores
// (key_norm_op) and position_scores (position_op). docs/cuda.md, "Kernel
// bodies on the host", lists the kernels that are not converted yet.
//
// An op is a struct with `threads` (the launch bound), a trivially constructible `shared` type (the
// block's static shared memory; `simt_no_shared` when none) and
// `static void body(Ctx&, shared&, args...)`. A launcher runs it: cuda_launcher (cuda/simt.cuh, one
// generic __global__ for every op) or simt_launcher (below, the host executor); a launch sequence
// written once as a template over the launcher serves both.
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/detail/base/stage_math.hpp>
#include <kvevict/detail/block/postprocess_device.hpp>
#include <kvevict/detail/block/score_device.hpp>
#include <kvevict/detail/base/softmax.hpp>
#include <kvevict/detail/base/real_math.hpp>
#include <kvevict/gqa_types.hpp>
#include <kvevict/view.hpp>

#include <cstdint>

namespace kvevict::detail {

/// A launch: blocks and threads per block.
struct simt_shape {
  index_t grid = 1, block = 1;
};

/// Blocks for a grid-stride loop over `items` work items: min(items, cap) (never 0). Every kernel
/// loops `for (item = block; item < items; item += grid)` with 64-bit items, so any size fits and the
/// results do not depend on the grid (tests pass a small cap to exercise the stride).
KVEVICT_HOST_DEVICE constexpr index_t simt_grid(index_t items, index_t cap = index_t(1) << 20) noexcept {
  return items < 1 ? 1 : items < cap ? items : cap;
}

/// The length of row `row` from lengths in device memory (or `limit` when there are none). A length
/// outside [0, limit] returns false; if `count`, 1 is added to *bad (when bad is non-null).
template <class Ctx>
KVEVICT_HOST_DEVICE bool simt_row_length(Ctx& c, const std::int32_t* lengths, index_t row, index_t limit,
                                         index_t& len, int* bad, bool count) {
  len = lengths != nullptr ? static_cast<index_t>(lengths[row]) : limit;
  if (len >= 0 && len <= limit) return true;
  if (count && bad != nullptr) c.atomic_add(bad, 1);
  return false;
}

/// Where kernels report rows or heads they skipped because device-resident arguments were invalid:
/// the caller's counter and/or the launcher's own (workspace) counter, either may be null.
struct simt_bad {
  int* a = nullptr;
  int* b = nullptr;
  template <class Ctx>
  KVEVICT_HOST_DEVICE void add(Ctx& c, int n) const {
    if (n == 0) return;
    if (a != nullptr) c.atomic_add(a, n);
    if (b != nullptr) c.atomic_add(b, n);
  }
};

// ---- protect: one thread per element, grid-stride ------------------------------------------------
inline constexpr index_t protect_threads = 256;
inline simt_shape protect_shape(index_t R, index_t T, index_t cap = index_t(1) << 20) {
  return {simt_grid((R * T + protect_threads - 1) / protect_threads, cap), protect_threads};
}
template <class Ctx>
KVEVICT_HOST_DEVICE void protect_body(Ctx& c, float* s, index_t s0, index_t s1, index_t R, index_t T, index_t n_sink,
                                      index_t n_recent, const std::int32_t* lengths, int* bad) {
  const index_t items = R * T, stride = c.grid_dim() * c.block_dim();
  for (index_t it = c.block() * c.block_dim() + c.thread(); it < items; it += stride) {
    const index_t r = it / T, t = it % T;
    index_t L = 0;
    if (!simt_row_length(c, lengths, r, T, L, bad, t == 0) || t >= L) continue;
    float& v = s[r * s0 + t * s1];
    v = protect_value(v, t, protect_sink_end(L, n_sink), protect_recent_begin(L, n_recent));
  }
}

// ---- gqa_reduce: one thread per (KV head, column); in place one thread per column ---------------
inline constexpr index_t gqa_threads = 256;
inline simt_shape gqa_reduce_shape(index_t hkv, index_t T, bool in_place, index_t cap = index_t(1) << 20) {
  return {simt_grid(((in_place ? 1 : hkv) * T + gqa_threads - 1) / gqa_threads, cap), gqa_threads};
}
/// In place (out = the first H_kv rows of in) one thread per column walks the KV heads in ascending
/// order, as the host does, so that row h is written only after every group reading it was reduced.
template <class Ctx>
KVEVICT_HOST_DEVICE void gqa_reduce_body(Ctx& c, const float* in, index_t is0, index_t is1, float* out, index_t os0,
                                         index_t os1, index_t hkv, index_t g, index_t T, gqa_op op, bool in_place) {
  const index_t heads = in_place ? 1 : hkv;  // in place: one item per column covers every head
  const index_t items = heads * T, stride = c.grid_dim() * c.block_dim();
  for (index_t it = c.block() * c.block_dim() + c.thread(); it < items; it += stride) {
    const index_t t = it % T, h0 = in_place ? 0 : it / T, h1 = in_place ? hkv : h0 + 1;
    for (index_t h = h0; h < h1; ++h) {
      const float* col = in + (h * g) * is0 + t * is1;
      float acc = col[0];
      for (index_t j = 1; j < g; ++j) acc = gqa_combine(op, acc, col[j * is0]);
      out[h * os0 + t * os1] = gqa_finish(op, acc, g);
    }
  }
}

// ---- ops and launchers -----------------------------------------------------------------------------
struct simt_no_shared {};

/// The host launcher: runs each op on a simt_executor (detail/block/simt.hpp), shared memory sized
/// for the op; stops at the first failed launch (ok false, the executor's error() says why).
template <class Executor>
struct simt_launcher {
  Executor& ex;
  bool ok = true;
  template <class Op, class... A>
  void run(simt_shape sh, A... a) {
    if (!ok) return;
    ex.resize_shared(sizeof(typename Op::shared));
    ok = ex.run(sh.grid, sh.block, [&](auto& c) { Op::body(c, *ex.template shared_as<typename Op::shared>(), a...); });
  }
};

// ---- rows staged through shared memory ------------------------------------------------------------
inline constexpr int stage_rows = 256;           ///< rows staged per step (one per thread of a 256-thread CTA)
inline constexpr int stage_cols = 16;            ///< elements of each row staged per step
inline constexpr int stage_ld = stage_cols + 1;  ///< odd row stride: conflict-free column reads

/// Tiles of stage_rows tokens covering `tokens`: the items per head of the staged ops (and the
/// partial maxima per head of value_norm_max_launch).
KVEVICT_HOST_DEVICE inline index_t stage_tiles(index_t tokens) { return (tokens + stage_rows - 1) / stage_rows; }

/// The shared memory of an op that stages its rows (simt_staged_row_reduce's sm).
struct staged_rows_shared {
  float sm[stage_rows * stage_ld];
};

/// Thread t's reduction over row t (t < nrows <= stage_rows) of d elements, row t's element k being
/// base[t * rs + k * es]: the rows are staged through sm[stage_rows][stage_ld] (fp32, widened exactly)
/// stage_cols elements at a time with coalesced loads (16 consecutive threads read one row's 16
/// consecutive elements), and f(s, staged, n) continues the reduction over n staged values, so the
/// order is k = 0..d-1 as in the host functions. Needs
/// block_dim() == stage_rows; every thread must call it (it synchronises the block). Returns 0 for
/// threads >= nrows.
template <class Ctx, class T, class F>
KVEVICT_HOST_DEVICE float simt_staged_row_reduce(Ctx& c, const T* base, index_t rs, index_t es, int nrows, index_t d,
                                                 float* sm, F f) {
  float s = 0.0f;
  const int tid = static_cast<int>(c.thread());
  for (index_t d0 = 0; d0 < d; d0 += stage_cols) {
    const int n = d - d0 < stage_cols ? static_cast<int>(d - d0) : stage_cols;
    c.sync();
    for (int e = tid; e < stage_rows * stage_cols; e += stage_rows) {
      const int t = e / stage_cols, k = e % stage_cols;
      c.st(sm + t * stage_ld + k, t < nrows && k < n ? widen(base[t * rs + (d0 + k) * es]) : 0.0f);
    }
    c.sync();
    if (tid < nrows) {
      const float* row = sm + tid * stage_ld;
      // announce the reads to the host executor's race check (on the GPU these unused loads are
      // dropped; a local copy of the row would be spilled to local memory by the pooling kernels)
      for (int k = 0; k < n; ++k) (void)c.ld(row + k);
      s = f(s, row, n);
    }
  }
  return s;
}

// ---- weight_by_value_norm ---------------------------------------------------------------------------
struct value_l1_step {
  KVEVICT_HOST_DEVICE float operator()(float acc, const float* x, int k) const { return value_l1_accumulate(acc, x, k, 1); }
};

/// Item (KV head h, tile of stage_rows value tokens): the max (max_nan, from 0) of the tile's norms
/// among the head's first lengths[h] tokens -> partial[h * tiles + tile]. Heads with a bad length
/// are skipped (their consumer skips them too).
template <class VE>
struct value_norm_max_partial_op {
  static constexpr int threads = stage_rows;
  struct shared : staged_rows_shared {
    float red[stage_rows];
  };
  template <class Ctx>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared& sh, pp_values<VE> vals, const std::int32_t* lengths,
                                       float* partial, index_t hkv, index_t tiles) {
    const int tid = static_cast<int>(c.thread());
    for (index_t item = c.block(); item < hkv * tiles; item += c.grid_dim()) {
      const index_t h = item / tiles, tile = item % tiles, t0 = tile * stage_rows;
      index_t len = 0;
      if (!simt_row_length(c, lengths, h, vals.tv, len, nullptr, false)) continue;
      const int n = len - t0 <= 0 ? 0 : len - t0 < stage_rows ? static_cast<int>(len - t0) : stage_rows;
      const float s = simt_staged_row_reduce(c, vals.v + h * vals.vs0 + t0 * vals.vs1, vals.vs1, vals.vs2, n, vals.d,
                                             sh.sm, value_l1_step{});
      c.sync();                                  // the previous item's readers of red are done
      c.st(sh.red + tid, tid < n ? s : 0.0f);  // 0: the identity of max_nan over norms (>= 0 or NaN)
      for (int off = stage_rows / 2; off > 0; off /= 2) {
        c.sync();
        if (tid < off) {
          const float m = max_nan(c.ld(sh.red + tid), c.ld(sh.red + tid + off));
          c.st(sh.red + tid, m);
        }
      }
      if (tid == 0) partial[h * tiles + tile] = c.ld(sh.red);  // written by thread 0 itself
    }
  }
};

/// One warp per KV head: factors[h] = max_nan over the head's partial maxima (lane-strided, then a
/// shuffle tree).
struct value_norm_max_final_op {
  static constexpr int threads = 256;
  using shared = simt_no_shared;
  template <class Ctx>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared&, const float* partial, index_t hkv, index_t tiles,
                                       float* factors) {
    const int lane = c.lane();
    const index_t wpb = c.block_dim() / 32, warps = c.grid_dim() * wpb;
    // every lane of a warp runs the same iterations (h is uniform per warp): full-warp shuffles
    for (index_t h = c.block() * wpb + c.warp(); h < hkv; h += warps) {
      float m = 0.0f;
      for (index_t k = lane; k < tiles; k += 32) m = max_nan(m, partial[h * tiles + k]);
      for (int off = 16; off > 0; off /= 2) m = max_nan(m, c.shfl_down(m, off));
      if (lane == 0) factors[h] = m;
    }
  }
};

/// per_token: item (KV head, tile of stage_rows tokens), the norms staged, then every row of the
/// head's group scaled.
template <class VE>
struct weight_per_token_op {
  static constexpr int threads = stage_rows;
  using shared = staged_rows_shared;
  template <class Ctx>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared& sh, float* s, index_t s0, index_t s1, index_t cols,
                                       index_t group, pp_values<VE> vals, const std::int32_t* lengths, index_t hkv,
                                       int* bad) {
    const int tid = static_cast<int>(c.thread());
    const index_t tiles = stage_tiles(cols);
    for (index_t item = c.block(); item < hkv * tiles; item += c.grid_dim()) {
      const index_t h = item / tiles, t0 = (item % tiles) * stage_rows;
      index_t len = 0;
      if (!simt_row_length(c, lengths, h, vals.tv, len, bad, t0 == 0 && tid == 0)) continue;
      const index_t n = cols < len ? cols : len;
      if (t0 >= n) continue;
      const int m = n - t0 < stage_rows ? static_cast<int>(n - t0) : stage_rows;
      const float norm = simt_staged_row_reduce(c, vals.v + h * vals.vs0 + t0 * vals.vs1, vals.vs1, vals.vs2, m, vals.d,
                                                sh.sm, value_l1_step{});
      if (tid < m)
        for (index_t r = h * group; r < (h + 1) * group; ++r) {
          float& v = s[r * s0 + (t0 + tid) * s1];
          v = mul_rn(v, norm);
        }
    }
  }
};

/// head_max: one thread per score, times its head's factor.
struct weight_head_max_op {
  static constexpr int threads = 256;
  using shared = simt_no_shared;
  template <class Ctx>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared&, float* s, index_t s0, index_t s1, index_t rows, index_t cols,
                                       index_t group, const float* factors, const std::int32_t* lengths, index_t tv,
                                       int* bad) {
    const index_t items = rows * cols, stride = c.grid_dim() * c.block_dim();
    for (index_t it = c.block() * c.block_dim() + c.thread(); it < items; it += stride) {
      const index_t r = it / cols, t = it % cols, h = r / group;
      index_t len = 0;
      if (!simt_row_length(c, lengths, h, tv, len, bad, t == 0 && r == h * group) || t >= len) continue;
      float& v = s[r * s0 + t * s1];
      v = mul_rn(v, factors[h]);
    }
  }
};

/// The head maxima of value norms into factors[hkv] (partial: hkv x stage_tiles(tv) floats).
template <class L, class VE>
void value_norm_max_launch(L& l, const pp_values<VE>& vals, const std::int32_t* lengths, index_t hkv, float* partial,
                           float* factors, index_t cap = index_t(1) << 20) {
  const index_t tiles = stage_tiles(vals.tv);
  if (hkv == 0) return;
  if (tiles > 0)
    l.template run<value_norm_max_partial_op<VE>>(simt_shape{simt_grid(hkv * tiles, cap), stage_rows}, vals, lengths,
                                                  partial, hkv, tiles);
  l.template run<value_norm_max_final_op>(simt_shape{simt_grid((hkv + 7) / 8, cap), 256}, static_cast<const float*>(partial),
                                          hkv, tiles, factors);
}

/// weight_by_value_norm's kernels after the host-side checks (rows, cols > 0): per_token one
/// kernel; head_max the value-norm maxima, then the scaling.
template <class L, class VE>
void weight_launch(L& l, float* s, index_t s0, index_t s1, index_t rows, index_t cols, const pp_values<VE>& vals,
                   index_t hkv, bool head_max, const std::int32_t* lengths, int* bad, float* partial, float* factors,
                   index_t cap = index_t(1) << 20) {
  const index_t group = rows / hkv;
  if (!head_max) {
    l.template run<weight_per_token_op<VE>>(simt_shape{simt_grid(hkv * stage_tiles(cols), cap), stage_rows}, s, s0,
                                            s1, cols, group, vals, lengths, hkv, bad);
    return;
  }
  value_norm_max_launch(l, vals, lengths, hkv, partial, factors, cap);
  l.template run<weight_head_max_op>(simt_shape{simt_grid((rows * cols + 255) / 256, cap), 256}, s, s0, s1, rows, cols,
                                     group, static_cast<const float*>(factors), lengths, vals.tv, bad);
}

// ---- key_norm_scores and position_scores --------------------------------------------------------------
struct key_sq_step {
  KVEVICT_HOST_DEVICE float operator()(float acc, const float* x, int m) const { return key_sq_accumulate(acc, x, m, 1); }
};

/// Knorm: item (KV head, tile of stage_rows tokens), the key rows staged through shared memory,
/// thread t summing row t's squares in order k = 0..d-1 (key_sq_accumulate), then -sqrt.
template <class KE>
struct key_norm_op {
  static constexpr int threads = stage_rows;
  using shared = staged_rows_shared;
  template <class Ctx>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared& sh, kv_view<const KE> keys, float* out, index_t os0,
                                       index_t os1) {
    const index_t tokens = keys.extent(1), tiles = stage_tiles(tokens);
    const index_t items = keys.extent(0) * tiles;
    for (index_t item = c.block(); item < items; item += c.grid_dim()) {
      const index_t h = item / tiles, t0 = (item % tiles) * stage_rows;
      const int n = tokens - t0 < stage_rows ? static_cast<int>(tokens - t0) : stage_rows;
      const KE* base = keys.data_handle() + h * keys.stride(0) + t0 * keys.stride(1);
      const float s = simt_staged_row_reduce(c, base, keys.stride(1), keys.stride(2), n, keys.extent(2), sh.sm,
                                             key_sq_step{});
      if (c.thread() < n) out[h * os0 + (t0 + c.thread()) * os1] = -sqrt_t(s);
    }
  }
};
template <class KE>
inline simt_shape key_norm_shape(const kv_view<const KE>& keys, index_t cap = index_t(1) << 20) {
  return {simt_grid(keys.extent(0) * stage_tiles(keys.extent(1)), cap), stage_rows};
}

/// position_scores: out[h][t] = t, one thread per element, grid-stride.
struct position_op {
  static constexpr int threads = 256;
  using shared = simt_no_shared;
  template <class Ctx>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared&, float* out, index_t os0, index_t os1, index_t R, index_t T) {
    const index_t items = R * T, stride = c.grid_dim() * c.block_dim();
    for (index_t it = c.block() * c.block_dim() + c.thread(); it < items; it += stride)
      out[(it / T) * os0 + (it % T) * os1] = static_cast<float>(it % T);
  }
};
inline simt_shape position_shape(index_t R, index_t T, index_t cap = index_t(1) << 20) {
  return {simt_grid((R * T + 255) / 256, cap), 256};
}

}  // namespace kvevict::detail
