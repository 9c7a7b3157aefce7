// kvevict/budget/layer_cascade.hpp: layer-by-layer prefill with cascading budgets (LAVa Algorithm 2,
// CAKE's cascading cache management). docs/budget.md.
//
// The engine prefills one layer at a time. After layer l, the budgets of layers 0..l are recomputed
// from their weights (LAVa: normalised entropy; CAKE: preference) over the layers prefilled so far,
// layer l keeps its best tokens, and every lower layer whose budget shrank re-selects from the
// scores it STORED at its own prefill, restricted to the tokens it still holds. A token once
// evicted never comes back.
//
//   layer_cascade c;
//   c.init(cfg, memory, layer_cascade::state_bytes(cfg).value());
//   for each layer l:
//     scores_l  = protected scores [H][N] (LAVa: window -> GQA max -> pool -> weight head_max -> protect)
//     weight_l  = lava_layer_entropy(scores_l) or cake_preference(cake_layer_stats(attention_l))
//     c.add_layer(be, ws, l, scores_l, weight_l)
//     compact(be, layer l's K/V, c.kept(l), ragged cache of layer l)         // positions in [0, N)
//     for j < l with c.changed(j): compact_inplace(be, cache of layer j, c.kept(j))  // rows it held
#pragma once

#include <kvevict/budget/adakv.hpp>
#include <kvevict/budget/apportion.hpp>
#include <kvevict/budget/lava.hpp>
#include <kvevict/distributed.hpp>
#include <kvevict/select.hpp>

#include <cstring>

namespace kvevict {

/// How a layer's budget is shared by its heads.
enum class cascade_split : int {
  /// LAVa (Algorithm 1): a layer total, shared through the flattened selection across heads
  /// (select_topk_flat, no floors; ties -> lower head, then lower position).
  flattened = 0,
  /// CAKE: every head of a layer keeps the same number of tokens (per-head top-k, select_topk).
  per_head = 1,
};

struct cascade_config {
  index_t layers = 0;         ///< L
  index_t heads = 0;          ///< H: KV heads per layer
  index_t prompt_length = 0;  ///< N: prompt tokens per head (every layer sees the whole prompt)
  protection prot;            ///< protected tokens of every head (the scores carry protect(prot))
  /// Tokens the whole model keeps, protected ones included ("B per head" = B H L). Between L H W
  /// and L H N (W = protected_count(N, prot)); a multiple of H for the per_head split.
  index_t total = 0;
  cascade_split split = cascade_split::flattened;
  /// Tensor parallelism (docs/distributed.md "The cascade"): every layer's KV heads are spread over
  /// `ranks` ranks, this cascade holding `heads` of them (head_shard); `total` is the model's over
  /// all ranks' heads (L x ranks x heads x ...), and add_layer / add_remote_layer take the ranks'
  /// communicator. 1: one process.
  index_t ranks = 1;
};

/// The cascading state (see the file comment). Non-owning: it lives in memory the engine provides
/// (state_bytes), about 12 bytes per token the model keeps (score, prompt position and the last
/// step's kept index) plus O(L H) offsets: the stored scores never exceed cfg.total tokens, because
/// after every step the layers hold at most the evictable budget plus their protected tokens.
/// Copying the object copies the pointers (both copies then share the memory).
///
/// Budget rule of a step (after layer m): with E the evictable budget (flattened: total - L H W
/// tokens; per_head: total / H - L W tokens per head) and caps_j the evictable tokens (per head for
/// per_head) layer j still holds (a new layer: all of them),
///   alloc_j = apportion(min(E, sum caps), weights_0..m, caps)        (budget/apportion.hpp)
/// i.e. proportional to the weights over the layers so far, capped by what each layer holds (which
/// makes every budget non-increasing over the steps), largest remainder with ties to the lower layer.
/// A layer keeps H W + alloc_j tokens (flattened) or W + alloc_j per head (per_head). After the last
/// layer the model keeps exactly cfg.total tokens.
///
/// Invariant (tested): each layer's final kept set is what selecting its final budget directly from
/// its original scores gives (top-k of a top-k is the top-k, with one total order of ties).
class layer_cascade {
 public:
  /// Bytes of memory init() needs for cfg (64 bytes of alignment slack included).
  /// Errors: as init's configuration errors.
  static result<std::size_t> state_bytes(const cascade_config& cfg) {
    KVEVICT_TRY(validate("layer_cascade::state_bytes", cfg));
    return layout_of(cfg).end + 64;
  }

