// The CUDA paged kernels as ops over the SIMT context (detail/block/simt.hpp, simt_bodies.hpp) and
// their launch sequences, written once for both launchers: the CUDA overloads of
// kvevict/cuda/paged.cuh call them with cuda_launcher, tests/test_paged_device_logic.cpp with
// simt_launcher (the host SIMT executor). Not API.
//
// The paged compaction (detail/block/paged_block.hpp's steps): reset of the page marks and the
// problem count, mark, validate, finish (one block), then the in-place tiles of compact_ops.hpp over
// the key pool and the value pool. The paged scores: Knorm and the value weighting, one block per
// row (grid-stride).
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/detail/block/compact_ops.hpp>
#include <kvevict/detail/block/paged_block.hpp>
#include <kvevict/detail/block/select_ops.hpp>
#include <kvevict/detail/block/simt_bodies.hpp>
#include <kvevict/paged_types.hpp>

#include <cstdint>

namespace kvevict::detail {

/// Step 0: marks[pages] and *problems zeroed (grid-stride).
struct paged_reset_op {
  static constexpr int threads = 256;
  using shared = simt_no_shared;
  template <class Ctx>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared&, std::uint32_t* marks, index_t pages, int* problems) {
    const index_t stride = c.grid_dim() * c.block_dim();
    for (index_t i = c.block() * c.block_dim() + c.thread(); i < pages; i += stride) marks[i] = 0;
    if (c.block() == 0 && c.thread() == 0) *problems = 0;
  }
};

/// Step 1: every listed page counted (grid-stride); a listed count outside [0, pool pages] is one
/// problem (nothing is marked).
struct paged_mark_op {
  static constexpr int threads = compact_op_threads;
  using shared = simt_no_shared;
  template <class Ctx>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared&, page_table table, index_t pool_pages, std::uint32_t* marks,
                                       simt_bad bad) {
    const index_t listed = table.indptr[table.lists];
    if (listed < 0 || listed > pool_pages) {
      if (c.block() == 0 && c.thread() == 0) bad.add(c, 1);
      return;
    }
    const auto count = [&c](std::uint32_t* m) { c.atomic_add(m, 1u); };
    int n = 0;
    const index_t stride = c.grid_dim() * c.block_dim();
    for (index_t i = c.block() * c.block_dim() + c.thread(); i < listed; i += stride)
      n += paged_mark_page(table, i, pool_pages, marks, count);
    bad.add(c, n);
  }
};

/// Step 2: row r's table entries, kept list and positions (validate_op of compact_ops.hpp).
struct paged_check {
  template <class Block, class T>
  KVEVICT_HOST_DEVICE static index_t run(Block& blk, index_t r, paged_inplace_heads<T> heads,
                                         const std::uint32_t* marks) {
    return paged_validate_row(blk, heads, r, marks);
  }
};

/// Step 3 (one block): all or nothing; writes the lengths, freed pages and rows to move.
template <class T>
struct paged_finish_op {
  static constexpr int threads = compact_op_threads;
  struct shared {
    ucount scan[threads / 32];
  };
  template <class Ctx>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared& sh, paged_inplace_heads<T> heads, const int* problems,
                                       paged_compaction_out out, index_t* head_rows, simt_bad bad) {
    simt_block<Ctx, threads> blk{c, sh.scan};
    const index_t added = paged_finish(blk, heads, *problems, out, head_rows);
    if (c.thread() == 0) bad.add(c, static_cast<int>(added));
  }
};

/// Knorm: block r (grid-stride) scores row r's tokens; a row its table does not describe (bad
/// offsets, last page, page ids, or more tokens than out's columns) is skipped and counted.
template <class T>
struct paged_key_norm_op {
  static constexpr int threads = compact_op_threads;
  using shared = simt_no_shared;
  template <class Ctx>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared&, paged_layer<T> layer, matrix_view<float> out, simt_bad bad) {
    for (index_t r = c.block(); r < layer.rows(); r += c.grid_dim()) {
      const index_t n = paged_readable_row(layer, r, out.extent(1));
      if (n < 0) {
        if (c.thread() == 0) bad.add(c, 1);
        continue;
      }
      for (index_t j = c.thread(); j < n; j += threads)
        out.data_handle()[r * out.stride(0) + j * out.stride(1)] = key_norm_score(layer.key(r, j), layer.keys.dim, 1);
    }
  }
};

