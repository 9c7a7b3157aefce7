// runner/runner.hpp: the forward pass of the reference runner, with the hooks eviction drivers
// need.
//
//   runner r;  r.init(model);            // scratch for blocks of up to max_block tokens
//   kv_cache c;  c.init(model.cfg());    // one per sequence; copyable
//   r.forward(c, tokens(prompt));        // prefill: one block, matrix-matrix, KV appended
//   r.forward(c, tokens(&tok, 1));       // decode: a block of one token
//   r.forward_extra(c, block, ...);      // run a block, expose its queries, drop its KV
//   r.logits(row)                        // [vocab] logits of the last forward
//
// A forward runs the block layer by layer. At layer l it computes the block's queries, keys and
// values (post-RoPE), appends the keys and values to layer l's cache, attends each query head
// over its KV head's rows (all rows held before the block, plus the block's rows up to its own:
// causal inside the block), runs the FFN, then calls `hooks.after_layer` with the block's
// queries, keys and values; that hook may compact layer l (and any other layer) before layer
// l + 1 runs. Chunked prefill is successive forwards; eviction between them is a compact().
#pragma once

#include <runner/kv_cache.hpp>
#include <runner/model.hpp>
#include <runner/ops.hpp>

#include <kvevict/status.hpp>
#include <kvevict/view.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>


namespace kvrun {

/// The input of one forward: `n` token ids or `n` input vectors (e.g. learned lookahead
/// embeddings, [n][dim]), and optionally their RoPE positions (default: next_position() + i).
struct block {
  const int* tokens = nullptr;
  const float* embeddings = nullptr;
  const pos_t* positions = nullptr;
  index_t n = 0;
};
inline block tokens(const int* ids, index_t n, const pos_t* positions = nullptr) { return {ids, nullptr, positions, n}; }
inline block tokens(const std::vector<int>& ids, const pos_t* positions = nullptr) {
  return {ids.data(), nullptr, positions, static_cast<index_t>(ids.size())};
}
inline block embeddings(const float* rows, index_t n, const pos_t* positions = nullptr) {
  return {nullptr, rows, positions, n};
}

/// Which rows of a block get logits.
enum class logits_mode {
  none,  ///< no classifier (a prefill whose next token is not needed)
  last,  ///< the block's last row (prefill, decode): runner::logits(0)
  all,   ///< every row (teacher-forced evaluation): runner::logits(i) for block row i
};

/// What `forward_hooks::after_layer` sees once layer `layer` has processed a block.
struct layer_event {
  int layer = 0;
  index_t rows = 0;                        ///< tokens in the block
  const pos_t* positions = nullptr;        ///< their RoPE positions
  kvevict::kv_view<const float> queries;   ///< [n_heads][rows][head_size], post-RoPE
  kvevict::kv_view<const float> keys;      ///< [n_kv_heads][rows][head_size], post-RoPE (also in the cache)
  kvevict::kv_view<const float> values;    ///< [n_kv_heads][rows][head_size]
  bool rolled_back = false;                ///< true in forward_extra: the block's KV is dropped afterwards
};

/// The linear layers of a transformer block, for projection hooks.
enum class projection { q, k, v, o, w1, w2, w3 };

/// What `forward_hooks::after_projection` sees: output[r][0..out) = input[r][0..in) x W for the
/// block's rows, before anything else uses it (q and k before RoPE, w1/w3 before SwiGLU, o and
/// w2 before the residual add). The hook may change `output` (e.g. add a LoRA delta to some
/// rows: LookaheadKV's adapters act on the lookahead rows only).
struct projection_event {
  int layer = 0;
  projection which = projection::q;
  index_t rows = 0;
  const float* input = nullptr;
  index_t input_stride = 0;  ///< floats between rows of input
  index_t in = 0;
  float* output = nullptr;
  index_t output_stride = 0;
  index_t out = 0;
};

struct forward_hooks {
  std::function<status(const layer_event&)> after_layer;
  std::function<status(const projection_event&)> after_projection;
};

struct runner_options {
  index_t max_block = 0;  ///< most tokens in one forward (0: the model's seq_len)
  index_t max_rows = 0;   ///< most rows a cache head may hold (0: seq_len); sizes attention scratch
  int threads = 0;        ///< OpenMP threads (0: omp_get_max_threads(); 1 without OpenMP)
  index_t max_sequences = 1;  ///< most segments (sequences) in one forward_batch; max_block bounds their rows
};

class runner;

/// One sequence's part of a batched forward (runner::forward_batch): its cache, its block and what
/// forward() / forward_extra() would be given. `st` receives its own outcome (a failed segment
/// leaves its cache as it was; the others run on), `logits_row` its first row in runner::logits().
struct forward_segment {
  kv_cache* cache = nullptr;
  block b;
  logits_mode mode = logits_mode::last;
  const forward_hooks* hooks = nullptr;  ///< may be null
  bool rolled_back = false;              ///< forward_extra's block (the caller rolls it back)
  status st;
  index_t logits_row = 0;
};

/// Where a gated runner (runner::init_gated) sends its forwards: a batch's scheduler
/// (examples/batch/), which runs them with other sequences' as one runner::forward_batch and hands
/// each its logits back (deliver).
class forward_gate {
 public:
  virtual status forward(runner& caller, kv_cache& cache, const block& b, logits_mode mode, const forward_hooks& hooks,
                         bool rolled_back) = 0;

