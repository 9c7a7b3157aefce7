// runner/kv_cache.hpp: the runner's KV cache, one page pool per layer shared by every KV head and
// every sequence drawing from it (docs/runner.md, "The paged cache").
//
// kv_pool holds, per layer, a pool of pages (keys, values and positions; a page holds page_size
// rows of ONE KV head: kvevict::page_pool, HND with one head per page) and a free list. A
// kv_cache is one sequence's cache: layer l, KV head h holds length(l, h) rows (post-RoPE keys,
// values, head_size floats each, and the ORIGINAL position of each row) in a list of pages taken
// from layer l's free list as rows arrive (kvevict::page_lists::per_head block tables), every page
// full but the last. Pages of a head are wherever the free list put them: heads and sequences
// interleave in the pool. A cache owns a private pool (init without a pool) or draws from a shared
// one (init with a pool: run_batch's sequences), which must outlive it; clear() and the destructor
// give its pages back. Heads may hold different numbers of rows (after AdaKV / LAVa eviction). RoPE
// was applied with a row's original position, which stays its position after eviction. New tokens
// get the position next_position(), the length of the sequence so far, never the compacted length.
//
// The attention and kvevict's drivers read the pages through the block tables (row(), paged()):
// nothing is copied. Eviction is kvevict::compact_layer on the layer's paged view (keys, values and
// positions): kept rows move to the front of their head's pages and the pages no longer needed go
// back to the pool's free list, where any head or sequence of that layer takes them next.
#pragma once

#include <runner/model.hpp>

#include <kvevict/compact.hpp>
#include <kvevict/drivers/compact_layer.hpp>
#include <kvevict/drivers/layer_kv.hpp>
#include <kvevict/paged.hpp>
#include <kvevict/view.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <type_traits>
#include <vector>

namespace kvrun {

/// Per layer, a page pool of keys, values and positions and its free list (see the file comment).
class kv_pool {
 public:
  /// `pages` pages per layer of `page_size` rows of one KV head of model config `c`. Errors:
  /// invalid_argument (pages < 1 or a page size outside [1, 2^31 - 1]), size_overflow.
  status init(const config& c, index_t pages, index_t page_size = 16) {
    if (pages < 1 || page_size < 1 || page_size > INT32_MAX)
      return status::error(errc::invalid_argument, "kv_pool: %lld pages of %lld tokens (both must be >= 1)",
                           static_cast<long long>(pages), static_cast<long long>(page_size));
    index_t rows = 0, floats = 0;
    if (pages > INT32_MAX / page_size || !detail::checked_mul(index_t(c.n_layers) * pages, page_size, rows) ||
        !detail::checked_mul(rows, c.head_size(), floats))
      return status::error(errc::size_overflow, "kv_pool: %d layers x %lld pages of %lld tokens overflow", c.n_layers,
                           static_cast<long long>(pages), static_cast<long long>(page_size));
    alloc(c.n_layers, pages, page_size, c.head_size());
    return {};
  }

  int layers() const { return layers_; }
  /// Pages per layer.
  index_t pages() const { return pages_; }
  index_t page_size() const { return page_size_; }
  index_t free_pages(int l) const { return free_n_[static_cast<std::size_t>(l)]; }
  /// Pages held now by every cache drawing from the pool (all layers), and the most held at once.
  index_t in_use() const { return in_use_; }
  index_t peak() const { return peak_; }

 private:
  friend class kv_cache;
  int layers_ = 0;
  index_t pages_ = 0, page_size_ = 0, head_size_ = 0, in_use_ = 0, peak_ = 0;
  std::vector<float> keys_, values_;   // [layer][page][page_size][head_size]
  std::vector<pos_t> positions_;       // [layer][page][page_size]
  std::vector<std::int32_t> free_;     // [layer][pages]: stacks of free page ids
  std::vector<index_t> free_n_;        // [layer]

