// kvevict/drivers/common.hpp: what every eviction driver shares (docs/drivers.md).
//
//   layer_kv<T>                    one layer of the engine's cache: ragged keys, values and the
//                                  ORIGINAL position of every row
//   make_layer_kv(keys, values, positions)
//   ragged_from_dense(dense, cu_capacity, lens)   a head-major dense cache viewed as a ragged_cache
//   model_shape, allocator, allocation            the model and the budget rule a driver applies
//
// A driver is an engine-facing loop: the engine runs its forward pass and, at the points the
// driver defines, hands it views of its queries / keys / values; the driver answers, per layer,
// with the rows of the engine's CURRENT cache each KV head keeps (ascending row indices, what
// compact_inplace and kvrun::kv_cache::compact take), and records the schedule into an optional
// eviction_recorder. Drivers reuse the stages: recipe_scores for scoring, the budget allocators,
// select_topk / select_topk_flat / adakv_budgets for selection. They never own the model or the
// cache, never allocate: their state lives in memory the engine provides (state_bytes) and their
// scratch comes through a kvevict::workspace (two-phase).
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/budget.hpp>
#include <kvevict/compact.hpp>
#include <kvevict/detail/base/checks.hpp>
#include <kvevict/detail/base/parallel.hpp>
#include <kvevict/metrics/footprint.hpp>
#include <kvevict/protect.hpp>
#include <kvevict/recipes.hpp>
#include <kvevict/select.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>
#include <kvevict/workspace.hpp>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace kvevict {

/// One layer of the engine's KV cache as every driver reads it. Head h holds keys.lens[h] rows,
/// row j at keys.row(h, j) (and values.row(h, j)); positions[keys.cu_capacity[h] + j] is the
/// ORIGINAL token position of that row (the one RoPE used; eviction never changes it), so the
/// positions array is laid out like the rows (dim 1, row stride 1). Rows are in arrival order, so
/// each head's positions are strictly ascending (checked). Values may use other offsets and their
/// own `lens` array but must hold the same number of rows per head (checked).
/// kvrun::kv_cache gives exactly this: make_layer_kv(c.keys(l), c.values(l), c.positions(l)).
template <class T>
struct layer_kv {
  ragged_cache<const T> keys;
  ragged_cache<const T> values;
  const pos_t* positions = nullptr;
};

/// The same cache, read-only.
template <class T>
ragged_cache<const std::remove_const_t<T>> const_cache(const ragged_cache<T>& c) noexcept {
  return {c.data, c.cu_capacity, c.lens, c.heads, c.dim, c.row_stride};
}

/// A layer from its key and value caches and a positions array laid out like the key rows.
template <class T>
layer_kv<std::remove_const_t<T>> make_layer_kv(const ragged_cache<T>& keys, const ragged_cache<T>& values,
                                                const pos_t* positions) noexcept {
  return {const_cache(keys), const_cache(values), positions};
}

/// A layer from key / value caches and a positions cache (dim 1, row stride 1, the keys' offsets:
/// what kvrun::kv_cache::positions(l) returns). Errors: positions with another head count, dim or
/// row stride than 1, or offsets that differ from the keys' (shape_mismatch); null offsets.
template <class T, class P>
result<layer_kv<std::remove_const_t<T>>> make_layer_kv(const ragged_cache<T>& keys, const ragged_cache<T>& values,
                                                       const ragged_cache<P>& positions) {
  static_assert(std::is_same_v<std::remove_const_t<P>, pos_t>, "make_layer_kv: positions are pos_t (int32)");
  constexpr const char* fn = "make_layer_kv";
  if (positions.heads != keys.heads)
    return status::error(errc::shape_mismatch, "%s: positions have %lld heads, the keys %lld", fn,
                         static_cast<long long>(positions.heads), static_cast<long long>(keys.heads));
  if (positions.dim != 1 || positions.row_stride != 1)
    return status::error(errc::shape_mismatch, "%s: positions must have dim 1 and row stride 1 (got %lld, %lld)", fn,
                         static_cast<long long>(positions.dim), static_cast<long long>(positions.row_stride));
  if (keys.cu_capacity == nullptr || positions.cu_capacity == nullptr)
    return status::error(errc::null_pointer, "%s: cu_capacity offsets are null", fn);
  for (index_t h = 0; h <= keys.heads; ++h)
    if (positions.cu_capacity[h] != keys.cu_capacity[h])
      return status::error(errc::shape_mismatch, "%s: positions.cu_capacity[%lld] = %d but keys.cu_capacity[%lld] = %d",
                           fn, static_cast<long long>(h), positions.cu_capacity[h], static_cast<long long>(h),
                           keys.cu_capacity[h]);
  return layer_kv<std::remove_const_t<T>>{const_cache(keys), const_cache(values), positions.data};
}

