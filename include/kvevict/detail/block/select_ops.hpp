// The CUDA selection kernels as ops over the SIMT context (detail/block/simt.hpp,
// detail/block/simt_bodies.hpp) and their launch sequences, written once for both launchers: the
// CUDA overloads of kvevict/cuda/select.cuh call them with cuda_launcher (one generic __global__
// per op), the tests with simt_launcher (the host SIMT executor: fibers, real barriers, warps,
// interleaved blocks with the multi-block tickets). Not API.
//
// The bodies are the item loops, tickets, fences and barriers around the block-generic functions of
// detail/block/select_block.hpp, which see the block through simt_block: each thread runs its own
// part, and the block-wide exclusive sum is a warp-shuffle scan (exact: unsigned integers) with the
// warps' totals in shared memory. Every block has select_block_threads (256) threads; shared memory
// per block: select_smem (42008 B) + the scan's 64 B, or only the scan's 64 B (count, row totals,
// counts and batch offsets ops).
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/detail/block/batch_block.hpp>
#include <kvevict/detail/block/block.hpp>
#include <kvevict/detail/block/select_block.hpp>
#include <kvevict/detail/block/simt_bodies.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace kvevict::detail {

/// The Block contract of detail/block/block.hpp over a SIMT context `c` of Threads threads (a
/// multiple of 32): each() runs the calling thread's part; exclusive_sum is an inclusive warp scan
/// by shuffles, the warps' totals through shared memory `scan` (Threads / 32 words), two barriers.
template <class Ctx, int Threads>
struct simt_block {
  static_assert(Threads % 32 == 0, "simt_block: whole warps");
  Ctx& c;
  ucount* scan;

  KVEVICT_HOST_DEVICE static constexpr int size() noexcept { return Threads; }
  template <class F>
  KVEVICT_HOST_DEVICE void each(F&& f) const {
    f(static_cast<int>(c.thread()));
  }
  KVEVICT_HOST_DEVICE void sync() const { c.sync(); }
  template <class V, class Then>
  KVEVICT_HOST_DEVICE void exclusive_sum(const V& v, const Then& then) const {
    const int tid = static_cast<int>(c.thread()), lane = c.lane(), warp = c.warp();
    const ucount own = v(tid);
    ucount x = own;
    for (int d = 1; d < 32; d *= 2) {
      const ucount y = c.shfl(x, lane >= d ? lane - d : lane);
      if (lane >= d) x += y;
    }
    if (lane == 31) c.st(scan + warp, x);
    c.sync();
    ucount before = 0, total = 0;
    for (int w = 0; w < Threads / 32; ++w) {
      const ucount t = c.ld(scan + w);
      if (w < warp) before += t;
      total += t;
    }
    then(tid, own, before + x - own, total);
    c.sync();  // the scan words and anything `then` wrote are reusable / visible
  }
  KVEVICT_HOST_DEVICE void atomic_add(std::uint32_t* p, std::uint32_t v) const { c.atomic_add(p, v); }
  KVEVICT_HOST_DEVICE void atomic_add(ucount* p, ucount v) const { c.atomic_add(p, v); }
  KVEVICT_HOST_DEVICE void plain_read(const void* p, std::size_t bytes) const { c.plain_read(p, bytes); }
  KVEVICT_HOST_DEVICE void plain_write(void* p, std::size_t bytes) const { c.plain_write(p, bytes); }
};

KVEVICT_HOST_DEVICE inline score_keys select_row_keys(const matrix_view<const float>& scores, index_t r) {
  return {scores.data_handle() + r * scores.stride(0), scores.stride(1)};
}

/// Row descriptions normally select row r of the scores matrix (R = its rows); a description with
/// members keys(scores, r) and count(scores) places its rows itself (varlen batches: row s * H + h
/// is columns cu_seqlens[s] .. of matrix row h).
template <class Rows, class = void>
struct rows_place_keys : std::false_type {};
template <class Rows>
struct rows_place_keys<Rows, std::void_t<decltype(std::declval<const Rows&>().keys(
                                 std::declval<const matrix_view<const float>&>(), index_t(0)))>> : std::true_type {};
