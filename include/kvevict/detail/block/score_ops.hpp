// The CUDA attention-score kernels (statistics pass, merge, columns pass) as ops over the SIMT
// context (detail/block/simt.hpp, simt_bodies.hpp) and their launch sequence, written once for both
// launchers: the CUDA overloads of kvevict/cuda/score.cuh call attention_scores_launch with
// cuda_launcher (one generic __global__ per op), the host tests with simt_launcher (the host SIMT
// executor: fibers, real barriers and warp shuffles, shared-memory race checks). Not API.
//
// The decomposition and the per-element arithmetic are those of detail/block/score_device.hpp, in
// the host kernels' summation order (docs/score.md "Summation order": the results equal seq's bits):
//   cs_stats_op    item (KV head, row block, split = host chunk of cs_chunk columns): the logits of up
//                  to cs_rows rows of the GQA group against each key tile of the chunk (thread (tr, tk):
//                  8 rows x 4 keys in registers, the head dimension staged through shared memory
//                  cs_dchunk elements at a time), in two sweeps: the chunk max, then the host's eight
//                  lane sums of e^(l - max) (threads 2r and 2r + 1 four lanes each, joined by a
//                  shuffle) -> part[row][chunk]
//   cs_merge_op    one thread per row: its chunks' statistics merged in order -> rowst[row]
//   cs_columns_op  item (KV head, output column tile): the probabilities of each block of the group's
//                  rows (e^(l - m_c) times the chunk's factor), per (query head, column) pushed in row
//                  order, finalised, written, combined over the group's heads in order (GQA output)
// Shared memory is read and written through the context (ld / st: race-checked on the host; on the
// GPU plain accesses, the staged operands read as float4 and the logit tile stored as float2).
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/detail/base/checks.hpp>
#include <kvevict/detail/base/paged_checks.hpp>
#include <kvevict/detail/base/score_checks.hpp>
#include <kvevict/detail/base/softmax.hpp>
#include <kvevict/detail/block/paged_block.hpp>
#include <kvevict/detail/block/score_device.hpp>
#include <kvevict/detail/block/simt_bodies.hpp>
#include <kvevict/detail/block/view_args.hpp>
#include <kvevict/gqa_types.hpp>
#include <kvevict/paged_types.hpp>
#include <kvevict/score_types.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>
#include <kvevict/workspace.hpp>

// Full unrolling of the register-tile loops in device code (acc stays in registers); nothing elsewhere.
#if defined(__CUDA_ARCH__)
#  define KVEVICT_CS_UNROLL _Pragma("unroll")
#else
#  define KVEVICT_CS_UNROLL
#endif

namespace kvevict::detail {

/// Vectors of the staged operands (16-byte reads) and of the logit tile (8-byte stores): CUDA's
/// float4 / float2 under nvcc, layout-equal structs elsewhere.
#if defined(__CUDACC__)
using cs_f4 = float4;
using cs_f2 = float2;
#else
struct alignas(16) cs_f4 {
  float x, y, z, w;
};
struct alignas(8) cs_f2 {
  float x, y;
};
#endif

/// The keys of dense views: KV head g's columns are the P prefix keys, then the block keys.
template <class KE>
struct cs_dense_keys {
  const KE* pk;
  index_t ps0, ps1, ps2;
  const KE* bk;
  index_t bs0, bs1, bs2;
  index_t p;
  /// Prefix columns of KV head (row) g: P for every head.
  KVEVICT_HOST_DEVICE index_t prefix(index_t) const { return p; }
  /// KV head g's keys: key(col, k) is element k of column col, widened to fp32.
  struct row_keys {
    const KE* pk;
    const KE* bk;
    index_t ps1, ps2, bs1, bs2, p;
    KVEVICT_HOST_DEVICE float key(index_t col, index_t k) const {
      return col < p ? widen(pk[col * ps1 + k * ps2]) : widen(bk[(col - p) * bs1 + k * bs2]);
    }
  };
  KVEVICT_HOST_DEVICE row_keys row(index_t g) const {
    return {pk + g * ps0, bk != nullptr ? bk + g * bs0 : bk, ps1, ps2, bs1, bs2, p};
  }
};

/// The keys of a paged layer (the window scores of paged_window_scores): row g (sequence, KV head)
/// holding n tokens has prefix columns [0, n - w) and block columns [n - w, n), token j read through
/// the row's page list. rowp[g] = n - w, or -1 for a row the table does not describe (cs_paged_rows_op).
template <class T>
struct cs_paged_keys {
  paged_layer<T> layer;
  const index_t* rowp;
  KVEVICT_HOST_DEVICE index_t prefix(index_t g) const { return rowp[g]; }
  struct row_keys {
    paged_layer<T> layer;
    index_t g;
    KVEVICT_HOST_DEVICE float key(index_t col, index_t k) const { return widen(layer.key(g, col)[k]); }
  };
  KVEVICT_HOST_DEVICE row_keys row(index_t g) const { return {layer, g}; }
};

/// Everything the score kernels read: raw pointers and strides (elements), the keys, shapes (P is
/// the keys' per-head prefix), options, plan.
template <class QE, class Keys>
struct cuda_score_args {
  const QE* q;
  index_t qs0, qs1, qs2;
  Keys keys;
  index_t hkv, group, w, d;
  bool has_block;
  bool out_all;  ///< output columns: the P prefix columns (false) or all P (+ w) columns (true)
  float scale;
  score_reduce reduce;
  float gamma;
  variance_estimator variance;
  index_t rows_g, rows_total, tiles, tiles_per_split, splits, row_blocks, out_tiles;
  float* out_h;  // [H_q][out_cols] or null
  index_t oh0, oh1;
  float* out_kv;  // [H_kv][out_cols] or null
  index_t ok0, ok1;
  gqa_op op;
  softmax_stats* part;   // [rows_total][splits]
  softmax_stats* rowst;  // [rows_total]