/// Value weighting: block r (grid-stride) weights row r's `group` score rows; head_max reduces the
/// threads' maxima through shared memory first (max_nan: the order does not matter). Rows the
/// table does not describe are skipped, counted.
template <class T>
struct paged_weight_op {
  static constexpr int threads = compact_op_threads;
  struct shared {
    float part[threads];
  };
  template <class Ctx>
  KVEVICT_HOST_DEVICE static void body(Ctx& c, shared& sh, paged_layer<T> layer, matrix_view<float> scores,
                                       index_t group, bool head_max, simt_bad bad) {
    const int tid = static_cast<int>(c.thread());
    for (index_t r = c.block(); r < layer.rows(); r += c.grid_dim()) {
      const index_t n = paged_readable_row(layer, r, scores.extent(1));
      if (n < 0) {
        if (tid == 0) bad.add(c, 1);
        continue;
      }
      float row_max = 0.0f;
      if (head_max) {
        c.st(sh.part + tid, paged_value_max_part(layer, r, n, tid, threads));
        c.sync();
        for (int i = 0; i < threads; ++i) row_max = max_nan(row_max, c.ld(sh.part + i));
        c.sync();  // every thread has read the parts before the next row writes them
      }
      paged_weight_part(layer, r, n, group, scores.data_handle(), scores.stride(0), scores.stride(1), head_max,
                        row_max, tid, threads);
    }
  }
};

// ---- launch sequences (after the host-side checks) ----------------------------------------------------

/// Where the paged compaction keeps its state (workspace on the GPU): marks[pool pages], one
/// problem count, head_rows[rows], the in-place tiles' ordering state.
struct paged_compact_state {
  std::uint32_t* marks;
  int* problems;
  index_t* head_rows;
  inplace_sync sync;
};

/// compact_paged's kernels (rows or lists > 0): reset, mark, validate, finish, then the in-place
/// tiles over the key pool and the value pool. Tests may force the tile rows, blocks per row and a
/// grid cap (inplace_copy_launch).
template <class L, class T>
void paged_compact_launch(L& l, const paged_layer<T>& layer, const ragged_positions& kept,
                          const paged_compaction_out& out, const paged_compact_state& st, int* bad,
                          index_t tile_rows = -1, index_t parts = 0, index_t cap = index_t(1) << 20) {
  const index_t R = layer.rows(), P = layer.keys.pages;
  const simt_bad count{bad, st.problems};
  const paged_inplace_heads<T> kh{layer.keys, layer.table, kept, layer.kv_heads, layer.lists};
  const paged_inplace_heads<T> vh{layer.values, layer.table, kept, layer.kv_heads, layer.lists};
  l.template run<paged_reset_op>(simt_shape{simt_grid((P + 255) / 256, cap), 256}, st.marks, P, st.problems);
  l.template run<paged_mark_op>(simt_shape{simt_grid((P + compact_op_threads - 1) / compact_op_threads, cap),
                                           compact_op_threads},
                                layer.table, P, st.marks, count);
  l.template run<validate_op<paged_check>>(simt_shape{simt_grid(R, cap), compact_op_threads}, R, count, kh,
                                           static_cast<const std::uint32_t*>(st.marks));
  l.template run<paged_finish_op<T>>(simt_shape{1, compact_op_threads}, kh, static_cast<const int*>(st.problems), out,
                                     st.head_rows, count);
  for (const paged_inplace_heads<T>* heads : {&kh, &vh}) {
    const page_pool<T>& p = heads->pool;
    const std::uint64_t bits = addr_bits(p.data) | static_cast<std::uint64_t>(p.page_stride) * sizeof(T) |
                               static_cast<std::uint64_t>(p.token_stride) * sizeof(T) |
                               static_cast<std::uint64_t>(p.head_stride) * sizeof(T);
    inplace_copy_launch<T>(l, *heads, true, bits, p.dim, 1, static_cast<const index_t*>(st.head_rows), st.sync,
                           tile_rows, parts, cap);
  }
}

/// paged_key_norm_scores (rows > 0).
template <class L, class T>
void paged_key_norm_launch(L& l, const paged_layer<T>& layer, const matrix_view<float>& out, int* bad,
                           index_t cap = index_t(1) << 20) {
  l.template run<paged_key_norm_op<T>>(simt_shape{simt_grid(layer.rows(), cap), compact_op_threads}, layer, out,
                                       simt_bad{bad, nullptr});
}

/// paged_weight_by_value_norm (rows > 0; scores' rows a multiple of the layer's).
template <class L, class T>
void paged_weight_launch(L& l, const matrix_view<float>& scores, const paged_layer<T>& layer, bool head_max, int* bad,
                         index_t cap = index_t(1) << 20) {
  l.template run<paged_weight_op<T>>(simt_shape{simt_grid(layer.rows(), cap), compact_op_threads}, layer, scores,
                                     scores.extent(0) / layer.rows(), head_max, simt_bad{bad, nullptr});
}

}  // namespace kvevict::detail
