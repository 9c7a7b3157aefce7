// The work of the CUDA post-processing kernels (<kvevict/cuda/postprocess.cuh>, <kvevict/cuda/pool.cuh>)
// written once, as host-device routines over an execution context: a block's threads share each
// ctx.each loop and ctx.sync() is a barrier (simt_loop_ctx of postprocess_ops.hpp, on the GPU and on
// the host SIMT executor, which the tests run the ops on). Nothing here is API.
//
//   pp_run_tile   one tile of pp_tile outputs of a KV head's row: the inputs the tile's pooling
//                 windows need (pp_tile + 2r of them) staged once in `span` (GQA-reduced first, or
//                 each query head of the group in turn), pooled block by block (pool_block) into
//                 `acc`, then GQA-finished, weighted and protected into the output
//   pp_run_block  rows whose pooling radius exceeds pp_max_radius: the outputs of one pooling block
//                 (or one chunk of the unpooled tail), reading the inputs from global memory (one GPU
//                 thread per block)
//   pp_choose_variant  which of the two the launcher runs (the host emulation asks it too)
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/detail/base/stage_math.hpp>
#include <kvevict/postprocess_types.hpp>
#include <kvevict/view.hpp>
#include <kvevict/detail/block/pool_block.hpp>
#include <kvevict/detail/block/view_args.hpp>
#include <kvevict/detail/base/softmax.hpp>

#include <cstddef>
#include <cstdint>