 protected:
  ~forward_gate() = default;
  static void deliver(runner& r, const float* logits, index_t rows);
};

class runner {
 public:
  /// Binds the runner to `m` (which must outlive it) and allocates its scratch: activations for
  /// max_block rows, logits for max_block rows, attention rows for max_rows keys per thread.
  /// Errors: invalid_argument for negative options.
  status init(const model& m, runner_options o = {}) {
    const config& c = m.cfg();
    if (o.max_block < 0 || o.max_rows < 0 || o.threads < 0 || o.max_sequences < 1)
      return status::error(errc::invalid_argument,
                           "runner: negative option (max_block %lld, max_rows %lld, threads %d) or max_sequences %lld < 1",
                           static_cast<long long>(o.max_block), static_cast<long long>(o.max_rows), o.threads,
                           static_cast<long long>(o.max_sequences));
    *this = runner{};
    model_ = &m;
    max_sequences_ = o.max_sequences;
    max_block_ = o.max_block > 0 ? o.max_block : c.seq_len;
    max_rows_ = o.max_rows > 0 ? o.max_rows : c.seq_len;
    threads_ = thread_count(o.threads);
    const auto B = static_cast<std::size_t>(max_block_);
    x_.assign(B * c.dim, 0.0f);
    xb_.assign(B * c.dim, 0.0f);
    tmp_.assign(B * c.dim, 0.0f);
    qkv_.assign(B * static_cast<std::size_t>(m.qkv_width()), 0.0f);
    h13_.assign(B * 2 * static_cast<std::size_t>(c.hidden_dim), 0.0f);
    att_.assign(static_cast<std::size_t>(threads_) * static_cast<std::size_t>(max_rows_), 0.0f);
    logits_.assign(B * c.vocab_size, 0.0f);
    pos_.assign(B, 0);
    row_seg_.assign(B, 0);
    const auto S = static_cast<std::size_t>(max_sequences_);
    first_.assign(S, 0);
    base_len_.assign(S * static_cast<std::size_t>(c.n_kv_heads), 0);
    appended_epoch_.assign(S * static_cast<std::size_t>(c.n_layers), 0);
    logits_rows_ = 0;
    return {};
  }

