// The decomposition of the CUDA attention-score kernels (<kvevict/cuda/score.cuh>) and every piece of
// arithmetic they do, as host-device functions: the kernels' bodies (detail/block/score_ops.hpp) call
// them on the GPU and, in the host tests, on the SIMT executor. Nothing here is API.
//
// Every value is computed in the host kernels' order (detail/host/score_host.hpp, docs/score.md
// "Summation order"), so the CUDA results equal seq's bit for bit:
//   pass 1 (statistics) one CTA per (KV head, block of up to cs_rows query rows of its GQA group,
//                       split = one host chunk of cs_chunk columns, cs_chunk_tiles key tiles): the
//                       logits of the block against each key tile of the chunk, twice: the first sweep
//                       takes each row's chunk max m_c (exact, any order), the second sums
//                       e^(l - m_c) in the host's cs_chunk_lanes lanes (lane j % 8 over the chunk's
//                       whole groups of 8 visible columns, the rest into lane 0, then lanes 0..7 added
//                       in order) -> part[row][chunk] = (m_c, L_c)
//   merge               one thread per row: the chunks the row sees merged in order from the empty
//                       statistics (softmax_merge, as the host's running st[r]) -> rowst[row] = (M, L)
//   pass 2 (columns)    one CTA per (KV head, tile of cs_keys output columns): for each block of rows
//                       of the group (whole heads when w <= cs_rows), the logits again,
//                       p = e^(l - m_c) * (e^(m_c - M) / L) (the host's chunk factor), then per
//                       (query head, column) the rows added (or Welford-pushed) in order i = 0..w-1,
//                       finalized, and optionally combined over the group's heads in order
//
// Every logit is the host's: one sequential fp32 dot product over d (separately rounded products and
// sums, or fused multiply-adds with score_options::fused_multiply_add) times the scale.
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/detail/base/score_checks.hpp>
#include <kvevict/detail/base/stage_math.hpp>
#include <kvevict/score_types.hpp>
#include <kvevict/detail/base/softmax.hpp>
#include <kvevict/status.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>

