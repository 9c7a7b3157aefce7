// kvevict/drivers/detail/driver_checks.hpp: the checks every driver runs on its configuration,
// its state memory, a layer of the engine's cache and a query block (internal).
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/compact.hpp>
#include <kvevict/budget/allocation.hpp>
#include <kvevict/budget/apportion.hpp>
#include <kvevict/detail/base/checks.hpp>
#include <kvevict/drivers/layer_kv.hpp>
#include <kvevict/metrics/footprint.hpp>
#include <kvevict/recipes.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>

#include <cstdint>
#include <cstdio>
#include <type_traits>

namespace kvevict {
namespace detail {

inline status check_model(const char* fn, const model_shape& m) {
  if (m.layers <= 0)
    return status::error(errc::invalid_argument, "%s: the model has %lld layers (at least 1 needed)", fn,
                         static_cast<long long>(m.layers));
  if (m.kv_heads <= 0)
    return status::error(errc::invalid_argument, "%s: the model has %lld KV heads per layer (at least 1 needed)", fn,
                         static_cast<long long>(m.kv_heads));
  if (m.query_heads <= 0 || m.query_heads % m.kv_heads != 0)
    return status::error(errc::invalid_argument, "%s: %lld query heads are not a positive multiple of %lld KV heads (GQA)",
                         fn, static_cast<long long>(m.query_heads), static_cast<long long>(m.kv_heads));
  if (m.head_dim <= 0)
    return status::error(errc::invalid_argument, "%s: head_dim = %lld (must be positive)", fn,
                         static_cast<long long>(m.head_dim));
  if (m.layers > INT32_MAX || m.kv_heads > INT32_MAX / 2)
    return status::error(errc::invalid_argument, "%s: %lld layers x %lld heads is too large", fn,
                         static_cast<long long>(m.layers), static_cast<long long>(m.kv_heads));
  return {};
}

/// A configuration a driver refuses (every driver's validate): if `refused`, errc::unsupported with
/// "fn: <what> <why>" (what: the recipe, allocator or feature; why: what the driver supports instead).
inline status check_supported(const char* fn, bool refused, const char* what, const char* why) {
  if (!refused) return {};
  return status::error(errc::unsupported, "%s: %s %s", fn, what, why);
}

/// Every driver call on cuda_t: refused with errc::unsupported, nothing changes (on_host below).
/// The drivers' state (kept lists, budgets, H2O sums, the recorder) is in host memory and their
/// block-table / position checks, allocators and bookkeeping are host loops reading the layer, so
/// they cannot take device memory (docs/paged.md, "On the GPU").
inline status drivers_on_cuda(const char* fn) {
  return status::error(errc::unsupported,
                       "%s: the drivers run on host backends (seq, par): their state and checks are host memory and "
                       "host loops; on cuda run the per-layer stages (paged_window_scores, select_topk_batch, "
                       "compact_paged) directly",
                       fn);
}

/// A driver entry point's frame: on cuda_t refused (drivers_on_cuda(fn), nothing changes), on a
/// host backend host(be). Every entry point taking a backend runs its body through it, as a
/// generic lambda, so the body is never compiled for cuda_t.
template <class Backend, class Host>
status on_host(const char* fn, Backend be, Host&& host) {
  if constexpr (std::is_same_v<Backend, cuda_t>) return drivers_on_cuda(fn);
  else return host(be);
}

/// Rows per head a driver scores at most (C): positive, H C and C within int32.
inline status check_capacity(const char* fn, const char* what, index_t C, index_t H) {
  index_t rows = 0;
  if (C <= 0 || C > INT32_MAX || !checked_mul(C, H, rows) || rows > INT32_MAX)
    return status::error(errc::invalid_argument, "%s: %s = %lld is outside [1, %lld] (int32 row offsets for %lld heads)",
                         fn, what, static_cast<long long>(C), static_cast<long long>(INT32_MAX / (H > 0 ? H : 1)),
                         static_cast<long long>(H));
  return {};
}

/// An external_block recipe reads the block the configuration names: query_rows >= 1 rows, with
/// the block's own keys allowed.
inline status external_block_queries(const char* fn, index_t given, index_t* rows, bool* block_keys) {
  if (given < 1)
    return status::error(errc::invalid_argument,
                         "%s: query_rows = %lld: an external_block recipe needs the block's row count", fn,
                         static_cast<long long>(given));
  *rows = given;
  *block_keys = true;
  return {};
}

/// The recipe's protection {n_sink, n_recent}.
inline protection recipe_protection(const recipe& r) { return {r.n_sink, r.n_recent}; }

/// Checks the budget matrix of a per_head / flattened / adakv allocation: [L][H], every entry
/// >= min_head (the protected tokens of a head at the decision) and <= max_head (-1: unbounded).
inline status check_budget_matrix(const char* fn, const allocation& a, const model_shape& m, index_t min_head,
                                  index_t max_head) {
  KVEVICT_TRY(check_view(fn, "alloc.budgets", a.budgets));
  if (a.budgets.extent(0) != m.layers || a.budgets.extent(1) != m.kv_heads)
    return status::error(errc::shape_mismatch, "%s: alloc.budgets is [%lld][%lld], expected [%lld layers][%lld heads]", fn,
                         static_cast<long long>(a.budgets.extent(0)), static_cast<long long>(a.budgets.extent(1)),
                         static_cast<long long>(m.layers), static_cast<long long>(m.kv_heads));
  for (index_t l = 0; l < m.layers; ++l) {
    index_t sum = 0;
    for (index_t h = 0; h < m.kv_heads; ++h) {
      const index_t b = a.budgets(l, h);
      sum += b;
      if (b < 0)
        return status::error(errc::invalid_argument, "%s: budgets[%lld][%lld] = %lld is negative", fn,
                             static_cast<long long>(l), static_cast<long long>(h), static_cast<long long>(b));
      if (a.kind == allocator::per_head && b < min_head)
        return status::error(errc::invalid_argument,
                             "%s: budgets[%lld][%lld] = %lld is below the %lld protected tokens of a head", fn,
                             static_cast<long long>(l), static_cast<long long>(h), static_cast<long long>(b),
                             static_cast<long long>(min_head));
      if (a.kind == allocator::per_head && max_head >= 0 && b > max_head)
        return status::error(errc::invalid_argument, "%s: budgets[%lld][%lld] = %lld is above the %lld rows of a head", fn,
                             static_cast<long long>(l), static_cast<long long>(h), static_cast<long long>(b),
                             static_cast<long long>(max_head));
    }
    if (sum > INT32_MAX)
      return status::error(errc::invalid_argument, "%s: layer %lld's budgets add up to more than %d", fn,
                           static_cast<long long>(l), INT32_MAX);
    if (a.kind != allocator::per_head && sum < min_head * m.kv_heads)
      return status::error(errc::invalid_argument,
                           "%s: layer %lld keeps %lld tokens, below the %lld protected tokens of its %lld heads", fn,
                           static_cast<long long>(l), static_cast<long long>(sum),
                           static_cast<long long>(min_head * m.kv_heads), static_cast<long long>(m.kv_heads));
    if (a.kind == allocator::adakv) {
      if (sum % m.kv_heads != 0)
        return status::error(errc::invalid_argument,
                             "%s: adakv: layer %lld's budgets add up to %lld, not a multiple of the %lld heads (AdaKV "
                             "keeps B_l per head on average)",
                             fn, static_cast<long long>(l), static_cast<long long>(sum),
                             static_cast<long long>(m.kv_heads));
      if (sum / m.kv_heads < min_head)
        return status::error(errc::invalid_argument, "%s: adakv: layer %lld's budget %lld per head is below the %lld "
                             "protected tokens of a head", fn, static_cast<long long>(l),
                             static_cast<long long>(sum / m.kv_heads), static_cast<long long>(min_head));
    }
    if (a.kind != allocator::per_head && max_head >= 0 && sum > max_head * m.kv_heads)
      return status::error(errc::invalid_argument, "%s: layer %lld keeps %lld tokens, more than its %lld rows", fn,
                           static_cast<long long>(l), static_cast<long long>(sum),
                           static_cast<long long>(max_head * m.kv_heads));
  }
  return {};
}

/// The state memory a driver's init() binds: not null, at least `needed` bytes (state_bytes).
inline status check_state_memory(const char* fn, const void* memory, std::size_t bytes, std::size_t needed) {
  if (memory == nullptr) return status::error(errc::null_pointer, "%s: memory is null", fn);
  if (bytes < needed)
    return status::error(errc::workspace_too_small, "%s: memory has %zu bytes, %zu needed (state_bytes)", fn, bytes,
                         needed);
  return {};
}

inline status check_recorder(const char* fn, const eviction_recorder* rec, const model_shape& m, index_t tokens) {
  if (rec == nullptr) return {};
  if (rec->layers() != m.layers || rec->heads() != m.kv_heads)
    return status::error(errc::shape_mismatch, "%s: the recorder has %lld layers x %lld heads, the model %lld x %lld", fn,
                         static_cast<long long>(rec->layers()), static_cast<long long>(rec->heads()),
                         static_cast<long long>(m.layers), static_cast<long long>(m.kv_heads));
  if (tokens > rec->capacity())
    return status::error(errc::invalid_argument, "%s: the recorder holds %lld positions, fewer than the %lld tokens", fn,
                         static_cast<long long>(rec->capacity()), static_cast<long long>(tokens));
  return {};
}

// ---------------------------------------------------------------------------------------------
// Views of one head of a ragged layer (no checks: the caller validated the layer)

template <class T>
kv_view<const T> head_rows(const ragged_cache<const T>& c, index_t h, index_t n) {
  using exts = cuda::std::dextents<index_t, 3>;
  const index_t rs = c.row_stride;
  const cuda::std::array<index_t, 3> str{rs * (n > 0 ? n : 1), rs, 1};
  return kv_view<const T>(c.data + static_cast<index_t>(c.cu_capacity[h]) * rs,
                          cuda::std::layout_stride::mapping<exts>(exts(1, n, c.dim), str));
}

/// Query heads [h g, (h+1) g) of a [H_q][rows][d] block.
template <class Q>
kv_view<const Q> group_rows(const kv_view<const Q>& q, index_t h, index_t g) {
  using exts = cuda::std::dextents<index_t, 3>;
  const cuda::std::array<index_t, 3> str{q.stride(0), q.stride(1), q.stride(2)};
  return kv_view<const Q>(q.data_handle() + h * g * q.stride(0),
                          cuda::std::layout_stride::mapping<exts>(exts(g, q.extent(1), q.extent(2)), str));
}

/// KV head h of a [H][rows][d] block (0 rows: an empty view).
template <class T>
kv_view<const T> one_head(const kv_view<const T>& k, index_t h) {
  if (k.extent(1) == 0) return {};
  using exts = cuda::std::dextents<index_t, 3>;
  const cuda::std::array<index_t, 3> str{k.stride(0), k.stride(1), k.stride(2)};
  return kv_view<const T>(k.data_handle() + h * k.stride(0),
                          cuda::std::layout_stride::mapping<exts>(exts(1, k.extent(1), k.extent(2)), str));
}

/// Rows [0, rows) x [0, cols) of a row-major buffer with row stride `stride`.
template <class T>
matrix_view<T> rows_view(T* p, index_t rows, index_t cols, index_t stride) {
  using exts = cuda::std::dextents<index_t, 2>;
  const cuda::std::array<index_t, 2> str{stride > 0 ? stride : 1, 1};
  return matrix_view<T>(p, cuda::std::layout_stride::mapping<exts>(exts(rows, cols), str));
}

// ---------------------------------------------------------------------------------------------
// Layer checks

/// What a call expects of a layer's rows besides the basic layout.
struct row_rules {
  index_t tokens = 0;        ///< every position must be < tokens (the tokens processed so far)
  index_t capacity = 0;      ///< at most this many rows per head (the driver's C)
  index_t tail = 0;          ///< the last `tail` rows of every head must hold positions [tokens - tail, tokens)
  const char* tail_what = "";  ///< what those rows are, for the message ("the window's tokens")
  bool whole = false;        ///< every head must hold rows 0..tokens-1 with positions 0..tokens-1
};

template <class T>
status check_cache_layout(const char* fn, const char* name, const ragged_cache<const T>& c, index_t H, index_t d) {
  if (c.heads != H)
    return status::error(errc::shape_mismatch, "%s: the layer's %s have %lld KV heads, the driver was set up for %lld", fn,
                         name, static_cast<long long>(c.heads), static_cast<long long>(H));
  if (c.dim != d)
    return status::error(errc::shape_mismatch, "%s: the layer's %s have head dim %lld, the driver was set up for %lld",
                         fn, name, static_cast<long long>(c.dim), static_cast<long long>(d));
  char what[48];
  std::snprintf(what, sizeof what, "%s.cu_capacity", name);
  KVEVICT_TRY(check_offsets(fn, what, c.cu_capacity, H));
  if (c.lens == nullptr) return status::error(errc::null_pointer, "%s: %s.lens is null", fn, name);
  KVEVICT_TRY(check_ragged_rows(fn, name, c.data, c.dim, c.row_stride, static_cast<index_t>(c.cu_capacity[H])));
  for (index_t h = 0; h < H; ++h)
    if (c.lens[h] < 0 || c.lens[h] > c.capacity(h))
      return status::error(errc::out_of_range, "%s: %s.lens[%lld] = %d is outside [0, %lld] (the head's capacity)", fn,
                           name, static_cast<long long>(h), c.lens[h], static_cast<long long>(c.capacity(h)));
  return {};
}

// A layer as the drivers read it (layer_reader's type, paged_rows.hpp): a layer_kv, or a paged
// layer's rows (paged_rows: its paged_layer, position pages and lengths). Each accessor has one
// overload per kind: the heads, the rows per head and the original position of row j of head h.
template <class T>
struct paged_rows;

template <class T>
index_t layer_heads(const layer_kv<T>& kv) { return kv.keys.heads; }
template <class T>
const std::int32_t* layer_lens(const layer_kv<T>& kv) { return kv.keys.lens; }
template <class T>
pos_t layer_pos(const layer_kv<T>& kv, index_t h, index_t j) { return kv.positions[kv.keys.cu_capacity[h] + j]; }

template <class T>
index_t layer_heads(const paged_rows<T>& kv) { return kv.layer.kv_heads; }
template <class T>
const std::int32_t* layer_lens(const paged_rows<T>& kv) { return kv.lens; }
template <class T>
pos_t layer_pos(const paged_rows<T>& kv, index_t h, index_t j) {
  const index_t ps = kv.positions.page_size;
  return *kv.positions.row(kv.layer.table.page_of(kv.layer.list_of(h), j, ps), j % ps, kv.layer.head_of(h));
}

/// The layer's layout: both caches, equal key / value row counts, positions present.
template <class T>
status check_layer_layout(const char* fn, index_t layer, const layer_kv<T>& kv, index_t H, index_t d) {
  KVEVICT_TRY(check_cache_layout(fn, "keys", kv.keys, H, d));
  KVEVICT_TRY(check_cache_layout(fn, "values", kv.values, H, d));
  if (kv.positions == nullptr && kv.keys.cu_capacity[H] > 0)
    return status::error(errc::null_pointer, "%s: layer %lld's positions are null", fn, static_cast<long long>(layer));
  for (index_t h = 0; h < H; ++h)
    if (kv.values.lens[h] != kv.keys.lens[h])
      return status::error(errc::shape_mismatch, "%s: layer %lld head %lld holds %d key rows but %d value rows", fn,
                           static_cast<long long>(layer), static_cast<long long>(h), kv.keys.lens[h], kv.values.lens[h]);
  return {};
}

/// The rows of a laid-out layer: at most C per head, positions strictly ascending in [0, tokens),
/// and the rules' tail / whole-prompt requirements. O(rows).
template <class KV>
status check_layer_rows(const char* fn, index_t layer, const KV& kv, const row_rules& rr) {
  const index_t H = layer_heads(kv);
  for (index_t h = 0; h < H; ++h) {
    const index_t n = layer_lens(kv)[h];
    if (n > rr.capacity)
      return status::error(errc::capacity_exceeded,
                           "%s: layer %lld head %lld holds %lld rows, more than the driver's capacity %lld", fn,
                           static_cast<long long>(layer), static_cast<long long>(h), static_cast<long long>(n),
                           static_cast<long long>(rr.capacity));
    pos_t prev = 0;
    for (index_t j = 0; j < n; ++j) {
      const pos_t pj = layer_pos(kv, h, j);
      if (pj < 0 || pj >= rr.tokens)
        return status::error(errc::out_of_range,
                             "%s: layer %lld head %lld row %lld holds position %d, outside [0, %lld) (the tokens "
                             "processed)",
                             fn, static_cast<long long>(layer), static_cast<long long>(h), static_cast<long long>(j),
                             pj, static_cast<long long>(rr.tokens));
      if (j > 0 && pj <= prev)
        return status::error(errc::not_sorted,
                             "%s: layer %lld head %lld: row %lld holds position %d after %d (rows must be in arrival "
                             "order)",
                             fn, static_cast<long long>(layer), static_cast<long long>(h), static_cast<long long>(j),
                             pj, prev);
      prev = pj;
    }
    if (rr.whole && n != rr.tokens)
      return status::error(errc::shape_mismatch,
                           "%s: layer %lld head %lld holds %lld rows; it must hold the whole prompt (%lld tokens, "
                           "nothing evicted yet)",
                           fn, static_cast<long long>(layer), static_cast<long long>(h), static_cast<long long>(n),
                           static_cast<long long>(rr.tokens));
    if (rr.tail > 0) {
      if (n < rr.tail || layer_pos(kv, h, n - rr.tail) != rr.tokens - rr.tail)
        return status::error(errc::invalid_argument,
                             "%s: the last %lld rows of layer %lld head %lld must be %s (positions [%lld, %lld)); the "
                             "head holds %lld rows%s",
                             fn, static_cast<long long>(rr.tail), static_cast<long long>(layer),
                             static_cast<long long>(h), rr.tail_what, static_cast<long long>(rr.tokens - rr.tail),
                             static_cast<long long>(rr.tokens), static_cast<long long>(n),
                             n >= rr.tail ? ", and one of them was evicted or is missing" : "");
    }
  }
  return {};
}

/// Everything about a layer the drivers rely on: check_layer_layout, then check_layer_rows.
template <class KV>
status check_layer(const char* fn, index_t layer, const KV& kv, index_t H, index_t d, const row_rules& rr) {
  KVEVICT_TRY(check_layer_layout(fn, layer, kv, H, d));
  return check_layer_rows(fn, layer, kv, rr);
}

/// A query block: [H_q][rows][d] (rows == 0 accepts an empty view), and optional block keys.
template <class Q, class T>
status check_queries(const char* fn, const kv_view<const Q>& q, index_t rows, const model_shape& m,
                     const kv_view<const T>& bk, bool block_keys_allowed) {
  if (rows == 0) {
    if (q.size() != 0)
      return status::error(errc::shape_mismatch, "%s: the recipe reads no queries but %lld query rows were given", fn,
                           static_cast<long long>(q.extent(1)));
  } else {
    if (q.extent(0) != m.query_heads || q.extent(1) != rows || q.extent(2) != m.head_dim)
      return status::error(errc::shape_mismatch, "%s: queries are [%lld][%lld][%lld], expected [%lld][%lld][%lld]", fn,
                           static_cast<long long>(q.extent(0)), static_cast<long long>(q.extent(1)),
                           static_cast<long long>(q.extent(2)), static_cast<long long>(m.query_heads),
                           static_cast<long long>(rows), static_cast<long long>(m.head_dim));
    KVEVICT_TRY(check_view(fn, "queries", q));
  }
  if (bk.extent(1) != 0) {
    if (!block_keys_allowed)
      return status::error(errc::shape_mismatch, "%s: block keys were given but this call takes none", fn);
    if (bk.extent(0) != m.kv_heads || bk.extent(1) != rows || bk.extent(2) != m.head_dim)
      return status::error(errc::shape_mismatch, "%s: block_keys are [%lld][%lld][%lld], expected [%lld][%lld][%lld]",
                           fn, static_cast<long long>(bk.extent(0)), static_cast<long long>(bk.extent(1)),
                           static_cast<long long>(bk.extent(2)), static_cast<long long>(m.kv_heads),
                           static_cast<long long>(rows), static_cast<long long>(m.head_dim));
    KVEVICT_TRY(check_view(fn, "block_keys", bk));
  }
  return {};
}

}  // namespace detail
}  // namespace kvevict