  void alloc(int layers, index_t pages, index_t page_size, index_t head_size) {
    const auto rows = static_cast<std::size_t>(index_t(layers) * pages * page_size);
    layers_ = layers;
    pages_ = pages;
    page_size_ = page_size;
    head_size_ = head_size;
    keys_.assign(rows * static_cast<std::size_t>(head_size), 0.0f);
    values_.assign(keys_.size(), 0.0f);
    positions_.assign(rows, 0);
    free_.resize(static_cast<std::size_t>(layers_ * pages_));
    free_n_.assign(static_cast<std::size_t>(layers_), pages_);
    for (int l = 0; l < layers_; ++l)  // a stack per layer: the lowest page on top
      for (index_t i = 0; i < pages_; ++i) free_[static_cast<std::size_t>(l * pages_ + i)] = static_cast<std::int32_t>(pages_ - 1 - i);
    in_use_ = peak_ = 0;
  }

  std::int32_t take(int l) {  // the caller checked free_pages(l) > 0
    ++in_use_;
    peak_ = std::max(peak_, in_use_);
    return free_[static_cast<std::size_t>(l * pages_ + --free_n_[static_cast<std::size_t>(l)])];
  }
  void give(int l, std::int32_t page) {
    --in_use_;
    free_[static_cast<std::size_t>(l * pages_ + free_n_[static_cast<std::size_t>(l)]++)] = page;
  }
  index_t row_index(int l, index_t page, index_t slot) const { return (index_t(l) * pages_ + page) * page_size_ + slot; }
  // layer l's pool of keys, values (dim head_size) or positions (dim 1)
  template <class T>
  kvevict::page_pool<T> pool(std::vector<T>& buf, int l) {
    const index_t dim = std::is_same_v<T, pos_t> ? 1 : head_size_;
    return *kvevict::make_page_pool(buf.data() + row_index(l, 0, 0) * dim, pages_, page_size_, index_t(1), dim,
                                    kvevict::page_layout::hnd);
  }
};

/// What kv_cache::save() remembers, for kv_cache::rollback().
struct cache_checkpoint {
  std::uint64_t appended = 0;  ///< rows appended to every head before the checkpoint
  std::uint64_t epoch = 0;     ///< compactions and clears before the checkpoint
  pos_t next_position = 0;
};

/// kv_cache's state besides its pool (copied as a whole by kv_cache's copy).
struct kv_cache_state {
  int layers_ = 0;
  index_t heads_ = 0, head_size_ = 0, capacity_ = 0;
  index_t page_size_ = 16, head_pages_ = 0;  // head_pages_: most pages a head's list holds
  int seq_len_ = 0;
  std::vector<std::int32_t> slots_;  // [layer][kv_head][head_pages_]: each head's page list
  std::vector<std::int32_t> lens_;   // [layer][kv_head]
  std::vector<std::uint64_t> layer_epoch_;  // compactions per layer
  // paged()'s block tables ([layer][...]: indptr, indices, last_page_len), compact()'s outputs and
  // compact_paged's workspace
  std::vector<std::int32_t> indptr_, indices_, last_page_len_, new_lens_, freed_;
  std::vector<unsigned char> ws_;
  mutable std::vector<float> dense_k_, dense_v_;  // dense_keys / dense_values
  index_t pages_freed_ = 0, peak_pages_ = 0;
  pos_t next_position_ = 0;
  std::uint64_t appended_ = 0;  // rows appended to every head by completed forwards
  std::uint64_t epoch_ = 0;     // compactions + clears + inits
  bool frozen_ = false;         // inside a block that will be rolled back
};

class kv_cache : private kv_cache_state {
 public:
  kv_cache() = default;
  /// A copy holds the same rows in a private pool (of the source's size when the source owns its
  /// pool, else ceil(capacity / page_size) pages per KV head); a destination drawing from a shared
  /// pool (of the source's shape, with the free pages needed) keeps taking its pages from it.
  kv_cache(const kv_cache& o) { *this = o; }
  kv_cache& operator=(const kv_cache& o) {
    if (this == &o) return *this;
    release_all();
    kv_pool* shared = pool_ != &own_ ? pool_ : nullptr;
    const kv_pool* src = o.pool_;
    static_cast<kv_cache_state&>(*this) = o;
    pool_ = nullptr;
    if (src == nullptr) return *this;
    bool fits = shared != nullptr && shared->layers() == layers_ && shared->head_size_ == head_size_ &&
                shared->page_size() == page_size_;
    for (int l = 0; fits && l < layers_; ++l) {
      index_t need = 0;
      for (index_t h = 0; h < heads_; ++h) need += held(l, h);
      fits = need <= shared->free_pages(l);
    }
    if (fits) {
      pool_ = shared;
    } else {
      own_.alloc(layers_, heads_ * head_pages_, page_size_, head_size_);  // sizes the source's init checked
      pool_ = &own_;
    }
    for (int l = 0; l < layers_; ++l)
      for (index_t h = 0; h < heads_; ++h)
        for (index_t i = 0; i < held(l, h); ++i) {
          const std::int32_t from = o.slot(l, h, i), to = pool_->take(l);
          slot(l, h, i) = to;
          const index_t a = src->row_index(l, from, 0), b = pool_->row_index(l, to, 0), ps = page_size_;
          std::copy_n(src->keys_.begin() + a * head_size_, ps * head_size_, pool_->keys_.begin() + b * head_size_);
          std::copy_n(src->values_.begin() + a * head_size_, ps * head_size_, pool_->values_.begin() + b * head_size_);
          std::copy_n(src->positions_.begin() + a, ps, pool_->positions_.begin() + b);
        }
    return *this;
  }
  ~kv_cache() { release_all(); }