  /// A runner without scratch whose forwards (forward, forward_extra, decode) go to `gate` (which
  /// must outlive it): a sequence of a batch (examples/batch/). Its checks are forward()'s; its
  /// logits are those the gate delivers, up to max_block rows.
  status init_gated(const model& m, forward_gate& gate, index_t max_block = 0) {
    if (max_block < 0)
      return status::error(errc::invalid_argument, "runner: negative max_block %lld", static_cast<long long>(max_block));
    *this = runner{};
    model_ = &m;
    gate_ = &gate;
    max_block_ = max_block > 0 ? max_block : m.cfg().seq_len;
    max_rows_ = m.cfg().seq_len;
    logits_.assign(static_cast<std::size_t>(max_block_) * static_cast<std::size_t>(m.cfg().vocab_size), 0.0f);
    return {};
  }

  /// Runs several sequences' blocks as ONE forward: each layer's projections over the stacked rows
  /// of every segment (the weights read once), each segment's attention over its own cache, its
  /// hooks called with its rows. Every row's arithmetic is that of forward() on its segment alone,
  /// so each segment's logits and cache equal its own forward's bit for bit. Each segment gets
  /// forward()'s checks (its error in `st`, nothing of it changed); segments drawing from one page
  /// pool must all fit in its free pages together (the later ones in order get capacity_exceeded
  /// otherwise); a hook's error stops only its segment (its rows removed again). Errors of the
  /// call: more segments than max_sequences, a cache in two segments, more rows than max_block in
  /// all. Not on a gated runner.
  status forward_batch(forward_segment* segs, index_t count) {
    if (model_ == nullptr || gate_ != nullptr)
      return status::error(errc::invalid_argument, "runner: forward_batch needs an initialised, ungated runner");
    if (count < 0 || count > max_sequences_)
      return status::error(errc::invalid_argument, "runner: %lld segments, max_sequences is %lld",
                           static_cast<long long>(count), static_cast<long long>(max_sequences_));
    index_t rows = 0;
    for (index_t s = 0; s < count; ++s) {
      for (index_t t = 0; t < s; ++t)
        if (segs[t].cache == segs[s].cache)
          return status::error(errc::invalid_argument, "runner: segments %lld and %lld share a cache",
                               static_cast<long long>(t), static_cast<long long>(s));
      rows += std::max<index_t>(segs[s].b.n, 0);
    }
    if (rows > max_block_)
      return status::error(errc::invalid_argument, "runner: a batch of %lld rows exceeds max_block %lld",
                           static_cast<long long>(rows), static_cast<long long>(max_block_));
    for (index_t s = 0; s < count; ++s) {
      forward_segment& g = segs[s];
      g.st = g.cache == nullptr ? status::error(errc::invalid_argument, "runner: segment %lld has no cache",
                                                static_cast<long long>(s))
                                : check(*g.cache, g.b);
      for (int l = 0; g.st.ok() && l < model_->cfg().n_layers; ++l) {  // the pool must hold every earlier segment too
        index_t need = g.cache->pages_needed(l, g.b.n);
        for (index_t t = 0; t < s; ++t)
          if (segs[t].st.ok() && segs[t].cache->pool_ == g.cache->pool_) need += segs[t].cache->pages_needed(l, segs[t].b.n);
        if (need > g.cache->pool_->free_pages(l))
          g.st = status::error(errc::capacity_exceeded, "runner: layer %d's page pool has %lld free pages, the batch's "
                               "blocks up to segment %lld need %lld", l, static_cast<long long>(g.cache->pool_->free_pages(l)),
                               static_cast<long long>(s), static_cast<long long>(need));
      }
    }
    busy_ = true;
    run(segs, count);
    busy_ = false;
    return {};
  }

  const model& get_model() const { return *model_; }
  int threads() const { return threads_; }
  index_t max_block() const { return max_block_; }

