// kvevict/drivers/streaming_heads.hpp: DuoAttention / PruLong head types applied at every point
// the cache grows (docs/drivers.md, "Streaming heads").
//
//   streaming_heads_driver d;
//   d.init(cfg, memory, streaming_heads_driver::state_bytes(cfg).value(), &recorder /*optional*/);
//   whenever the engine appended rows to layer l (a prefill chunk, a layer's whole prefill, a
//   decoded token) and `tokens` tokens have been processed:
//     d.update(l, layer_kv_l, tokens);      // a layer_kv, or a paged_layer_kv (config.pool_pages)
//     if (d.evicted(l)) compact layer l with d.kept(l);
//
// Retrieval heads (mask 1) keep every row; streaming heads (mask 0) keep the rows whose original
// position is a sink (< n_sink) or among the n_recent - 1 newest (> tokens - n_recent): with its own
// key, the next query (position `tokens`) then sees exactly the sinks and n_recent recent keys, the
// window of StreamingLLM, DuoAttention and PruLong (the current key included). After every update
// a streaming head holds min(tokens, n_sink + n_recent - 1) rows, and one-token steps record
// exactly eviction_recorder::set_streaming's schedule, so the KV footprint and the peak a recorder
// measures are what a DuoAttention / PruLong engine holds, in the chunked prefill, the layer-wise
// prefill and decoding alike. No scores, no queries, no workspace.
#pragma once

#include <kvevict/drivers/detail/driver_skeleton.hpp>

namespace kvevict {

struct streaming_heads_config {
  model_shape model;
  /// C: the most rows a head holds when update() is called (sizes the state).
  index_t capacity = 0;
  /// The streaming heads' sinks and recent window (the current token's key included: n_recent >= 1).
  protection streaming;
  /// [layers][kv_heads]: 1 = retrieval head (full cache), 0 = streaming head; copied by init().
  matrix_view<const std::uint8_t> retrieval;
  /// Paged layers (paged_layer_kv): the most pages their pools may have (the state holds a bitmap
  /// of them for the table checks); 0: layer_kv only.
  index_t pool_pages = 0;
};

/// Streaming heads at every step (see the file comment and docs/drivers.md).
class streaming_heads_driver : public detail::driver_skeleton<streaming_heads_driver, streaming_heads_config> {
  friend class detail::driver_skeleton<streaming_heads_driver, streaming_heads_config>;

 public:
  static constexpr const char* name = "streaming_heads_driver";

  // state_bytes(cfg), workspace_bytes(be) (always 0), config(): detail::driver_skeleton.

  // init(cfg, memory, bytes, recorder): detail::driver_skeleton, ending in attach() below.
  // init's errors: model shape; capacity outside [1, INT32_MAX / H]; n_sink < 0 or n_recent < 1; a mask
  // that is not [L][H] or holds a value other than 0 and 1; recorder shape; memory null or too small.

