// kvevict/drivers/detail/driver_skeleton.hpp: what the four drivers share besides the checks
// (internal): the state memory plan, per-head scoring into per-thread slots, the selection an
// allocator runs and the recording of dropped rows.
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/budget.hpp>
#include <kvevict/comm.hpp>
#include <kvevict/distributed.hpp>
#include <kvevict/detail/base/parallel.hpp>
#include <kvevict/drivers/detail/driver_checks.hpp>
#include <kvevict/drivers/detail/paged_rows.hpp>
#include <kvevict/metrics/footprint.hpp>
#include <kvevict/protect.hpp>
#include <kvevict/recipes.hpp>
#include <kvevict/select.hpp>
#include <kvevict/workspace.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>

namespace kvevict {
namespace detail {

/// The threads a driver's backend runs heads on: thread_count (1 for seq, par's threads or the
/// OpenMP default, on(ex)'s concurrency).
template <class Backend>
int driver_threads(Backend be) {
  return thread_count(be);
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

/// Workspace bytes of one recipe_scores call over one KV head of up to C rows, ragged or paged
/// (paged_row_recipe_scores; the size grows with the rows and the query rows, so the largest
/// shape bounds every call).
template <class Backend>
result<std::size_t> head_score_bytes(Backend be, const recipe& r, index_t g, index_t rows, index_t C, index_t d,
                                     bool block_keys) {
  if (!uses_attention(r.kind)) return std::size_t{0};
  std::size_t n = 0;
  const bool with_block = block_keys && r.kind != recipe_kind::h2o && r.kind != recipe_kind::tova &&
                          r.source == query_source::external_block;
  for (const index_t bk : {index_t{0}, with_block ? rows : index_t{0}}) {
    auto a = recipe_scores_workspace_bytes(be, r, g, rows, 1, C, d, bk);
    if (!a) return a.error();
    auto p = paged_row_recipe_bytes(be, r, g, rows, C, d, bk);
    if (!p) return p.error();
    n = std::max({n, *a, *p});
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

/// Slots: seq 1 slot of the seq size; par or on(ex) with H >= 2 one seq-sized slot per thread or
/// worker (heads run in parallel, each head sequentially inside); with one head: one slot of the
/// backend's size.
template <class Backend>
result<std::size_t> score_slot_bytes(Backend be, const recipe& r, index_t g, index_t rows, index_t C, index_t d,
                                     bool block_keys, index_t H, int* count) {
  if constexpr (!std::is_same_v<Backend, seq_t>) {
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

/// recipe_scores over head h (n rows) of a ragged layer, or over row h of a paged one.
template <class Backend, class Q, class T>
status score_head(Backend be, workspace& w, const recipe& r, const kv_view<const Q>& qh, const layer_kv<T>& kv,
                  index_t h, index_t n, const matrix_view<float>& out, const kv_view<const T>& bk) {
  return recipe_scores(be, w, r, qh, head_rows(kv.keys, h, n), head_rows(kv.values, h, n), out, bk);
}
template <class Backend, class Q, class T>
status score_head(Backend be, workspace& w, const recipe& r, const kv_view<const Q>& qh, const paged_rows<T>& kv,
                  index_t h, index_t, const matrix_view<float>& out, const kv_view<const T>& bk) {
  return paged_row_recipe_scores(be, w, r, qh, kv.layer, h, bk, out);
}

/// Scores every head of a validated layer (a layer_kv or paged_rows) into scores [H][C] (row h:
/// its first lens[h] columns) with recipe `r`. queries: [H_q][rows][d] (unused by Knorm /
/// StreamingLLM); block_keys: [H][rows][d] or empty. seq and par compute the same per-head calls,
/// so their results are identical.
template <class Backend, class KV, class Q, class T>
status score_layer(Backend be, const score_scratch& s, const recipe& r, const KV& kv, index_t g,
                   const kv_view<const Q>& queries, const kv_view<const T>& block_keys, float* scores, index_t C) {
  const index_t H = layer_heads(kv);
  auto one = [&](auto inner, unsigned char* slot, index_t h) -> status {
    const index_t n = layer_lens(kv)[h];
    if (n == 0) return {};
    workspace w{slot, s.slot};
    kv_view<const Q> qh{};
    if (uses_attention(r.kind)) qh = group_rows(queries, h, g);
    return score_head(inner, w, r, qh, kv, h, n, rows_view(scores + h * C, 1, n, C), one_head(block_keys, h));
  };
  if constexpr (!std::is_same_v<Backend, seq_t>) {
    if (H >= 2) {
    // at most s.count workers (the slots the workspace holds), whatever OpenMP's defaults are now
    auto heads = [&](index_t h, int worker) {
      unsigned char* slot = s.slots + static_cast<std::size_t>(worker) * s.slot;
      s.flags[h] = one(seq, slot, h).ok() ? 0 : 1;
    };
    if constexpr (std::is_same_v<Backend, par_t>) detail::parallel_for_workers(par_t{s.count}, H, s.count, heads);
    else detail::parallel_for_workers(be, H, s.count, heads);
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
  std::size_t n = select_topk_workspace_bytes(be, C);
  std::size_t other = 0;
  if (kind == allocator::flattened || kind == allocator::lava) other = select_topk_flat_workspace_bytes(be, H, C);
  if (kind == allocator::adakv) other = adakv_budgets_workspace_bytes(be, H, C);
  return other > n ? other : n;
}

/// Workspace bytes of a driver call's selection: select_bytes(local_kind) in one process; across
/// the tensor-parallel ranks (`sharded`) the sharded selection's (sharded_flat_workspace_bytes),
/// for lava at least the sharded entropy's per-head records of all `ranks` ranks' H heads.
template <class Backend>
std::size_t driver_select_bytes(Backend be, bool sharded, allocator kind, allocator local_kind, index_t H, index_t C,
                                index_t ranks) {
  if (!sharded) return select_bytes(be, local_kind, H, C);
  const std::size_t n = sharded_flat_workspace_bytes(be, H, C, kind == allocator::adakv);
  if (kind != allocator::lava) return n;
  return std::max(n, sharded_lava_entropy_workspace_bytes(H * ranks));
}

/// lava's entropy of a layer's scores (protection `prot`, normalization `norm`): in one process
/// over its heads; `sharded`, every rank gets the entropy over all the layer's heads (the call
/// reached its collective: *in_collective = true).
template <class Backend>
status driver_layer_entropy(Backend be, workspace& sel, comm_ref tp, bool sharded, bool* in_collective,
                            const matrix_view<const float>& sv, const std::int32_t* lens, const protection& prot,
                            entropy_norm norm, double* e) {
  lava_entropy_options eo;
  eo.prot = prot;
  eo.norm = norm;
  if (!sharded) return lava_layer_entropy(be, sv, lens, eo, e);
  *in_collective = true;
  return lava_layer_entropy(be, sel, tp, sv, lens, eo, e);
}

/// Tensor parallelism: a call that failed on this rank before its collective still joins the
/// agreement that collective opens (`nsums` zero sums, at most 2), so the other ranks return the
/// same error instead of waiting.
inline status join_failed_call(comm_ref tp, const char* fn, const status& st, int nsums) {
  std::int64_t sums[2] = {};
  return agree(tp, fn, st, config_line{}, sums, nsums);
}

/// Records the rows of a layer that `kept` (row indices, ascending per head) does not list as
/// evicted after `step` tokens: their original positions go to rec.mark_evicted (all heads at
/// once, all or nothing). pos_of(h, j): the position of head h's row j; lens: rows per head;
/// scratch: room for every row of the layer, cu: H + 1.
template <class PosOf>
status record_dropped(eviction_recorder* rec, index_t layer, index_t H, PosOf pos_of, const std::int32_t* lens,
                      const ragged_positions& kept, index_t step, pos_t* scratch, std::int32_t* cu) {
  if (rec == nullptr) return {};
  cu[0] = 0;
  for (index_t h = 0; h < H; ++h) {
    const pos_t* k = kept.pos + kept.cu[h];
    const index_t nk = kept.length(h), n = lens[h];
    std::int32_t at = cu[h];
    index_t i = 0;
    for (index_t j = 0; j < n; ++j) {
      if (i < nk && k[i] == j) {
        ++i;
        continue;
      }
      scratch[at++] = pos_of(h, j);
    }
    cu[h + 1] = at;
  }
  if (cu[H] == 0) return {};
  return rec->mark_evicted(layer, ragged_positions{scratch, cu, H}, step);
}

/// The same, reading positions and lengths from an engine layer (layer_kv or paged_rows).
template <class KV>
status record_dropped(eviction_recorder* rec, index_t layer, const KV& kv, const ragged_positions& kept,
                      index_t step, pos_t* scratch, std::int32_t* cu) {
  return record_dropped(
      rec, layer, layer_heads(kv), [&](index_t h, index_t j) { return layer_pos(kv, h, j); }, layer_lens(kv), kept,
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

/// add_layer_scores' scores: [H][>= the most rows of a head], finite or +-inf (no NaN) in every
/// head's first lens[h] columns.
inline status check_layer_scores(const char* fn, const matrix_view<const float>& scores, const std::int32_t* lens,
                                 index_t H) {
  KVEVICT_TRY(check_view(fn, "scores", scores));
  index_t most = 0;
  for (index_t h = 0; h < H; ++h) most = lens[h] > most ? lens[h] : most;
  if (scores.extent(0) != H || scores.extent(1) < most)
    return status::error(errc::shape_mismatch,
                         "%s: scores are [%lld][%lld], expected [%lld KV heads][at least %lld rows] (the layer's rows)",
                         fn, static_cast<long long>(scores.extent(0)), static_cast<long long>(scores.extent(1)),
                         static_cast<long long>(H), static_cast<long long>(most));
  for (index_t h = 0; h < H; ++h)
    for (index_t j = 0; j < lens[h]; ++j)
      if (scores(h, j) != scores(h, j))
        return status::error(errc::invalid_argument, "%s: scores[%lld][%lld] is NaN", fn, static_cast<long long>(h),
                             static_cast<long long>(j));
  return {};
}

/// Copies checked scores into a driver's [H][C] buffer and protects them with `prot`, as
/// recipe_scores leaves its output (idempotent on recipe_scores' own scores).
template <class Backend>
status take_layer_scores(Backend be, const matrix_view<const float>& scores, const std::int32_t* lens, index_t H,
                         const protection& prot, float* dst, index_t C) {
  for (index_t h = 0; h < H; ++h)
    for (index_t j = 0; j < lens[h]; ++j) dst[h * C + j] = scores(h, j);
  return protect(be, rows_view(dst, H, C, C), prot.n_sink, prot.n_recent, lens);
}

/// The cake preference / caller weight a driver was given: finite and >= 0.
inline status check_layer_weight(const char* fn, index_t layer, double weight, const char* what) {
  if (!(weight >= 0.0) || weight - weight != 0.0)
    return status::error(errc::invalid_argument, "%s: layer %lld's %s is %g (must be finite and >= 0)", fn,
                         static_cast<long long>(layer), what, weight);
  return {};
}

// ---------------------------------------------------------------------------------------------
// The skeleton every driver is built on

/// The workspace of one driver call; pieces a driver does not use are empty.
struct call_scratch {
  float* scores = nullptr;  ///< [H][C] scores of the layer being decided (when not kept in the state)
  float* acc = nullptr;     ///< decode H2O: [H][C] sums after this step, committed when it succeeds
  score_scratch sc;         ///< per-head recipe_scores slots
  workspace sel;            ///< the selection's (select_bytes) or the cascade's workspace
  std::int32_t* counts = nullptr;      ///< [H] rows each head keeps
  pos_t* evicted = nullptr;            ///< [H][C] positions of the dropped rows (recording)
  std::int32_t* evicted_cu = nullptr;  ///< [H + 1]
  paged_rows_scratch paged;            ///< a paged layer's checks and row view (pool_pages > 0)
  index_t* caps = nullptr;    ///< [L] all-layer allocators: evictable rows of each layer
  index_t* shares = nullptr;  ///< [L] their apportioned shares
  index_t* totals = nullptr;  ///< [L] their layer totals
};

/// What a driver call's workspace holds: every size from the callees' own size queries.
struct call_scratch_shape {
  index_t H = 0, C = 0;
  bool scores = true;     ///< [H][C] scores in the workspace (false: the driver's state keeps them)
  bool acc = false;       ///< decode H2O's step sums
  std::size_t slot = 0;   ///< one scoring slot (score_slot_bytes)
  int slots = 1;
  std::size_t sel = 0;    ///< selection bytes
  bool recording = true;  ///< counts, evicted rows
  index_t layers = 0;     ///< all-layer allocators: L (caps, shares, totals); 0 otherwise
  index_t pool_pages = 0; ///< paged layers: the most pages of their pools (0: ragged layers only)
};

inline status carve_call_scratch(const char* fn, workspace& ws, const call_scratch_shape& s, call_scratch& w) {
  const auto HC = static_cast<std::size_t>(s.H * s.C), H = static_cast<std::size_t>(s.H),
             L = static_cast<std::size_t>(s.layers);
  workspace_carver c(ws);
  w.scores = c.take<float>(s.scores ? HC : 0);
  w.acc = c.take<float>(s.acc ? HC : 0);
  carve_score_scratch(c, w.sc, s.slot, s.slots, s.H);
  w.sel = workspace{c.take<unsigned char>(s.sel), s.sel};
  w.counts = c.take<std::int32_t>(s.recording ? H : 0);
  w.evicted = c.take<pos_t>(s.recording ? HC : 0);
  w.evicted_cu = c.take<std::int32_t>(s.recording ? H + 1 : 0);
  const bool paged = s.pool_pages > 0;
  w.paged.pool_pages = s.pool_pages;
  w.paged.bitmap = c.take<std::uint64_t>(static_cast<std::size_t>(page_bitmap_words(s.pool_pages)));
  w.paged.indptr = c.take<std::int32_t>(paged ? H + 1 : 0);
  w.paged.lens = c.take<std::int32_t>(paged ? H : 0);
  w.caps = c.take<index_t>(L);
  w.shares = c.take<index_t>(L);
  w.totals = c.take<index_t>(L);
  return c.finish(fn);
}

/// The state memory init() binds a driver to: as the caller gave it, and `base`, its first 64-byte
/// aligned byte (where the driver's memory plan starts).
struct state_memory {
  void* memory = nullptr;
  std::size_t bytes = 0;
  unsigned char* base = nullptr;
};

/// The parts every driver shares: init (binding the state memory and the recorder), the workspace
/// size (the driver's carve() run as a query), and the first checks of every call. Derived, a
/// driver (friend of this class), provides
///   static constexpr const char* name;                             "post_fill_driver", ...
///   static status validate(const char* fn, const Config&);         configuration errors
///   static std::size_t plan_bytes(const Config&);                  state bytes of a valid config
///   status attach(const char* fn, const Config&, const state_memory&);  init's last step
///   template <class Backend> status carve(Backend, workspace&, call_scratch&) const;
/// and, when its recorder holds more than one step, static index_t recorder_tokens(const Config&).
template <class Derived, class Config>
class driver_skeleton {
 public:
  /// Binds the driver to `memory` (>= state_bytes(cfg), any alignment), copies what it keeps of
  /// cfg and resets it. The recorder (optional; layers x kv_heads, capacity >= recorder_tokens(cfg))
  /// must outlive the driver. Errors (each driver lists its configuration errors at its class):
  /// the configuration; recorder shape; memory null or too small.
  status init(const Config& cfg, void* memory, std::size_t bytes, eviction_recorder* recorder = nullptr) {
    char fn[64];
    std::snprintf(fn, sizeof fn, "%s::init", Derived::name);
    unsigned char* base = nullptr;
    KVEVICT_TRY(bind(fn, cfg, memory, bytes, recorder, Derived::recorder_tokens(cfg), &base));
    KVEVICT_TRY(self_mut().attach(fn, cfg, state_memory{memory, bytes, base}));
    ok_ = true;
    return {};
  }

  /// Bytes of state memory init() needs for cfg. Errors: as init's configuration errors.
  static result<std::size_t> state_bytes(const Config& cfg) {
    char fn[64];
    std::snprintf(fn, sizeof fn, "%s::state_bytes", Derived::name);
    KVEVICT_TRY(Derived::validate(fn, cfg));
    return Derived::plan_bytes(cfg);
  }

  /// Workspace bytes every call of the driver needs on backend `be` (what their size queries
  /// report). Errors: not initialised.
  template <class Backend>
  result<std::size_t> workspace_bytes(Backend be) const {
    if (!ok_) return status::error(errc::invalid_argument, "%s::workspace_bytes: not initialised (init)", Derived::name);
    workspace q;
    call_scratch w;
    KVEVICT_TRY(self().carve(be, q, w));
    return q.bytes;
  }

  const Config& config() const noexcept { return cfg_; }

 protected:
  /// The state bytes of a valid configuration: the driver's memory plan (a driver with another
  /// kind of state declares its own plan_bytes).
  static std::size_t plan_bytes(const Config& c) { return Derived::plan(c).layout.bytes(); }

  /// The recorder's capacity in tokens init() requires: one step (the decode-time drivers); the
  /// prefill drivers record at prompt positions (prefill_driver_skeleton: cfg.tokens).
  static index_t recorder_tokens(const Config&) { return 1; }

  /// Makes room in s for scoring every head with recipe r over a query block of `rows` rows
  /// (block keys or not): the largest slot and slot count of all the shapes a driver scores.
  template <class Backend>
  status fit_score_slots(Backend be, const recipe& r, index_t rows, bool block_keys, call_scratch_shape& s) const {
    const index_t H = cfg_.model.kv_heads;
    int slots = 1;
    const auto b = score_slot_bytes(be, r, cfg_.model.query_heads / H, rows, s.C, cfg_.model.head_dim, block_keys, H,
                                    &slots);
    if (!b) return b.error();
    s.slot = *b > s.slot ? *b : s.slot;
    s.slots = slots > s.slots ? slots : s.slots;
    return {};
  }

  /// A call's workspace shape with the model's heads and C columns per score row.
  call_scratch_shape scratch_shape(index_t C) const {
    call_scratch_shape s;
    s.H = cfg_.model.kv_heads;
    s.C = C;
    return s;
  }

  /// init's shared steps: the configuration, the recorder (layers x kv_heads, capacity >=
  /// recorder_tokens), the memory (not null, >= state_bytes). On success the driver holds a copy
  /// of cfg and is bound to `memory`, *base its first 64-byte aligned byte; on error nothing changes.
  status bind(const char* fn, const Config& cfg, void* memory, std::size_t bytes, eviction_recorder* rec,
              index_t recorder_tokens, unsigned char** base) {
    KVEVICT_TRY(Derived::validate(fn, cfg));
    KVEVICT_TRY(check_recorder(fn, rec, cfg.model, recorder_tokens));
    KVEVICT_TRY(check_state_memory(fn, memory, bytes, Derived::plan_bytes(cfg)));
    cfg_ = cfg;
    rec_ = rec;
    mem_ = {reinterpret_cast<std::uintptr_t>(memory), reinterpret_cast<std::uintptr_t>(memory) + bytes};
    *base = align64(memory);
    return {};
  }

  /// A call's first steps: initialised, then the workspace carved (on a size query the call ends
  /// after this: ws.is_query()).
  template <class Backend>
  status open_call(const char* fn, Backend be, workspace& ws, call_scratch& w) const {
    if (!ok_) return status::error(errc::invalid_argument, "%s: the driver is not initialised (init)", fn);
    return self().carve(be, ws, w);
  }

  /// The workspace must not overlap the state memory.
  status check_ws(const char* fn, const workspace& ws) const {
    if (ws_range(ws).intersects(mem_))
      return status::error(errc::overlap, "%s: the workspace overlaps the driver's state memory", fn);
    return {};
  }

  /// Layers come in order: `layer` must be `next` (< L). `scope` names the pass (" of chunk [s, e)"
  /// or "").
  static status check_order(const char* fn, index_t layer, index_t next, index_t L, const char* scope = "") {
    if (layer == next && layer < L) return {};
    if (next >= L)
      return status::error(errc::invalid_argument, "%s: layer %lld given, but all %lld layers%s were added", fn,
                           static_cast<long long>(layer), static_cast<long long>(L), scope);
    return status::error(errc::invalid_argument, "%s: layer %lld given, expected layer %lld (layers come in order)", fn,
                         static_cast<long long>(layer), static_cast<long long>(next));
  }

  /// The decode-time drivers' layers come in any order: `layer` must be inside [0, L).
  status check_layer_index(const char* fn, index_t layer) const {
    const index_t L = cfg_.model.layers;
    if (layer < 0 || layer >= L)
      return status::error(errc::out_of_range, "%s: layer %lld is outside [0, %lld)", fn, static_cast<long long>(layer),
                           static_cast<long long>(L));
    return {};
  }

  /// A decode-time driver's layer after `tokens` tokens (inside [first, INT32_MAX)): its layout,
  /// positions below `tokens` and at most cfg.capacity rows per head (check_layer).
  template <class KV>
  status check_layer_after(const char* fn, index_t layer, const KV& kv, index_t tokens, index_t first) const {
    if (tokens < first || tokens >= INT32_MAX)
      return status::error(errc::invalid_argument, "%s: tokens = %lld is outside [%lld, %d)", fn,
                           static_cast<long long>(tokens), static_cast<long long>(first), INT32_MAX);
    row_rules rr;
    rr.tokens = tokens;
    rr.capacity = cfg_.capacity;
    return check_layer(fn, layer, kv, cfg_.model.kv_heads, cfg_.model.head_dim, rr);
  }

  Config cfg_{};
  eviction_recorder* rec_ = nullptr;
  byte_range mem_{};
  bool ok_ = false;

 private:
  const Derived& self() const { return static_cast<const Derived&>(*this); }
  Derived& self_mut() { return static_cast<Derived&>(*this); }
};

/// The prefill drivers (post-fill, cascade, chunked): layers added in order, each either with the
/// recipe's queries (add_layer) or with scores (add_layer_scores); both reach Derived::add_scored.
/// Derived provides, besides driver_skeleton's: check_layer_call(fn, layer, kv, by_scores),
/// query_rows_now(), block_keys_now(), check_call_rest(fn, ws, layer, lens, weight),
/// score_recipe(), scores_of(layer, w), score_columns(), add_scored(be, w, layer, kv, scores, weight),
/// and for tensor parallelism a member `bool in_collective_` (set once the call reaches its first
/// collective) and joined(fn, ws, st, layer, weight) (a call that failed on this rank before it still
/// joins the ranks' agreement, so every rank returns the error instead of waiting).
/// The public entry points are documented in docs/drivers.md and at each driver's class.
template <class Derived, class Config>
class prefill_driver_skeleton : public driver_skeleton<Derived, Config> {
 public:
  /// Layer `layer` (in order) with the recipe's query block [H_q][rows][d] (and the block's own
  /// keys [H][rows][d] or an empty view; weight: the layer's CAKE preference / caller weight where
  /// the driver takes one): every head is scored with recipe_scores, then add_layer_scores' path.
  /// kv: a layer_kv, or a paged_layer_kv (one sequence of a paged layer; the config's
  /// pool_pages bounds its pools).
  /// With a tensor-parallel communicator a call failing on one rank fails on every rank.
  /// On cuda_t both refuse (drivers_on_cuda), nothing changes.
  template <class Backend, class KV, class Q>
  status add_layer(Backend be, workspace& ws, index_t layer, const KV& kv, kv_view<Q> queries,
                   kv_view<const layer_element_t<KV>> block_keys = {}, double weight = 0.0) {
    char fn[64];
    std::snprintf(fn, sizeof fn, "%s::add_layer", Derived::name);
    return on_host(fn, be, [&](auto host) {
      Derived& d = static_cast<Derived&>(*this);
      d.in_collective_ = false;
      return d.joined(fn, ws, add_layer_queries(fn, host, ws, layer, kv, queries, block_keys, weight), layer, weight);
    });
  }

  /// Layer `layer` (in order) with scores an engine or a trained scorer computed: [H][>= rows of a
  /// head] (row h: head h's rows, its first kv.keys.lens[h] columns, in the cache's order), higher
  /// = keep, no NaN. The driver copies them and protects the recipe's {n_sink, n_recent}, so
  /// recipe_scores' output gives exactly add_layer's result. No queries are read (the query-window
  /// row checks do not apply). Workspace: add_layer's. Errors (nothing changes): add_layer's except
  /// the query ones; scores of the wrong shape or NaN.
  template <class Backend, class KV, typename = layer_element_t<KV>>
  status add_layer_scores(Backend be, workspace& ws, index_t layer, const KV& kv, matrix_view<const float> scores,
                          double weight = 0.0) {
    char fn[64];
    std::snprintf(fn, sizeof fn, "%s::add_layer_scores", Derived::name);
    return on_host(fn, be, [&](auto host) {
      Derived& d = static_cast<Derived&>(*this);
      d.in_collective_ = false;
      return d.joined(fn, ws, add_layer_given_scores(fn, host, ws, layer, kv, scores, weight), layer, weight);
    });
  }

 protected:
  /// The recorder holds the prompt's positions: cfg.tokens.
  static index_t recorder_tokens(const Config& c) { return c.tokens; }

  /// decide() of the drivers that decide after their layers (post-fill, chunked): refused on
  /// cuda_t (nothing changes); the call opened (a size query ends here); `added` of the pass's L
  /// layers added (`scope` names the pass, as check_order's: " of chunk [s, e)" or ""); then
  /// Derived::decide_layers(fn, be, ws, w, st) with the status so far: it checks the rest and, with
  /// ranks or stages, hands the status to their agreement (a rank failing here fails them all).
  template <class Backend>
  status decide_call(Backend be, workspace& ws, index_t added, const char* scope) {
    char fn[64];
    std::snprintf(fn, sizeof fn, "%s::decide", Derived::name);
    return on_host(fn, be, [&](auto host) {
      call_scratch w;
      status st = this->open_call(fn, host, ws, w);
      if (ws.is_query()) return st;
      const index_t L = this->cfg_.model.layers;
      if (st.ok() && added < L)
        st = status::error(errc::invalid_argument, "%s: only %lld of %lld layers%s were added", fn,
                           static_cast<long long>(added), static_cast<long long>(L), scope);
      return static_cast<Derived&>(*this).decide_layers(fn, host, ws, w, st);
    });
  }

  /// The opening of both add paths: the call's scratch carved from ws (a size query stops there),
  /// the layer opened (dense or paged) and checked against the driver's order and layout
  /// (Derived::check_layer_call, `by_scores`).
  template <class Backend, class KV>
  status open_layer_call(const char* fn, Backend be, workspace& ws, index_t layer, const KV& kv_in, bool by_scores,
                         call_scratch& w, typename layer_reader<KV>::type& kv) {
    Derived& d = static_cast<Derived&>(*this);
    KVEVICT_TRY(this->open_call(fn, be, ws, w));
    if (ws.is_query()) return {};
    KVEVICT_TRY(open_layer(fn, w.paged, kv_in, d.cfg_.model.kv_heads, d.cfg_.model.head_dim, kv));
    return d.check_layer_call(fn, layer, kv, by_scores);
  }

  /// add_layer(queries) of the prefill drivers: every head scored with the driver's recipe
  /// (recipe_scores per head into the driver's score buffer), then the scores path. Derived
  /// provides check_layer_call(fn, layer, kv, by_scores), query_rows_now(), block_keys_now(),
  /// check_call_rest(fn, ws, layer, kv, weight), score_recipe(), scores_of(layer, w),
  /// score_columns() and add_scored(be, w, layer, kv, scores, weight).
  template <class Backend, class KV, class Q, class T>
  status add_layer_queries(const char* fn, Backend be, workspace& ws, index_t layer, const KV& kv_in,
                           kv_view<Q> queries_in, const kv_view<const T>& block_keys, double weight) {
    const kv_view<const std::remove_const_t<Q>> queries = queries_in;
    Derived& d = static_cast<Derived&>(*this);
    call_scratch w;
    typename layer_reader<KV>::type kv;
    KVEVICT_TRY(open_layer_call(fn, be, ws, layer, kv_in, false, w, kv));
    if (ws.is_query()) return {};
    KVEVICT_TRY(check_queries(fn, queries, d.query_rows_now(), d.cfg_.model, block_keys, d.block_keys_now()));
    KVEVICT_TRY(d.check_call_rest(fn, ws, layer, layer_lens(kv), weight));
    float* scores = d.scores_of(layer, w);
    const index_t g = d.cfg_.model.query_heads / d.cfg_.model.kv_heads;
    KVEVICT_TRY(score_layer(be, w.sc, d.score_recipe(), kv, g, queries, block_keys, scores, d.score_columns()));
    return d.add_scored(be, w, layer, kv, scores, weight);
  }

  /// add_layer_scores of the prefill drivers: the scores checked, copied into the driver's score
  /// buffer and protected with the recipe's protection, then the same path as add_layer_queries.
  template <class Backend, class KV>
  status add_layer_given_scores(const char* fn, Backend be, workspace& ws, index_t layer, const KV& kv_in,
                                const matrix_view<const float>& scores, double weight) {
    Derived& d = static_cast<Derived&>(*this);
    call_scratch w;
    typename layer_reader<KV>::type kv;
    KVEVICT_TRY(open_layer_call(fn, be, ws, layer, kv_in, true, w, kv));
    if (ws.is_query()) return {};
    KVEVICT_TRY(check_layer_scores(fn, scores, layer_lens(kv), d.cfg_.model.kv_heads));
    KVEVICT_TRY(d.check_call_rest(fn, ws, layer, layer_lens(kv), weight));
    float* own = d.scores_of(layer, w);
    KVEVICT_TRY(take_layer_scores(be, scores, layer_lens(kv), d.cfg_.model.kv_heads,
                                  recipe_protection(d.score_recipe()), own, d.score_columns()));
    return d.add_scored(be, w, layer, kv, own, weight);
  }

};

// ---------------------------------------------------------------------------------------------
// All-layer allocators (lava, cake): what a layer leaves in the state until the decision

/// Per layer: its scores [H][C], its rows' positions [H][C], rows per head, its weight.
struct held_layers {
  float* scores = nullptr;
  pos_t* rowpos = nullptr;
  std::int32_t* lens = nullptr;
  double* weight = nullptr;
  index_t H = 0, C = 0;

  float* layer_scores(index_t l) const { return scores + l * H * C; }
  matrix_view<const float> scores_view(index_t l) const { return rows_view<const float>(layer_scores(l), H, C, C); }
  const pos_t* head_positions(index_t l, index_t h) const { return rowpos + (l * H + h) * C; }

  /// Keeps layer l's row counts and positions (its scores are already at layer_scores(l)).
  template <class KV>
  void store(index_t l, const KV& kv, double w) {
    for (index_t h = 0; h < H; ++h) {
      const std::int32_t n = layer_lens(kv)[h];
      lens[l * H + h] = n;
      pos_t* p = rowpos + (l * H + h) * C;
      for (index_t j = 0; j < n; ++j) p[j] = layer_pos(kv, h, j);
    }
    weight[l] = w;
  }

  /// LAVa's layer totals over L held layers: totals[l] = protected rows of layer l, caps[l] its
  /// evictable rows; *prot_sum and *rows their sums (the caller picks what the model keeps, then
  /// share_lava_totals).
  void protected_totals(index_t L, const protection& prot, index_t* caps, index_t* totals, index_t* prot_sum,
                        index_t* rows) const {
    *prot_sum = *rows = 0;
    for (index_t l = 0; l < L; ++l) {
      index_t wl = 0, nl = 0;
      for (index_t h = 0; h < H; ++h) {
        wl += protected_count(lens[l * H + h], prot.n_sink, prot.n_recent);
        nl += lens[l * H + h];
      }
      caps[l] = nl - wl;
      totals[l] = wl;
      *prot_sum += wl;
      *rows += nl;
    }
  }

  /// After protected_totals' arrays were combined across ranks or stages (L layers of them): their
  /// sums again.
  static void row_sums(index_t L, const index_t* caps, const index_t* totals, index_t* prot_sum, index_t* rows) {
    *prot_sum = *rows = 0;
    for (index_t l = 0; l < L; ++l) {
      *prot_sum += totals[l];
      *rows += totals[l] + caps[l];
    }
  }

  /// Tensor parallelism: protected_totals' arrays of L layers summed over every rank's heads, and
  /// their sums.
  static status sum_over_ranks(const comm_ref& tp, index_t L, index_t* caps, index_t* totals, index_t* prot_sum,
                               index_t* rows) {
    static_assert(std::is_same_v<index_t, std::int64_t>, "index_t is summed as int64");
    KVEVICT_TRY(tp.allreduce_sum(caps, L));
    KVEVICT_TRY(tp.allreduce_sum(totals, L));
    row_sums(L, caps, totals, prot_sum, rows);
    return {};
  }

  /// totals[l] += the layer's share of `evictable` (apportion by the weights, capped by caps).
  status share_lava_totals(index_t L, index_t evictable, const index_t* caps, index_t* shares, index_t* totals) const {
    KVEVICT_TRY(apportion(evictable, weight, caps, L, shares));
    for (index_t l = 0; l < L; ++l) totals[l] += shares[l];
    return {};
  }

  /// Records the rows layer l drops (kept: its selection) at `step`.
  status record(eviction_recorder* rec, index_t l, const ragged_positions& kept, index_t step, const call_scratch& w) const {
    return record_dropped(
        rec, l, H, [&](index_t h, index_t j) { return head_positions(l, h)[j]; }, lens + l * H, kept, step, w.evicted,
        w.evicted_cu);
  }
};

/// What post_fill_driver and chunked_driver keep per layer in their state memory: per-head
/// budgets [L][H], the kept lists (positions and offsets [L][H + 1]), ready flags [L] and the held
/// layers (row counts, weights; with an all-layer allocator also scores and row positions [L][H][C]).
class layer_store {
 protected:
  struct store_plan {
    mem_plan layout;
    std::size_t budgets = 0, kept_pos = 0, kept_cu = 0, ready = 0, weight = 0, lens = 0, scores = 0, rowpos = 0;
    bool hold_scores = false;
    /// Takes the pieces for L layers of H heads, kept lists of `kept_rows` positions in all and
    /// (hold: an all-layer allocator) C columns of held scores per head.
    void take_store(index_t L, index_t H, index_t C, index_t kept_rows, bool hold) {
      const auto l = static_cast<std::size_t>(L), h = static_cast<std::size_t>(H), c = static_cast<std::size_t>(C);
      hold_scores = hold;
      budgets = layout.take(l * h * sizeof(std::int32_t));
      kept_pos = layout.take(static_cast<std::size_t>(kept_rows) * sizeof(pos_t));
      kept_cu = layout.take(l * (h + 1) * sizeof(std::int32_t));
      ready = layout.take(l);
      weight = layout.take(l * sizeof(double));
      lens = layout.take(l * h * sizeof(std::int32_t));
      if (hold) {
        scores = layout.take(l * h * c * sizeof(float));
        rowpos = layout.take(l * h * c * sizeof(pos_t));
      }
    }
  };

  /// Allocators that come with a budget matrix.
  static bool has_matrix(allocator k) {
    return k == allocator::per_head || k == allocator::flattened || k == allocator::adakv;
  }

  /// Binds the pieces at `base` and resets them: budgets_[l][h] = budget_of(l, h), nothing kept,
  /// ready or held.
  template <class BudgetOf>
  void bind_store(unsigned char* base, const store_plan& p, index_t L, index_t H, index_t C, BudgetOf budget_of) {
    budgets_ = reinterpret_cast<std::int32_t*>(base + p.budgets);
    kept_pos_ = reinterpret_cast<pos_t*>(base + p.kept_pos);
    kept_cu_ = reinterpret_cast<std::int32_t*>(base + p.kept_cu);
    ready_ = base + p.ready;
    held_ = {p.hold_scores ? reinterpret_cast<float*>(base + p.scores) : nullptr,
             p.hold_scores ? reinterpret_cast<pos_t*>(base + p.rowpos) : nullptr,
             reinterpret_cast<std::int32_t*>(base + p.lens), reinterpret_cast<double*>(base + p.weight), H, C};
    for (index_t l = 0; l < L; ++l) {
      ready_[l] = 0;
      held_.weight[l] = 0.0;
      for (index_t h = 0; h < H; ++h) {
        budgets_[l * H + h] = budget_of(l, h);
        held_.lens[l * H + h] = 0;
      }
      for (index_t h = 0; h <= H; ++h) kept_cu_[l * (H + 1) + h] = 0;
    }
  }

  /// decide()'s last step for held layer l (an all-layer allocator): its rows selected into its
  /// kept lists (offsets at kept_cu_, positions at `pos`), lava keeping `total` rows of the layer
  /// (select_topk_flat; across the tensor-parallel ranks `tp` when `sharded`), cake (per_head) each
  /// head its budgets_ row; then the rows it drops recorded at `step`.
  template <class Backend>
  status select_held(Backend be, call_scratch& w, allocator kind, const comm_ref& tp, bool sharded, index_t l,
                     index_t total, pos_t* pos, eviction_recorder* rec, index_t step) {
    const index_t H = held_.H;
    std::int32_t* cu = kept_cu_ + l * (H + 1);
    if (kind == allocator::lava && sharded) {  // the layer's total over every rank's heads
      comm_ref c = tp;
      KVEVICT_TRY(select_topk_flat(be, w.sel, c, held_.scores_view(l), held_.lens + l * H, total, nullptr, cu, pos));
    } else {
      KVEVICT_TRY(select_layer(be, w.sel, kind, held_.scores_view(l), held_.lens + l * H, budgets_ + l * H, total,
                               adakv_options{}, cu, pos));
    }
    return held_.record(rec, l, ragged_positions{pos, cu, H}, step, w);
  }

  std::int32_t* budgets_ = nullptr;
  pos_t* kept_pos_ = nullptr;
  std::int32_t* kept_cu_ = nullptr;
  unsigned char* ready_ = nullptr;
  held_layers held_{};
};

}  // namespace detail
}  // namespace kvevict