  /// Columns KV head g sees (prefix p, then the block) and the output columns of head g.
  KVEVICT_HOST_DEVICE index_t cols_of(index_t p) const { return has_block ? p + w : p; }
  KVEVICT_HOST_DEVICE index_t out_cols_of(index_t p) const { return out_all ? cols_of(p) : p; }
};

/// The logits of `nrows` (<= cs_rows) query rows, whose element k is q[qoff[row] + k * qs2], against
/// keys j0 .. j0 + cs_keys - 1 of KV head g: thread (tr, tk) accumulates rows tr*8 .. tr*8+7 x keys
/// tk*4 .. tk*4+3 in registers, the head dimension staged through shared memory cs_dchunk elements
/// at a time (each logit is still one sequential sum over k = 0..d-1). Rows >= nrows and columns
/// >= cols give 0 (never used). Opens with a block barrier: sm may be in use until then.
template <bool Fused, class Ctx, class QE, class Keys>
KVEVICT_HOST_DEVICE inline void cs_block_logits(Ctx& c, const cuda_score_args<QE, Keys>& a, float* sm,
                                                const index_t* qoff, int nrows, index_t g, index_t j0,
                                                float (&acc)[cs_thread_rows][cs_thread_keys]) {
  constexpr int key_threads = cs_keys / cs_thread_keys;
  const int tid = static_cast<int>(c.thread()), tr = tid / key_threads, tk = tid % key_threads;
  float* const qs = sm;                        // [cs_dchunk][cs_q_ld]
  float* const ks = sm + cs_dchunk * cs_q_ld;  // [cs_dchunk][cs_k_ld]
  KVEVICT_CS_UNROLL
  for (int r = 0; r < cs_thread_rows; ++r)
    KVEVICT_CS_UNROLL
    for (int k = 0; k < cs_thread_keys; ++k) acc[r][k] = 0.0f;
  const bool active = tr * cs_thread_rows < nrows;  // whole warps of padding rows skip the products
  const index_t cols = a.cols_of(a.keys.prefix(g));
  const auto keys = a.keys.row(g);
  for (index_t d0 = 0; d0 < a.d; d0 += cs_dchunk) {
    const int n = a.d - d0 < cs_dchunk ? static_cast<int>(a.d - d0) : cs_dchunk;
    c.sync();
    for (int e = tid; e < cs_rows * cs_dchunk; e += cs_threads) {
      const cs_stage_slot sl = cs_stage_slot_of(e);
      const int lr = sl.row, dd = sl.dd;
      c.st(qs + dd * cs_q_ld + lr, lr < nrows && dd < n ? widen(a.q[c.ld(qoff + lr) + (d0 + dd) * a.qs2]) : 0.0f);
    }
    for (int e = tid; e < cs_keys * cs_dchunk; e += cs_threads) {
      const cs_stage_slot sl = cs_stage_slot_of(e);
      const int kk = sl.row, dd = sl.dd;
      const index_t col = j0 + kk;
      c.st(ks + dd * cs_k_ld + kk, col < cols && dd < n ? keys.key(col, d0 + dd) : 0.0f);
    }
    c.sync();
    if (active) {
      for (int dd = 0; dd < n; ++dd) {
        const cs_f4* qrow = reinterpret_cast<const cs_f4*>(qs + dd * cs_q_ld + tr * cs_thread_rows);
        const cs_f4 qa = c.ld(qrow), qb = c.ld(qrow + 1);
        const cs_f4 kb = c.ld(reinterpret_cast<const cs_f4*>(ks + dd * cs_k_ld + tk * cs_thread_keys));
        const float qv[cs_thread_rows] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
        const float kv[cs_thread_keys] = {kb.x, kb.y, kb.z, kb.w};
        KVEVICT_CS_UNROLL
        for (int r = 0; r < cs_thread_rows; ++r)
          KVEVICT_CS_UNROLL
          for (int k = 0; k < cs_thread_keys; ++k) acc[r][k] = logit_term<Fused>(acc[r][k], qv[r], kv[k]);
      }
    }
  }
}

/// What the two passes' ops share: 256 threads, two blocks per SM (__launch_bounds__(256, 2)), the
/// logit / staging tile and the staged rows' query offsets in shared memory.
struct cs_pass_op_base {
  static constexpr int threads = cs_threads;
  static constexpr int min_blocks = 2;
  struct tile_shared {
    alignas(16) float sm[cs_tile_floats];
    index_t qoff[cs_rows];
  };
};

/// Pass 1, one key tile: the block's logits against keys j0 .. j0 + cs_keys - 1, scaled, stored in
/// sm[row][column] (row stride cs_l_ld). Opens and ends with a block barrier.
template <bool Fused, class Ctx, class QE, class Keys>
KVEVICT_HOST_DEVICE inline void cs_logit_tile(Ctx& c, const cuda_score_args<QE, Keys>& a, float* sm,
                                              const index_t* qoff, int nrows, index_t g, index_t j0) {
  constexpr int key_threads = cs_keys / cs_thread_keys;
  const int tid = static_cast<int>(c.thread()), tr = tid / key_threads, tk = tid % key_threads;
  float acc[cs_thread_rows][cs_thread_keys];
  cs_block_logits<Fused>(c, a, sm, qoff, nrows, g, j0, acc);
  c.sync();  // the staged queries and keys are no longer read
  KVEVICT_CS_UNROLL
  for (int r = 0; r < cs_thread_rows; ++r) {  // float2 stores: 2-way at most (scalar: 4-way)
    cs_f2* const dst = reinterpret_cast<cs_f2*>(sm + (tr * cs_thread_rows + r) * cs_l_ld + tk * cs_thread_keys);
    c.st(dst, cs_f2{mul_rn(acc[r][0], a.scale), mul_rn(acc[r][1], a.scale)});
    c.st(dst + 1, cs_f2{mul_rn(acc[r][2], a.scale), mul_rn(acc[r][3], a.scale)});
  }
  c.sync();
}

/// Pass 1: item (g, row block rb, split s = host chunk s) computes each row's statistics of the
/// chunk as the host's score_chunk_exp does: sweep 1 over the chunk's key tiles takes the max m_c of
/// the row's visible logits (threads 2r and 2r + 1 each over half of every tile, then the larger of
/// the two: exact); sweep 2 computes the logits again and adds e^(l - m_c) into the host's lanes
/// (thread 2r + h owns lanes 4h .. 4h + 3: lane j % 8 for the chunk's whole groups of 8 visible
/// columns, in column order; the remaining < 8 columns into lane 0 by thread 2r), then thread 2r
/// adds lanes 0..7 in order -> part[row][s] = (m_c, L_c). Rows that do not see the chunk write nothing.
template <bool Fused, class QE, class Keys>
struct cs_stats_op : cs_pass_op_base {
  using shared = tile_shared;
  template <class Ctx>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared& sh, const cuda_score_args<QE, Keys> a) {
    constexpr int half_lanes = cs_chunk_lanes / 2;
    const int tid = static_cast<int>(c.thread());
    const int srow = tid / 2, half = tid % 2;
    const index_t items = a.hkv * a.row_blocks * a.splits;
    for (index_t item = c.block(); item < items; item += c.grid_dim()) {
      const index_t s = item % a.splits, rest = item / a.splits, rb = rest % a.row_blocks, g = rest / a.row_blocks;
      const index_t p = a.keys.prefix(g);
      if (p < 0) continue;  // a paged row its table does not describe (counted by cs_paged_rows_op)
      const index_t row0 = rb * cs_rows;
      const int nrows = a.rows_g - row0 < cs_rows ? static_cast<int>(a.rows_g - row0) : cs_rows;
      const index_t max_vis = score_block_max_visible(row0, nrows, a.w, p, a.has_block);
      const index_t t0 = s * a.tiles_per_split;
      if (t0 * cs_keys >= max_vis) continue;  // causal block: no row of the block sees this chunk
      c.sync();  // the previous item's readers of qoff and sm are done
      for (int lr = tid; lr < nrows; lr += cs_threads) {
        const index_t r = row0 + lr;
        c.st(sh.qoff + lr, (g * a.group + r / a.w) * a.qs0 + (r % a.w) * a.qs1);
      }
      const index_t my_vis = srow < nrows ? score_row_visible(p, a.has_block, (row0 + srow) % a.w) : 0;
      const index_t t_end = t0 + a.tiles_per_split < a.tiles ? t0 + a.tiles_per_split : a.tiles;
      const float* const lrow = sh.sm + srow * cs_l_ld;
      // sweep 1: the chunk max of each row (order keys: NaN and -0 ranked as the host ranks them)
      std::int32_t mk = float_order_key(neg_inf_f());
      for (index_t t = t0; t < t_end && t * cs_keys < max_vis; ++t) {
        cs_logit_tile<Fused>(c, a, sh.sm, sh.qoff, nrows, g, t * cs_keys);
        const int run_n = score_run_count(my_vis, t * cs_keys, half);
        for (int k = 0; k < run_n; ++k) {
          const std::int32_t key = float_order_key(c.ld(lrow + half * cs_half + k));
          mk = key > mk ? key : mk;
        }
      }
      const std::int32_t other_mk = c.shfl_xor(mk, 1);
      const float m = float_from_order_key(other_mk > mk ? other_mk : mk);
      // sweep 2: the lanes of e^(l - m), in the host's order
      const int n = score_chunk_count(my_vis, s), full = n - n % cs_chunk_lanes;
      float lane[half_lanes];
      KVEVICT_CS_UNROLL
      for (int l = 0; l < half_lanes; ++l) lane[l] = 0.0f;
      for (index_t t = t0; t < t_end && t * cs_keys < max_vis; ++t) {
        cs_logit_tile<Fused>(c, a, sh.sm, sh.qoff, nrows, g, t * cs_keys);
        const int base = static_cast<int>((t - t0) * cs_keys);  // the tile's first column in the chunk
        KVEVICT_CS_UNROLL
        for (int l = 0; l < half_lanes; ++l)
          for (int k = half * half_lanes + l; k < cs_keys && base + k < full; k += cs_chunk_lanes)
            lane[l] = add_rn(lane[l], score_chunk_e(c.ld(lrow + k), m));
        if (half == 0)  // the last n % 8 visible columns, after lane 0's whole groups
          for (int k = full > base ? full - base : 0; k < cs_keys && base + k < n; ++k)
            lane[0] = add_rn(lane[0], score_chunk_e(c.ld(lrow + k), m));
      }
      float sm[cs_chunk_lanes];
      KVEVICT_CS_UNROLL
      for (int l = 0; l < half_lanes; ++l) {
        const float o = c.shfl_xor(lane[l], 1);
        sm[l] = half == 0 ? lane[l] : o;
        sm[half_lanes + l] = half == 0 ? o : lane[l];
      }
      if (half == 0 && n > 0) a.part[(g * a.rows_g + row0 + srow) * a.splits + s] = softmax_stats{m, score_lanes_total(sm)};
    }
  }
};