/// Views a dense cache [H][T][d] as a ragged_cache without copying: cu_capacity[h] = h C with
/// C = head stride / token stride (>= T; C = T for one head), lens[h] = T. The rows of a head must
/// be contiguous and evenly spaced, i.e. a head-major layout (padded capacity allowed): token-major
/// caches [T][H][d] cannot be ragged caches (use compact() to copy them into one). cu_capacity
/// (H + 1) and lens (H) are the caller's; the result reads the dense memory.
/// Errors: invalid view; dim stride != 1 (with d > 1); token stride < d; head stride not a multiple
/// >= T of the token stride; H C or T above INT32_MAX; null or overlapping cu_capacity / lens.
template <class T>
result<ragged_cache<T>> ragged_from_dense(kv_view<T> dense, std::int32_t* cu_capacity, std::int32_t* lens) {
  constexpr const char* fn = "ragged_from_dense";
  KVEVICT_TRY(detail::check_view(fn, "dense", dense));
  const index_t H = dense.extent(0), Tn = dense.extent(1), D = dense.extent(2);
  if (cu_capacity == nullptr) return status::error(errc::null_pointer, "%s: cu_capacity is null", fn);
  if (lens == nullptr && H > 0) return status::error(errc::null_pointer, "%s: lens is null", fn);
  if (D > 1 && dense.stride(2) != 1)
    return status::error(errc::invalid_argument, "%s: rows must be contiguous (dim stride %lld, expected 1)", fn,
                         static_cast<long long>(dense.stride(2)));
  const index_t rs = dense.stride(1);
  if (rs < D)
    return status::error(errc::invalid_argument, "%s: the token stride %lld is smaller than the head dim %lld", fn,
                         static_cast<long long>(rs), static_cast<long long>(D));
  index_t C = Tn;
  if (H > 1) {
    const index_t hs = dense.stride(0);
    if (hs % rs != 0 || hs / rs < Tn)
      return status::error(errc::invalid_argument,
                           "%s: the head stride %lld is not a multiple >= %lld tokens of the token stride %lld: a "
                           "ragged cache needs each head's rows contiguous (head-major layout; token-major caches "
                           "must be copied with compact)",
                           fn, static_cast<long long>(hs), static_cast<long long>(Tn), static_cast<long long>(rs));
    C = hs / rs;
  }
  index_t rows = 0;
  if (Tn > INT32_MAX || !detail::checked_mul(H, C, rows) || rows > INT32_MAX)
    return status::error(errc::size_overflow, "%s: %lld heads x %lld rows do not fit int32 offsets", fn,
                         static_cast<long long>(H), static_cast<long long>(C));
  const detail::byte_range data = detail::range_of(dense);
  const auto cb = reinterpret_cast<std::uintptr_t>(cu_capacity);
  const auto lb = reinterpret_cast<std::uintptr_t>(lens);
  const detail::byte_range cr{cb, cb + static_cast<std::uintptr_t>(H + 1) * sizeof(std::int32_t)};
  const detail::byte_range lr =
      H > 0 ? detail::byte_range{lb, lb + static_cast<std::uintptr_t>(H) * sizeof(std::int32_t)} : detail::byte_range{};
  if (cr.intersects(data) || lr.intersects(data) || cr.intersects(lr))
    return status::error(errc::overlap, "%s: cu_capacity, lens and the cache overlap in memory", fn);
  for (index_t h = 0; h <= H; ++h) cu_capacity[h] = static_cast<std::int32_t>(h * C);
  for (index_t h = 0; h < H; ++h) lens[h] = static_cast<std::int32_t>(Tn);
  return ragged_cache<T>{dense.data_handle(), cu_capacity, lens, H, D, rs > 0 ? rs : 1};
}

