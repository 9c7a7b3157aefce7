// kvevict/drivers/detail/driver_skeleton.hpp: what the four drivers share besides the checks
// (internal): the state memory plan, per-head scoring into per-thread slots, the selection an
// allocator runs and the recording of dropped rows.
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/budget.hpp>
#include <kvevict/detail/parallel.hpp>
#include <kvevict/drivers/detail/driver_checks.hpp>
#include <kvevict/metrics/footprint.hpp>
#include <kvevict/protect.hpp>
#include <kvevict/recipes.hpp>
#include <kvevict/select.hpp>
#include <kvevict/workspace.hpp>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace kvevict {
namespace detail {

inline int driver_threads(seq_t) { return 1; }
inline int driver_threads(par_t p) {
#if defined(_OPENMP)
  return p.threads > 0 ? p.threads : omp_get_max_threads();
#else
  (void)p;
  return 1;
#endif
}
inline int driver_thread_id() {
#if defined(_OPENMP)
  return omp_get_thread_num();
#else
  return 0;
#endif
}

/// Offsets of the pieces of a driver's state memory (64-byte aligned pieces).
struct mem_plan {
  std::size_t end = 0;
  std::size_t take(std::size_t bytes) {
    const std::size_t at = end;
    end = (end + bytes + 63) / 64 * 64;
    return at;
  }
  std::size_t bytes() const { return end + 64; }
};
inline unsigned char* align64(void* p) {
  auto* b = static_cast<unsigned char*>(p);
  return b + (64 - reinterpret_cast<std::uintptr_t>(b) % 64) % 64;
}
// ---------------------------------------------------------------------------------------------
// Scoring: one recipe_scores call per KV head over that head's rows, with its group's queries

/// Workspace bytes of one recipe_scores call over one KV head of up to C rows (the size grows
/// with the rows and the query rows, so the largest shape bounds every call).
template <class Backend>
result<std::size_t> head_score_bytes(Backend be, const recipe& r, index_t g, index_t rows, index_t C, index_t d,
                                     bool block_keys) {
  if (!uses_attention(r.kind)) return std::size_t{0};
  auto a = recipe_scores_workspace_size(be, r, g, rows, 1, C, d, 0);
  if (!a) return a.error();
  std::size_t n = *a;
  if (block_keys && r.kind != recipe_kind::h2o && r.kind != recipe_kind::tova &&
      r.source == query_source::external_block) {
    auto b = recipe_scores_workspace_size(be, r, g, rows, 1, C, d, rows);
    if (!b) return b.error();
    n = *b > n ? *b : n;
  }
  return n;
}

/// Per-backend scoring scratch: `slots` per-head workspaces of `slot` bytes and H int32 flags.
struct score_scratch {
  unsigned char* slots = nullptr;
  std::size_t slot = 0;
  int count = 0;
  std::int32_t* flags = nullptr;
};

/// Slots: seq 1 slot of the seq size; par with H >= 2 one seq-sized slot per thread (heads run
/// in parallel, each head sequentially inside); par with one head: one par-sized slot.
template <class Backend>
result<std::size_t> score_slot_bytes(Backend be, const recipe& r, index_t g, index_t rows, index_t C, index_t d,
                                     bool block_keys, index_t H, int* count) {
  if constexpr (std::is_same_v<Backend, par_t>) {
    if (H >= 2) {
      *count = driver_threads(be);
      return head_score_bytes(seq, r, g, rows, C, d, block_keys);
    }
  }
  *count = 1;
  return head_score_bytes(be, r, g, rows, C, d, block_keys);
}

inline void carve_score_scratch(workspace_carver& c, score_scratch& s, std::size_t slot, int count, index_t H) {
  s.slot = (slot + 63) / 64 * 64;
  s.count = count;
  s.slots = c.take<unsigned char>(s.slot * static_cast<std::size_t>(count));
  s.flags = c.take<std::int32_t>(static_cast<std::size_t>(H));
}

/// Scores every head of a validated layer into scores [H][C] (row h: its first lens[h] columns)
/// with recipe `r`. queries: [H_q][rows][d] (unused by Knorm / StreamingLLM); block_keys: [H][rows][d]
/// or empty. seq and par compute the same per-head calls, so their results are identical.
template <class Backend, class T, class Q>
status score_layer(Backend be, const score_scratch& s, const recipe& r, const layer_kv<T>& kv, index_t g,
                   const kv_view<const Q>& queries, const kv_view<const T>& block_keys, float* scores, index_t C) {
  const index_t H = kv.keys.heads;
  auto one = [&](auto inner, unsigned char* slot, index_t h) -> status {
    const index_t n = kv.keys.lens[h];
    if (n == 0) return {};
    workspace w{slot, s.slot};
    kv_view<const Q> qh{};
    if (uses_attention(r.kind)) qh = group_rows(queries, h, g);
    return recipe_scores(inner, w, r, qh, head_rows(kv.keys, h, n), head_rows(kv.values, h, n),
                         rows_view(scores + h * C, 1, n, C), one_head(block_keys, h));
  };
  if constexpr (std::is_same_v<Backend, par_t>) {
    if (H >= 2) {
    // at most s.count threads (the slots the workspace holds), whatever OpenMP's defaults are now
    (void)be;
    detail::parallel_for(par_t{s.count}, H, [&](index_t h) {
      unsigned char* slot = s.slots + static_cast<std::size_t>(driver_thread_id()) * s.slot;
      s.flags[h] = one(seq, slot, h).ok() ? 0 : 1;
    });
    for (index_t h = 0; h < H; ++h)
      if (s.flags[h] != 0) return one(seq, s.slots, h);  // re-run to report the error (deterministic)
    return {};
    }
  }
  for (index_t h = 0; h < H; ++h) KVEVICT_TRY(one(be, s.slots, h));
  return {};
}

// ---------------------------------------------------------------------------------------------
// Selection and recording

/// Identity kept lists (every row kept): cu from the lengths, pos = 0..len-1 per head.
inline void keep_all_rows(const std::int32_t* lens, index_t H, std::int32_t* cu, pos_t* pos) {
  cu[0] = 0;
  for (index_t h = 0; h < H; ++h) {
    cu[h + 1] = cu[h] + lens[h];
    for (std::int32_t j = 0; j < lens[h]; ++j) pos[cu[h] + j] = j;
  }
}

/// Workspace bytes of the selection select_layer runs for `kind` over scores [H][C], from the
/// selections' own size queries: select_topk's (per_head), at least as much as select_topk_flat's
/// (flattened, lava) or adakv_budgets' (adakv).
template <class Backend>
std::size_t select_bytes(Backend be, allocator kind, index_t H, index_t C) {
  std::size_t n = select_topk_workspace_size(be, C);
  std::size_t other = 0;
  if (kind == allocator::flattened || kind == allocator::lava) other = select_topk_flat_workspace_bytes(be, H, C);
  if (kind == allocator::adakv) other = adakv_budgets_workspace_bytes(be, H, C);
  return other > n ? other : n;
}

/// Records the rows of a layer that `kept` (row indices, ascending per head) does not list as
/// evicted after `step` tokens: their original positions go to rec.mark_evicted (all heads at
/// once, all or nothing). head_pos(h): pointer to head h's row positions; lens: rows per head;
/// scratch: room for every row of the layer, cu: H + 1.
template <class HeadPos>
status record_dropped(eviction_recorder* rec, index_t layer, index_t H, HeadPos head_pos, const std::int32_t* lens,
                      const ragged_positions& kept, index_t step, pos_t* scratch, std::int32_t* cu) {
  if (rec == nullptr) return {};
  cu[0] = 0;
  for (index_t h = 0; h < H; ++h) {
    const pos_t* p = head_pos(h);
    const pos_t* k = kept.pos + kept.cu[h];
    const index_t nk = kept.length(h), n = lens[h];
    std::int32_t at = cu[h];
    index_t i = 0;
    for (index_t j = 0; j < n; ++j) {
      if (i < nk && k[i] == j) {
        ++i;
        continue;
      }
      scratch[at++] = p[j];
    }
    cu[h + 1] = at;
  }
  if (cu[H] == 0) return {};
  return rec->mark_evicted(layer, ragged_positions{scratch, cu, H}, step);
}

/// The same, reading positions and lengths from an engine layer.
template <class T>
status record_dropped(eviction_recorder* rec, index_t layer, const layer_kv<T>& kv, const ragged_positions& kept,
                      index_t step, pos_t* scratch, std::int32_t* cu) {
  return record_dropped(
      rec, layer, kv.keys.heads, [&](index_t h) { return kv.positions + kv.keys.cu_capacity[h]; }, kv.keys.lens, kept,
      step, scratch, cu);
}

/// Selection of one layer's kept rows into (cu, pos) from scores [H][C] (row h: lens[h] columns):
///   per_head             head h keeps counts[h]           select_topk (ragged)
///   flattened, lava      the layer keeps `total`          select_topk_flat, no floors
///   adakv                the layer keeps B H (B = total / H) with floors  adakv_budgets
/// When the layer keeps every row the identity is written without selecting.
template <class Backend>
status select_layer(Backend be, workspace& ws, allocator kind, const matrix_view<const float>& scores,
                    const std::int32_t* lens, const std::int32_t* counts, index_t total, const adakv_options& ao,
                    std::int32_t* cu, pos_t* pos) {
  const index_t H = scores.extent(0);
  index_t held = 0;
  for (index_t h = 0; h < H; ++h) held += lens[h];
  if (kind == allocator::per_head) {
    bool all = true;
    for (index_t h = 0; h < H; ++h) all = all && counts[h] == lens[h];
    if (all) {
      keep_all_rows(lens, H, cu, pos);
      return {};
    }
    cu[0] = 0;
    for (index_t h = 0; h < H; ++h) cu[h + 1] = cu[h] + counts[h];
    return select_topk(be, ws, scores, lens, ragged_positions_out{pos, cu, H});
  }
  if (total == held) {
    keep_all_rows(lens, H, cu, pos);
    return {};
  }
  if (kind == allocator::adakv) return adakv_budgets(be, ws, scores, lens, total / H, ao, cu, pos);
  return select_topk_flat(be, ws, scores, lens, total, nullptr, cu, pos);
}

}  // namespace detail
}  // namespace kvevict