/// The merge: one thread per row folds the statistics of the chunks the row sees, in order, into the
/// empty statistics (the host's running st[r]) -> rowst[row]. Rows of a paged row the table does not
/// describe are skipped.
template <class QE, class Keys>
struct cs_merge_op {
  static constexpr int threads = cs_threads;
  using shared = simt_no_shared;
  template <class Ctx>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared&, const cuda_score_args<QE, Keys> a) {
    for (index_t row = c.block() * cs_threads + c.thread(); row < a.rows_total; row += c.grid_dim() * cs_threads) {
      const index_t g = row / a.rows_g, p = a.keys.prefix(g);
      if (p < 0) continue;
      const index_t vis = score_row_visible(p, a.has_block, (row % a.rows_g) % a.w);
      const index_t chunks = (vis + cs_chunk - 1) / cs_chunk;
      softmax_stats s = softmax_empty();
      for (index_t k = 0; k < chunks; ++k) s = softmax_merge(s, a.part[row * a.splits + k]);
      a.rowst[row] = s;
    }
  }
};

/// Pass 2, one block of rows [row0, row0 + nrows) of KV head g's group against output columns
/// [c0, c0 + ncols) (inside chunk c0 / cs_chunk): the probabilities p = e^(l - m_c) * (e^(m_c - M) / L),
/// the host's, (0 where a row does not see a column) in sm[row][column]; rst[row] holds (m_c, factor).
/// Returns false, without touching sm, when no row of the block sees any of the columns (every p is
/// 0). Opens with a block barrier; ends with one when it returns true.
template <bool Fused, class Ctx, class QE, class Keys>
KVEVICT_HOST_DEVICE inline bool cs_prob_tile(Ctx& c, const cuda_score_args<QE, Keys>& a, float* sm, index_t* qoff,
                                             index_t* rvis, softmax_stats* rst, index_t g, index_t row0, int nrows,
                                             index_t c0, int ncols) {
  c.sync();
  const index_t p = a.keys.prefix(g);
  if (score_block_max_visible(row0, nrows, a.w, p, a.has_block) <= c0) return false;
  const int tid = static_cast<int>(c.thread());
  for (int lr = tid; lr < nrows; lr += cs_threads) {
    const index_t r = row0 + lr, i = r % a.w;
    c.st(qoff + lr, (g * a.group + r / a.w) * a.qs0 + i * a.qs1);
    const index_t vis = score_row_visible(p, a.has_block, i);
    c.st(rvis + lr, vis);
    softmax_stats cf{0.0f, 0.0f};  // (chunk max, chunk factor); unused where the row sees no column
    if (vis > c0) {
      cf.max = a.part[(g * a.rows_g + r) * a.splits + c0 / cs_chunk].max;
      cf.sum = score_chunk_scale(cf.max, a.rowst[g * a.rows_g + r]);
    }
    c.st(rst + lr, cf);
  }
  float acc[cs_thread_rows][cs_thread_keys];
  cs_block_logits<Fused>(c, a, sm, qoff, nrows, g, c0, acc);
  c.sync();
  constexpr int key_threads = cs_keys / cs_thread_keys;
  const int tr = tid / key_threads, tk = tid % key_threads;
  KVEVICT_CS_UNROLL
  for (int r = 0; r < cs_thread_rows; ++r) {
    const int lr = tr * cs_thread_rows + r;
    float pv[cs_thread_keys];
    KVEVICT_CS_UNROLL
    for (int k = 0; k < cs_thread_keys; ++k) {
      const int kk = tk * cs_thread_keys + k;
      pv[k] = 0.0f;
      if (lr < nrows && kk < ncols && c0 + kk < c.ld(rvis + lr)) {
        const softmax_stats cf = c.ld(rst + lr);
        pv[k] = mul_rn(score_chunk_e(mul_rn(acc[r][k], a.scale), cf.max), cf.sum);
      }
    }
    cs_f2* const dst = reinterpret_cast<cs_f2*>(sm + lr * cs_l_ld + tk * cs_thread_keys);  // 2-way at most
    c.st(dst, cs_f2{pv[0], pv[1]});
    c.st(dst + 1, cs_f2{pv[2], pv[3]});
  }
  c.sync();
  return true;
}