/// The model a driver serves: every layer has kv_heads KV heads and query_heads query heads
/// (GQA: query head q reads KV head q / (query_heads / kv_heads)) of dimension head_dim.
struct model_shape {
  index_t layers = 0;
  index_t kv_heads = 0;
  index_t query_heads = 0;
  index_t head_dim = 0;
};

/// How the tokens a model keeps are shared by its layers and heads (docs/budget.md).
enum class allocator : int {
  /// Head (l, h) keeps budgets(l, h): uniform_budgets, pyramid_budgets, duo_budgets, cake_budgets
  /// computed beforehand, any [L][H] matrix.
  per_head = 0,
  /// Layer l keeps sum_h budgets(l, h) tokens; its heads compete through the flattened selection
  /// (LAVa Algorithm 1; with uniform budgets this is LAVa's "uniform layer budgets" ablation).
  flattened = 1,
  /// Layer l keeps B_l x H tokens, B_l = sum_h budgets(l, h) / H, shared with AdaKV's safeguard
  /// floor (adakv_budgets; Ada-SnapKV with uniform budgets, Ada-PyramidKV with pyramid ones).
  adakv = 2,
  /// All layers: `total` tokens shared by the layers in proportion to the normalised entropy of
  /// their scores (LAVa Eq. 7-8, lava_layer_budgets' rule), flattened within each layer.
  lava = 3,
  /// All layers (post-fill only): per-head budgets total / (L H) reshaped across layers by the
  /// layers' CAKE preferences, which the engine passes to add_layer (cake_budgets).
  cake = 4,
};

constexpr const char* allocator_name(allocator a) noexcept {
  switch (a) {
    case allocator::per_head: return "per_head";
    case allocator::flattened: return "flattened";
    case allocator::adakv: return "adakv";
    case allocator::lava: return "lava";
    case allocator::cake: return "cake";
  }
  return "unknown";
}

/// The allocation rule of a driver. The budget matrix is copied at init (the caller may free it).
struct allocation {
  allocator kind = allocator::per_head;
  /// [L][H] int32 per-head budgets (per_head, flattened, adakv), protected tokens included.
  matrix_view<const std::int32_t> budgets{};
  /// lava, cake: the tokens the whole model keeps, protected ones included ("B per head" = B H L).
  index_t total = 0;
  /// adakv: safeguard fraction and floor rule (adakv_options; the protection is the recipe's).
  double adakv_alpha = 0.2;
  adakv_floor floor_rule = adakv_floor::budget;
  /// lava: entropy normalisation (lava_entropy_options; the protection is the recipe's).
  entropy_norm lava_norm = entropy_norm::log_count;
};

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

