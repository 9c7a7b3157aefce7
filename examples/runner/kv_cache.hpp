// runner/kv_cache.hpp: the runner's KV cache, one page pool per layer (docs/runner.md, "The
// paged cache").
//
// Layer l, KV head h holds length(l, h) rows of keys and of values (post-RoPE keys, head_size
// floats each) and the same number of positions, in order of arrival, in pages of page_size()
// tokens: a page pool per layer (kvevict::page_pool, one KV head per page) and a block table with
// one list per KV head (kvevict::page_lists::per_head), every page full but the last. Heads may
// hold different numbers of rows (after AdaKV / LAVa eviction). Each row remembers the ORIGINAL
// position of its token: RoPE was applied with it when the key was computed, and it stays the
// token's position after eviction. New tokens get the position next_position(), the length of the
// sequence so far, never the compacted length.
//
// Eviction is kvevict::compact_layer on the layer's paged view (keys, values and positions): kept
// rows move to the front of their head's pages and the pages no longer needed are freed
// (pages_freed() counts them). Each (layer, head) draws its pages from its own arena of ceil(capacity / page_size) pages, lowest
// free page first, so a head's pages are consecutive: the attention and kvevict's drivers (which
// read ragged caches, not paged layers yet) read keys(l) / dense_keys(l, rows) without copies.
#pragma once

#include <runner/model.hpp>

#include <kvevict/compact.hpp>
#include <kvevict/drivers/compact_layer.hpp>
#include <kvevict/paged.hpp>
#include <kvevict/view.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <type_traits>
#include <vector>

namespace kvrun {

/// What kv_cache::save() remembers, for kv_cache::rollback().
struct cache_checkpoint {
  std::uint64_t appended = 0;  ///< rows appended to every head before the checkpoint
  std::uint64_t epoch = 0;     ///< compactions and clears before the checkpoint
  pos_t next_position = 0;
};

class kv_cache {
 public:
  kv_cache() = default;

  /// Allocates an empty cache for model config `c` with `capacity` rows per layer and KV head
  /// (0: c.seq_len) in pages of `page_size` tokens (each head's arena: ceil(capacity / page_size)
  /// pages). Errors: invalid_argument for a negative capacity or one above c.seq_len (positions
  /// are < seq_len and an extra block may repeat positions, but a head never needs more rows than
  /// the context) or a page size below 1, size_overflow if the buffers do not fit in memory indices.
  status init(const config& c, index_t capacity = 0, index_t page_size = 16) {
    if (capacity < 0 || capacity > c.seq_len)
      return status::error(errc::invalid_argument, "kv_cache: capacity %lld is outside [0, seq_len %d] (0 = seq_len)",
                           static_cast<long long>(capacity), c.seq_len);
    if (page_size < 1 || page_size > INT32_MAX)
      return status::error(errc::invalid_argument, "kv_cache: page size %lld is outside [1, 2^31 - 1]",
                           static_cast<long long>(page_size));
    if (capacity == 0) capacity = c.seq_len;
    const index_t pages = (capacity + page_size - 1) / page_size;  // per head
    index_t rows = 0, floats = 0;
    if (pages > INT32_MAX / page_size || !detail::checked_mul(index_t(c.n_layers) * c.n_kv_heads, pages * page_size, rows) ||
        !detail::checked_mul(rows, c.head_size(), floats) || pages * page_size > INT32_MAX / (c.n_kv_heads + 1))
      return status::error(errc::size_overflow, "kv_cache: %d layers x %d heads x %lld rows overflow", c.n_layers,
                           c.n_kv_heads, static_cast<long long>(capacity));
    layers_ = c.n_layers;
    heads_ = c.n_kv_heads;
    head_size_ = c.head_size();
    capacity_ = capacity;
    page_size_ = page_size;
    head_pages_ = pages;
    stride_ = pages * page_size;
    seq_len_ = c.seq_len;
    keys_.assign(static_cast<std::size_t>(floats), 0.0f);
    values_.assign(static_cast<std::size_t>(floats), 0.0f);
    positions_.assign(static_cast<std::size_t>(rows), 0);
    lens_.assign(static_cast<std::size_t>(index_t(layers_) * heads_), 0);
    cu_capacity_.resize(static_cast<std::size_t>(heads_) + 1);
    for (index_t h = 0; h <= heads_; ++h) cu_capacity_[static_cast<std::size_t>(h)] = static_cast<std::int32_t>(h * stride_);
    const auto lists = static_cast<std::size_t>(heads_), listed = static_cast<std::size_t>(heads_ * pages);
    indptr_.assign(lists + 1, 0);
    indices_.assign(listed, 0);
    last_page_len_.assign(lists, 0);
    new_lens_.assign(lists, 0);
    freed_.assign(listed, 0);
    ws_.assign(std::max<std::size_t>(kvevict::paged_workspace_bytes(heads_ * pages), 64), 0);  // never empty: a null ws is a query
    pages_freed_ = peak_pages_ = 0;
    layer_epoch_.assign(static_cast<std::size_t>(layers_), 0);
    next_position_ = 0;
    appended_ = 0;
    ++epoch_;
    frozen_ = false;
    return {};
  }