/// Pass 2: item (g, output column tile). For every block of the group's rows (whole heads when
/// w <= cs_rows, else cs_rows-row pieces of one head), the probability tile, then per (query head,
/// column) the rows pushed in order i = 0..w-1, finalised, written, and combined over the group's
/// heads in order (GQA output).
template <bool Fused, class QE, class Keys>
struct cs_columns_op : cs_pass_op_base {
  struct shared : tile_shared {
    index_t rvis[cs_rows];
    softmax_stats rst[cs_rows];
  };
  template <class Ctx>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared& sh, const cuda_score_args<QE, Keys> a) {
    float* const sm = sh.sm;
    const int tid = static_cast<int>(c.thread());
    const bool welford = a.reduce == score_reduce::mean_plus_variance;
    const bool want_kv = a.out_kv != nullptr;
    const index_t hpb = score_heads_per_block(a.w);
    const index_t items = a.hkv * a.out_tiles;
    for (index_t item = c.block(); item < items; item += c.grid_dim()) {
      const index_t g = item / a.out_tiles, c0 = (item % a.out_tiles) * cs_keys;
      // the head's prefix is read again where needed (a kernel parameter for dense keys): fewer live registers
      const index_t p0 = a.keys.prefix(g), out_cols = a.out_cols_of(p0);
      if (p0 < 0 || c0 >= out_cols) continue;  // a bad paged row, or a tile past a shorter paged row
      const int ncols = out_cols - c0 < cs_keys ? static_cast<int>(out_cols - c0) : cs_keys;
      float gacc = 0.0f;  // thread tid < ncols: the GQA accumulator of column c0 + tid
      if (hpb > 0) {
        for (index_t hb0 = 0; hb0 < a.group; hb0 += hpb) {
          const int nh = a.group - hb0 < hpb ? static_cast<int>(a.group - hb0) : static_cast<int>(hpb);
          const int nrows = nh * static_cast<int>(a.w);
          const bool any = cs_prob_tile<Fused>(c, a, sm, sh.qoff, sh.rvis, sh.rst, g, hb0 * a.w, nrows, c0, ncols);
          for (int pair = tid; pair < nh * cs_keys; pair += cs_threads) {
            const int hl = pair / cs_keys, j = pair % cs_keys;
            if (j >= ncols) continue;
            float acc = 0.0f, m2 = 0.0f;
            if (any || welford)
              for (index_t i = 0; i < a.w; ++i)
                score_column_push(welford, acc, m2, any ? c.ld(sm + (hl * a.w + i) * cs_l_ld + j) : 0.0f, i);
            const index_t col = c0 + j;
            const float v =
                score_finalize(a.reduce, acc, m2, a.w, score_column_seen(a.keys.prefix(g), a.w, col), a.gamma,
                               a.variance);
            if (a.out_h != nullptr) a.out_h[(g * a.group + hb0 + hl) * a.oh0 + col * a.oh1] = v;
            if (want_kv) c.st(sm + hl * a.w * cs_l_ld + j, v);  // read back below; only this thread wrote it
          }
          if (want_kv) {
            c.sync();
            if (tid < ncols)
              for (int hl = 0; hl < nh; ++hl) {
                const float v = c.ld(sm + hl * a.w * cs_l_ld + tid);
                gacc = hb0 + hl == 0 ? v : gqa_combine(a.op, gacc, v);
              }
          }
        }
      } else {
        for (index_t hh = 0; hh < a.group; ++hh) {
          float acc = 0.0f, m2 = 0.0f;
          for (index_t b0 = 0; b0 < a.w; b0 += cs_rows) {
            const int nrows = a.w - b0 < cs_rows ? static_cast<int>(a.w - b0) : cs_rows;
            const bool any =
                cs_prob_tile<Fused>(c, a, sm, sh.qoff, sh.rvis, sh.rst, g, hh * a.w + b0, nrows, c0, ncols);
            if (tid < ncols && (any || welford))
              for (int lr = 0; lr < nrows; ++lr)
                score_column_push(welford, acc, m2, any ? c.ld(sm + lr * cs_l_ld + tid) : 0.0f, b0 + lr);
          }
          if (tid < ncols) {
            const index_t col = c0 + tid;
            const float v =
                score_finalize(a.reduce, acc, m2, a.w, score_column_seen(a.keys.prefix(g), a.w, col), a.gamma,
                               a.variance);
            if (a.out_h != nullptr) a.out_h[(g * a.group + hh) * a.oh0 + col * a.oh1] = v;
            gacc = hh == 0 ? v : gqa_combine(a.op, gacc, v);
          }
        }
      }
      if (want_kv && tid < ncols) a.out_kv[g * a.ok0 + (c0 + tid) * a.ok1] = gqa_finish(a.op, gacc, a.group);
    }
  }
};