  /// Binds the state to `memory` (bytes >= state_bytes(cfg); any alignment) and resets it.
  /// Errors: zero layers or heads; prompt_length outside [1, INT32_MAX]; negative n_sink/n_recent;
  /// total negative, below the L H W protected tokens or above the prompt (L H N); per_head with a
  /// total that is not a multiple of H; H N above INT32_MAX (int32 offsets); unknown split; memory
  /// null or smaller than state_bytes (workspace_too_small).
  status init(const cascade_config& cfg, void* memory, std::size_t bytes) {
    constexpr const char* fn = "layer_cascade::init";
    KVEVICT_TRY(validate(fn, cfg));
    const layout lay = layout_of(cfg);
    if (memory == nullptr) return status::error(errc::null_pointer, "%s: memory is null", fn);
    if (bytes < lay.end + 64)
      return status::error(errc::workspace_too_small, "%s: memory has %zu bytes, %zu needed (state_bytes)", fn, bytes,
                           lay.end + 64);
    auto* base = static_cast<unsigned char*>(memory);
    base += (64 - reinterpret_cast<std::uintptr_t>(base) % 64) % 64;
    cfg_ = cfg;
    mem_ = {reinterpret_cast<std::uintptr_t>(memory), reinterpret_cast<std::uintptr_t>(memory) + bytes};
    weight_ = reinterpret_cast<double*>(base + lay.weight);
    alloc_ = reinterpret_cast<index_t*>(base + lay.alloc);
    next_ = reinterpret_cast<index_t*>(base + lay.next);
    off_ = reinterpret_cast<index_t*>(base + lay.off);
    held_cu_ = reinterpret_cast<std::int32_t*>(base + lay.held_cu);
    step_cu_ = reinterpret_cast<std::int32_t*>(base + lay.step_cu);
    changed_ = base + lay.changed;
    remote_ = base + lay.remote;
    scores_ = reinterpret_cast<float*>(base + lay.scores);
    pos_ = reinterpret_cast<pos_t*>(base + lay.pos);
    step_ = reinterpret_cast<pos_t*>(base + lay.step);
    const index_t L = cfg.layers, H = cfg.heads;
    W_ = protected_count(cfg.prompt_length, cfg.prot.n_sink, cfg.prot.n_recent);
    const index_t HA = H * cfg.ranks;  // every rank's heads
    evictable_ = cfg.split == cascade_split::flattened ? cfg.total - L * HA * W_ : cfg.total / HA - L * W_;
    for (index_t l = 0; l < L; ++l) {
      weight_[l] = 0.0;
      alloc_[l] = 0;
      next_[l] = 0;
      changed_[l] = 0;
      remote_[l] = 0;
      for (index_t h = 0; h <= H; ++h) held_cu_[l * (H + 1) + h] = step_cu_[l * (H + 1) + h] = 0;
    }
    for (index_t l = 0; l <= L; ++l) off_[l] = 0;
    added_ = 0;
    ready_ = true;
    broken_ = false;
    return {};
  }

  /// Workspace bytes add_layer needs on backend `be`: the largest selection of a step, from the
  /// selections' own size queries (flattened: select_topk_flat over [H][N] or select_topk over one
  /// row of min(total, H N) scores; per_head: select_topk over [H][N]). Errors: not initialised.
  template <class Backend>
  result<std::size_t> workspace_bytes(Backend be) const {
    if (!ready_) return status::error(errc::invalid_argument, "layer_cascade::workspace_bytes: not initialised (init)");
    workspace q;
    KVEVICT_TRY(carve_selection(be, q, "layer_cascade::workspace_bytes"));
    return q.bytes;
  }

  /// Layer `layer` (= layers_added(): layers come in order) was prefilled; `scores` [H][N] are its
  /// protected scores (protect(cfg.prot): protected positions +inf, no other +inf), `weight` its
  /// LAVa entropy / CAKE preference. Recomputes the budgets of layers 0..layer, selects this layer's
  /// kept tokens from `scores` and re-selects the lower layers that must shrink from their stored
  /// scores. Afterwards kept(j) / changed(j) say what each layer must do to its cache.
  /// Workspace (two-phase; a query checks the views only and leaves the state alone): the largest
  /// selection of a step (flattened: select_topk_flat over [H][N] or select_topk over one row of
  /// min(total, H N) scores; per_head: select_topk over [H][N]); query with the same backend.
  /// Errors (the state is unchanged): not initialised; scores not [H][N] (shape_mismatch) or
  /// invalid; layer out of order or >= L; weight NaN, infinite or negative; scores not protected;
  /// scores or the workspace overlapping the state's memory; workspace too small.
  template <class Backend>
  status add_layer(Backend be, workspace& ws, index_t layer, matrix_view<const float> scores, double weight) {
    constexpr const char* fn = "layer_cascade::add_layer";
    KVEVICT_TRY(check_scores_shape(fn, scores));
    KVEVICT_TRY(carve_selection(be, ws, fn));
    if (ws.is_query()) return {};
    KVEVICT_TRY(check_one_process(fn));
    KVEVICT_TRY(check_add(fn, ws, layer, scores, weight));
    return step(be, ws, static_cast<single_process*>(nullptr), layer, weight, &scores);
  }