  int layers() const { return layers_; }
  index_t kv_heads() const { return heads_; }
  index_t head_size() const { return head_size_; }
  index_t capacity() const { return capacity_; }
  /// Tokens per page.
  index_t page_size() const { return page_size_; }
  /// Pages of the pools: ceil(capacity / page_size) per layer and KV head.
  index_t total_pages() const { return index_t(layers_) * heads_ * head_pages_; }
  /// Pages holding rows now: ceil(length / page_size) per layer and KV head.
  index_t pages_in_use() const {
    index_t t = 0;
    for (const std::int32_t n : lens_) t += (n + page_size_ - 1) / page_size_;
    return t;
  }
  /// The most pages held at once (after any forward or compaction) since init() / clear().
  index_t peak_pages() const { return peak_pages_; }
  /// Pages compact() gave back to the free pages since init() / clear() (kvevict::compact_paged's
  /// freed page lists; rolled-back blocks do not count).
  index_t pages_freed() const { return pages_freed_; }
  /// Position of the next token: 1 + the largest position ever kept (0 when empty). Eviction
  /// does not change it.
  pos_t next_position() const { return next_position_; }

  /// Rows head h of layer l holds.
  index_t length(int l, index_t h) const { return lens_[idx(l, h)]; }
  /// The `kv_heads()` lengths of layer l.
  const std::int32_t* lengths(int l) const { return lens_.data() + index_t(l) * heads_; }
  /// Rows held by all heads of all layers (the un-evicted entries of the footprint metrics).
  index_t total_rows() const {
    index_t t = 0;
    for (const std::int32_t n : lens_) t += n;
    return t;
  }

  const float* key_row(int l, index_t h, index_t j) const { return keys_.data() + row_off(l, h, j); }
  const float* value_row(int l, index_t h, index_t j) const { return values_.data() + row_off(l, h, j); }
  /// Original token position of row j of head h, layer l.
  pos_t position(int l, index_t h, index_t j) const {
    return positions_[static_cast<std::size_t>(row_off(l, h, j) / head_size_)];
  }

  /// Layer l's keys / values / positions as kvevict ragged caches (positions: dim 1). The three
  /// share one `lens` array. They are for reading and for kvevict stages that read ragged caches;
  /// change a cache only through compact() (compacting one of them alone would desynchronise
  /// keys, values and positions).
  kvevict::ragged_cache<float> keys(int l) { return {keys_.data() + layer_off(l), cu_capacity_.data(), lens_ptr(l), heads_, head_size_, head_size_}; }
  kvevict::ragged_cache<float> values(int l) { return {values_.data() + layer_off(l), cu_capacity_.data(), lens_ptr(l), heads_, head_size_, head_size_}; }
  kvevict::ragged_cache<pos_t> positions(int l) {
    return {positions_.data() + layer_off(l) / head_size_, cu_capacity_.data(), lens_ptr(l), heads_, 1, 1};
  }

  /// The first `rows` rows of every head of layer l as a dense [kv_head][rows][head_size] view.
  /// Errors: out_of_range if l is not a layer or a head holds fewer than `rows` rows.
  kvevict::result<kvevict::kv_view<const float>> dense_keys(int l, index_t rows) const {
    return dense(keys_, "dense_keys", l, rows);
  }
  kvevict::result<kvevict::kv_view<const float>> dense_values(int l, index_t rows) const {
    return dense(values_, "dense_values", l, rows);
  }