/// The three launches of one attention_scores call, on either launcher (grid_cap bounds every grid:
/// the results do not depend on it; tests pass a small one to exercise the grid-stride loops).
template <bool Fused, class QE, class Keys, class Launcher>
void cs_launch(Launcher& l, const cuda_score_args<QE, Keys>& a, index_t grid_cap = index_t(1) << 20) {
  l.template run<cs_stats_op<Fused, QE, Keys>>(simt_shape{simt_grid(a.hkv * a.row_blocks * a.splits, grid_cap), cs_threads},
                                             a);
  l.template run<cs_merge_op<QE, Keys>>(
      simt_shape{simt_grid((a.rows_total + cs_threads - 1) / cs_threads, grid_cap), cs_threads}, a);
  l.template run<cs_columns_op<Fused, QE, Keys>>(simt_shape{simt_grid(a.hkv * a.out_tiles, grid_cap), cs_threads}, a);
}

/// The CUDA attention_scores' workspace (both phases): per-split and per-row softmax statistics.
inline status carve_cuda_score(const char* fn, workspace& ws, const cuda_score_plan& pl, softmax_stats*& part,
                               softmax_stats*& rowst) {
  workspace_carver carver(ws);
  part = carver.take<softmax_stats>(static_cast<std::size_t>(pl.part_entries));
  rowst = carver.take<softmax_stats>(static_cast<std::size_t>(pl.rows_total));
  return carver.finish(fn);
}