  /// Tensor parallelism (cfg.ranks = comm.size() ranks, each holding cfg.heads heads of every
  /// layer; docs/distributed.md "The cascade"): add_layer with this rank's [heads][N] scores. Every
  /// rank receives exactly its heads' rows of what the single-process cascade over all ranks' heads
  /// keeps: the flattened split selects (the new layer and every re-selection of a lower layer)
  /// across the ranks (histograms summed, ties to the lower global head, then the lower position);
  /// the per_head split's selections are per head and need no communication. `weight` must be the
  /// same on every rank (LAVa: the sharded lava_layer_entropy's; CAKE: the sharded preference's).
  /// Workspace: add_layer's on this rank's heads, or the sharded selections' (the larger).
  /// Communication per step: one agreement (13 integers); flattened: one sharded selection for the
  /// new layer and one per lower layer that shrinks (sharded select_topk_flat's allreduces).
  /// Errors: add_layer's, and the communicator's size differing from cfg.ranks; a rank whose
  /// arguments are invalid, or ranks disagreeing on the layer, its weight or the configuration,
  /// fail every rank with the same error (the state unchanged). A failing collective's status is
  /// returned as is (the cascade must then be init()ed again).
  template <class Backend, class Comm>
  status add_layer(Backend be, workspace& ws, Comm& comm, index_t layer, matrix_view<const float> scores,
                   double weight) {
    constexpr const char* fn = "layer_cascade::add_layer (sharded)";
    status st = check_scores_shape(fn, scores);
    if (st.ok()) st = carve_selection(be, ws, fn);
    if (ws.is_query()) return st;
    if (st.ok()) st = check_ranks(fn, comm.size());
    if (st.ok()) st = check_add(fn, ws, layer, scores, weight);
    KVEVICT_TRY(agree_step(comm, fn, st, layer, weight, false));
    return step(be, ws, &comm, layer, weight, &scores);
  }

  /// Pipeline parallelism (docs/distributed.md): layer `layer` (= layers_added()) is held by another
  /// stage. It takes part in the budget rule by its weight (and, later, by what it would hold), so
  /// this stage's own layers shrink exactly as on one process, but nothing of it is stored here: it
  /// holds no tokens, kept(layer) and positions(layer) are empty and changed(layer) is false.
  /// A stage holding layers [a, b) calls add_remote_layer for layers [0, a) (their weights from the
  /// earlier stages), add_layer for its own, then add_remote_layer for [b, L) once their weights are
  /// known (gather_layer_values); its layers then hold what the single-process cascade holds.
  /// Workspace: add_layer's (the lower layers' re-selections). Errors: add_layer's (no scores).
  template <class Backend>
  status add_remote_layer(Backend be, workspace& ws, index_t layer, double weight) {
    constexpr const char* fn = "layer_cascade::add_remote_layer";
    KVEVICT_TRY(check_ready(fn));
    KVEVICT_TRY(carve_selection(be, ws, fn));
    if (ws.is_query()) return {};
    KVEVICT_TRY(check_one_process(fn));
    KVEVICT_TRY(check_remote(fn, ws, layer, weight));
    return step(be, ws, static_cast<single_process*>(nullptr), layer, weight, nullptr);
  }

  /// Tensor and pipeline parallelism together (a grid): add_remote_layer on every rank of this
  /// stage (`comm`: the stage's tensor-parallel ranks), each re-selecting its heads of the lower
  /// layers that shrink across the ranks as add_layer (sharded) does. Errors: add_remote_layer's and
  /// add_layer (sharded)'s agreement errors, on every rank.
  template <class Backend, class Comm>
  status add_remote_layer(Backend be, workspace& ws, Comm& comm, index_t layer, double weight) {
    constexpr const char* fn = "layer_cascade::add_remote_layer (sharded)";
    status st = check_ready(fn);
    if (st.ok()) st = carve_selection(be, ws, fn);
    if (ws.is_query()) return st;
    if (st.ok()) st = check_ranks(fn, comm.size());
    if (st.ok()) st = check_remote(fn, ws, layer, weight);
    KVEVICT_TRY(agree_step(comm, fn, st, layer, weight, true));
    return step(be, ws, &comm, layer, weight, nullptr);
  }

