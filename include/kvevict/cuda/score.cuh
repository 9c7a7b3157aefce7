// CUDA overloads of <kvevict/score.hpp>: attention scores of a query block (window, external block,
// H2O, TOVA) and key norms, plus the GQA-reduced form of the attention scores in the same launch
// (attention_scores_gqa, window_scores_gqa). docs/cuda.md has the algorithm, launch shapes,
// memory traffic, costs, numerics and what was validated where.
//
// Same semantics, argument checks (the host's check functions) and error messages as the host
// overloads; views hold device pointers. Launches are asynchronous on the backend's stream; nothing
// synchronises the host or allocates: the two-phase workspace holds each row's softmax statistics.
//
// The attention matrix is never materialised: pass 1 computes each query row's softmax statistics
// (max, sum) tile by tile with the online merge of detail/base/softmax.hpp; pass 2 recomputes the logits
// tile by tile and adds the probabilities into the per-column reduction. One CTA per (KV head, key
// tile) holds the tile's keys in shared memory for every query row of the GQA group.
//
// Results are deterministic (fixed decomposition and summation order, no atomics) and bit-identical
// to the host emulation of the same decomposition (include/kvevict/detail/block/score_emulation.hpp); they differ
// from the host backends only by summation order, within the bound of docs/cuda.md. The
// GQA-reduced output equals gqa_reduce of the per-head output bit for bit.
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/cuda/error.cuh>
#include <kvevict/cuda/launch.cuh>
#include <kvevict/cuda/simt.cuh>
#include <kvevict/detail/block/simt_bodies.hpp>
#include <kvevict/detail/base/checks.hpp>
#include <kvevict/detail/block/score_device.hpp>
#include <kvevict/detail/base/softmax.hpp>
#include <kvevict/gqa.hpp>
#include <kvevict/numeric.hpp>
#include <kvevict/score.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>
#include <kvevict/workspace.hpp>

#include <type_traits>

