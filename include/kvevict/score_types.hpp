// kvevict/score_types.hpp: the options of the attention-score stage and SnapKV's window split
// (score.hpp is the stage; recipes and detail/ need only these).
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/view.hpp>

namespace kvevict {

/// How a column's attention is reduced over the w query rows of the block.
enum class score_reduce : int {
  /// sum_i p_ij / w (rows that do not see column j count as 0). SnapKV as written in the paper and
  /// in kvpress, LookaheadKV, LAQ, ground truth (LookaheadKV Eq. 1), LAVa/VATP windows. Default.
  mean = 0,
  /// sum_i p_ij. KVCache-Factory's SnapKV/PyramidKV/H2O code and H2O's accumulated attention.
  /// Same ranking as mean within a head (a constant factor).
  sum = 1,
  /// sum_i p_ij / #{rows i that see column j}: normalised H2O (kvpress ObservedAttentionPress).
  /// Equals mean on prefix columns; differs on block columns (block column c is seen by w - c rows).
  mean_visible = 2,
  /// mean_i p_ij + gamma * var_i p_ij over all w rows (CAKE's eviction indicator).
  mean_plus_variance = 3,
};

/// Variance estimator of mean_plus_variance.
enum class variance_estimator : int {
  /// Divide by w - 1: what CAKE's public code computes (torch.var's default). Default. For w = 1
  /// the variance is defined as 0 here (torch gives NaN).
  unbiased = 0,
  /// Divide by w.
  biased = 1,
};

struct score_options {
  score_reduce reduce = score_reduce::mean;
  /// Logit scale: logits are scale * (q . k). 0 (default) means 1/sqrt(d). Must be finite, >= 0.
  float scale = 0.0f;
  /// CAKE's gamma (mean_plus_variance only; 200 as in CAKE and DESIGN.md). Finite, >= 0.
  float gamma = 200.0f;
  variance_estimator variance = variance_estimator::unbiased;
  /// Logits as fused multiply-adds (one rounding per term) instead of separately rounded products
  /// and sums. Faster on CPUs with FMA (about 15% at 32K context with AVX-512); the bits differ from
  /// the default in the last places but are again the same on every kernel and CPU; on CPUs without
  /// FMA (or builds without the x86 dispatch) it uses the much slower software fmaf. Default off.
  bool fused_multiply_add = false;
};

/// SnapKV's split of one cache into the prefix [H][0, T-w) and the window [H][T-w, T): two strided
/// sub-views of the same memory, no copies. Any layout (head-major, token-major, padded).
template <class T>
struct window_split {
  kv_view<T> prefix;
  kv_view<T> window;
};

}  // namespace kvevict