template <class Rows>
KVEVICT_HOST_DEVICE score_keys row_keys(const matrix_view<const float>& scores, const Rows& rows, index_t r) {
  if constexpr (rows_place_keys<Rows>::value) return rows.keys(scores, r);
  else return select_row_keys(scores, r);
}
template <class Rows>
KVEVICT_HOST_DEVICE index_t row_count(const matrix_view<const float>& scores, const Rows& rows) {
  if constexpr (rows_place_keys<Rows>::value) return rows.count(scores);
  else return scores.extent(0);
}

/// Shared memory of every selection op.
struct select_shared {
  select_smem sm;
  ucount scan[select_block_threads / 32];
};

/// Base of the block-per-item selection ops: 256 threads, at least 3 blocks per SM, select_smem.
struct select_op_base {
  static constexpr int threads = select_block_threads;
  static constexpr int min_blocks = 3;
  using shared = select_shared;
};
/// The same for ops that need only the scan's shared memory.
struct select_scan_op_base {
  static constexpr int threads = select_block_threads;
  static constexpr int min_blocks = 3;
  struct shared {
    ucount scan[select_block_threads / 32];
  };
};

/// Block r (grid-stride) selects row r: passes in shared memory, ordered emit. With `states`, the
/// final state of each row is stored (the flattened selection's floors).
template <class Rows>
struct select_one_block_op : select_op_base {
  template <class Ctx>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared& sh, matrix_view<const float> scores, Rows rows, bool full_key,
                                       bool emit, row_state* states, simt_bad bad) {
    simt_block<Ctx, threads> blk{c, sh.scan};
    const index_t R = row_count(scores, rows);
    for (index_t r = c.block(); r < R; r += c.grid_dim()) {
      const row_state s = one_block_row(blk, row_keys(scores, rows, r), rows, r, full_key, emit, states, sh.sm);
      if (s.mode == row_bad && c.thread() == 0) bad.add(c, 1);
      c.sync();  // shared memory is reused by the next row
    }
  }
};

/// Pass `pass` over every (row, chunk) item: chunk histograms into the row's global histogram; the
/// block that takes a row's last ticket chooses the bucket and stores the row's state.
template <class Rows>
struct select_multi_pass_op : select_op_base {
  template <class Ctx>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared& sh, matrix_view<const float> scores, Rows rows, select_dev_ws w,
                                       select_plan plan, int pass, bool full_key, simt_bad bad) {
    simt_block<Ctx, threads> blk{c, sh.scan};
    const index_t R = row_count(scores, rows), C = plan.chunks;
    for (index_t item = c.block(); item < R * C; item += c.grid_dim()) {
      const index_t r = item / C, ch = item % C;
      bool bad_row = false;
      const bool worked =
          multi_pass_chunk(blk, row_keys(scores, rows, r), rows, w, plan, R, r, ch, pass, sh.sm, bad_row);
      if (bad_row && c.thread() == 0) bad.add(c, 1);
      if (worked) {
        c.fence();  // this block's histogram atomics before its ticket
        c.sync();
        if (c.thread() == 0)
          c.st(&sh.sm.flag, c.atomic_add(&w.tickets[index_t(pass) * R + r], 1u) == unsigned(C - 1) ? 1 : 0);
        c.sync();
        if (c.ld(&sh.sm.flag) != 0) {
          c.fence();
          const std::uint32_t* h = w.hist + (index_t(pass) * R + r) * radix_bins;
          multi_pass_finish(blk, [&c, h](int b) { return c.ld_cg(h + b); }, rows, w, r, pass, full_key, sh.sm);
        }
      }
      c.sync();
    }
  }
};

