// Host emulation of the CUDA attention-score kernels (<kvevict/cuda/score.cuh>): the same
// decomposition (row blocks, key tiles, two statistics runs per tile, splits, the merge's lanes and
// shuffle tree, head-aligned pass-2 blocks, per-column pushes in row order, GQA combination in head
// order) calling exactly the host-device functions of <kvevict/detail/block/score_device.hpp>. Used by the
// host test test_score_device_logic (against attention_scores on seq) and by the GPU test (the
// device must match it bit for bit). Plain loops; every element computed once per pass. Host only
// (owns std::vectors); nothing in the library's call paths includes it.
#pragma once

#include <kvevict/detail/block/score_device.hpp>
#include <kvevict/detail/base/score_checks.hpp>
#include <kvevict/detail/base/stage_math.hpp>
#include <kvevict/score_types.hpp>

#include <vector>

namespace kvevict::detail {


template <class QE, class KE>
struct emulated_scorer {
  kv_view<const QE> q;
  kv_view<const KE> prefix, block;
  kvevict::detail::score_shape sh;
  kvevict::detail::cuda_score_plan pl;
  kvevict::score_options opt;

  float widened_q(index_t head, index_t i, index_t k) const {
    return kvevict::detail::widen(q.data_handle()[head * q.stride(0) + i * q.stride(1) + k * q.stride(2)]);
  }
  float widened_key(index_t g, index_t col, index_t k) const {
    if (col < sh.p)
      return kvevict::detail::widen(prefix.data_handle()[g * prefix.stride(0) + col * prefix.stride(1) + k * prefix.stride(2)]);
    const index_t c = col - sh.p;
    return kvevict::detail::widen(block.data_handle()[g * block.stride(0) + c * block.stride(1) + k * block.stride(2)]);
  }
  /// Logit of group row r (head r / w, position r % w) of KV head g with column col: the dot product
  /// over d in order (in chunks of cs_dchunk on the GPU: the same order), then times the scale.
  float logit(index_t g, index_t r, index_t col) const {
    const index_t head = g * sh.group + r / sh.w, i = r % sh.w;
    float acc = 0.0f;
    for (index_t k = 0; k < sh.d; ++k) {
      const float a = widened_q(head, i, k), b = widened_key(g, col, k);
      acc = opt.fused_multiply_add ? kvevict::detail::logit_term<true>(acc, a, b)
                                   : kvevict::detail::logit_term<false>(acc, a, b);
    }
    return kvevict::detail::mul_rn(acc, sh.scale);
  }

  /// Pass 1 and the merge: the final statistics of every row (global row = query head * w + i).
  std::vector<softmax_stats> row_statistics() const {
    using namespace kvevict::detail;
    std::vector<softmax_stats> part(static_cast<std::size_t>(pl.part_entries));
    for (index_t g = 0; g < sh.hkv; ++g)
      for (index_t rb = 0; rb < pl.row_blocks; ++rb)
        for (index_t s = 0; s < pl.splits; ++s) {
          const index_t row0 = rb * cs_rows;
          const index_t nrows = pl.rows_g - row0 < cs_rows ? pl.rows_g - row0 : cs_rows;
          const index_t max_vis = score_block_max_visible(row0, nrows, sh.w, sh.p, sh.has_block);
          std::vector<softmax_stats> run(static_cast<std::size_t>(nrows), softmax_empty());
          const index_t t_end = (s + 1) * pl.tiles_per_split < pl.tiles ? (s + 1) * pl.tiles_per_split : pl.tiles;
          for (index_t t = s * pl.tiles_per_split; t < t_end; ++t) {
            const index_t j0 = t * cs_keys;
            if (j0 >= max_vis) break;
            for (index_t lr = 0; lr < nrows; ++lr) {
              const index_t r = row0 + lr;
              const index_t vis = score_row_visible(sh.p, sh.has_block, r % sh.w);
              float l[cs_keys];
              for (int kk = 0; kk < cs_keys; ++kk)
                l[kk] = j0 + kk < sh.cols ? logit(g, r, j0 + kk) : 0.0f;  // the GPU computes padding too
              const softmax_stats h0 = score_run_stats(l, 1, score_run_count(vis, j0, 0));
              const softmax_stats h1 = score_run_stats(l + cs_half, 1, score_run_count(vis, j0, 1));
              run[static_cast<std::size_t>(lr)] = softmax_merge(run[static_cast<std::size_t>(lr)], softmax_merge(h0, h1));
            }
          }
          for (index_t lr = 0; lr < nrows; ++lr)
            part[static_cast<std::size_t>((g * pl.rows_g + row0 + lr) * pl.splits + s)] = run[static_cast<std::size_t>(lr)];
        }
    std::vector<softmax_stats> rowst(static_cast<std::size_t>(pl.rows_total));
    for (index_t row = 0; row < pl.rows_total; ++row) {
      softmax_stats lanes[cs_merge_lanes];
      for (int lane = 0; lane < cs_merge_lanes; ++lane)
        lanes[lane] = score_merge_lane(part.data() + row * pl.splits, pl.splits, lane);
      for (int off = cs_merge_lanes / 2; off > 0; off /= 2)
        for (int lane = 0; lane < off; ++lane) lanes[lane] = softmax_merge(lanes[lane], lanes[lane + off]);
      rowst[static_cast<std::size_t>(row)] = lanes[0];
    }
    return rowst;
  }