  /// Evicts: head h of layer l keeps its rows kept.pos[kept.cu[h] .. kept.cu[h+1]) (row indices
  /// into its current rows, strictly ascending), packed to the front in that order, keys, values
  /// and positions alike. No allocation. next_position() is unchanged.
  /// Errors: out_of_range (l not a layer), shape_mismatch (kept.heads != kv_heads()),
  /// invalid_argument (inside a rolled-back block, see runner::forward_extra), overlap (kept lists
  /// stored inside the cache), and every error of kvevict::compact_layer (malformed offsets, rows
  /// out of range, not ascending). Nothing is changed on error.
  status compact(int l, kvevict::ragged_positions kept) {
    if (l < 0 || l >= layers_)
      return status::error(errc::out_of_range, "kv_cache::compact: layer %d is outside [0, %d)", l, layers_);
    if (frozen_)
      return status::error(errc::invalid_argument,
                           "kv_cache::compact: the cache is inside a block that will be rolled back; compact after it");
    if (kept.heads != heads_)
      return status::error(errc::shape_mismatch, "kv_cache::compact: kept lists %lld heads, the cache has %lld",
                           static_cast<long long>(kept.heads), static_cast<long long>(heads_));
    // kept lists living inside this cache's buffers (any layer's) would be overwritten midway:
    // refuse them before a row moves (compact_layer checks the offsets, rows and this layer's memory)
    if (kept.pos != nullptr && kept.cu != nullptr && kept.heads > 0 && kept.cu[kept.heads] > 0) {
      const auto* first = reinterpret_cast<const unsigned char*>(kept.pos);
      const auto* last = reinterpret_cast<const unsigned char*>(kept.pos + kept.cu[kept.heads]);
      auto inside = [&](const auto& buf) {
        const auto* b = reinterpret_cast<const unsigned char*>(buf.data());
        const auto* e = reinterpret_cast<const unsigned char*>(buf.data() + buf.size());
        return std::less<const unsigned char*>{}(first, e) && std::less<const unsigned char*>{}(b, last);
      };
      if (inside(keys_) || inside(values_) || inside(positions_))
        return status::error(errc::overlap, "kv_cache::compact: the kept lists lie inside the cache's own memory");
    }
    // layer l's paged view: one list per head, pages h * head_pages_ + [0, ceil(len / page_size))
    const std::int32_t* len = lengths(l);
    for (index_t h = 0; h < heads_; ++h) {
      const std::int32_t n = len[h], np = static_cast<std::int32_t>((n + page_size_ - 1) / page_size_);
      const auto at = static_cast<std::size_t>(indptr_[static_cast<std::size_t>(h)]);
      indptr_[static_cast<std::size_t>(h) + 1] = static_cast<std::int32_t>(at) + np;
      for (std::int32_t i = 0; i < np; ++i) indices_[at + static_cast<std::size_t>(i)] = static_cast<std::int32_t>(h * head_pages_ + i);
      last_page_len_[static_cast<std::size_t>(h)] = static_cast<std::int32_t>(np == 0 ? 0 : n - (np - 1) * page_size_);
    }
    kvevict::paged_layer<float> layer;
    layer.keys = pool(keys_, l);
    layer.values = pool(values_, l);
    layer.table = {indptr_.data(), indices_.data(), last_page_len_.data(), heads_};
    layer.sequences = 1;
    layer.kv_heads = heads_;
    layer.lists = kvevict::page_lists::per_head;
    std::int32_t freed = 0;
    kvevict::workspace ws{ws_.data(), ws_.size()};
    KVEVICT_TRY(kvevict::compact_layer(kvevict::seq, ws, layer, pool(positions_, l), kept,
                                       {new_lens_.data(), freed_.data(), static_cast<index_t>(freed_.size()), &freed}));
    std::copy(new_lens_.begin(), new_lens_.end(), lens_ptr(l));
    pages_freed_ += freed;
    ++epoch_;
    ++layer_epoch_[static_cast<std::size_t>(l)];
    return {};
  }

  /// Remembers the cache's state, for rollback().
  cache_checkpoint save() const { return {appended_, epoch_, next_position_}; }

  /// Drops every row appended since `cp`, restoring lengths and next_position(); rows kept
  /// before `cp` are untouched (appends never overwrite held rows). Errors: invalid_argument if
  /// the cache was compacted or cleared since `cp` (the rows to drop are no longer the last ones)
  /// or `cp` is from a later state.
  status rollback(const cache_checkpoint& cp) {
    if (cp.epoch != epoch_)
      return status::error(errc::invalid_argument, "kv_cache::rollback: the cache was compacted or cleared since the checkpoint");
    if (cp.appended > appended_)
      return status::error(errc::invalid_argument, "kv_cache::rollback: the checkpoint is newer than the cache");
    const auto n = static_cast<std::int32_t>(appended_ - cp.appended);
    for (std::int32_t& len : lens_) len -= n;
    appended_ = cp.appended;
    next_position_ = cp.next_position;
    return {};
  }