/// Every chunk of the rows still selecting: its packed (above, tied) counts (!Emit), or its ordered
/// emit from the counts of the chunks before it (Emit; the counts kernel needs only the scan's
/// shared memory).
template <class Rows, bool Emit>
struct select_multi_chunk_op {
  static constexpr int threads = select_block_threads;
  static constexpr int min_blocks = 3;
  using shared = std::conditional_t<Emit, select_shared, select_scan_op_base::shared>;
  template <class Ctx>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared& sh, matrix_view<const float> scores, Rows rows, select_dev_ws w,
                                       select_plan plan) {
    simt_block<Ctx, threads> blk{c, sh.scan};
    const index_t R = row_count(scores, rows), C = plan.chunks;
    for (index_t item = c.block(); item < R * C; item += c.grid_dim()) {
      if constexpr (Emit) {
        multi_emit_chunk(blk, row_keys(scores, rows, item / C), rows, w, plan, item / C, item % C, sh.sm);
        c.sync();
      } else {
        multi_count_chunk(blk, row_keys(scores, rows, item / C), rows, w, plan, item / C, item % C);
      }
    }
  }
};

// ---- the flattened selection ------------------------------------------------------------------------

/// Row r's state from its length, floor and floor threshold (one thread per row); bad rows and the
/// layer sums by atomics.
struct flat_rows_op {
  static constexpr int threads = 256;
  using shared = simt_no_shared;
  template <class Ctx>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared&, const std::int32_t* lengths, index_t T,
                                       const std::int32_t* floors, index_t R, flat_dev_ws w) {
    const index_t stride = c.grid_dim() * c.block_dim();
    for (index_t r = c.block() * c.block_dim() + c.thread(); r < R; r += stride) {
      const flat_dev_row f = flat_row_at(lengths, T, floors, w.sel.states, r);
      w.rows[r] = f;
      if (f.bad != 0) {
        c.atomic_add(&w.layer->bad_rows, 1);
      } else {
        c.atomic_add(&w.layer->sum_len, static_cast<ucount>(f.n));
        c.atomic_add(&w.layer->sum_floor, static_cast<ucount>(f.floor));
      }
    }
  }
};

/// Layer pass `pass` over every (row, chunk) item; the block with the pass's last ticket chooses the
/// bucket.
struct flat_layer_pass_op : select_op_base {
  template <class Ctx>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared& sh, matrix_view<const float> scores, flat_dev_ws w,
                                       index_t total, int pass) {
    simt_block<Ctx, threads> blk{c, sh.scan};
    radix_threshold g;
    if (!flat_pass_threshold(*w.layer, total, pass, g)) return;  // uniform over the grid
    const index_t R = scores.extent(0), C = w.layer_plan.chunks;
    for (index_t item = c.block(); item < R * C; item += c.grid_dim()) {
      flat_layer_chunk(blk, select_row_keys(scores, item / C), w, R, item / C, item % C, g, pass, sh.sm);
      c.fence();
      c.sync();
      if (c.thread() == 0)
        c.st(&sh.sm.flag, c.atomic_add(&w.tickets[pass], ucount(1)) == static_cast<ucount>(R * C - 1) ? 1 : 0);
      c.sync();
      if (c.ld(&sh.sm.flag) != 0) {
        c.fence();
        const ucount* h = w.layer_hist + index_t(pass) * radix_bins;
        flat_finish_pass(blk, [&c, h](int b) { return c.ld_cg(h + b); }, w.rows, R, pass, g, *w.layer, sh.sm);
      }
      c.sync();
    }
  }
};

/// Block r (grid-stride): row r's remaining keys above and equal to the layer threshold.
struct flat_row_totals_op : select_scan_op_base {
  template <class Ctx>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared& sh, flat_dev_ws w, index_t R, index_t total) {
    simt_block<Ctx, threads> blk{c, sh.scan};
    radix_threshold g;
    if (!flat_pass_threshold(*w.layer, total, 0, g)) return;
    for (index_t r = c.block(); r < R; r += c.grid_dim()) {
      flat_row_totals_of(blk, w, R, r);
      c.sync();
    }
  }
};