namespace kvevict::detail {

// ---- geometry (shared by the kernels and their host emulation) ---------------------------------
inline constexpr int cs_threads = 256;              ///< threads per CTA
inline constexpr int cs_rows = 128;                 ///< query rows per row block
inline constexpr int cs_keys = 64;                  ///< keys (columns) per tile
inline constexpr int cs_dchunk = 32;                ///< head-dim elements staged in shared memory per step
inline constexpr int cs_thread_rows = 8;            ///< logits per thread: 8 rows x 4 keys
inline constexpr int cs_thread_keys = 4;
inline constexpr int cs_half = cs_keys / 2;         ///< keys per statistics run (two runs per tile)
inline constexpr int cs_q_ld = cs_rows + 4;         ///< staged queries [cs_dchunk][cs_q_ld] (float4 rows)
inline constexpr int cs_k_ld = cs_keys + 4;         ///< staged keys [cs_dchunk][cs_k_ld]
inline constexpr int cs_l_ld = cs_keys + 2;         ///< logit / probability tile [cs_rows][cs_l_ld] (float2 rows)
inline constexpr int cs_tile_floats = cs_rows * cs_l_ld;  ///< the shared buffer (the staging aliases it)
/// The host's statistics chunk (score_chunk in detail/host/score_host.hpp; tests/test_score_device_logic.cpp
/// checks they are equal): the columns [c * cs_chunk, (c + 1) * cs_chunk) of a row have one max m_c.
inline constexpr int cs_chunk = 1024;
inline constexpr int cs_chunk_tiles = cs_chunk / cs_keys;  ///< key tiles per chunk (= per pass-1 split)
inline constexpr int cs_chunk_lanes = 8;            ///< the host's lanes of a chunk's sum (score_lanes)

static_assert(cs_threads == (cs_rows / cs_thread_rows) * (cs_keys / cs_thread_keys), "one logit block per CTA");
static_assert(cs_threads == 2 * cs_rows, "two threads (runs) per row for the statistics");
static_assert(cs_chunk % cs_keys == 0 && cs_keys % cs_chunk_lanes == 0 && cs_chunk_lanes % 2 == 0,
              "tiles do not straddle chunks; each thread of a row's pair owns half of the lanes");
static_assert(cs_dchunk * (cs_q_ld + cs_k_ld) <= cs_tile_floats, "the staging fits in the logit tile");
static_assert(cs_q_ld % 4 == 0 && cs_k_ld % 4 == 0 && (cs_dchunk * cs_q_ld) % 4 == 0 && cs_thread_rows % 4 == 0 &&
                  cs_thread_keys == 4,
              "float4 reads of the staged queries and keys stay 16-byte aligned");
static_assert(cs_l_ld % 2 == 0 && cs_l_ld % 32 == 2, "float2 stores of the logit tile: 8-byte aligned, 2-way at most");
static_assert(cs_q_ld % 32 == 4 && cs_k_ld % 32 == 4 && cs_dchunk % 8 == 0 && cs_rows % 4 == 0 && cs_keys % 4 == 0,
              "the staging stores of cs_stage_slot_of hit 32 distinct banks");

/// Where thread slot e (0 <= e < rows * cs_dchunk, rows = cs_rows or cs_keys) of the staging loop puts
/// its element: row `row`, head-dim element `dd` of the chunk, stored at s[dd * ld + row]. A warp (32
/// consecutive e) takes 4 rows x 8 consecutive elements: with ld = 4 (mod 32) its 32 stores hit 32
/// distinct banks (one row x 32 elements per warp would hit 8: a 4-way conflict), and each row's 8
/// elements are contiguous in global memory; the warps of one iteration take neighbouring elements.
struct cs_stage_slot {
  int row, dd;
};
KVEVICT_HOST_DEVICE constexpr cs_stage_slot cs_stage_slot_of(int e) noexcept {
  constexpr int dgroups = cs_dchunk / 8;
  const int lane = e % 32, grp = e / 32;
  return {(grp / dgroups) * 4 + lane % 4, (grp % dgroups) * 8 + lane / 4};
}

/// The launch plan of one attention_scores call on the GPU; depends on the shapes only.
struct cuda_score_plan {
  index_t rows_g = 0;           ///< group * w: rows of one KV head's group
  index_t rows_total = 0;       ///< H_q * w
  index_t tiles = 0;            ///< key tiles over the visible columns (pass 1)
  index_t tiles_per_split = 0;  ///< key tiles per pass-1 CTA: cs_chunk_tiles (one host chunk)
  index_t splits = 0;           ///< pass-1 CTAs per (KV head, row block): the chunks, ceil(cols / cs_chunk)
  index_t row_blocks = 0;       ///< pass-1 row blocks per KV head
  index_t out_tiles = 0;        ///< output column tiles (pass 2)
  index_t part_entries = 0;     ///< rows_total * splits: (m_c, L_c) of every row's chunks
};

inline status make_cuda_score_plan(const char* fn, const score_shape& sh, cuda_score_plan& pl) {
  pl = {};
  if (sh.hq == 0 || sh.out_cols == 0) return {};
  if (!checked_mul(sh.group, sh.w, pl.rows_g) || !checked_mul(sh.hq, sh.w, pl.rows_total))
    return status::error(errc::size_overflow, "%s: heads x w overflows", fn);
  pl.tiles = (sh.cols + cs_keys - 1) / cs_keys;
  pl.out_tiles = (sh.out_cols + cs_keys - 1) / cs_keys;
  pl.row_blocks = (pl.rows_g + cs_rows - 1) / cs_rows;
  pl.tiles_per_split = cs_chunk_tiles;  // a split is one host chunk: its max and lane sums are the host's
  pl.splits = (pl.tiles + pl.tiles_per_split - 1) / pl.tiles_per_split;
  if (!checked_mul(pl.rows_total, pl.splits, pl.part_entries))
    return status::error(errc::size_overflow, "%s: the statistics workspace overflows", fn);
  index_t t = 0;
  if (!checked_mul(sh.hkv, pl.row_blocks, t) || !checked_mul(t, pl.splits, t) ||
      !checked_mul(pl.part_entries + pl.rows_total, static_cast<index_t>(sizeof(softmax_stats)), t))
    return status::error(errc::size_overflow, "%s: the launch or workspace size overflows", fn);
  return {};
}

// ---- per-element arithmetic ---------------------------------------------------------------------

/// One term of a logit's dot product: acc + q * k with separately rounded product and sum (the host's
/// default) or as one fused multiply-add (score_options::fused_multiply_add). Same bits everywhere.
template <bool Fused>
KVEVICT_HOST_DEVICE inline float logit_term(float acc, float q, float k) noexcept {
  if constexpr (Fused) {
#if KVEVICT_DEVICE_COMPILATION
    return __fmaf_rn(q, k, acc);
#else
    return std::fma(q, k, acc);
#endif
  } else {
    return add_rn(acc, mul_rn(q, k));
  }
}

/// An element of a query or key, widened exactly to fp32 (branch-free; the same values as to_float).
KVEVICT_HOST_DEVICE inline float widen(float x) noexcept { return x; }
KVEVICT_HOST_DEVICE inline float widen(float16 x) noexcept { return widen_f16_bits(x.bits); }
KVEVICT_HOST_DEVICE inline float widen(bfloat16 x) noexcept { return widen_bf16_bits(x.bits); }

/// Columns row i of the block sees: the P prefix keys and, with block keys, block keys 0..i.
KVEVICT_HOST_DEVICE inline index_t score_row_visible(index_t p, bool has_block, index_t i) noexcept {
  return has_block ? p + i + 1 : p;
}

/// The widest row of rows [row0, row0 + nrows) of a group (row r is position r % w of head r / w).
KVEVICT_HOST_DEVICE inline index_t score_block_max_visible(index_t row0, index_t nrows, index_t w, index_t p,
                                                           bool has_block) noexcept {
  const index_t last = row0 + nrows - 1;
  const index_t imax = last / w != row0 / w ? w - 1 : last % w;
  return score_row_visible(p, has_block, imax);
}

/// Visible columns of a run of a tile, for a row that sees `visible` columns (a prefix): the tile
/// starting at column j0, run `half` (0 or 1) = its columns [half * cs_half, (half + 1) * cs_half).
KVEVICT_HOST_DEVICE inline int score_run_count(index_t visible, index_t j0, int half) noexcept {
  const index_t n = visible - j0 - static_cast<index_t>(half) * cs_half;
  return n <= 0 ? 0 : n >= cs_half ? cs_half : static_cast<int>(n);
}

/// Visible columns of chunk `ch` for a row that sees `visible` columns: the host's m (0 to cs_chunk).
KVEVICT_HOST_DEVICE inline int score_chunk_count(index_t visible, index_t ch) noexcept {
  const index_t n = visible - ch * cs_chunk;
  return n <= 0 ? 0 : n >= cs_chunk ? cs_chunk : static_cast<int>(n);
}

/// The host's e of logit l in a chunk whose max is m (score_chunk_exp): e^(l - m); in a chunk whose
/// max is -inf (only -inf and sign-bit NaN logits) the logit itself if NaN, else 0.
KVEVICT_HOST_DEVICE inline float score_chunk_e(float l, float m) noexcept {
  if (m == neg_inf_f()) return is_nan_f(l) ? l : 0.0f;
  return softmax_exp(sub_rn(l, m));
}

/// The host's factor turning chunk exponentials into probabilities (score_chunk_factor):
/// e^(m_c - M) / L for a row with statistics (M, L).
KVEVICT_HOST_DEVICE inline float score_chunk_scale(float chunk_max, softmax_stats row) noexcept {
  return softmax_exp(sub_rn(chunk_max, row.max)) / row.sum;
}

/// Sum of a chunk's lanes in the host's order: ((sm[0] + sm[1]) + ...) + sm[7].
KVEVICT_HOST_DEVICE inline float score_lanes_total(const float (&sm)[cs_chunk_lanes]) noexcept {
  float sum = sm[0];
  for (int l = 1; l < cs_chunk_lanes; ++l) sum = add_rn(sum, sm[l]);
  return sum;
}

/// Adds row i's probability p to a column's accumulator: a sum, or Welford's mean and sum of squared
/// deviations (mean_plus_variance) with inv_n = 1/(i + 1), as the host's score_row_welford.
KVEVICT_HOST_DEVICE inline void score_column_push(bool welford, float& acc, float& m2, float p, index_t i) noexcept {
  if (welford)
    welford_push(acc, m2, p, 1.0f / static_cast<float>(i + 1));
  else
    acc = acc + p;
}

/// Rows of the block that see column j: all w for prefix columns, w - (j - P) for block column j.
KVEVICT_HOST_DEVICE inline index_t score_column_seen(index_t p, index_t w, index_t j) noexcept {
  return j < p ? w : w - (j - p);
}

/// Pass 2 processes a group's rows in blocks of whole heads when a head's w rows fit a block
/// (cs_rows / w heads per block), otherwise in pieces of cs_rows rows of one head (returns 0).
KVEVICT_HOST_DEVICE inline index_t score_heads_per_block(index_t w) noexcept {
  return w <= cs_rows ? cs_rows / w : 0;
}

}  // namespace kvevict::detail