  /// Pass 2: out_h [H_q][out_cols] (if it has rows) and out_kv [H_kv][out_cols] (if it has rows).
  void columns(const std::vector<softmax_stats>& rowst, const matrix_view<float>& out_h,
               const matrix_view<float>& out_kv, kvevict::gqa_op op) const {
    using namespace kvevict::detail;
    const bool welford = opt.reduce == kvevict::score_reduce::mean_plus_variance;
    for (index_t g = 0; g < sh.hkv; ++g)
      for (index_t col = 0; col < sh.out_cols; ++col) {
        float gacc = 0.0f;
        for (index_t hh = 0; hh < sh.group; ++hh) {
          const index_t head = g * sh.group + hh;
          float acc = 0.0f, m2 = 0.0f;
          for (index_t i = 0; i < sh.w; ++i) {
            const bool vis = col < score_row_visible(sh.p, sh.has_block, i);
            const float p = vis ? score_tile_prob(rowst[static_cast<std::size_t>(head * sh.w + i)],
                                                  logit(g, hh * sh.w + i, col), true)
                                : 0.0f;
            score_column_push(welford, acc, m2, p, i);
          }
          const float v = score_finalize(opt.reduce, acc, m2, sh.w, score_column_seen(sh.p, sh.w, col), opt.gamma,
                                         opt.variance);
          if (out_h.extent(0) > 0) out_h.data_handle()[head * out_h.stride(0) + col * out_h.stride(1)] = v;
          gacc = hh == 0 ? v : gqa_combine(op, gacc, v);
        }
        if (out_kv.extent(0) > 0)
          out_kv.data_handle()[g * out_kv.stride(0) + col * out_kv.stride(1)] = gqa_finish(op, gacc, sh.group);
      }
  }
};

/// The whole CUDA attention_scores (and its GQA-reduced form) emulated on the host. Returns the
/// checks' status exactly as the CUDA launcher would.
template <class QE, class KE>
kvevict::status emulate_cuda_attention_scores(kv_view<const QE> q, kv_view<const KE> prefix, kv_view<const KE> block,
                                              matrix_view<float> out_h, matrix_view<float> out_kv, kvevict::gqa_op op,
                                              const kvevict::score_options& opt) {
  constexpr const char* fn = "emulated attention_scores";
  emulated_scorer<QE, KE> e{q, prefix, block, {}, {}, opt};
  KVEVICT_TRY(kvevict::detail::check_attention_inputs(fn, q, prefix, block, opt, e.sh));
  if (out_h.extent(0) > 0)
    KVEVICT_TRY(kvevict::detail::check_score_output(fn, "out", out_h, e.sh.hq, "query heads", q, prefix, block, e.sh));
  if (out_kv.extent(0) > 0)
    KVEVICT_TRY(kvevict::detail::check_score_output(fn, "out_kv", out_kv, e.sh.hkv, "KV heads", q, prefix, block, e.sh));
  KVEVICT_TRY(kvevict::detail::make_cuda_score_plan(fn, e.sh, e.pl));
  if (e.pl.rows_total == 0) return {};
  e.columns(e.row_statistics(), out_h, out_kv, op);
  return {};
}

}  // namespace kvevict::detail