  /// Runs block `b` through the model on `cache`, appending its keys and values to every layer,
  /// and computes logits for the rows `mode` asks for. next_position() becomes
  /// max(next_position(), last position + 1).
  /// Errors, checked before anything changes: invalid_argument (runner not initialised, called
  /// from inside a hook, empty block, n > max_block, both or neither of tokens/embeddings),
  /// shape_mismatch (cache made for another model), out_of_range (a token outside the vocabulary,
  /// a position outside [0, seq_len)), capacity_exceeded (a head lacks room for n rows, or the
  /// cache's capacity exceeds max_rows). A hook's error stops the forward and is returned; the
  /// block's rows are then removed again from every layer the hook did not compact.
  status forward(kv_cache& cache, const block& b, logits_mode mode = logits_mode::last, const forward_hooks& hooks = {}) {
    KVEVICT_TRY(check(cache, b));
    busy_ = true;
    const status st = run_one(cache, b, mode, hooks, /*rolled_back=*/false);
    busy_ = false;
    return st;
  }

  /// Runs `b` like forward() (the hooks see its queries, keys and values; logits are computed),
  /// then rolls `cache` back to its state before the block: the block's rows are dropped from
  /// every layer and next_position() is restored. For lookahead tokens, LAQ pseudo queries and the
  /// window appended to a chunk by patched chunked prefill. The hooks must not compact the cache
  /// (kv_cache::compact fails inside). Errors: those of forward().
  status forward_extra(kv_cache& cache, const block& b, logits_mode mode = logits_mode::none,
                       const forward_hooks& hooks = {}) {
    KVEVICT_TRY(check(cache, b));
    const cache_checkpoint cp = cache.save();
    busy_ = true;
    cache.frozen_ = true;
    const status st = run_one(cache, b, mode, hooks, /*rolled_back=*/true);
    cache.frozen_ = false;
    busy_ = false;
    if (!st.ok()) return st;  // run() already removed the block's rows
    return cache.rollback(cp);
  }

  /// One decode step: forward of the single token `token`, logits of it in logits(0).
  status decode(kv_cache& cache, int token, const forward_hooks& hooks = {}) {
    return forward(cache, tokens(&token, 1), logits_mode::last, hooks);
  }

  /// Logits of the last forward: row 0 for logits_mode::last, block row `row` for all. The
  /// runner owns them; the next forward overwrites them.
  const float* logits(index_t row = 0) const {
    return logits_.data() + row * static_cast<index_t>(model_->cfg().vocab_size);
  }
  /// Rows of logits the last forward produced (0, 1 or the block size).
  index_t logits_rows() const { return logits_rows_; }

 private:
  const model* model_ = nullptr;
  friend class forward_gate;
  forward_gate* gate_ = nullptr;  // init_gated's
  index_t max_block_ = 0, max_rows_ = 0, max_sequences_ = 1;
  int threads_ = 1;
  bool busy_ = false;
  // scratch, [row][...] for the block's rows
  std::vector<float> x_, xb_, tmp_, qkv_, h13_, att_, logits_;
  std::vector<pos_t> pos_;
  std::vector<std::int32_t> row_seg_;            // per row: its segment
  std::vector<index_t> first_;                   // per segment: its first row
  std::vector<std::int32_t> base_len_;           // [segment][KV head]: rows held before the block
  std::vector<std::uint64_t> appended_epoch_;    // [segment][layer]: the layer's compaction count when the block was appended
  index_t logits_rows_ = 0;