 private:
  status check_scores_shape(const char* fn, const matrix_view<const float>& scores) const {
    KVEVICT_TRY(check_ready(fn));
    KVEVICT_TRY(detail::check_select_scores(fn, scores));
    const index_t H = cfg_.heads, N = cfg_.prompt_length;
    if (scores.extent(0) != H || scores.extent(1) != N)
      return status::error(errc::shape_mismatch, "%s: scores is [%lld][%lld], expected [%lld heads][%lld tokens]", fn,
                           static_cast<long long>(scores.extent(0)), static_cast<long long>(scores.extent(1)),
                           static_cast<long long>(H), static_cast<long long>(N));
    return {};
  }
  /// add_layer's checks after the workspace's size: order, weight, overlaps, protection.
  status check_add(const char* fn, const workspace& ws, index_t layer, const matrix_view<const float>& scores,
                   double weight) const {
    KVEVICT_TRY(check_order(fn, layer, weight));
    const detail::byte_range wr = detail::ws_range(ws);
    if (mem_.intersects(detail::range_of(scores)))
      return detail::select_overlap(fn, "scores", "the cascade's memory");
    if (wr.intersects(mem_)) return detail::select_overlap(fn, "the workspace", "the cascade's memory");
    if (wr.intersects(detail::range_of(scores))) return detail::select_overlap(fn, "the workspace", "scores");
    for (index_t h = 0; h < cfg_.heads; ++h)
      KVEVICT_TRY(detail::check_protected_scores(fn, scores, h, cfg_.prompt_length, cfg_.prot));
    return {};
  }
  status check_remote(const char* fn, const workspace& ws, index_t layer, double weight) const {
    KVEVICT_TRY(check_order(fn, layer, weight));
    if (detail::ws_range(ws).intersects(mem_)) return detail::select_overlap(fn, "the workspace", "the cascade's memory");
    return {};
  }
  /// A cascade configured for several ranks needs their communicator (and the other way round).
  status check_one_process(const char* fn) const {
    if (cfg_.ranks == 1) return {};
    return status::error(errc::invalid_argument, "%s: the cascade is configured for %lld tensor-parallel ranks; pass "
                         "their communicator", fn, static_cast<long long>(cfg_.ranks));
  }
  status check_ranks(const char* fn, int size) const {
    if (size == cfg_.ranks) return {};
    return status::error(errc::invalid_argument, "%s: the communicator has %d ranks, the cascade is configured for "
                         "%lld (cascade_config::ranks)", fn, size, static_cast<long long>(cfg_.ranks));
  }
  /// Tensor parallelism: the ranks agree that every rank's call is valid and that they add the same
  /// layer with the same weight to the same configuration, before any collective of the step.
  template <class Comm>
  status agree_step(Comm& comm, const char* fn, const status& local, index_t layer, double weight, bool remote) const {
    detail::config_line config;
    config.print("%s layer %lld, weight %.17g, split %d, total %lld, %lld layers x %lld heads per rank, %lld tokens, "
                 "n_sink %lld, n_recent %lld", remote ? "remote" : "own", static_cast<long long>(layer), weight,
                 static_cast<int>(cfg_.split), static_cast<long long>(cfg_.total), static_cast<long long>(cfg_.layers),
                 static_cast<long long>(cfg_.heads), static_cast<long long>(cfg_.prompt_length),
                 static_cast<long long>(cfg_.prot.n_sink), static_cast<long long>(cfg_.prot.n_recent));
    return detail::agree(comm, fn, local, config, nullptr, 0);
  }

