// The CUDA pooling / fused post-processing kernels as ops over the SIMT context (detail/block/simt.hpp,
// simt_bodies.hpp) and their launch sequence, written once for both launchers: kvevict/cuda/pool.cuh
// and postprocess.cuh call it with cuda_launcher, tests/test_postprocess.cpp with simt_launcher (the
// host SIMT executor). The work itself is postprocess_device.hpp's (pp_run_tile over a loop-shared
// context, pp_run_block). Not API.
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/detail/block/postprocess_device.hpp>
#include <kvevict/detail/block/simt_bodies.hpp>

#include <cstddef>

#include <cstdint>

namespace kvevict::detail {

/// The loop-shared context of postprocess_device.hpp (its `Ctx`) over a SIMT context: the block's
/// threads share each loop, sync() is the block barrier, value norms are staged through `stage`
/// (stage_rows x stage_ld floats of shared memory; needs block_dim() == stage_rows).
template <class C>
struct simt_loop_ctx {
  C& c;
  float* stage;
  template <class F>
  KVEVICT_HOST_DEVICE void each(index_t n, const F& f) const {
    for (index_t i = c.thread(); i < n; i += c.block_dim()) f(i);
  }
  KVEVICT_HOST_DEVICE void sync() const { c.sync(); }
  KVEVICT_HOST_DEVICE void plain_read(const void* p, std::size_t bytes) const { c.plain_read(p, bytes); }
  KVEVICT_HOST_DEVICE void plain_write(void* p, std::size_t bytes) const { c.plain_write(p, bytes); }
  template <class VE>
  KVEVICT_HOST_DEVICE void l1_norms(const VE* base, index_t rs, index_t es, index_t n, index_t d, float* norms) const {
    for (index_t t0 = 0; t0 < n; t0 += stage_rows) {
      const int m = n - t0 < stage_rows ? static_cast<int>(n - t0) : stage_rows;
      const float s = simt_staged_row_reduce(c, base + t0 * rs, rs, es, m, d, stage, value_l1_step{});
      if (c.thread() < m) {
        c.plain_write(norms + t0 + c.thread(), sizeof(float));
        norms[t0 + c.thread()] = s;
      }
    }
  }
};

/// The guard of a row's lengths: row_lengths[h] in [0, T] and, when weighting, value_lengths[h] in
/// [0, tv]; a bad row is counted once (by the caller flagged `count`).
template <class Ctx>
KVEVICT_HOST_DEVICE bool pp_row_lengths(Ctx& c, const pp_params& a, index_t tv, index_t h, index_t& L, index_t& vlen,
                                        int* bad, bool count) {
  if (!simt_row_length(c, a.row_lengths, h, a.T, L, bad, count)) return false;
  vlen = tv;
  return !a.weight_values || simt_row_length(c, a.value_lengths, h, tv, vlen, bad, count);
}

/// One block per (KV head or row, tile of pp_tile outputs), grid-stride: pp_run_tile with the inputs
/// staged in shared memory (37,888 B). At least two blocks per SM: without the minimum ptxas gave
/// the fp16 variant 80 registers and 56 B of spill on sm_80; with it every variant fits without
/// spilling.
template <class VE>
struct pp_tile_op {
  static constexpr int threads = stage_rows;
  static constexpr int min_blocks = 2;
  struct shared {
    float span[pp_span];
    float stash[pp_tile];
    float acc[pp_tile];
    float stage[stage_rows * stage_ld];
  };
  template <class Ctx>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared& sh, pp_params a, pp_values<VE> vals, int* bad) {
    const simt_loop_ctx<Ctx> ctx{c, sh.stage};
    const index_t tiles = pp_tiles_per_row(a.T), items = a.hkv * tiles;
    for (index_t item = c.block(); item < items; item += c.grid_dim()) {
      const index_t h = item / tiles, t0 = (item % tiles) * pp_tile;
      index_t L = 0, vlen = 0;
      if (!pp_row_lengths(c, a, vals.tv, h, L, vlen, bad, t0 == 0 && c.thread() == 0) || t0 >= L) continue;
      c.sync();  // the previous item is done with the shared buffers
      pp_run_tile(ctx, a, vals, h, L, vlen, t0, sh.span, sh.stash, sh.acc);
    }
  }
};

/// One thread per (KV head or row, work item of pp_run_block), grid-stride, for kernels above
/// 2 * pp_max_radius + 1. stash: [hkv][T] floats (pool_first with a group of several heads), else null.
template <class VE>
struct pp_block_op {
  static constexpr int threads = stage_rows;
  using shared = simt_no_shared;
  template <class Ctx>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared&, pp_params a, pp_values<VE> vals, float* stash,
                                       index_t items_per_row, int* bad) {
    const index_t items = a.hkv * items_per_row, stride = c.grid_dim() * c.block_dim();
    for (index_t it = c.block() * c.block_dim() + c.thread(); it < items; it += stride) {
      const index_t h = it / items_per_row, b = it % items_per_row;
      index_t L = 0, vlen = 0;
      if (!pp_row_lengths(c, a, vals.tv, h, L, vlen, bad, b == 0)) continue;
      pp_run_block(a, vals, h, L, vlen, b, stash != nullptr ? stash + h * a.T : nullptr);
    }
  }
};

/// The fused work (and pooling alone) in the decomposition pp_choose_variant picks; with head_max
/// weighting (factors non-null, a.factors == factors) the value-norm maxima first
/// (value_norm_max_launch; partial: hkv x stage_tiles(tv) floats).
template <class L, class VE>
void postprocess_launch(L& l, const pp_params& a, const pp_values<VE>& vals, float* partial, float* factors,
                        float* stash, int* bad, index_t cap = index_t(1) << 20) {
  if (a.hkv == 0 || a.T == 0) return;
  if (factors != nullptr) value_norm_max_launch(l, vals, a.value_lengths, a.hkv, partial, factors, cap);
  if (pp_choose_variant(a.pool, a.kernel) == pp_variant::tiles) {
    l.template run<pp_tile_op<VE>>(simt_shape{simt_grid(a.hkv * pp_tiles_per_row(a.T), cap), stage_rows}, a, vals,
                                   bad);
  } else {
    const index_t bpr = pp_items_per_row(a);
    l.template run<pp_block_op<VE>>(simt_shape{simt_grid((a.hkv * bpr + stage_rows - 1) / stage_rows, cap), stage_rows},
                                    a, vals, stash, bpr, bad);
  }
}

}  // namespace kvevict::detail