namespace kvevict::detail {

inline constexpr index_t pp_tile = 1024;        ///< outputs per tile (per CTA work item)
inline constexpr index_t pp_max_radius = 1024;  ///< largest kernel / 2 of the tiled path (kernel <= 2049)
inline constexpr index_t pp_span = pp_tile + 2 * pp_max_radius;  ///< staged inputs of one tile

/// Arguments of the fused post-processing (and of pooling alone: g = 1, no weighting, no protection):
/// postprocess_scores' options as given (gqa, order, pool, kernel, divisor, weight_values, weight,
/// n_sink, n_recent, unpooled_tail), then the views, shape and per-row inputs.
struct pp_params : postprocess_options {
  const float* in;  ///< [H_q][T]
  index_t is0, is1;
  float* out;  ///< [H_kv][T]
  index_t os0, os1;
  index_t hkv, g, T;
  bool protect;                       ///< n_sink / n_recent applied (false: pooling alone)
  const std::int32_t* row_lengths;    ///< [H_kv] or null
  const std::int32_t* value_lengths;  ///< [H_kv] or null
  const float* factors;               ///< head_max: [H_kv] max value norms
};

/// Value rows (weighting): [H_kv][tv][d].
template <class VE>
struct pp_values {
  const VE* v;
  index_t vs0, vs1, vs2, tv, d;
};

/// The GQA reduction of KV head h's group at position p (gqa_reduce's operations and order).
KVEVICT_HOST_DEVICE inline float pp_gqa_at(const pp_params& a, index_t h, index_t p) {
  const float* col = a.in + (h * a.g) * a.is0 + p * a.is1;
  float acc = col[0];
  for (index_t j = 1; j < a.g; ++j) acc = gqa_combine(a.gqa, acc, col[j * a.is0]);
  return gqa_finish(a.gqa, acc, a.g);
}

/// Announces to the context (the host SIMT executor's race check; nothing on the GPU) the plain
/// shared-memory accesses of pooling block b in pp_run_tile (pool_block over a row of P, radius r,
/// outputs [t0, ph)): its inputs span[p - base] read, its outputs' stash and acc entries written
/// (and read back) by this thread alone.
template <class Ctx>
KVEVICT_HOST_DEVICE void pp_announce_pool_block(const Ctx& ctx, const float* span, index_t base, float* stash,
                                                float* acc, index_t t0, index_t ph, index_t P, index_t r, index_t b) {
  const index_t k = 2 * r + 1, e0 = b * k;
  const index_t first = e0 > t0 ? e0 : t0, last = e0 + k < ph ? e0 + k : ph;
  if (first >= last) return;
  const index_t lo = first - r > 0 ? first - r : 0, hi = last + k - 1 - r < P ? last + k - 1 - r : P;
  if (hi > lo) ctx.plain_read(span + (lo - base), static_cast<std::size_t>(hi - lo) * sizeof(float));
  ctx.plain_write(stash + (first - t0), static_cast<std::size_t>(last - first) * sizeof(float));
  ctx.plain_write(acc + (first - t0), static_cast<std::size_t>(last - first) * sizeof(float));
}

/// Outputs [t0, min(t0 + pp_tile, L)) of KV head h (row length L, value length vlen; L > t0).
/// span: pp_span floats, stash and acc: pp_tile floats each (shared memory on the GPU). Opens and
/// ends with a barrier-free ctx: callers sync before reusing the buffers.
template <class Ctx, class VE>
KVEVICT_HOST_DEVICE void pp_run_tile(const Ctx& ctx, const pp_params& a, const pp_values<VE>& vals, index_t h,
                                     index_t L, index_t vlen, index_t t0, float* span, float* stash, float* acc) {
  const index_t hi = t0 + pp_tile < L ? t0 + pp_tile : L;
  const index_t nout = hi - t0;
  const bool pooled = a.pool != pool_kind::none;
  const bool pool_first = pooled && a.order == gqa_order::pool_first;
  const index_t P = pooled_length(L, a.unpooled_tail);
  if (!pooled) {
    ctx.each(nout, [&](index_t i) {
      ctx.plain_write(acc + i, sizeof(float));
      acc[i] = pp_gqa_at(a, h, t0 + i);
    });
  } else if (t0 < P) {
    // the pooled outputs [t0, ph) of the tile, pooling a row of P
    const index_t ph = hi < P ? hi : P;
    const index_t r = pool_radius(a.kernel, P);
    const index_t base = t0 - r;  // span[p - base] holds input p
    const index_t plo = t0 - r > 0 ? t0 - r : 0, phi = ph + r < P ? ph + r : P;
    const index_t b_lo = pool_first_block(a.kernel, P, t0), nb = pool_last_block(a.kernel, P, ph) - b_lo + 1;
    const auto x = [&](index_t p) { return span[p - base]; };
    if (!pool_first) {
      ctx.each(phi - plo, [&](index_t k) {
        ctx.plain_write(span + (plo + k - base), sizeof(float));
        span[plo + k - base] = pp_gqa_at(a, h, plo + k);
      });
      ctx.sync();
      ctx.each(nb, [&](index_t bi) {
        pp_announce_pool_block(ctx, span, base, stash, acc, t0, ph, P, r, b_lo + bi);
        pool_block_any(a.pool, a.divisor, x, stash, t0, 1, [&](index_t i, float v) { acc[i - t0] = v; }, P, a.kernel,
                       b_lo + bi, t0, ph);
      });
    } else {
      for (index_t j = 0; j < a.g; ++j) {
        const float* row = a.in + (h * a.g + j) * a.is0;
        ctx.sync();  // the previous query head's pooling is done with span and stash
        ctx.each(phi - plo, [&](index_t k) {
          ctx.plain_write(span + (plo + k - base), sizeof(float));
          span[plo + k - base] = row[(plo + k) * a.is1];
        });
        ctx.sync();
        ctx.each(nb, [&](index_t bi) {
          pp_announce_pool_block(ctx, span, base, stash, acc, t0, ph, P, r, b_lo + bi);
          pool_block_any(
              a.pool, a.divisor, x, stash, t0, 1,
              [&](index_t i, float v) { acc[i - t0] = j == 0 ? v : gqa_combine(a.gqa, acc[i - t0], v); }, P, a.kernel,
              b_lo + bi, t0, ph);
        });
      }
    }
  }
  // the unpooled tail's outputs of the tile: the group's reduced scores (finished already)
  const index_t raw0 = pooled && t0 < P ? P : t0;
  if (pooled && raw0 < hi)
    ctx.each(hi - raw0, [&](index_t k) {
      ctx.plain_write(acc + (raw0 - t0 + k), sizeof(float));
      acc[raw0 - t0 + k] = pp_gqa_at(a, h, raw0 + k);
    });
  ctx.sync();
  // per-token value norms of the weighted outputs, into stash (free again)
  const index_t wend = a.weight_values ? (L < vlen ? L : vlen) : 0;
  const index_t nw = wend > t0 ? (wend < hi ? wend : hi) - t0 : 0;
  if (a.weight_values && a.weight == value_weight::per_token)
    ctx.l1_norms(vals.v + h * vals.vs0 + t0 * vals.vs1, vals.vs1, vals.vs2, nw, vals.d, stash);
  ctx.sync();
  const float factor = a.weight_values && a.weight == value_weight::head_max ? a.factors[h] : 0.0f;
  const index_t sink_end = a.protect ? protect_sink_end(L, a.n_sink) : -1;
  const index_t recent_begin = a.protect ? protect_recent_begin(L, a.n_recent) : L;
  ctx.each(nout, [&](index_t i) {
    const index_t t = t0 + i;
    ctx.plain_read(acc + i, sizeof(float));
    if (a.weight == value_weight::per_token && i < nw) ctx.plain_read(stash + i, sizeof(float));
    float v = acc[i];
    if (pool_first && t < P) v = gqa_finish(a.gqa, v, a.g);
    const bool weighted = i < nw;
    const float f = a.weight == value_weight::per_token ? (weighted ? stash[i] : 0.0f) : factor;
    v = weighted ? mul_rn(v, f) : v;
    a.out[h * a.os0 + t * a.os1] = a.protect ? protect_value(v, t, sink_end, recent_begin) : v;
  });
}

/// Number of pooling blocks of a row of n positions.
KVEVICT_HOST_DEVICE inline index_t pp_blocks(index_t kernel, index_t n) {
  return n <= 0 ? 0 : (n + 2 * pool_radius(kernel, n)) / (2 * pool_radius(kernel, n) + 1);
}

/// The outputs of work item b of KV head h's row (length L, value length vlen), for kernels wider
/// than the tiled path allows; inputs read from global memory. Items [0, pp_blocks(kernel, P)) are the
/// pooling blocks of the pooled part (P = pooled_length(L, unpooled_tail)), the next ones chunks of
/// pp_tile positions of the unpooled tail; items past those write nothing. stash: the pool_first
/// scratch row of the head (T floats, stride 1), unused for gqa_first (which stashes in the output row
/// itself, as pool_row_impl does). One GPU thread per item; every output of the item is its own.
template <class VE>
KVEVICT_HOST_DEVICE void pp_run_block(const pp_params& a, const pp_values<VE>& vals, index_t h, index_t L, index_t vlen,
                                      index_t b, float* stash) {
  float* const o = a.out + h * a.os0;
  const index_t P = pooled_length(L, a.unpooled_tail);
  const index_t wend = a.weight_values ? (L < vlen ? L : vlen) : 0;
  const index_t sink_end = a.protect ? protect_sink_end(L, a.n_sink) : -1;
  const index_t recent_begin = a.protect ? protect_recent_begin(L, a.n_recent) : L;
  const float factor = a.weight_values && a.weight == value_weight::head_max ? a.factors[h] : 0.0f;
  const auto finish = [&](index_t t, float v) {
    const bool weighted = t < wend;
    float f = factor;
    if (weighted && a.weight == value_weight::per_token)
      f = value_l1_norm(vals.v + h * vals.vs0 + t * vals.vs1, vals.d, vals.vs2);
    v = weighted ? mul_rn(v, f) : v;
    o[t * a.os1] = a.protect ? protect_value(v, t, sink_end, recent_begin) : v;
  };
  const index_t nb = pp_blocks(a.kernel, P);
  if (b >= nb) {  // a chunk of the unpooled tail: the group's reduced scores
    const index_t lo = P + (b - nb) * pp_tile;
    const index_t hi = lo + pp_tile < L ? lo + pp_tile : L;
    for (index_t t = lo; t < hi; ++t) finish(t, pp_gqa_at(a, h, t));
    return;
  }
  if (a.order == gqa_order::gqa_first || a.g == 1) {
    const auto x = [&](index_t p) { return pp_gqa_at(a, h, p); };
    pool_block_any(a.pool, a.divisor, x, o, 0, a.os1, finish, P, a.kernel, b, 0, P);
    return;
  }
  for (index_t j = 0; j < a.g; ++j) {
    const float* row = a.in + (h * a.g + j) * a.is0;
    const auto x = [&](index_t p) { return row[p * a.is1]; };
    pool_block_any(
        a.pool, a.divisor, x, stash, 0, 1,
        [&](index_t i, float v) { o[i * a.os1] = j == 0 ? v : gqa_combine(a.gqa, o[i * a.os1], v); }, P, a.kernel, b, 0,
        P);
  }
  const index_t k = 2 * pool_radius(a.kernel, P) + 1;
  const index_t last = (b + 1) * k < P ? (b + 1) * k : P;
  for (index_t t = b * k; t < last; ++t) finish(t, gqa_finish(a.gqa, o[t * a.os1], a.g));
}

/// The two decompositions of the fused work (and of pooling alone). The launcher and the host
/// emulation both ask pp_choose_variant, so they cannot disagree.
enum class pp_variant {
  tiles,   ///< one CTA per (row, tile of pp_tile outputs): pp_run_tile
  blocks,  ///< one thread per (row, work item of pp_run_block): kernels wider than 2 * pp_max_radius + 1
};

KVEVICT_HOST_DEVICE inline pp_variant pp_choose_variant(pool_kind pool, index_t kernel) {
  return pool == pool_kind::none || kernel / 2 <= pp_max_radius ? pp_variant::tiles : pp_variant::blocks;
}

/// Tiles of a row of T positions (pp_variant::tiles: t0 = tile x pp_tile).
KVEVICT_HOST_DEVICE inline index_t pp_tiles_per_row(index_t T) { return (T + pp_tile - 1) / pp_tile; }

/// Work items per row that cover any row of length <= T (pp_variant::blocks): the pooling blocks of a
/// row of T, at least 1, then the unpooled tail's chunks.
KVEVICT_HOST_DEVICE inline index_t pp_items_per_row(const pp_params& a) {
  const index_t blocks = pp_blocks(a.kernel, a.T) > 0 ? pp_blocks(a.kernel, a.T) : 1;
  const index_t tail = a.unpooled_tail < a.T ? a.unpooled_tail : a.T;
  return blocks + (tail + pp_tile - 1) / pp_tile;
}

/// The fused post-processing's arguments from postprocess_scores' (every backend's launcher and the
/// host emulation build them here). factors: head_max weighting's per-head factors or null.
inline pp_params make_pp_params(const matrix_view<const float>& in, const matrix_view<float>& out,
                                const postprocess_options& opt, const std::int32_t* row_lengths,
                                const std::int32_t* value_lengths, const float* factors) {
  pp_params a{};
  static_cast<postprocess_options&>(a) = opt;
  view_args(in, a.in, a.is0, a.is1);
  view_args(out, a.out, a.os0, a.os1);
  a.hkv = out.extent(0);
  a.g = a.hkv > 0 ? in.extent(0) / a.hkv : 1;
  a.T = in.extent(1);
  a.protect = true;
  a.row_lengths = row_lengths;
  a.value_lengths = opt.weight_values ? value_lengths : nullptr;
  a.factors = factors;
  return a;
}

/// The value rows of postprocess_scores' values view (empty when not weighting).
template <class VE>
inline pp_values<VE> make_pp_values(const kv_view<const VE>& values, bool weight_values) {
  if (!weight_values) return pp_values<VE>{};
  return {values.data_handle(), values.stride(0), values.stride(1), values.stride(2), values.extent(1),
          values.extent(2)};
}

}  // namespace kvevict::detail