  /// Allocates an empty cache for model config `c` with `capacity` rows per layer and KV head
  /// (0: c.seq_len) in pages of `page_size` tokens, drawing its pages from `shared` (which must
  /// outlive the cache, hold c's layers and head size and have pages of `page_size` tokens) or,
  /// with shared == nullptr, from a private pool of ceil(capacity / page_size) pages per KV head
  /// and layer. Errors: invalid_argument for a negative capacity or one above c.seq_len (positions
  /// are < seq_len and an extra block may repeat positions, but a head never needs more rows than
  /// the context), a page size below 1 or a pool of another shape; size_overflow if the buffers do
  /// not fit in memory indices.
  status init(const config& c, index_t capacity = 0, index_t page_size = 16, kv_pool* shared = nullptr) {
    if (capacity < 0 || capacity > c.seq_len)
      return status::error(errc::invalid_argument, "kv_cache: capacity %lld is outside [0, seq_len %d] (0 = seq_len)",
                           static_cast<long long>(capacity), c.seq_len);
    if (page_size < 1 || page_size > INT32_MAX)
      return status::error(errc::invalid_argument, "kv_cache: page size %lld is outside [1, 2^31 - 1]",
                           static_cast<long long>(page_size));
    if (shared != nullptr && (shared->layers() != c.n_layers || shared->head_size_ != c.head_size() || shared->page_size() != page_size))
      return status::error(errc::invalid_argument,
                           "kv_cache: the shared pool has %d layers, head size %lld, pages of %lld tokens; the cache "
                           "needs %d, %d, %lld", shared->layers(), static_cast<long long>(shared->head_size_),
                           static_cast<long long>(shared->page_size()), c.n_layers, c.head_size(),
                           static_cast<long long>(page_size));
    if (capacity == 0) capacity = c.seq_len;
    const index_t pages = (capacity + page_size - 1) / page_size;  // per head
    if (pages > INT32_MAX / (c.n_kv_heads + 1) / page_size)
      return status::error(errc::size_overflow, "kv_cache: %d heads x %lld rows overflow", c.n_kv_heads,
                           static_cast<long long>(capacity));
    release_all();
    pool_ = nullptr;
    if (shared == nullptr) KVEVICT_TRY(own_.init(c, c.n_kv_heads * pages, page_size));
    pool_ = shared != nullptr ? shared : &own_;
    layers_ = c.n_layers;
    heads_ = c.n_kv_heads;
    head_size_ = c.head_size();
    capacity_ = capacity;
    page_size_ = page_size;
    head_pages_ = pages;
    seq_len_ = c.seq_len;
    const auto LH = static_cast<std::size_t>(index_t(layers_) * heads_), lists = static_cast<std::size_t>(heads_);
    slots_.assign(LH * static_cast<std::size_t>(pages), 0);
    lens_.assign(LH, 0);
    indptr_.assign(static_cast<std::size_t>(layers_) * (lists + 1), 0);
    indices_.assign(slots_.size(), 0);
    last_page_len_.assign(LH, 0);
    new_lens_.assign(lists, 0);
    freed_.assign(lists * static_cast<std::size_t>(pages), 0);
    ws_.assign(std::max<std::size_t>(kvevict::paged_workspace_bytes(pool_->pages()), 64), 0);  // never empty: a null ws is a query
    dense_k_.assign(lists * static_cast<std::size_t>(capacity * head_size_), 0.0f);
    dense_v_.assign(dense_k_.size(), 0.0f);
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
  /// Pages of the pool the cache draws from (all layers; shared with other caches or its own).
  index_t total_pages() const { return pool_ == nullptr ? 0 : index_t(layers_) * pool_->pages(); }
  /// Pages per layer of that pool (the drivers' pool_pages).
  index_t pool_pages() const { return pool_ == nullptr ? 0 : pool_->pages(); }
  /// Pages holding this cache's rows now: ceil(length / page_size) per layer and KV head.
  index_t pages_in_use() const {
    index_t t = 0;
    for (const std::int32_t n : lens_) t += (n + page_size_ - 1) / page_size_;
    return t;
  }
  /// The most pages held at once (after any forward or compaction) since init() / clear().
  index_t peak_pages() const { return peak_pages_; }
  /// Pages compact() gave back to the pool's free list since init() / clear() (kvevict::
  /// compact_paged's freed page lists; rolled-back blocks do not count).
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

  /// Row j of head h, layer l (through the head's page list).
  const float* key_row(int l, index_t h, index_t j) const { return pool_->keys_.data() + row(l, h, j) * head_size_; }
  const float* value_row(int l, index_t h, index_t j) const { return pool_->values_.data() + row(l, h, j) * head_size_; }
  /// Original token position of row j of head h, layer l.
  pos_t position(int l, index_t h, index_t j) const { return pool_->positions_[static_cast<std::size_t>(row(l, h, j))]; }

  /// Layer l as the drivers read it: one sequence of the pool's paged layer, its per-head block
  /// table built from the heads' page lists, keys, values and positions read through it. Valid
  /// until the cache's next change or the next paged(l) call. Errors: out_of_range (l not a layer).
  kvevict::result<kvevict::paged_layer_kv<float>> paged(int l) {
    KVEVICT_TRY(check_rows("paged", l, 0));
    return kvevict::make_paged_layer_kv(layer(l), pool_->pool(pool_->positions_, l));
  }

  /// The first `rows` rows of every head of layer l gathered into a dense [kv_head][rows][head_size]
  /// view (the cache's own scratch: valid until the next dense_keys / dense_values call), for the
  /// stages that read dense keys (CAKE's window preference, H2O's initial scores, LAQ++'s block).
  /// Errors: out_of_range if l is not a layer or a head holds fewer than `rows` rows.
  kvevict::result<kvevict::kv_view<const float>> dense_keys(int l, index_t rows) const {
    return dense(pool_ != nullptr ? pool_->keys_.data() : nullptr, dense_k_, "dense_keys", l, rows);
  }
  kvevict::result<kvevict::kv_view<const float>> dense_values(int l, index_t rows) const {
    return dense(pool_ != nullptr ? pool_->values_.data() : nullptr, dense_v_, "dense_values", l, rows);
  }

  /// Evicts: head h of layer l keeps its rows kept.pos[kept.cu[h] .. kept.cu[h+1]) (row indices
  /// into its current rows, strictly ascending), packed to the front in that order, keys, values
  /// and positions alike; its pages past the kept rows go back to the pool's free list. No
  /// allocation. next_position() is unchanged.
  /// Errors: out_of_range (l not a layer), shape_mismatch (kept.heads != kv_heads()),
  /// invalid_argument (inside a rolled-back block, see runner::forward_extra), overlap (kept lists
  /// stored inside the pool), and every error of kvevict::compact_layer (malformed offsets, rows
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
    // kept lists living inside the pool (any layer's) would be overwritten midway: refuse them
    // before a row moves (compact_layer checks the offsets, rows and this layer's memory)
    if (kept.pos != nullptr && kept.cu != nullptr && kept.total() > 0) {
      const auto* first = reinterpret_cast<const unsigned char*>(kept.pos);
      const auto* last = reinterpret_cast<const unsigned char*>(kept.pos + kept.total());
      auto inside = [&](const auto& buf) {
        const auto* b = reinterpret_cast<const unsigned char*>(buf.data());
        const auto* e = reinterpret_cast<const unsigned char*>(buf.data() + buf.size());
        return std::less<const unsigned char*>{}(first, e) && std::less<const unsigned char*>{}(b, last);
      };
      if (inside(pool_->keys_) || inside(pool_->values_) || inside(pool_->positions_))
        return status::error(errc::overlap, "kv_cache::compact: the kept lists lie inside the cache's own memory");
    }
    std::int32_t freed = 0;
    kvevict::workspace ws{ws_.data(), ws_.size()};
    KVEVICT_TRY(kvevict::compact_layer(kvevict::seq, ws, layer(l), pool_->pool(pool_->positions_, l), kept,
                                       {new_lens_.data(), freed_.data(), static_cast<index_t>(freed_.size()), &freed}));
    for (index_t h = 0; h < heads_; ++h) set_length(l, h, new_lens_[static_cast<std::size_t>(h)]);
    pages_freed_ += freed;
    ++epoch_;
    ++layer_epoch_[static_cast<std::size_t>(l)];
    return {};
  }