/// The arguments common to the dense and paged forms: queries, shape, options, plan, workspace.
template <class QE, class Keys>
void cs_fill_args(cuda_score_args<QE, Keys>& a, const kv_view<const QE>& q, const score_shape& sh,
                  const cuda_score_plan& pl, const score_options& opt, softmax_stats* part, softmax_stats* rowst) {
  view_args(q, a.q, a.qs0, a.qs1, a.qs2);
  a.hkv = sh.hkv;
  a.group = sh.group;
  a.w = sh.w;
  a.d = sh.d;
  a.has_block = sh.has_block;
  a.out_all = sh.out_cols == sh.cols;
  a.scale = sh.scale;
  a.reduce = opt.reduce;
  a.gamma = opt.gamma;
  a.variance = opt.variance;
  a.rows_g = pl.rows_g;
  a.rows_total = pl.rows_total;
  a.tiles = pl.tiles;
  a.tiles_per_split = pl.tiles_per_split;
  a.splits = pl.splits;
  a.row_blocks = pl.row_blocks;
  a.out_tiles = pl.out_tiles;
  a.part = part;
  a.rowst = rowst;
}

/// The CUDA attention_scores on launcher l: the checks (the host's, then `aligned(name, pointer)` on
/// every pointer: the device alignment check, or nothing on the host), the plan, the workspace, the
/// arguments, then the three launches. Per-head output out_h (unless it has 0 rows and kv_requested)
/// and/or the GQA-reduced out_kv (if kv_requested). Launch errors are the launcher's.
template <class QE, class KE, class Launcher, class Aligned>
status attention_scores_launch(const char* fn, Launcher& l, workspace& ws, const kv_view<const QE>& q,
                               const kv_view<const KE>& prefix, const kv_view<const KE>& block,
                               const matrix_view<float>& out_h, bool kv_requested, const matrix_view<float>& out_kv,
                               gqa_op op, const score_options& opt, const Aligned& aligned,
                               index_t grid_cap = index_t(1) << 20) {
  score_shape sh;
  KVEVICT_TRY(check_attention_inputs(fn, q, prefix, block, opt, sh));
  const bool want_h = !kv_requested || out_h.extent(0) != 0;
  if (kv_requested) {
    KVEVICT_TRY(check_gqa_op(fn, op));
    if (sh.hq == 0)
      return status::error(errc::shape_mismatch, "%s: there are no query heads to reduce over (H_q = 0)", fn);
    KVEVICT_TRY(check_score_output(fn, "out_kv", out_kv, sh.hkv, "KV heads", q, prefix, block, sh));
  }
  if (want_h) {
    const index_t kv_cols = sh.out_cols;
    KVEVICT_TRY(check_score_output(fn, kv_requested ? "out_per_head" : "out", out_h, sh.hq, "query heads", q, prefix,
                                   block, sh));
    if (kv_requested && sh.out_cols != kv_cols)
      return status::error(errc::shape_mismatch, "%s: out_per_head has %lld columns but out_kv has %lld", fn,
                           static_cast<long long>(sh.out_cols), static_cast<long long>(kv_cols));
    if (kv_requested && range_of(out_h).intersects(range_of(out_kv)))
      return status::error(errc::overlap, "%s: out_per_head overlaps out_kv in memory", fn);
  }
  KVEVICT_TRY(aligned("queries", q.data_handle()));
  KVEVICT_TRY(aligned("prefix_keys", prefix.data_handle()));
  if (sh.has_block) KVEVICT_TRY(aligned("block_keys", block.data_handle()));
  if (want_h) KVEVICT_TRY(aligned(kv_requested ? "out_per_head" : "out", out_h.data_handle()));
  if (kv_requested) KVEVICT_TRY(aligned("out_kv", out_kv.data_handle()));
  cuda_score_plan pl;
  KVEVICT_TRY(make_cuda_score_plan(fn, sh, pl));
  softmax_stats *part = nullptr, *rowst = nullptr;
  KVEVICT_TRY(carve_cuda_score(fn, ws, pl, part, rowst));
  if (ws.is_query() || pl.rows_total == 0) return {};

  cuda_score_args<QE, cs_dense_keys<KE>> a{};
  cs_fill_args(a, q, sh, pl, opt, part, rowst);
  a.keys = {prefix.data_handle(), prefix.stride(0), prefix.stride(1), prefix.stride(2),
            sh.has_block ? block.data_handle() : nullptr, sh.has_block ? block.stride(0) : 0,
            sh.has_block ? block.stride(1) : 0, sh.has_block ? block.stride(2) : 0, sh.p};
  view_args(out_h, a.out_h, a.oh0, a.oh1, want_h);
  view_args(out_kv, a.out_kv, a.ok0, a.ok1, kv_requested);
  a.op = op;
  if (opt.fused_multiply_add)
    cs_launch<true>(l, a, grid_cap);
  else
    cs_launch<false>(l, a, grid_cap);
  return {};
}