/// One block: every row's count, the offsets kept_cu, the layer's error report.
struct flat_counts_op : select_scan_op_base {
  template <class Ctx>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared& sh, flat_dev_ws w, index_t R, index_t total, std::int32_t* cu,
                                       simt_bad bad) {
    simt_block<Ctx, threads> blk{c, sh.scan};
    const int n = flat_counts_of(blk, w, R, total, cu);
    if (c.thread() == 0) bad.add(c, n);
  }
};

// ---- the per-head batched selection's offsets --------------------------------------------------------

/// One block: the ragged offsets kept_cu of select_topk_batch from per-head budgets
/// (detail/block/batch_block.hpp); heads whose budget or length is bad are counted into *bad.
struct batch_offsets_op {
  static constexpr int threads = select_block_threads;
  using shared = select_scan_op_base::shared;
  template <class Ctx>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared& sh, const std::int32_t* budgets, const std::int32_t* row_lengths,
                                       const std::int32_t* cu_seqlens, index_t R, index_t H, index_t T,
                                       index_t capacity, std::int32_t* cu, int* bad, bool flattened) {
    simt_block<Ctx, threads> blk{c, sh.scan};
    const index_t added = batch_offsets(blk, budgets, row_lengths, cu_seqlens, R, H, T, capacity, cu, flattened);
    if (c.thread() == 0 && added > 0 && bad != nullptr)
      c.atomic_add(bad, static_cast<int>(added < 1 << 30 ? added : 1 << 30));
  }
};

/// Launched for R = 0 too: kept_cu[0] = 0, as the host writes it. cu_seqlens: varlen lengths (or
/// null: row_lengths, padded). flattened: per-sequence counts (batch_flat_launch).
template <class L>
void batch_offsets_launch(L& l, const std::int32_t* budgets, const std::int32_t* row_lengths,
                          const std::int32_t* cu_seqlens, index_t R, index_t H, index_t T, index_t capacity,
                          std::int32_t* cu, int* bad, bool flattened = false) {
  l.template run<batch_offsets_op>(simt_shape{1, select_block_threads}, budgets, row_lengths, cu_seqlens, R, H, T,
                                   capacity, cu, bad, flattened);
}

/// Block s (grid-stride): sequence s of a flattened batch (detail/block/batch_block.hpp,
/// batch_flat_sequence). At least 2 blocks per SM (not 3): one block per sequence, and at 3 the
/// register cap (80) spilled.
struct batch_flat_op {
  static constexpr int threads = select_block_threads;
  static constexpr int min_blocks = 2;
  using shared = select_shared;
  template <class Ctx>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared& sh, batch_keys b, const std::int32_t* budgets, std::int32_t* cu,
                                       pos_t* pos) {
    simt_block<Ctx, threads> blk{c, sh.scan};
    for (index_t s = c.block(); s < b.S; s += c.grid_dim()) {
      batch_flat_sequence(blk, b, budgets, s, cu, pos, sh.sm);
      c.sync();  // shared memory is reused by the next sequence
    }
  }
};

/// select_topk_batch(cuda)'s flattened budgets: the offsets op (per-sequence counts, all or
/// nothing; problems into *bad), then one block per sequence. `capacity`: room in pos (0 when pos
/// is null). `cap` bounds the grid (tests).
template <class L>
void batch_flat_launch(L& l, const batch_keys& b, const std::int32_t* budgets, index_t capacity, std::int32_t* cu,
                       pos_t* pos, int* bad, index_t cap = index_t(1) << 20) {
  const index_t R = b.S * b.H;
  batch_offsets_launch(l, budgets, b.row_lengths, b.cu_seqlens, R, b.H, b.T, capacity, cu, bad, true);
  if (R > 0) l.template run<batch_flat_op>(simt_shape{simt_grid(b.S, cap), select_block_threads}, b, budgets, cu, pos);
}

// ---- launch sequences (after the host-side checks and the workspace zeroing) -------------------------