  /// Remembers the cache's state, for rollback().
  cache_checkpoint save() const { return {appended_, epoch_, next_position_}; }

  /// Drops every row appended since `cp`, restoring lengths and next_position() (pages no longer
  /// needed go back to the pool); rows kept before `cp` are untouched (appends never overwrite
  /// held rows). Errors: invalid_argument if the cache was compacted or cleared since `cp` (the
  /// rows to drop are no longer the last ones) or `cp` is from a later state.
  status rollback(const cache_checkpoint& cp) {
    if (cp.epoch != epoch_)
      return status::error(errc::invalid_argument, "kv_cache::rollback: the cache was compacted or cleared since the checkpoint");
    if (cp.appended > appended_)
      return status::error(errc::invalid_argument, "kv_cache::rollback: the checkpoint is newer than the cache");
    const auto n = static_cast<std::int32_t>(appended_ - cp.appended);
    for (int l = 0; l < layers_; ++l) drop_last(l, n);
    appended_ = cp.appended;
    next_position_ = cp.next_position;
    return {};
  }

  /// Empties every head (its pages back to the pool); next_position() becomes 0.
  void clear() {
    release_all();
    pages_freed_ = peak_pages_ = 0;
    next_position_ = 0;
    appended_ = 0;
    ++epoch_;
  }