  /// Layer l holds kv after `tokens` tokens (every position < tokens, at most C rows per head, in
  /// arrival order): kept(l) keeps every row of a retrieval head and the sinks and the positions
  /// > tokens - n_recent of a streaming head; evicted(l) says whether a row is dropped (recorded at
  /// step `tokens`). Layers may come in any order, as often as the engine likes. kv: a layer_kv or
  /// a paged_layer_kv (one sequence of a paged layer, read through its block table; the pools at
  /// most config.pool_pages pages); the kept rows are the same for the same rows.
  /// Errors (nothing changes but evicted(l), false after any error): not initialised; layer outside
  /// [0, L); the layer's layout (a paged layer's pools and table: open_paged_rows) and positions;
  /// more rows than the capacity; tokens outside [1, INT32_MAX); the recorder's errors.
  template <class KV, class = detail::layer_element_t<KV>>
  status update(index_t layer, const KV& kv_in, index_t tokens) {
    constexpr const char* fn = "streaming_heads_driver::update";
    if (!ok_) return status::error(errc::invalid_argument, "%s: the driver is not initialised (init)", fn);
    const index_t H = cfg_.model.kv_heads, C = cfg_.capacity;
    KVEVICT_TRY(check_layer_index(fn, layer));
    evicted_[layer] = 0;
    typename detail::layer_reader<KV>::type kv;
    KVEVICT_TRY(detail::open_layer(fn, paged_, kv_in, H, cfg_.model.head_dim, kv));
    KVEVICT_TRY(check_layer_after(fn, layer, kv, tokens, 1));
    const index_t recent_from = tokens - cfg_.streaming.n_recent + 1;  // the next query's key completes the window
    std::int32_t* cu = kept_cu_ + layer * (H + 1);
    pos_t* pos = kept_pos_ + layer * H * C;
    bool dropped = false;
    cu[0] = 0;
    for (index_t h = 0; h < H; ++h) {
      const index_t n = detail::layer_lens(kv)[h];
      std::int32_t at = cu[h];
      for (index_t j = 0; j < n; ++j) {
        const pos_t p = detail::layer_pos(kv, h, j);
        if (mask_[layer * H + h] != 0 || p < cfg_.streaming.n_sink || p >= recent_from) pos[at++] = static_cast<pos_t>(j);
      }
      dropped = dropped || at - cu[h] != n;
      cu[h + 1] = at;
    }
    const ragged_positions k{pos, cu, H};
    if (dropped) KVEVICT_TRY(detail::record_dropped(rec_, layer, kv, k, tokens, drop_pos_, drop_cu_));
    evicted_[layer] = dropped ? 1 : 0;
    return {};
  }

  /// Did the last update of layer l drop a row? (Then compact it with kept(l).)
  bool evicted(index_t layer) const noexcept { return ok_ && layer >= 0 && layer < cfg_.model.layers && evicted_[layer] != 0; }
  /// The rows of layer l to keep after its last update (row indices, ascending per head).
  ragged_positions kept(index_t layer) const noexcept {
    const index_t H = cfg_.model.kv_heads;
    return {kept_pos_ + layer * H * cfg_.capacity, kept_cu_ + layer * (H + 1), H};
  }
  /// Is head (l, h) a retrieval head?
  bool retrieval(index_t layer, index_t head) const noexcept { return mask_[layer * cfg_.model.kv_heads + head] != 0; }

 private:
  /// init's last step (detail::driver_skeleton::init, after the configuration, recorder and memory
  /// checks): the state pieces placed at m.base and reset.
  status attach(const char* /*fn*/, const streaming_heads_config& cfg, const detail::state_memory& m) {
    const plan_t p = plan(cfg);
    const index_t L = cfg.model.layers, H = cfg.model.kv_heads;
    mask_ = m.base + p.mask;
    evicted_ = m.base + p.evicted;
    kept_pos_ = reinterpret_cast<pos_t*>(m.base + p.kept_pos);
    kept_cu_ = reinterpret_cast<std::int32_t*>(m.base + p.kept_cu);
    drop_pos_ = reinterpret_cast<pos_t*>(m.base + p.drop_pos);
    drop_cu_ = reinterpret_cast<std::int32_t*>(m.base + p.drop_cu);
    paged_.pool_pages = cfg.pool_pages;
    paged_.bitmap = reinterpret_cast<std::uint64_t*>(m.base + p.paged_bitmap);
    paged_.indptr = reinterpret_cast<std::int32_t*>(m.base + p.paged_indptr);
    paged_.lens = reinterpret_cast<std::int32_t*>(m.base + p.paged_lens);
    for (index_t l = 0; l < L; ++l) {
      evicted_[l] = 0;
      for (index_t h = 0; h < H; ++h) mask_[l * H + h] = cfg.retrieval(l, h) != 0 ? 1 : 0;
      for (index_t h = 0; h <= H; ++h) kept_cu_[l * (H + 1) + h] = 0;
    }
    cfg_.retrieval = {};
    return {};
  }