  status check(const kv_cache& cache, const block& b) {
    if (model_ == nullptr) return status::error(errc::invalid_argument, "runner: not initialised (call init)");
    if (busy_) return status::error(errc::invalid_argument, "runner: forward called from inside a hook of another forward");
    const config& c = model_->cfg();
    if (cache.layers() != c.n_layers || cache.kv_heads() != c.n_kv_heads || cache.head_size() != c.head_size() ||
        cache.seq_len_ != c.seq_len)
      return status::error(errc::shape_mismatch,
                           "runner: the cache has %d layers x %lld KV heads x head size %lld, the model %d x %d x %d "
                           "(initialise the cache with this model's config)",
                           cache.layers(), static_cast<long long>(cache.kv_heads()),
                           static_cast<long long>(cache.head_size()), c.n_layers, c.n_kv_heads, c.head_size());
    if (cache.capacity() > max_rows_)
      return status::error(errc::capacity_exceeded, "runner: cache capacity %lld exceeds the runner's max_rows %lld",
                           static_cast<long long>(cache.capacity()), static_cast<long long>(max_rows_));
    if (b.n <= 0) return status::error(errc::invalid_argument, "runner: empty block (n = %lld)", static_cast<long long>(b.n));
    if (b.n > max_block_)
      return status::error(errc::invalid_argument, "runner: block of %lld tokens exceeds max_block %lld",
                           static_cast<long long>(b.n), static_cast<long long>(max_block_));
    if ((b.tokens == nullptr) == (b.embeddings == nullptr))
      return status::error(errc::invalid_argument, "runner: a block needs exactly one of tokens and embeddings");
    if (b.tokens != nullptr)
      for (index_t i = 0; i < b.n; ++i)
        if (b.tokens[i] < 0 || b.tokens[i] >= c.vocab_size)
          return status::error(errc::out_of_range, "runner: token %d (block row %lld) is outside the vocabulary [0, %d)",
                               b.tokens[i], static_cast<long long>(i), c.vocab_size);
    for (index_t i = 0; i < b.n; ++i) {
      const index_t p = b.positions != nullptr ? b.positions[i] : index_t(cache.next_position()) + i;
      if (p < 0 || p >= c.seq_len)
        return status::error(errc::out_of_range, "runner: position %lld (block row %lld) is outside the context [0, %d)",
                             static_cast<long long>(p), static_cast<long long>(i), c.seq_len);
    }
    for (int l = 0; l < c.n_layers; ++l) KVEVICT_TRY(cache.check_room(l, b.n));
    return {};
  }

  status call_projection(const forward_hooks& hooks, int l, projection which, index_t n, const float* in,
                         index_t in_stride, index_t in_dim, float* out, index_t out_stride, index_t out_dim) {
    if (!hooks.after_projection) return {};
    return hooks.after_projection({l, which, n, in, in_stride, in_dim, out, out_stride, out_dim});
  }

  // Removes segment s's rows from layers [0, upto) that were not compacted since the append.
  void undo_append(index_t s, kv_cache& cache, int upto, index_t n) {
    const std::uint64_t* epoch = appended_epoch_.data() + s * model_->cfg().n_layers;
    for (int l = 0; l < upto; ++l)
      if (cache.layer_epoch_[static_cast<std::size_t>(l)] == epoch[l]) cache.drop_last(l, n);
  }

  // forward() / forward_extra(): to the gate, or one segment
  status run_one(kv_cache& cache, const block& b, logits_mode mode, const forward_hooks& hooks, bool rolled_back) {
    if (gate_ != nullptr) return gate_->forward(*this, cache, b, mode, hooks, rolled_back);
    forward_segment seg{&cache, b, mode, &hooks, rolled_back, {}, 0};
    run(&seg, 1);
    return seg.st;
  }