/// Rows per head a driver scores at most (C): positive, H C and C within int32.
inline status check_capacity(const char* fn, const char* what, index_t C, index_t H) {
  index_t rows = 0;
  if (C <= 0 || C > INT32_MAX || !checked_mul(C, H, rows) || rows > INT32_MAX)
    return status::error(errc::invalid_argument, "%s: %s = %lld is outside [1, %lld] (int32 row offsets for %lld heads)",
                         fn, what, static_cast<long long>(C), static_cast<long long>(INT32_MAX / (H > 0 ? H : 1)),
                         static_cast<long long>(H));
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

inline status check_allocation_options(const char* fn, const allocation& a) {
  const int k = static_cast<int>(a.kind);
  if (k < 0 || k > static_cast<int>(allocator::cake))
    return status::error(errc::invalid_argument, "%s: unknown allocator value %d", fn, k);
  if (a.kind == allocator::adakv) {
    if (!(a.adakv_alpha >= 0.0 && a.adakv_alpha <= 1.0))
      return status::error(errc::invalid_argument, "%s: adakv alpha = %g is outside [0, 1]", fn, a.adakv_alpha);
    if (a.floor_rule != adakv_floor::budget && a.floor_rule != adakv_floor::evictable)
      return status::error(errc::invalid_argument, "%s: unknown adakv_floor value %d", fn,
                           static_cast<int>(a.floor_rule));
  }
  if (a.kind == allocator::lava && a.lava_norm != entropy_norm::log_count && a.lava_norm != entropy_norm::count)
    return status::error(errc::invalid_argument, "%s: unknown entropy_norm value %d", fn, static_cast<int>(a.lava_norm));
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
template <class T>
status check_layer_rows(const char* fn, index_t layer, const layer_kv<T>& kv, const row_rules& rr) {
  const index_t H = kv.keys.heads;
  for (index_t h = 0; h < H; ++h) {
    const index_t n = kv.keys.lens[h];
    if (n > rr.capacity)
      return status::error(errc::capacity_exceeded,
                           "%s: layer %lld head %lld holds %lld rows, more than the driver's capacity %lld", fn,
                           static_cast<long long>(layer), static_cast<long long>(h), static_cast<long long>(n),
                           static_cast<long long>(rr.capacity));
    const pos_t* p = kv.positions + kv.keys.cu_capacity[h];
    for (index_t j = 0; j < n; ++j) {
      if (p[j] < 0 || p[j] >= rr.tokens)
        return status::error(errc::out_of_range,
                             "%s: layer %lld head %lld row %lld holds position %d, outside [0, %lld) (the tokens "
                             "processed)",
                             fn, static_cast<long long>(layer), static_cast<long long>(h), static_cast<long long>(j),
                             p[j], static_cast<long long>(rr.tokens));
      if (j > 0 && p[j] <= p[j - 1])
        return status::error(errc::not_sorted,
                             "%s: layer %lld head %lld: row %lld holds position %d after %d (rows must be in arrival "
                             "order)",
                             fn, static_cast<long long>(layer), static_cast<long long>(h), static_cast<long long>(j),
                             p[j], p[j - 1]);
    }
    if (rr.whole && n != rr.tokens)
      return status::error(errc::shape_mismatch,
                           "%s: layer %lld head %lld holds %lld rows; it must hold the whole prompt (%lld tokens, "
                           "nothing evicted yet)",
                           fn, static_cast<long long>(layer), static_cast<long long>(h), static_cast<long long>(n),
                           static_cast<long long>(rr.tokens));
    if (rr.tail > 0) {
      if (n < rr.tail || p[n - rr.tail] != rr.tokens - rr.tail)
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
template <class T>
status check_layer(const char* fn, index_t layer, const layer_kv<T>& kv, index_t H, index_t d, const row_rules& rr) {
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

// ---------------------------------------------------------------------------------------------
// Scoring: one recipe_scores call per KV head over that head's rows, with its group's queries

/// Workspace bytes of one recipe_scores call over one KV head of up to C rows (the size grows
/// with the rows and the query rows, so the largest shape bounds every call).
template <class Backend>
result<std::size_t> head_score_bytes(Backend be, const recipe& r, index_t g, index_t rows, index_t C, index_t d,
                                     bool block_keys) {
  if (!uses_attention(r.kind)) return std::size_t{0};
  auto a = recipe_scores_workspace_bytes(be, r, g, rows, 1, C, d, 0);
  if (!a) return a.error();
  std::size_t n = *a;
  if (block_keys && r.kind != recipe_kind::h2o && r.kind != recipe_kind::tova &&
      r.source == query_source::external_block) {
    auto b = recipe_scores_workspace_bytes(be, r, g, rows, 1, C, d, rows);
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

/// Workspace bytes of the selection an allocator runs over scores [H][C]: select_topk's,
/// select_topk_flat's (flattened, lava) or adakv_budgets' (H int32 floors, then
/// select_topk_flat's), computed with the carvers those functions use.
template <class Backend>
std::size_t select_bytes(Backend be, allocator kind, index_t H, index_t C) {
  std::size_t n = select_topk_workspace_bytes(be, C);
  if (kind == allocator::flattened || kind == allocator::lava || kind == allocator::adakv) {
    workspace q;
    workspace_carver c(q);
    if (kind == allocator::adakv) {
      (void)c.take<std::int32_t>(static_cast<std::size_t>(H));
      (void)c.take<unsigned char>(0);  // select_topk_flat's scratch starts 64-byte aligned after the floors
    }
    (void)carve_flat_ws(c, H, C, thread_count(be));
    (void)c.finish("select_bytes");
    n = q.bytes > n ? q.bytes : n;
  }
  return n;
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