  status check_ready(const char* fn) const {
    if (!ready_) return status::error(errc::invalid_argument, "%s: the cascade is not initialised (init)", fn);
    if (broken_)
      return status::error(errc::invalid_argument, "%s: an earlier step failed half-way; init() the cascade again", fn);
    return {};
  }
  /// Layers come in order, at most L of them; a weight is finite and >= 0.
  status check_order(const char* fn, index_t layer, double weight) const {
    if (added_ == cfg_.layers)
      return status::error(errc::invalid_argument, "%s: layer %lld given, but all %lld layers were added already", fn,
                           static_cast<long long>(layer), static_cast<long long>(cfg_.layers));
    if (layer != added_)
      return status::error(errc::invalid_argument, "%s: layer %lld given, expected layer %lld (layers come in order)", fn,
                           static_cast<long long>(layer), static_cast<long long>(added_));
    if (!(weight >= 0.0) || weight - weight != 0.0)
      return status::error(errc::invalid_argument, "%s: the weight (entropy / preference) of layer %lld is %g (must be "
                           "finite and >= 0)", fn, static_cast<long long>(layer), weight);
    return {};
  }

  /// One step of the cascade: the budgets of layers 0..m, the lower layers shrunk, then layer m
  /// selected from `scores` (null: a layer held by another stage, which stores nothing here).
  template <class Backend, class Comm>
  status step(Backend be, workspace& ws, Comm* comm, index_t layer, double weight,
              const matrix_view<const float>* scores) {
    const index_t H = cfg_.heads * cfg_.ranks, N = cfg_.prompt_length;  // every rank's heads
    const bool flat = cfg_.split == cascade_split::flattened;
    // 1. budgets of layers 0..m
    const index_t m = layer;
    weight_[m] = weight;
    const index_t new_cap = flat ? H * (N - W_) : N - W_;
    const auto cap = [&](index_t j) { return j < m ? alloc_[j] : new_cap; };
    index_t cap_sum = 0;
    for (index_t j = 0; j <= m; ++j) cap_sum += cap(j);
    const index_t target = evictable_ < cap_sum ? evictable_ : cap_sum;
    detail::apportion_run(
        target, m + 1, [this](index_t j) { return weight_[j]; }, cap, detail::array_out<index_t>{next_});

    // 2. lower layers: shrink (re-select from the stored scores) or move down, packed in order
    status st;
    index_t at = 0;
    for (index_t j = 0; j < m && st.ok(); ++j) {
      if (remote_[j] != 0) {  // holds nothing here
        off_[j] = at;
        continue;
      }
      st = flat ? reselect_flat(be, ws, comm, j, at) : reselect_per_head(be, ws, j, at);
      at = off_[j] + count(held_cu(j));
    }
    // 3. the new layer
    remote_[m] = scores == nullptr ? 1 : 0;
    if (scores == nullptr) {
      off_[m] = at;
      changed_[m] = 0;
    } else if (st.ok()) {
      st = flat ? select_new_flat(be, ws, comm, *scores, m, at) : select_new_per_head(be, ws, *scores, m, at);
    }
    if (!st.ok()) {
      broken_ = true;
      return st;
    }
    for (index_t j = 0; j <= m; ++j) alloc_[j] = next_[j];
    off_[m + 1] = off_[m] + count(held_cu(m));
    added_ = m + 1;
    return {};
  }

 public:

  const cascade_config& config() const noexcept { return cfg_; }
  /// Layers added so far.
  index_t layers_added() const noexcept { return added_; }
  /// Did the last add_layer change what `layer` holds? (The new layer: always.)
  bool changed(index_t layer) const noexcept { return valid(layer) && changed_[layer] != 0; }
  /// The last step's kept list of `layer`, per head ascending: for the layer just added, prompt
  /// positions in [0, N); for a lower layer, indices into the rows it held before the step (what
  /// compact_inplace on its cache takes; the identity when !changed). Empty for layers not added.
  ragged_positions kept(index_t layer) const noexcept {
    if (!valid(layer)) return {};
    return {step_ + off_[layer], step_cu_ + layer * (cfg_.heads + 1), cfg_.heads};
  }
  /// The prompt positions `layer` holds now, per head ascending. Empty for layers not added.
  ragged_positions positions(index_t layer) const noexcept {
    if (!valid(layer)) return {};
    return {pos_ + off_[layer], held_cu(layer), cfg_.heads};
  }
  /// The stored scores of those tokens (aligned with positions(layer)); null for layers not added.
  const float* held_scores(index_t layer) const noexcept { return valid(layer) ? scores_ + off_[layer] : nullptr; }
  /// Tokens `layer` keeps now, over all heads, protected ones included (0 for layers not added).
  index_t layer_total(index_t layer) const noexcept { return valid(layer) ? count(held_cu(layer)) : 0; }
  /// Tokens held by all layers added so far.
  index_t held_total() const noexcept { return added_ > 0 ? off_[added_] : 0; }
  /// The weight given for `layer` (0 for layers not added).
  double weight(index_t layer) const noexcept { return valid(layer) ? weight_[layer] : 0.0; }