  /// Empties every head; next_position() becomes 0.
  void clear() {
    std::fill(lens_.begin(), lens_.end(), 0);
    pages_freed_ = peak_pages_ = 0;
    next_position_ = 0;
    appended_ = 0;
    ++epoch_;
  }

 private:
  friend class runner;

  int layers_ = 0;
  index_t heads_ = 0, head_size_ = 0, capacity_ = 0;
  index_t page_size_ = 16, head_pages_ = 0, stride_ = 0;  // stride_: a head's arena, head_pages_ * page_size_ rows
  int seq_len_ = 0;
  std::vector<float> keys_, values_;     // [layer][kv_head][stride_][head_size]: layer l's page pool
  std::vector<pos_t> positions_;         // [layer][kv_head][stride_]
  std::vector<std::int32_t> lens_;       // [layer][kv_head]
  std::vector<std::int32_t> cu_capacity_;  // {0, stride_, 2 stride_, ...}: the same for every layer
  std::vector<std::uint64_t> layer_epoch_;  // compactions per layer
  // compact()'s block table (one layer's), its outputs and compact_paged's workspace
  std::vector<std::int32_t> indptr_, indices_, last_page_len_, new_lens_, freed_;
  std::vector<unsigned char> ws_;
  index_t pages_freed_ = 0, peak_pages_ = 0;
  pos_t next_position_ = 0;
  std::uint64_t appended_ = 0;  // rows appended to every head by completed forwards
  std::uint64_t epoch_ = 0;     // compactions + clears + inits
  bool frozen_ = false;         // inside a block that will be rolled back

  std::size_t idx(int l, index_t h) const { return static_cast<std::size_t>(index_t(l) * heads_ + h); }
  std::int32_t* lens_ptr(int l) { return lens_.data() + index_t(l) * heads_; }
  index_t layer_off(int l) const { return index_t(l) * heads_ * stride_ * head_size_; }
  index_t row_off(int l, index_t h, index_t j) const { return layer_off(l) + (h * stride_ + j) * head_size_; }
  // layer l's page pool of keys, values (dim head_size) or positions (dim 1)
  template <class T>
  kvevict::page_pool<T> pool(std::vector<T>& buf, int l) {
    const index_t dim = std::is_same_v<T, pos_t> ? 1 : head_size_;
    return *kvevict::make_page_pool(buf.data() + layer_off(l) / head_size_ * dim, heads_ * head_pages_, page_size_,
                                    index_t(1), dim, kvevict::page_layout::hnd);
  }

  kvevict::result<kvevict::kv_view<const float>> dense(const std::vector<float>& buf, const char* fn, int l,
                                                        index_t rows) const {
    if (l < 0 || l >= layers_)
      return status::error(errc::out_of_range, "kv_cache::%s: layer %d is outside [0, %d)", fn, l, layers_);
    for (index_t h = 0; h < heads_; ++h)
      if (rows < 0 || rows > length(l, h))
        return status::error(errc::out_of_range, "kv_cache::%s: %lld rows requested but head %lld of layer %d holds %lld",
                             fn, static_cast<long long>(rows), static_cast<long long>(h), l,
                             static_cast<long long>(length(l, h)));
    return kvevict::make_kv_view(buf.data() + layer_off(l), heads_, rows, head_size_, stride_ * head_size_,
                                 head_size_);
  }

  // --- used by the runner ---
  // Appends n rows (keys/values [n][*] with `stride` floats between tokens, head h at h*head_size)
  // with positions pos[0..n) to every head of layer l. Capacity was checked by the caller.
  void append_rows(int l, const float* k, const float* v, index_t stride, const pos_t* pos, index_t n) {
    for (index_t h = 0; h < heads_; ++h) {
      std::int32_t& len = lens_[idx(l, h)];
      for (index_t i = 0; i < n; ++i) {
        const index_t off = row_off(l, h, len + i);
        std::copy(k + i * stride + h * head_size_, k + i * stride + (h + 1) * head_size_, keys_.begin() + off);
        std::copy(v + i * stride + h * head_size_, v + i * stride + (h + 1) * head_size_, values_.begin() + off);
        positions_[static_cast<std::size_t>(off / head_size_)] = pos[i];
      }
      len += static_cast<std::int32_t>(n);
    }
    peak_pages_ = std::max(peak_pages_, pages_in_use());
  }
};

}  // namespace kvrun