  // The forward of segments whose st is ok (checked): their rows stacked in the scratch
  // ([row][...], segment after segment), per segment its hooks, cache and attention.
  void run(forward_segment* segs, index_t count) {
    const model& m = *model_;
    const config& c = m.cfg();
    const index_t d = c.dim, hs = c.head_size(), H = c.n_heads, Hkv = c.n_kv_heads, kvd = c.kv_dim();
    const index_t hidden = c.hidden_dim, qs = m.qkv_width(), group = c.group_size();
    float* x = x_.data();
    float* xb = xb_.data();
    float* tmp = tmp_.data();
    float* qkv = qkv_.data();
    float* h13 = h13_.data();
    pos_t* pos = pos_.data();
    index_t n = 0;  // rows of every segment (a failed segment's rows are computed, never used)
    for (index_t s = 0; s < count; ++s) {
      const forward_segment& g = segs[s];
      first_[static_cast<std::size_t>(s)] = n;
      if (!g.st.ok()) continue;
      for (index_t i = 0; i < g.b.n; ++i, ++n) {
        pos[n] = g.b.positions != nullptr ? g.b.positions[i] : static_cast<pos_t>(g.cache->next_position() + i);
        const float* e = g.b.tokens != nullptr ? m.embedding(g.b.tokens[i]) : g.b.embeddings + i * d;
        std::copy(e, e + d, x + n * d);
        row_seg_[static_cast<std::size_t>(n)] = static_cast<std::int32_t>(s);
      }
    }
    // segment s's projection hook on its rows; a hook's (or any) error stops s: its rows leave
    // layers [0, upto) again
    const auto fail = [&](index_t s, const status& st, int upto) {
      undo_append(s, *segs[s].cache, upto, segs[s].b.n);
      segs[s].st = st;
    };
    const auto project = [&](int l, projection which, const float* in, index_t in_stride, index_t in_dim, float* out,
                             index_t out_stride, index_t out_dim, int upto) {
      for (index_t s = 0; s < count; ++s) {
        forward_segment& g = segs[s];
        if (!g.st.ok() || g.hooks == nullptr || !g.hooks->after_projection) continue;
        const index_t r = first_[static_cast<std::size_t>(s)];
        const status st = g.hooks->after_projection(
            {l, which, g.b.n, in + r * in_stride, in_stride, in_dim, out + r * out_stride, out_stride, out_dim});
        if (!st.ok()) fail(s, st, upto);
      }
    };

    for (int l = 0; l < c.n_layers; ++l) {
      // attention: RMSNorm, q|k|v projections, RoPE
      for (index_t i = 0; i < n; ++i) detail::rmsnorm(xb + i * d, x + i * d, m.attn_norm(l), d);
      detail::matmul(threads_, xb, d, n, d, m.wqkv(l), qs, qkv, qs);
      project(l, projection::q, xb, d, d, qkv, qs, d, l);
      project(l, projection::k, xb, d, d, qkv + d, qs, kvd, l);
      project(l, projection::v, xb, d, d, qkv + d + kvd, qs, kvd, l);
      for (index_t i = 0; i < n; ++i) {
        float* row = qkv + i * qs;
        for (index_t j = 0; j < d + kvd; j += 2) {  // every query head, then every key head
          const int pair = static_cast<int>((j % hs) / 2);
          const float fr = m.rope_cos(pos[i], pair), fi = m.rope_sin(pos[i], pair);
          const float v0 = row[j], v1 = row[j + 1];
          row[j] = v0 * fr - v1 * fi;
          row[j + 1] = v0 * fi + v1 * fr;
        }
      }

      // each segment appends its keys and values to its cache, then its rows attend over it
      index_t work = 0;
      for (index_t s = 0; s < count; ++s) {
        forward_segment& g = segs[s];
        if (!g.st.ok()) continue;
        std::int32_t* base = base_len_.data() + s * Hkv;
        const index_t r = first_[static_cast<std::size_t>(s)];
        for (index_t h = 0; h < Hkv; ++h) base[h] = static_cast<std::int32_t>(g.cache->length(l, h));
        g.cache->append_rows(l, qkv + r * qs + d, qkv + r * qs + d + kvd, qs, pos + r, g.b.n);
        appended_epoch_[static_cast<std::size_t>(s * c.n_layers + l)] = g.cache->layer_epoch_[static_cast<std::size_t>(l)];
        index_t visible = 0;
        for (index_t h = 0; h < Hkv; ++h) visible += base[h] + g.b.n;
        work += g.b.n * group * visible * hs * 2;
      }
      detail::parallel_for(threads_, n * H, work, [&](index_t item, int thread) {
        const index_t i = item / H, q = item % H, g = q / group;
        const index_t s = row_seg_[static_cast<std::size_t>(i)];
        const forward_segment& seg = segs[s];
        if (!seg.st.ok()) return;
        const kv_cache& cache = *seg.cache;
        detail::attend_rows(  // through head g's page list
            qkv + i * qs + q * hs, [&](index_t t) { return cache.key_row(l, g, t); },
            [&](index_t t) { return cache.value_row(l, g, t); },
            base_len_[static_cast<std::size_t>(s * Hkv + g)] + (i - first_[static_cast<std::size_t>(s)]) + 1, hs,
            att_.data() + index_t(thread) * max_rows_, xb + i * d + q * hs);
      });
      detail::matmul(threads_, xb, d, n, d, m.wo(l), d, tmp, d);
      project(l, projection::o, xb, d, d, tmp, d, d, l + 1);
      for (index_t i = 0; i < n * d; ++i) x[i] += tmp[i];

      // FFN: RMSNorm, w1|w3, SwiGLU, w2
      for (index_t i = 0; i < n; ++i) detail::rmsnorm(xb + i * d, x + i * d, m.ffn_norm(l), d);
      detail::matmul(threads_, xb, d, n, d, m.w13(l), 2 * hidden, h13, 2 * hidden);
      project(l, projection::w1, xb, d, d, h13, 2 * hidden, hidden, l + 1);
      project(l, projection::w3, xb, d, d, h13 + hidden, 2 * hidden, hidden, l + 1);
      for (index_t i = 0; i < n; ++i) detail::swiglu(h13 + i * 2 * hidden, h13 + i * 2 * hidden + hidden, hidden);
      detail::matmul(threads_, h13, 2 * hidden, n, hidden, m.w2(l), d, tmp, d);
      project(l, projection::w2, h13, 2 * hidden, hidden, tmp, d, d, l + 1);
      for (index_t i = 0; i < n * d; ++i) x[i] += tmp[i];

      for (index_t s = 0; s < count; ++s) {
        forward_segment& g = segs[s];
        if (!g.st.ok() || g.hooks == nullptr || !g.hooks->after_layer) continue;
        const index_t r = first_[static_cast<std::size_t>(s)];
        layer_event ev;
        ev.layer = l;
        ev.rows = g.b.n;
        ev.positions = pos + r;
        ev.queries = *kvevict::make_kv_view<const float>(qkv + r * qs, H, g.b.n, hs, hs, qs);
        ev.keys = *kvevict::make_kv_view<const float>(qkv + r * qs + d, Hkv, g.b.n, hs, hs, qs);
        ev.values = *kvevict::make_kv_view<const float>(qkv + r * qs + d + kvd, Hkv, g.b.n, hs, hs, qs);
        ev.rolled_back = g.rolled_back;
        const status st = g.hooks->after_layer(ev);
        if (!st.ok()) fail(s, st, l + 1);
      }
    }

    // final RMSNorm and classifier for the rows that need logits, segment after segment
    index_t out = 0;
    for (index_t s = 0; s < count; ++s) {
      forward_segment& g = segs[s];
      g.logits_row = out;
      if (!g.st.ok()) continue;
      const index_t k = g.mode == logits_mode::none ? 0 : g.mode == logits_mode::last ? 1 : g.b.n;
      const index_t first = first_[static_cast<std::size_t>(s)] + g.b.n - k;
      for (index_t i = 0; i < k; ++i, ++out) detail::rmsnorm(xb + out * d, x + (first + i) * d, m.final_norm(), d);
    }
    detail::matmul(threads_, xb, d, out, d, m.classifier(), c.vocab_size, logits_.data(), c.vocab_size);
    logits_rows_ = out;

    for (index_t s = 0; s < count; ++s) {
      forward_segment& g = segs[s];
      if (!g.st.ok()) continue;
      const index_t r = first_[static_cast<std::size_t>(s)];
      for (index_t i = 0; i < g.b.n; ++i)
        g.cache->next_position_ = std::max(g.cache->next_position_, static_cast<pos_t>(pos[r + i] + 1));
      g.cache->appended_ += static_cast<std::uint64_t>(g.b.n);
    }
  }
};

inline void forward_gate::deliver(runner& r, const float* logits, index_t rows) {
  std::copy(logits, logits + rows * static_cast<index_t>(r.model_->cfg().vocab_size), r.logits_.begin());
  r.logits_rows_ = rows;
}

}  // namespace kvrun