 private:
  struct layout {
    std::size_t weight = 0, alloc = 0, next = 0, off = 0, held_cu = 0, step_cu = 0, changed = 0, remote = 0,
                scores = 0, pos = 0, step = 0, end = 0;
  };

  static layout layout_of(const cascade_config& cfg) {
    const auto L = static_cast<std::size_t>(cfg.layers), H = static_cast<std::size_t>(cfg.heads);
    const auto cap = static_cast<std::size_t>(cfg.total);
    layout y;
    std::size_t o = 0;
    const auto take = [&o](std::size_t bytes) {
      const std::size_t at = o;
      o = (o + bytes + 63) / 64 * 64;
      return at;
    };
    y.weight = take(L * sizeof(double));
    y.alloc = take(L * sizeof(index_t));
    y.next = take(L * sizeof(index_t));
    y.off = take((L + 1) * sizeof(index_t));
    y.held_cu = take(L * (H + 1) * sizeof(std::int32_t));
    y.step_cu = take(L * (H + 1) * sizeof(std::int32_t));
    y.changed = take(L);
    y.remote = take(L);
    y.scores = take(cap * sizeof(float));
    y.pos = take(cap * sizeof(pos_t));
    y.step = take(cap * sizeof(pos_t));
    y.end = o;
    return y;
  }

  static status validate(const char* fn, const cascade_config& cfg) {
    KVEVICT_TRY(detail::check_layers_heads(fn, cfg.layers, cfg.heads));
    KVEVICT_TRY(detail::check_prompt_length(fn, cfg.prompt_length));
    KVEVICT_TRY(detail::check_protection(fn, cfg.prot));
    if (cfg.split != cascade_split::flattened && cfg.split != cascade_split::per_head)
      return status::error(errc::invalid_argument, "%s: unknown cascade_split value %d", fn, static_cast<int>(cfg.split));
    index_t layer_tokens = 0;
    if (!detail::checked_mul(cfg.heads, cfg.prompt_length, layer_tokens) || layer_tokens > INT32_MAX)
      return status::error(errc::invalid_argument, "%s: %lld heads x %lld tokens is above %d per layer (int32 offsets)",
                           fn, static_cast<long long>(cfg.heads), static_cast<long long>(cfg.prompt_length), INT32_MAX);
    const index_t W = protected_count(cfg.prompt_length, cfg.prot.n_sink, cfg.prot.n_recent);
    if (cfg.ranks < 1 || cfg.ranks > detail::max_agree_ranks)
      return status::error(errc::invalid_argument, "%s: ranks = %lld (1 to %d)", fn, static_cast<long long>(cfg.ranks),
                           detail::max_agree_ranks);
    index_t all_heads = 0;
    if (!detail::checked_mul(cfg.heads, cfg.ranks, all_heads))
      return status::error(errc::size_overflow, "%s: %lld heads x %lld ranks overflow", fn,
                           static_cast<long long>(cfg.heads), static_cast<long long>(cfg.ranks));
    KVEVICT_TRY(detail::check_model_total(fn, cfg.total, cfg.layers, all_heads, cfg.prompt_length, W));
    if (cfg.split == cascade_split::per_head && cfg.total % all_heads != 0)
      return status::error(errc::invalid_argument,
                           "%s: total budget %lld is not a multiple of the %lld heads (per_head split: every head of "
                           "a layer keeps the same number)",
                           fn, static_cast<long long>(cfg.total), static_cast<long long>(all_heads));
    return {};
  }

  template <class Backend>
  std::size_t selection_bytes(Backend be) const {
    const index_t H = cfg_.heads, N = cfg_.prompt_length;
    if (cfg_.split != cascade_split::flattened) return select_topk_workspace_bytes(be, N);
    const index_t row = cfg_.total < H * N ? cfg_.total : H * N;  // the most a lower layer holds here
    const std::size_t flat = cfg_.ranks > 1 ? sharded_flat_workspace_bytes(be, H, N, false)
                                            : select_topk_flat_workspace_bytes(be, H, N);
    const std::size_t one = cfg_.ranks > 1 ? sharded_flat_workspace_bytes(be, 1, row, false)
                                           : select_topk_workspace_bytes(be, row);
    return flat > one ? flat : one;
  }

  /// add_layer's workspace layout (both phases): the largest selection's own query size, carved.
  template <class Backend>
  status carve_selection(Backend be, workspace& ws, const char* fn) const {
    detail::workspace_carver carver(ws);
    (void)carver.take<unsigned char>(selection_bytes(be));
    return carver.finish(fn);
  }