/// Threshold search (and, with `emit`, the ordered emit) of every row described by `rows`. `cap`
/// bounds the grids (tests pass a small one to exercise the grid-stride loops).
template <class L, class Rows>
void select_rows_launch(L& l, const matrix_view<const float>& scores, const Rows& rows, const select_dev_ws& w,
                        const select_plan& plan, bool full_key, bool emit, simt_bad bad,
                        index_t cap = index_t(1) << 20) {
  const index_t R = row_count(scores, rows);
  if (R == 0) return;
  constexpr index_t threads = select_block_threads;
  if (!plan.multi) {
    l.template run<select_one_block_op<Rows>>(simt_shape{simt_grid(R, cap), threads}, scores, rows, full_key, emit,
                                              w.states, bad);
    return;
  }
  const simt_shape grid{simt_grid(R * plan.chunks, cap), threads};
  for (int pass = 0; pass < radix_passes; ++pass)
    l.template run<select_multi_pass_op<Rows>>(grid, scores, rows, w, plan, pass, full_key, bad);
  if (!emit) return;
  const stored_rows<Rows> stored{rows, w.states};
  l.template run<select_multi_chunk_op<stored_rows<Rows>, false>>(grid, scores, stored, w, plan);
  l.template run<select_multi_chunk_op<stored_rows<Rows>, true>>(grid, scores, stored, w, plan);
}

/// The emit of rows whose thresholds are given (flattened selection).
template <class L, class Rows>
void emit_given_launch(L& l, const matrix_view<const float>& scores, const Rows& rows, const select_dev_ws& w,
                       const select_plan& plan, index_t cap = index_t(1) << 20) {
  const index_t R = scores.extent(0);
  if (R == 0) return;
  constexpr index_t threads = select_block_threads;
  if (!plan.multi) {
    l.template run<select_one_block_op<Rows>>(simt_shape{simt_grid(R, cap), threads}, scores, rows, true, true,
                                              static_cast<row_state*>(nullptr), simt_bad{});
    return;
  }
  const simt_shape grid{simt_grid(R * plan.chunks, cap), threads};
  l.template run<select_multi_chunk_op<Rows, false>>(grid, scores, rows, w, plan);
  l.template run<select_multi_chunk_op<Rows, true>>(grid, scores, rows, w, plan);
}

/// The flattened selection's kernels (w.sel's zeroed part already zeroed): the floors' thresholds,
/// the rows' states, the three layer passes, the rows' totals, the counts and offsets, the emit.
template <class L>
void select_flat_launch(L& l, const matrix_view<const float>& scores, const std::int32_t* row_lengths, index_t total,
                        const std::int32_t* floors, std::int32_t* kept_cu, pos_t* kept_pos, const flat_dev_ws& w,
                        const select_plan& plan, simt_bad bad, index_t cap = index_t(1) << 20) {
  const index_t R = scores.extent(0), T = scores.extent(1);
  if (floors != nullptr)
    select_rows_launch(l, scores, floor_rows{row_lengths, T, floors}, w.sel, plan, true, false, simt_bad{}, cap);
  l.template run<flat_rows_op>(simt_shape{simt_grid((R + 255) / 256, cap), 256}, row_lengths, T, floors, R, w);
  if (R > 0) {
    const simt_shape layer{simt_grid(R * w.layer_plan.chunks, cap), select_block_threads};
    for (int pass = 0; pass < radix_passes; ++pass) l.template run<flat_layer_pass_op>(layer, scores, w, total, pass);
    l.template run<flat_row_totals_op>(simt_shape{simt_grid(R, cap), select_block_threads}, w, R, total);
  }
  l.template run<flat_counts_op>(simt_shape{1, select_block_threads}, w, R, total, kept_cu, bad);
  if (kept_pos != nullptr)
    emit_given_launch(l, scores, flat_emit_rows{w.rows, static_cast<const std::int32_t*>(kept_cu), kept_pos}, w.sel,
                      plan, cap);
}

}  // namespace kvevict::detail