 private:
  friend class runner;
  kv_pool own_;               // the private pool (init without a shared one)
  kv_pool* pool_ = nullptr;   // &own_ or the shared pool

  std::size_t idx(int l, index_t h) const { return static_cast<std::size_t>(index_t(l) * heads_ + h); }
  index_t held(int l, index_t h) const { return (length(l, h) + page_size_ - 1) / page_size_; }
  std::int32_t& slot(int l, index_t h, index_t i) { return slots_[idx(l, h) * static_cast<std::size_t>(head_pages_) + static_cast<std::size_t>(i)]; }
  std::int32_t slot(int l, index_t h, index_t i) const { return slots_[idx(l, h) * static_cast<std::size_t>(head_pages_) + static_cast<std::size_t>(i)]; }
  // the pool row of head h's row j
  index_t row(int l, index_t h, index_t j) const { return pool_->row_index(l, slot(l, h, j / page_size_), j % page_size_); }

  // head h of layer l holds n rows (n <= its length): its pages past them go back to the pool
  void set_length(int l, index_t h, index_t n) {
    for (index_t i = (n + page_size_ - 1) / page_size_; i < held(l, h); ++i) pool_->give(l, slot(l, h, i));
    lens_[idx(l, h)] = static_cast<std::int32_t>(n);
  }
  void drop_last(int l, index_t n) {
    for (index_t h = 0; h < heads_; ++h) set_length(l, h, length(l, h) - n);
  }
  void release_all() {
    if (pool_ == nullptr) return;
    for (int l = 0; l < layers_; ++l)
      for (index_t h = 0; h < heads_; ++h) set_length(l, h, 0);
  }

  status check_rows(const char* fn, int l, index_t rows) const {
    if (l < 0 || l >= layers_)
      return status::error(errc::out_of_range, "kv_cache::%s: layer %d is outside [0, %d)", fn, l, layers_);
    for (index_t h = 0; h < heads_; ++h)
      if (rows < 0 || rows > length(l, h))
        return status::error(errc::out_of_range, "kv_cache::%s: %lld rows requested but head %lld of layer %d holds %lld",
                             fn, static_cast<long long>(rows), static_cast<long long>(h), l,
                             static_cast<long long>(length(l, h)));
    return {};
  }