  bool valid(index_t layer) const noexcept { return ready_ && layer >= 0 && layer < added_; }
  std::int32_t* held_cu(index_t layer) const noexcept { return held_cu_ + layer * (cfg_.heads + 1); }
  std::int32_t* step_cu(index_t layer) const noexcept { return step_cu_ + layer * (cfg_.heads + 1); }
  index_t count(const std::int32_t* cu) const noexcept { return cu[cfg_.heads]; }

  template <class T>
  static matrix_view<T> dense(T* p, index_t rows, index_t cols) {
    using exts = cuda::std::dextents<index_t, 2>;
    const cuda::std::array<index_t, 2> strides{cols > 0 ? cols : 1, 1};
    return matrix_view<T>(p, typename cuda::std::layout_stride::template mapping<exts>(exts(rows, cols), strides));
  }
  static matrix_view<const float> row_view(const float* p, index_t n) { return dense(p, 1, n); }
  static matrix_view<const float> dense_view(const float* p, index_t rows, index_t cols) { return dense(p, rows, cols); }
  static matrix_view<pos_t> kept_view(pos_t* p, index_t rows, index_t cols) { return dense(p, rows, cols); }

  /// Moves layer j's stored tokens from off_[j] to `at` (at <= off_[j]) and writes the identity as its
  /// kept list.
  void keep_all(index_t j, index_t at) {
    const index_t n = count(held_cu(j)), from = off_[j];
    if (at != from) {
      std::memmove(scores_ + at, scores_ + from, static_cast<std::size_t>(n) * sizeof(float));
      std::memmove(pos_ + at, pos_ + from, static_cast<std::size_t>(n) * sizeof(pos_t));
    }
    const std::int32_t* cu = held_cu(j);
    for (index_t h = 0; h < cfg_.heads; ++h)
      for (std::int32_t i = cu[h]; i < cu[h + 1]; ++i) step_[at + i] = i - cu[h];
    std::memcpy(step_cu(j), cu, static_cast<std::size_t>(cfg_.heads + 1) * sizeof(std::int32_t));
    off_[j] = at;
    changed_[j] = 0;
  }

  template <class Backend, class Comm>
  status reselect_flat(Backend be, workspace& ws, Comm* comm, index_t j, index_t at) {
    if (next_[j] == alloc_[j]) {  // the same on every rank (the budgets are global)
      keep_all(j, at);
      return {};
    }
    const index_t H = cfg_.heads, from = off_[j], n = count(held_cu(j));
    index_t k = H * cfg_.ranks * W_ + next_[j];
    // one row holding the layer's heads back to back: the flat index order (head, then position)
    // is select_topk_flat's tie order, so this is the flattened selection of what the layer holds.
    // Across ranks: one such row per rank, in rank order (= global head order); this rank keeps k
    // of the layer's global k.
    if (comm == nullptr) {
      KVEVICT_TRY(select_topk(be, ws, row_view(scores_ + from, n), nullptr, kept_view(step_ + at, 1, k)));
    } else {
      std::int32_t cu[2] = {};
      KVEVICT_TRY(select_sharded(be, ws, *comm, row_view(scores_ + from, n), k, cu, step_ + at));
      k = cu[1];
    }
    std::int32_t* old_cu = held_cu(j);
    std::int32_t* new_cu = step_cu(j);
    index_t h = 0;
    new_cu[0] = 0;
    for (index_t i = 0; i < k; ++i) {  // ascending flat indices; dst <= src, so in place is safe
      const index_t f = step_[at + i];
      while (f >= old_cu[h + 1]) new_cu[++h] = static_cast<std::int32_t>(i);
      step_[at + i] = static_cast<pos_t>(f - old_cu[h]);
      scores_[at + i] = scores_[from + f];
      pos_[at + i] = pos_[from + f];
    }
    while (h < H) new_cu[++h] = static_cast<std::int32_t>(k);
    std::memcpy(old_cu, new_cu, static_cast<std::size_t>(H + 1) * sizeof(std::int32_t));
    off_[j] = at;
    changed_[j] = 1;
    return {};
  }