/// Paged window scores, step 1: block r (grid-stride) checks row r's table entries (paged_readable_row)
/// and length: rowp[r] = n - w for a row of n tokens, or -1 (counted into bad) if its table entries
/// are bad, it holds fewer than w tokens, or its output columns (n - w, or n with include_window)
/// exceed out's C.
template <class T>
struct cs_paged_rows_op {
  static constexpr int threads = 32;
  using shared = simt_no_shared;
  template <class Ctx>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared&, paged_layer<T> layer, index_t w, bool include_window,
                                       index_t C, index_t* rowp, simt_bad bad) {
    if (c.thread() != 0) return;
    for (index_t r = c.block(); r < layer.rows(); r += c.grid_dim()) {
      const index_t n = paged_readable_row(layer, r, include_window ? C : C + w);
      rowp[r] = n >= w ? n - w : -1;
      if (n < w) bad.add(c, 1);
    }
  }
};

/// paged_window_scores of the CUDA backend on launcher l (the host paged_window_scores' semantics):
/// row r = (sequence s, KV head h) of the layer is scored as window_scores of its n tokens (prefix
/// [0, n - w), block [n - w, n)) for its `group` query heads, into out rows r * group ...; columns
/// past a row's output are untouched. The plan is that of the widest row out allows (P = C, or
/// C - w with include_window), rows holding fewer tiles stop early, so each row's scores are
/// bit-identical to the dense window_scores of the row. Host-side checks: the layer's shape,
/// the queries, out and the options (`aligned` as in attention_scores_launch); the table is device
/// data: rows it does not describe are skipped and counted into bad. Workspace: the row prefixes
/// (8 B per row) and the statistics of the widest row's plan.
template <class QE, class T, class Launcher, class Aligned>
status paged_window_scores_launch(const char* fn, Launcher& l, workspace& ws, const kv_view<const QE>& q,
                                  const paged_layer<T>& layer, const matrix_view<float>& out,
                                  bool include_window, const score_options& opt, const Aligned& aligned, simt_bad bad,
                                  index_t grid_cap = index_t(1) << 20) {
  KVEVICT_TRY(check_paged_shape(fn, layer));
  KVEVICT_TRY(check_score_options(fn, opt));
  index_t group = 1;
  KVEVICT_TRY(check_paged_window_shape(fn, q, layer, out, group));
  const index_t R = layer.rows(), w = q.extent(1), C = out.extent(1);
  if (R > 0) {
    if (layer.table.indptr == nullptr || (layer.table.lists > 0 && layer.table.last_page_len == nullptr))
      return status::error(errc::null_pointer, "%s: table.indptr or table.last_page_len is null", fn);
    if (include_window && C < w)
      return status::error(errc::shape_mismatch, "%s: out has %lld columns, fewer than the window's %lld", fn,
                           static_cast<long long>(C), static_cast<long long>(w));
    const byte_range o = range_of(out);
    if (o.intersects(range_of(q)) || o.intersects(pool_range(layer.keys)) || o.intersects(pool_range(layer.values)))
      return status::error(errc::overlap, "%s: out overlaps the queries or the page pools", fn);
  }
  KVEVICT_TRY(aligned("window_queries", q.data_handle()));
  KVEVICT_TRY(aligned("out", out.data_handle()));
  KVEVICT_TRY(aligned("table.indptr", layer.table.indptr));
  KVEVICT_TRY(aligned("table.indices", layer.table.indices));
  KVEVICT_TRY(aligned("table.last_page_len", layer.table.last_page_len));
  KVEVICT_TRY(aligned("the key pool", layer.keys.data));
  score_shape sh;
  cuda_score_plan pl;
  if (R > 0) {
    const index_t pmax = include_window ? C - w : C;
    KVEVICT_TRY(score_shape_from_sizes(fn, R * group, R, w, pmax, layer.keys.dim, true, C, opt, sh));
    KVEVICT_TRY(make_cuda_score_plan(fn, sh, pl));
  }
  workspace_carver carver(ws);
  index_t* rowp = carver.take<index_t>(static_cast<std::size_t>(R));
  softmax_stats* part = carver.take<softmax_stats>(static_cast<std::size_t>(pl.part_entries));
  softmax_stats* rowst = carver.take<softmax_stats>(static_cast<std::size_t>(pl.rows_total));
  KVEVICT_TRY(carver.finish(fn));
  if (ws.is_query() || R == 0) return {};
  l.template run<cs_paged_rows_op<T>>(simt_shape{simt_grid(R, grid_cap), cs_paged_rows_op<T>::threads}, layer, w,
                                      include_window, C, rowp, bad);
  if (pl.rows_total == 0) return {};
  cuda_score_args<QE, cs_paged_keys<T>> a{};
  cs_fill_args(a, q, sh, pl, opt, part, rowst);
  a.keys = {layer, rowp};
  view_args(out, a.out_h, a.oh0, a.oh1);
  a.op = gqa_op::mean;
  if (opt.fused_multiply_add)
    cs_launch<true>(l, a, grid_cap);
  else
    cs_launch<false>(l, a, grid_cap);
  return {};
}

}  // namespace kvevict::detail

#undef KVEVICT_CS_UNROLL