  // layer l's paged view: one list per head
  kvevict::paged_layer<float> layer(int l) {
    std::int32_t* ip = indptr_.data() + index_t(l) * (heads_ + 1);
    std::int32_t* ix = indices_.data() + index_t(l) * heads_ * head_pages_;
    std::int32_t* last = last_page_len_.data() + index_t(l) * heads_;
    for (index_t h = 0; h < heads_; ++h) {
      const index_t n = length(l, h), np = (n + page_size_ - 1) / page_size_;
      ip[h + 1] = static_cast<std::int32_t>(ip[h] + np);
      for (index_t i = 0; i < np; ++i) ix[ip[h] + i] = slot(l, h, i);
      last[h] = static_cast<std::int32_t>(np == 0 ? 0 : n - (np - 1) * page_size_);
    }
    kvevict::paged_layer<float> L;
    L.keys = pool_->pool(pool_->keys_, l);
    L.values = pool_->pool(pool_->values_, l);
    L.table = {ip, ix, last, heads_};
    L.sequences = 1;
    L.kv_heads = heads_;
    L.lists = kvevict::page_lists::per_head;
    return L;
  }

  kvevict::result<kvevict::kv_view<const float>> dense(const float* src, std::vector<float>& out, const char* fn, int l,
                                                        index_t rows) const {
    KVEVICT_TRY(check_rows(fn, l, rows));
    for (index_t h = 0; h < heads_; ++h)
      for (index_t j = 0; j < rows; ++j)
        std::copy_n(src + row(l, h, j) * head_size_, head_size_, out.begin() + (h * rows + j) * head_size_);
    return kvevict::make_kv_view(static_cast<const float*>(out.data()), heads_, rows, head_size_,
                                 std::max<index_t>(rows, 1) * head_size_, head_size_);
  }

  // --- used by the runner ---
  // Pages layer l's pool must still give for n more rows per head; errors when a head's capacity
  // or the pool's free pages do not allow them.
  index_t pages_needed(int l, index_t n) const {
    index_t need = 0;
    for (index_t h = 0; h < heads_; ++h) need += (length(l, h) + n + page_size_ - 1) / page_size_ - held(l, h);
    return need;
  }
  status check_room(int l, index_t n) const {
    for (index_t h = 0; h < heads_; ++h)
      if (length(l, h) + n > capacity_)
        return status::error(errc::capacity_exceeded,
                             "runner: layer %d head %lld holds %lld of %lld rows; a block of %lld does not fit", l,
                             static_cast<long long>(h), static_cast<long long>(length(l, h)),
                             static_cast<long long>(capacity_), static_cast<long long>(n));
    const index_t need = pages_needed(l, n);
    if (need > pool_->free_pages(l))
      return status::error(errc::capacity_exceeded, "runner: layer %d's page pool has %lld free pages, a block of %lld needs %lld",
                           l, static_cast<long long>(pool_->free_pages(l)), static_cast<long long>(n),
                           static_cast<long long>(need));
    return {};
  }
  // Appends n rows (keys/values [n][*] with `stride` floats between tokens, head h at h*head_size)
  // with positions pos[0..n) to every head of layer l, taking pages from the pool as a head's last
  // page fills. Room was checked by the caller (check_room).
  void append_rows(int l, const float* k, const float* v, index_t stride, const pos_t* pos, index_t n) {
    for (index_t h = 0; h < heads_; ++h) {
      std::int32_t& len = lens_[idx(l, h)];
      for (index_t i = 0; i < n; ++i, ++len) {
        if (len % page_size_ == 0) slot(l, h, len / page_size_) = pool_->take(l);
        const index_t r = row(l, h, len);
        std::copy(k + i * stride + h * head_size_, k + i * stride + (h + 1) * head_size_, pool_->keys_.begin() + r * head_size_);
        std::copy(v + i * stride + h * head_size_, v + i * stride + (h + 1) * head_size_, pool_->values_.begin() + r * head_size_);
        pool_->positions_[static_cast<std::size_t>(r)] = pos[i];
      }
    }
    peak_pages_ = std::max(peak_pages_, pages_in_use());
  }
};

}  // namespace kvrun