  template <class Backend>
  status reselect_per_head(Backend be, workspace& ws, index_t j, index_t at) {
    if (next_[j] == alloc_[j]) {
      keep_all(j, at);
      return {};
    }
    const index_t H = cfg_.heads, from = off_[j], c = W_ + alloc_[j], c2 = W_ + next_[j];
    KVEVICT_TRY(select_topk(be, ws, dense_view(scores_ + from, H, c), nullptr, kept_view(step_ + at, H, c2)));
    for (index_t h = 0; h < H; ++h)
      for (index_t i = 0; i < c2; ++i) {  // (h, i) ascending: dst <= src, in place is safe
        const index_t src = from + h * c + step_[at + h * c2 + i], dst = at + h * c2 + i;
        scores_[dst] = scores_[src];
        pos_[dst] = pos_[src];
      }
    fill_uniform_cu(j, c2);
    off_[j] = at;
    changed_[j] = 1;
    return {};
  }

  /// The flattened selection of `k` entries over every rank's rows (rank order = row order): this
  /// rank's counts at cu[rows + 1], its kept positions at pos. The ranks agreed before the step, and
  /// every rank makes the same calls (the budgets are global), so this goes straight to the
  /// sharded selection's collectives.
  template <class Backend, class Comm>
  status select_sharded(Backend be, workspace& ws, Comm& comm, const matrix_view<const float>& scores, index_t k,
                        std::int32_t* cu, pos_t* pos) {
    detail::workspace_carver c(ws);
    const detail::sharded_flat_ws sws =
        detail::carve_sharded_flat_ws(c, scores.extent(0), scores.extent(1), detail::thread_count(be));
    KVEVICT_TRY(c.finish("layer_cascade (sharded selection)"));  // fits: selection_bytes is the largest
    return detail::run_sharded_flat(be, comm, scores, nullptr, k, nullptr, 0, cu, pos, sws);
  }

  void fill_uniform_cu(index_t j, index_t per_head) {
    std::int32_t* a = held_cu(j);
    std::int32_t* b = step_cu(j);
    for (index_t h = 0; h <= cfg_.heads; ++h) a[h] = b[h] = static_cast<std::int32_t>(h * per_head);
  }

  template <class Backend, class Comm>
  status select_new_flat(Backend be, workspace& ws, Comm* comm, const matrix_view<const float>& scores, index_t m,
                         index_t at) {
    const index_t H = cfg_.heads, k = H * cfg_.ranks * W_ + next_[m];
    if (comm == nullptr)
      KVEVICT_TRY(select_topk_flat(be, ws, scores, nullptr, k, nullptr, step_cu(m), step_ + at));
    else  // this rank's heads' part of the layer's k (after the step, what a rank holds <= cfg.total)
      KVEVICT_TRY(select_sharded(be, ws, *comm, scores, k, step_cu(m), step_ + at));
    std::memcpy(held_cu(m), step_cu(m), static_cast<std::size_t>(H + 1) * sizeof(std::int32_t));
    const std::int32_t* cu = held_cu(m);
    for (index_t h = 0; h < H; ++h)
      for (std::int32_t i = cu[h]; i < cu[h + 1]; ++i) {
        pos_[at + i] = step_[at + i];
        scores_[at + i] = scores(h, step_[at + i]);
      }
    off_[m] = at;
    changed_[m] = 1;
    return {};
  }

  template <class Backend>
  status select_new_per_head(Backend be, workspace& ws, const matrix_view<const float>& scores, index_t m, index_t at) {
    const index_t H = cfg_.heads, c = W_ + next_[m];
    KVEVICT_TRY(select_topk(be, ws, scores, nullptr, kept_view(step_ + at, H, c)));
    for (index_t h = 0; h < H; ++h)
      for (index_t i = 0; i < c; ++i) {
        const pos_t p = step_[at + h * c + i];
        pos_[at + h * c + i] = p;
        scores_[at + h * c + i] = scores(h, p);
      }
    fill_uniform_cu(m, c);
    off_[m] = at;
    changed_[m] = 1;
    return {};
  }

  cascade_config cfg_{};
  detail::byte_range mem_{};
  double* weight_ = nullptr;
  index_t* alloc_ = nullptr;
  index_t* next_ = nullptr;
  index_t* off_ = nullptr;
  std::int32_t* held_cu_ = nullptr;
  std::int32_t* step_cu_ = nullptr;
  unsigned char* changed_ = nullptr;
  unsigned char* remote_ = nullptr;  // 1: a layer held by another pipeline stage
  float* scores_ = nullptr;
  pos_t* pos_ = nullptr;
  pos_t* step_ = nullptr;
  index_t W_ = 0;
  index_t evictable_ = 0;
  index_t added_ = 0;
  bool ready_ = false;
  bool broken_ = false;
};

}  // namespace kvevict