namespace kvevict {
namespace detail {

/// Everything the score kernels read: raw pointers and strides (elements), shapes, options, plan.
template <class QE, class KE>
struct cuda_score_args {
  const QE* q;
  index_t qs0, qs1, qs2;
  const KE* pk;
  index_t ps0, ps1, ps2;
  const KE* bk;
  index_t bs0, bs1, bs2;
  index_t hkv, group, w, p, d, cols, out_cols;
  bool has_block;
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
};

/// The logits of `nrows` (<= cs_rows) query rows, whose element k is q[qoff[row] + k * qs2], against
/// keys j0 .. j0 + cs_keys - 1 of KV head g: thread (tr, tk) accumulates rows tr*8 .. tr*8+7 x keys
/// tk*4 .. tk*4+3 in registers, the head dimension staged through shared memory cs_dchunk elements
/// at a time (each logit is still one sequential sum over k = 0..d-1). Rows >= nrows and columns
/// >= cols give 0 (never used). Opens with a CTA barrier: sm may be in use until then.
template <bool Fused, class QE, class KE>
__device__ __forceinline__ void cs_block_logits(const cuda_score_args<QE, KE>& a, float* sm, const index_t* qoff,
                                                int nrows, index_t g, index_t j0,
                                                float (&acc)[cs_thread_rows][cs_thread_keys]) {
  constexpr int key_threads = cs_keys / cs_thread_keys;
  const int tid = static_cast<int>(threadIdx.x), tr = tid / key_threads, tk = tid % key_threads;
  float* const qs = sm;                        // [cs_dchunk][cs_q_ld]
  float* const ks = sm + cs_dchunk * cs_q_ld;  // [cs_dchunk][cs_k_ld]
#pragma unroll
  for (int r = 0; r < cs_thread_rows; ++r)
#pragma unroll
    for (int c = 0; c < cs_thread_keys; ++c) acc[r][c] = 0.0f;
  const bool active = tr * cs_thread_rows < nrows;  // whole warps of padding rows skip the products
  const KE* const pk = a.pk + g * a.ps0;
  const KE* const bk = a.has_block ? a.bk + g * a.bs0 : a.bk;
  for (index_t d0 = 0; d0 < a.d; d0 += cs_dchunk) {
    const int n = a.d - d0 < cs_dchunk ? static_cast<int>(a.d - d0) : cs_dchunk;
    __syncthreads();
    for (int e = tid; e < cs_rows * cs_dchunk; e += cs_threads) {
      const cs_stage_slot sl = cs_stage_slot_of(e);
      const int lr = sl.row, dd = sl.dd;
      qs[dd * cs_q_ld + lr] = lr < nrows && dd < n ? widen(a.q[qoff[lr] + (d0 + dd) * a.qs2]) : 0.0f;
    }
    for (int e = tid; e < cs_keys * cs_dchunk; e += cs_threads) {
      const cs_stage_slot sl = cs_stage_slot_of(e);
      const int kk = sl.row, dd = sl.dd;
      const index_t col = j0 + kk;
      float v = 0.0f;
      if (col < a.cols && dd < n)
        v = col < a.p ? widen(pk[col * a.ps1 + (d0 + dd) * a.ps2]) : widen(bk[(col - a.p) * a.bs1 + (d0 + dd) * a.bs2]);
      ks[dd * cs_k_ld + kk] = v;
    }
    __syncthreads();
    if (active) {
      for (int dd = 0; dd < n; ++dd) {
        const float4* qrow = reinterpret_cast<const float4*>(qs + dd * cs_q_ld + tr * cs_thread_rows);
        const float4 qa = qrow[0], qb = qrow[1];
        const float4 kb = *reinterpret_cast<const float4*>(ks + dd * cs_k_ld + tk * cs_thread_keys);
        const float qv[cs_thread_rows] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
        const float kv[cs_thread_keys] = {kb.x, kb.y, kb.z, kb.w};
#pragma unroll
        for (int r = 0; r < cs_thread_rows; ++r)
#pragma unroll
          for (int c = 0; c < cs_thread_keys; ++c) acc[r][c] = logit_term<Fused>(acc[r][c], qv[r], kv[c]);
      }
    }
  }
}

/// Pass 1: CTA item (g, row block rb, split s) merges, for each row of the block, the statistics of
/// key tiles [s * tiles_per_split, ...) in order: two runs of cs_half keys per tile (threads 2r and
/// 2r + 1), merged, then merged into the row's running statistics -> part[row][s].
template <bool Fused, class QE, class KE>
__global__ void __launch_bounds__(cs_threads, 2) cs_stats_kernel(const cuda_score_args<QE, KE> a) {
  __shared__ __align__(16) float sm[cs_tile_floats];
  __shared__ index_t qoff[cs_rows];
  constexpr int key_threads = cs_keys / cs_thread_keys;
  const int tid = static_cast<int>(threadIdx.x), tr = tid / key_threads, tk = tid % key_threads;
  const int srow = tid / 2, half = tid % 2;
  const index_t items = a.hkv * a.row_blocks * a.splits;
  for (index_t item = blockIdx.x; item < items; item += gridDim.x) {
    const index_t s = item % a.splits, rest = item / a.splits, rb = rest % a.row_blocks, g = rest / a.row_blocks;
    const index_t row0 = rb * cs_rows;
    const int nrows = a.rows_g - row0 < cs_rows ? static_cast<int>(a.rows_g - row0) : cs_rows;
    __syncthreads();  // the previous item's readers of qoff and sm are done
    for (int lr = tid; lr < nrows; lr += cs_threads) {
      const index_t r = row0 + lr;
      qoff[lr] = (g * a.group + r / a.w) * a.qs0 + (r % a.w) * a.qs1;
    }
    const index_t my_vis = srow < nrows ? score_row_visible(a.p, a.has_block, (row0 + srow) % a.w) : 0;
    const index_t max_vis = score_block_max_visible(row0, nrows, a.w, a.p, a.has_block);
    softmax_stats run = softmax_empty();
    const index_t t_end = (s + 1) * a.tiles_per_split < a.tiles ? (s + 1) * a.tiles_per_split : a.tiles;
    for (index_t t = s * a.tiles_per_split; t < t_end; ++t) {
      const index_t j0 = t * cs_keys;
      if (j0 >= max_vis) break;  // causal block: no row of the block sees this tile or later ones
      float acc[cs_thread_rows][cs_thread_keys];
      cs_block_logits<Fused>(a, sm, qoff, nrows, g, j0, acc);
      __syncthreads();  // the staged queries and keys are no longer read
#pragma unroll
      for (int r = 0; r < cs_thread_rows; ++r) {  // float2 stores: 2-way at most (scalar: 4-way)
        float2* const dst = reinterpret_cast<float2*>(sm + (tr * cs_thread_rows + r) * cs_l_ld + tk * cs_thread_keys);
        dst[0] = make_float2(mul_rn(acc[r][0], a.scale), mul_rn(acc[r][1], a.scale));
        dst[1] = make_float2(mul_rn(acc[r][2], a.scale), mul_rn(acc[r][3], a.scale));
      }
      __syncthreads();
      const softmax_stats mine = score_run_stats(sm + srow * cs_l_ld + half * cs_half, 1, score_run_count(my_vis, j0, half));
      softmax_stats other;
      other.max = __shfl_xor_sync(0xffffffffu, mine.max, 1);
      other.sum = __shfl_xor_sync(0xffffffffu, mine.sum, 1);
      const softmax_stats tile = half == 0 ? softmax_merge(mine, other) : softmax_merge(other, mine);
      run = softmax_merge(run, tile);
    }
    if (half == 0 && srow < nrows) a.part[(g * a.rows_g + row0 + srow) * a.splits + s] = run;
  }
}

/// The merge: one warp per row, lane l merges splits l, l + 32, ... in order, then the lanes by a
/// fixed shuffle tree (offsets 16, 8, 4, 2, 1) -> rowst[row].
__global__ void __launch_bounds__(cs_threads) cs_merge_kernel(const softmax_stats* part, softmax_stats* rowst,
                                                              index_t rows, index_t splits) {
  constexpr int warps = cs_threads / 32;
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  for (index_t row = static_cast<index_t>(blockIdx.x) * warps + warp; row < rows;
       row += static_cast<index_t>(gridDim.x) * warps) {
    softmax_stats s = score_merge_lane(part + row * splits, splits, lane);
    for (int off = cs_merge_lanes / 2; off > 0; off /= 2) {
      softmax_stats o;
      o.max = __shfl_down_sync(0xffffffffu, s.max, off);
      o.sum = __shfl_down_sync(0xffffffffu, s.sum, off);
      s = softmax_merge(s, o);
    }
    if (lane == 0) rowst[row] = s;
  }
}

/// Pass 2, one block of rows [row0, row0 + nrows) of KV head g's group against output columns
/// [c0, c0 + ncols): the probabilities p (0 where a row does not see a column) in sm[row][column].
/// Returns false, without touching sm, when no row of the block sees any of the columns (every p is
/// 0). Opens with a CTA barrier; ends with one when it returns true.
template <bool Fused, class QE, class KE>
__device__ bool cs_prob_tile(const cuda_score_args<QE, KE>& a, float* sm, index_t* qoff, index_t* rvis,
                             softmax_stats* rst, index_t g, index_t row0, int nrows, index_t c0, int ncols) {
  __syncthreads();
  if (score_block_max_visible(row0, nrows, a.w, a.p, a.has_block) <= c0) return false;
  const int tid = static_cast<int>(threadIdx.x);
  for (int lr = tid; lr < nrows; lr += cs_threads) {
    const index_t r = row0 + lr, i = r % a.w;
    qoff[lr] = (g * a.group + r / a.w) * a.qs0 + i * a.qs1;
    rvis[lr] = score_row_visible(a.p, a.has_block, i);
    rst[lr] = a.rowst[g * a.rows_g + r];
  }
  float acc[cs_thread_rows][cs_thread_keys];
  cs_block_logits<Fused>(a, sm, qoff, nrows, g, c0, acc);
  __syncthreads();
  constexpr int key_threads = cs_keys / cs_thread_keys;
  const int tr = tid / key_threads, tk = tid % key_threads;
#pragma unroll
  for (int r = 0; r < cs_thread_rows; ++r) {
    const int lr = tr * cs_thread_rows + r;
    float pv[cs_thread_keys];
#pragma unroll
    for (int c = 0; c < cs_thread_keys; ++c) {
      const int kk = tk * cs_thread_keys + c;
      pv[c] = 0.0f;
      if (lr < nrows && kk < ncols) pv[c] = score_tile_prob(rst[lr], mul_rn(acc[r][c], a.scale), c0 + kk < rvis[lr]);
    }
    float2* const dst = reinterpret_cast<float2*>(sm + lr * cs_l_ld + tk * cs_thread_keys);  // 2-way at most
    dst[0] = make_float2(pv[0], pv[1]);
    dst[1] = make_float2(pv[2], pv[3]);
  }
  __syncthreads();
  return true;
}

/// Pass 2: CTA item (g, output column tile). For every block of the group's rows (whole heads when
/// w <= cs_rows, else cs_rows-row pieces of one head), the probability tile, then per (query head,
/// column) the rows pushed in order i = 0..w-1, finalised, written, and combined over the group's
/// heads in order (GQA output).
template <bool Fused, class QE, class KE>
__global__ void __launch_bounds__(cs_threads, 2) cs_columns_kernel(const cuda_score_args<QE, KE> a) {
  __shared__ __align__(16) float sm[cs_tile_floats];
  __shared__ index_t qoff[cs_rows];
  __shared__ index_t rvis[cs_rows];
  __shared__ softmax_stats rst[cs_rows];
  const int tid = static_cast<int>(threadIdx.x);
  const bool welford = a.reduce == score_reduce::mean_plus_variance;
  const bool want_kv = a.out_kv != nullptr;
  const index_t hpb = score_heads_per_block(a.w);
  const index_t items = a.hkv * a.out_tiles;
  for (index_t item = blockIdx.x; item < items; item += gridDim.x) {
    const index_t g = item / a.out_tiles, c0 = (item % a.out_tiles) * cs_keys;
    const int ncols = a.out_cols - c0 < cs_keys ? static_cast<int>(a.out_cols - c0) : cs_keys;
    float gacc = 0.0f;  // thread tid < ncols: the GQA accumulator of column c0 + tid
    if (hpb > 0) {
      for (index_t hb0 = 0; hb0 < a.group; hb0 += hpb) {
        const int nh = a.group - hb0 < hpb ? static_cast<int>(a.group - hb0) : static_cast<int>(hpb);
        const int nrows = nh * static_cast<int>(a.w);
        const bool any = cs_prob_tile<Fused>(a, sm, qoff, rvis, rst, g, hb0 * a.w, nrows, c0, ncols);
        for (int pair = tid; pair < nh * cs_keys; pair += cs_threads) {
          const int hl = pair / cs_keys, j = pair % cs_keys;
          if (j >= ncols) continue;
          float acc = 0.0f, m2 = 0.0f;
          if (any || welford)
            for (index_t i = 0; i < a.w; ++i)
              score_column_push(welford, acc, m2, any ? sm[(hl * a.w + i) * cs_l_ld + j] : 0.0f, i);
          const index_t col = c0 + j;
          const float v = score_finalize(a.reduce, acc, m2, a.w, score_column_seen(a.p, a.w, col), a.gamma, a.variance);
          if (a.out_h != nullptr) a.out_h[(g * a.group + hb0 + hl) * a.oh0 + col * a.oh1] = v;
          if (want_kv) sm[hl * a.w * cs_l_ld + j] = v;  // read back below; only this thread wrote this row's column
        }
        if (want_kv) {
          __syncthreads();
          if (tid < ncols)
            for (int hl = 0; hl < nh; ++hl) {
              const float v = sm[hl * a.w * cs_l_ld + tid];
              gacc = hb0 + hl == 0 ? v : gqa_combine(a.op, gacc, v);
            }
        }
      }
    } else {
      for (index_t hh = 0; hh < a.group; ++hh) {
        float acc = 0.0f, m2 = 0.0f;
        for (index_t b0 = 0; b0 < a.w; b0 += cs_rows) {
          const int nrows = a.w - b0 < cs_rows ? static_cast<int>(a.w - b0) : cs_rows;
          const bool any = cs_prob_tile<Fused>(a, sm, qoff, rvis, rst, g, hh * a.w + b0, nrows, c0, ncols);
          if (tid < ncols && (any || welford))
            for (int lr = 0; lr < nrows; ++lr)
              score_column_push(welford, acc, m2, any ? sm[lr * cs_l_ld + tid] : 0.0f, b0 + lr);
        }
        if (tid < ncols) {
          const index_t col = c0 + tid;
          const float v = score_finalize(a.reduce, acc, m2, a.w, score_column_seen(a.p, a.w, col), a.gamma, a.variance);
          if (a.out_h != nullptr) a.out_h[(g * a.group + hh) * a.oh0 + col * a.oh1] = v;
          gacc = hh == 0 ? v : gqa_combine(a.op, gacc, v);
        }
      }
    }
    if (want_kv && tid < ncols) a.out_kv[g * a.ok0 + (c0 + tid) * a.ok1] = gqa_finish(a.op, gacc, a.group);
  }
}

template <bool Fused, class QE, class KE>
status cs_launch(const char* fn, cuda_t be, const cuda_score_args<QE, KE>& a) {
  const cudaStream_t st = stream_of(be);
  cs_stats_kernel<Fused, QE, KE><<<grid_for(a.hkv * a.row_blocks * a.splits), cs_threads, 0, st>>>(a);
  KVEVICT_TRY(cuda_status(cudaGetLastError(), fn));
  constexpr index_t warps = cs_threads / 32;
  cs_merge_kernel<<<grid_for((a.rows_total + warps - 1) / warps), cs_threads, 0, st>>>(a.part, a.rowst, a.rows_total,
                                                                                     a.splits);
  KVEVICT_TRY(cuda_status(cudaGetLastError(), fn));
  cs_columns_kernel<Fused, QE, KE><<<grid_for(a.hkv * a.out_tiles), cs_threads, 0, st>>>(a);
  return cuda_status(cudaGetLastError(), fn);
}

/// The CUDA attention_scores' workspace (both phases): per-split and per-row softmax statistics.
inline status carve_cuda_score(const char* fn, workspace& ws, const cuda_score_plan& pl, softmax_stats*& part,
                               softmax_stats*& rowst) {
  workspace_carver carver(ws);
  part = carver.take<softmax_stats>(static_cast<std::size_t>(pl.part_entries));
  rowst = carver.take<softmax_stats>(static_cast<std::size_t>(pl.rows_total));
  return carver.finish(fn);
}

/// The CUDA attention_scores: per-head output out_h (unless it has 0 rows and out_kv is given) and/or
/// the GQA-reduced out_kv (if kv_requested).
template <class QE, class KE>
status attention_scores_cuda(const char* fn, cuda_t be, workspace& ws, const kv_view<const QE>& q,
                             const kv_view<const KE>& prefix, const kv_view<const KE>& block,
                             const matrix_view<float>& out_h, bool kv_requested, const matrix_view<float>& out_kv,
                             gqa_op op, const score_options& opt) {
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
  KVEVICT_TRY(check_device_alignment(fn, "queries", q.data_handle()));
  KVEVICT_TRY(check_device_alignment(fn, "prefix_keys", prefix.data_handle()));
  if (sh.has_block) KVEVICT_TRY(check_device_alignment(fn, "block_keys", block.data_handle()));
  if (want_h) KVEVICT_TRY(check_device_alignment(fn, kv_requested ? "out_per_head" : "out", out_h.data_handle()));
  if (kv_requested) KVEVICT_TRY(check_device_alignment(fn, "out_kv", out_kv.data_handle()));
  cuda_score_plan pl;
  KVEVICT_TRY(make_cuda_score_plan(fn, sh, pl));
  softmax_stats *part = nullptr, *rowst = nullptr;
  KVEVICT_TRY(carve_cuda_score(fn, ws, pl, part, rowst));
  if (ws.is_query() || pl.rows_total == 0) return {};

  cuda_score_args<QE, KE> a{};
  a.q = q.data_handle();
  a.qs0 = q.stride(0);
  a.qs1 = q.stride(1);
  a.qs2 = q.stride(2);
  a.pk = prefix.data_handle();
  a.ps0 = prefix.stride(0);
  a.ps1 = prefix.stride(1);
  a.ps2 = prefix.stride(2);
  a.bk = sh.has_block ? block.data_handle() : nullptr;
  a.bs0 = sh.has_block ? block.stride(0) : 0;
  a.bs1 = sh.has_block ? block.stride(1) : 0;
  a.bs2 = sh.has_block ? block.stride(2) : 0;
  a.hkv = sh.hkv;
  a.group = sh.group;
  a.w = sh.w;
  a.p = sh.p;
  a.d = sh.d;
  a.cols = sh.cols;
  a.out_cols = sh.out_cols;
  a.has_block = sh.has_block;
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
  a.out_h = want_h ? out_h.data_handle() : nullptr;
  a.oh0 = want_h ? out_h.stride(0) : 0;
  a.oh1 = want_h ? out_h.stride(1) : 0;
  a.out_kv = kv_requested ? out_kv.data_handle() : nullptr;
  a.ok0 = kv_requested ? out_kv.stride(0) : 0;
  a.ok1 = kv_requested ? out_kv.stride(1) : 0;
  a.op = op;
  a.part = part;
  a.rowst = rowst;
  return opt.fused_multiply_add ? cs_launch<true>(fn, be, a) : cs_launch<false>(fn, be, a);
}

}  // namespace detail

/// attention_scores on the GPU (views hold device pointers). Same semantics, errors and defaults as
/// the host overload; the workspace holds each query row's softmax statistics, 8 bytes x H_q x w x
/// (1 + splits) (docs/cuda.md). Asynchronous on be.stream; no host synchronisation.
template <class Q, class K>
status attention_scores(cuda_t be, workspace& ws, kv_view<Q> queries, kv_view<K> prefix_keys, kv_view<K> block_keys,
                        matrix_view<float> out, const score_options& opt = {}) {
  static_assert(is_kv_element_v<Q> && is_kv_element_v<K>, "attention_scores: elements must be float, float16 or bfloat16");
  using QE = std::remove_const_t<Q>;
  using KE = std::remove_const_t<K>;
  return detail::attention_scores_cuda<QE, KE>("attention_scores(cuda)", be, ws, kv_view<const QE>(queries),
                                               kv_view<const KE>(prefix_keys), kv_view<const KE>(block_keys), out,
                                               false, {}, gqa_op::mean, opt);
}

/// attention_scores and gqa_reduce in one launch sequence: out_kv [H_kv][P] (or [H_kv][P + w]) is
/// gqa_reduce(per-head scores, op), bit for bit the same as gqa_reduce(seq, ...) applied to what
/// attention_scores(cuda, ...) writes; the per-head scores are also written to out_per_head
/// [H_q][same columns] unless it has 0 rows (the default). Errors: those of attention_scores (for
/// out_kv: KV-head rows), an op outside gqa_op, H_q = 0, out_per_head with other columns than out_kv
/// or overlapping it.
template <class Q, class K>
status attention_scores_gqa(cuda_t be, workspace& ws, kv_view<Q> queries, kv_view<K> prefix_keys,
                            kv_view<K> block_keys, matrix_view<float> out_kv, gqa_op op, const score_options& opt = {},
                            matrix_view<float> out_per_head = {}) {
  static_assert(is_kv_element_v<Q> && is_kv_element_v<K>,
                "attention_scores_gqa: elements must be float, float16 or bfloat16");
  using QE = std::remove_const_t<Q>;
  using KE = std::remove_const_t<K>;
  return detail::attention_scores_cuda<QE, KE>("attention_scores_gqa(cuda)", be, ws, kv_view<const QE>(queries),
                                               kv_view<const KE>(prefix_keys), kv_view<const KE>(block_keys),
                                               out_per_head, true, out_kv, op, opt);
}

namespace detail {
/// The GPU score wrappers' one path (score.hpp's run_score_wrapper on the GPU): `prepare`'s checks
/// and block, then attention_scores_cuda (per-head `out`; with `kv_requested` also the GQA-reduced
/// out_kv by `op`).
template <class Q, class K, class Prepare>
status run_score_wrapper_cuda(const char* fn, cuda_t be, workspace& ws, kv_view<Q> queries, kv_view<K> keys,
                              const matrix_view<float>& out, bool kv_requested, const matrix_view<float>& out_kv,
                              gqa_op op, Prepare prepare) {
  using QE = std::remove_const_t<Q>;
  using KE = std::remove_const_t<K>;
  const auto c = prepare(kv_view<const QE>(queries), kv_view<const KE>(keys));
  if (!c) return c.error();
  return attention_scores_cuda<QE, KE>(fn, be, ws, c->queries, c->prefix, c->block, out, kv_requested, out_kv, op,
                                       c->opt);
}
}  // namespace detail

/// window_scores on the GPU (the SnapKV family's window); see the host overload.
template <class Q, class K>
status window_scores(cuda_t be, workspace& ws, kv_view<Q> window_queries, kv_view<K> keys, matrix_view<float> out,
                     const score_options& opt = {}) {
  static_assert(is_kv_element_v<Q> && is_kv_element_v<K>, "window_scores: elements must be float, float16 or bfloat16");
  constexpr const char* fn = "window_scores(cuda)";
  return detail::run_score_wrapper_cuda(fn, be, ws, window_queries, keys, out, false, {}, gqa_op::mean,
                                        [&](const auto& q, const auto& k) {
                                          return detail::prepare_window_scores(fn, q, k, opt);
                                        });
}

/// window_scores followed by gqa_reduce, in one launch sequence (see attention_scores_gqa).
template <class Q, class K>
status window_scores_gqa(cuda_t be, workspace& ws, kv_view<Q> window_queries, kv_view<K> keys,
                         matrix_view<float> out_kv, gqa_op op, const score_options& opt = {},
                         matrix_view<float> out_per_head = {}) {
  static_assert(is_kv_element_v<Q> && is_kv_element_v<K>,
                "window_scores_gqa: elements must be float, float16 or bfloat16");
  constexpr const char* fn = "window_scores_gqa(cuda)";
  return detail::run_score_wrapper_cuda(fn, be, ws, window_queries, keys, out_per_head, true, out_kv, op,
                                        [&](const auto& q, const auto& k) {
                                          return detail::prepare_window_scores(fn, q, k, opt);
                                        });
}

/// h2o_scores on the GPU; see the host overload. Causal tiles are skipped (half the work).
template <class Q, class K>
status h2o_scores(cuda_t be, workspace& ws, kv_view<Q> queries, kv_view<K> keys, matrix_view<float> out,
                  bool normalised = false, float scale = 0.0f) {
  static_assert(is_kv_element_v<Q> && is_kv_element_v<K>, "h2o_scores: elements must be float, float16 or bfloat16");
  constexpr const char* fn = "h2o_scores(cuda)";
  return detail::run_score_wrapper_cuda(fn, be, ws, queries, keys, out, false, {}, gqa_op::mean,
                                        [&](const auto& q, const auto& k) {
                                          return detail::prepare_h2o_scores(fn, q, k, out, normalised, scale);
                                        });
}

/// tova_scores on the GPU; see the host overload.
template <class Q, class K>
status tova_scores(cuda_t be, workspace& ws, kv_view<Q> last_query, kv_view<K> keys, matrix_view<float> out,
                   float scale = 0.0f) {
  static_assert(is_kv_element_v<Q> && is_kv_element_v<K>, "tova_scores: elements must be float, float16 or bfloat16");
  constexpr const char* fn = "tova_scores(cuda)";
  return detail::run_score_wrapper_cuda(fn, be, ws, last_query, keys, out, false, {}, gqa_op::mean,
                                        [&](const auto& q, const auto& k) {
                                          return detail::prepare_tova_scores(fn, q, k, scale);
                                        });
}

/// key_norm_scores on the GPU: bit-identical to the host (same per-element sum, correctly rounded
/// sqrt). No workspace.
template <class K>
status key_norm_scores(cuda_t be, kv_view<K> keys_in, matrix_view<float> out) {
  constexpr const char* fn = "key_norm_scores(cuda)";
  const auto checked = detail::key_norm_inputs(fn, keys_in, out);
  if (!checked) return checked.error();
  const auto& keys = *checked;
  KVEVICT_TRY(detail::check_device_alignment(fn, "keys", keys.data_handle()));
  KVEVICT_TRY(detail::check_device_alignment(fn, "out", out.data_handle()));
  if (keys.extent(0) == 0 || keys.extent(1) == 0) return {};
  detail::cuda_launcher l{detail::stream_of(be), fn};
  l.run<detail::key_norm_op<std::remove_const_t<K>>>(detail::key_norm_shape(keys), keys, out.data_handle(), out.stride(0), out.stride(1));
  return l.err;
}

/// position_scores on the GPU (out in device memory): out[h][t] = t, exact. No workspace.
inline status position_scores(cuda_t be, matrix_view<float> out) {
  constexpr const char* fn = "position_scores(cuda)";
  KVEVICT_TRY(detail::check_position_scores(fn, out));
  KVEVICT_TRY(detail::check_device_alignment(fn, "out", out.data_handle()));
  const index_t R = out.extent(0), T = out.extent(1);
  if (R == 0 || T == 0) return {};
  detail::cuda_launcher l{detail::stream_of(be), fn};
  l.run<detail::position_op>(detail::position_shape(R, T), out.data_handle(), out.stride(0), out.stride(1), R, T);
  return l.err;
}

namespace detail {

/// attention_scores_workspace_bytes on the GPU (score.hpp's size query): its two
/// softmax-statistics buffers.
template <>
struct score_workspace<cuda_t> {
  static constexpr const char* name = "attention_scores_workspace_bytes(cuda)";
  static status carve(const char* fn, cuda_t, const score_shape& sh, const score_options&, workspace& ws) {
    cuda_score_plan pl;
    KVEVICT_TRY(make_cuda_score_plan(fn, sh, pl));
    softmax_stats *part = nullptr, *rowst = nullptr;
    return carve_cuda_score(fn, ws, pl, part, rowst);
  }
};

}  // namespace detail

}  // namespace kvevict