  struct plan_t {
    detail::mem_plan layout;
    std::size_t mask = 0, evicted = 0, kept_pos = 0, kept_cu = 0, drop_pos = 0, drop_cu = 0;
    std::size_t paged_bitmap = 0, paged_indptr = 0, paged_lens = 0;
  };

  static status validate(const char* fn, const streaming_heads_config& c) {
    KVEVICT_TRY(detail::check_model(fn, c.model));
    KVEVICT_TRY(detail::check_capacity(fn, "capacity", c.capacity, c.model.kv_heads));
    KVEVICT_TRY(detail::check_pool_pages(fn, c.pool_pages));
    if (c.streaming.n_sink < 0 || c.streaming.n_recent < 1)
      return status::error(errc::invalid_argument, "%s: n_sink = %lld must be >= 0 and n_recent = %lld >= 1 (the current key)", fn,
                           static_cast<long long>(c.streaming.n_sink), static_cast<long long>(c.streaming.n_recent));
    KVEVICT_TRY(detail::check_view(fn, "retrieval", c.retrieval));
    if (c.retrieval.extent(0) != c.model.layers || c.retrieval.extent(1) != c.model.kv_heads)
      return status::error(errc::shape_mismatch, "%s: the retrieval mask is [%lld][%lld], expected [%lld layers][%lld heads]",
                           fn, static_cast<long long>(c.retrieval.extent(0)), static_cast<long long>(c.retrieval.extent(1)),
                           static_cast<long long>(c.model.layers), static_cast<long long>(c.model.kv_heads));
    for (index_t l = 0; l < c.model.layers; ++l)
      for (index_t h = 0; h < c.model.kv_heads; ++h)
        if (c.retrieval(l, h) > 1)
          return status::error(errc::invalid_argument, "%s: retrieval[%lld][%lld] = %d is neither 0 nor 1", fn,
                               static_cast<long long>(l), static_cast<long long>(h), static_cast<int>(c.retrieval(l, h)));
    return {};
  }

  static plan_t plan(const streaming_heads_config& c) {
    plan_t p;
    const auto L = static_cast<std::size_t>(c.model.layers), H = static_cast<std::size_t>(c.model.kv_heads),
               C = static_cast<std::size_t>(c.capacity);
    p.mask = p.layout.take(L * H);
    p.evicted = p.layout.take(L);
    p.kept_pos = p.layout.take(L * H * C * sizeof(pos_t));
    p.kept_cu = p.layout.take(L * (H + 1) * sizeof(std::int32_t));
    p.drop_pos = p.layout.take(H * C * sizeof(pos_t));
    p.drop_cu = p.layout.take((H + 1) * sizeof(std::int32_t));
    const bool paged = c.pool_pages > 0;  // open_paged_rows' scratch
    p.paged_bitmap = p.layout.take(static_cast<std::size_t>(detail::page_bitmap_words(c.pool_pages)) * sizeof(std::uint64_t));
    p.paged_indptr = p.layout.take(paged ? (H + 1) * sizeof(std::int32_t) : 0);
    p.paged_lens = p.layout.take(paged ? H * sizeof(std::int32_t) : 0);
    return p;
  }

  template <class Backend>
  status carve(Backend, workspace&, detail::call_scratch&) const {
    return {};  // no scores, no selection: nothing to carve
  }

  unsigned char* mask_ = nullptr;
  unsigned char* evicted_ = nullptr;
  pos_t* kept_pos_ = nullptr;
  std::int32_t* kept_cu_ = nullptr;
  pos_t* drop_pos_ = nullptr;
  std::int32_t* drop_cu_ = nullptr;
  detail::paged_rows_scratch paged_;  // a paged layer's checks and row view (pool_pages > 0)
};

}  // namespace kvevict
