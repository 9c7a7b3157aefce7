// kvevict/metrics/footprint.hpp: KV footprint and peak KV of an eviction schedule, and the
// critical footprint of a performance-vs-footprint curve ("Cache Me If You Can", §2.1, App. A).
//
// An eviction schedule describes one sequence of N tokens (prompt + decode) for every
// (layer, KV head): evicted_at[layer][head][j] is the number of tokens processed (queries run)
// when key j was removed from memory, or `never_evicted` (or N) if it stays to the end. Key j is
// created while token j is processed, so it is resident for the queries i with
//     j <= i < evicted_at[j],        and j + 1 <= evicted_at[j] <= N is required.
//
//   make_eviction_recorder(buf, L, H, capacity)   a driver-side recorder over the caller's buffer
//     .mark_evicted(layer, head, positions, n, step) / .retain_only(layer, head, kept, n, step)
//     .set_full / .set_streaming / .set_post_fill    from-scratch schedules of one (layer, head)
//     .schedule(N)                                  the first N positions, for the metrics
//   measure_kv_usage(ws, schedule, usage[, layer[, head]])
//       usage.footprint() = Σ_i #resident(i) / Σ_i (i+1)        (KV footprint)
//       usage.peak_kv()   = max_i #resident(i) / N              (peak KV)
//   critical_footprint(points, n, full_performance, result[, options])
//
// Metrics are evaluation tools, not hot-path stages: they run on the calling thread, their only
// scratch comes through a kvevict::workspace, and every count is an exact 64-bit integer.
#pragma once

#include <kvevict/config.hpp>
#include <kvevict/detail/base/checks.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>
#include <kvevict/workspace.hpp>

#include <cmath>
#include <cstdint>
#include <limits>

namespace kvevict {

/// evicted_at value of a key that stays in memory until the end of the sequence (N means the same).
inline constexpr pos_t never_evicted = std::numeric_limits<pos_t>::max();

/// evicted_at[layer][kv_head][position] of one sequence; N = extent(2).
using eviction_schedule = strided_view<const pos_t, 3>;

namespace detail {

inline status check_layer_head(const char* fn, index_t layer, index_t head, index_t layers, index_t heads) {
  if (layer < 0 || layer >= layers)
    return status::error(errc::out_of_range, "%s: layer %lld is outside [0, %lld)", fn, static_cast<long long>(layer),
                         static_cast<long long>(layers));
  if (head < 0 || head >= heads)
    return status::error(errc::out_of_range, "%s: head %lld is outside [0, %lld)", fn, static_cast<long long>(head),
                         static_cast<long long>(heads));
  return {};
}

inline status check_schedule_shape(const char* fn, const eviction_schedule& s) {
  KVEVICT_TRY(check_view(fn, "schedule", s));
  if (s.extent(0) == 0 || s.extent(1) == 0)
    return status::error(errc::invalid_argument, "%s: the schedule has no (layer, head) rows (%lld layers x %lld heads)",
                         fn, static_cast<long long>(s.extent(0)), static_cast<long long>(s.extent(1)));
  if (s.extent(2) == 0) return status::error(errc::invalid_argument, "%s: the schedule covers no tokens", fn);
  if (s.extent(2) > static_cast<index_t>(never_evicted) - 1)
    return status::error(errc::invalid_argument, "%s: the schedule covers %lld tokens, more than positions can hold", fn,
                         static_cast<long long>(s.extent(2)));
  return {};
}

/// evicted_at must be never_evicted or in [j+1, N].
inline status check_evicted_at(const char* fn, pos_t e, index_t layer, index_t head, index_t j, index_t tokens) {
  if (e == never_evicted || (e > j && e <= tokens)) return {};
  if (e <= j)
    return status::error(errc::out_of_range,
                         "%s: evicted_at[%lld][%lld][%lld] = %d is before the key was created (it must be > %lld)", fn,
                         static_cast<long long>(layer), static_cast<long long>(head), static_cast<long long>(j), e,
                         static_cast<long long>(j));
  return status::error(errc::out_of_range,
                       "%s: evicted_at[%lld][%lld][%lld] = %d is past the end of the sequence (%lld tokens; use %lld "
                       "or never_evicted for a key kept to the end)",
                       fn, static_cast<long long>(layer), static_cast<long long>(head), static_cast<long long>(j), e,
                       static_cast<long long>(tokens), static_cast<long long>(tokens));
}

}  // namespace detail

/// KV usage of a set of (layer, KV head) rows of a schedule. Counts are exact; the ratios are the
/// paper's metrics. For several rows, `resident` and `peak` add the rows up at each query position
/// (memory in use at that time), so footprint() is the mean of the rows' footprints (they share one
/// denominator) while peak_kv() is the peak of the total, not the mean of per-row peaks.
struct kv_usage {
  index_t tokens = 0;          ///< N, the sequence length
  index_t rows = 0;            ///< number of (layer, KV head) rows aggregated
  std::int64_t resident = 0;   ///< Σ_rows Σ_{i<N} #{keys resident at query i}
  std::int64_t full = 0;       ///< the same for full causal attention: rows · N(N+1)/2
  std::int64_t peak = 0;       ///< max_i Σ_rows #{keys resident at query i}
  index_t peak_query = 0;      ///< the first query position where `peak` is reached

  /// KV footprint ("Cache Me If You Can" §2.1): resident / full, in [0, 1] (1 = full attention).
  double footprint() const noexcept { return full > 0 ? static_cast<double>(resident) / static_cast<double>(full) : 0.0; }
  /// Peak KV (appendix A): peak / (rows · N), the peak normalised to the sequence length, in [0, 1].
  double peak_kv() const noexcept {
    return rows > 0 && tokens > 0 ? static_cast<double>(peak) / (static_cast<double>(rows) * static_cast<double>(tokens))
                                  : 0.0;
  }
};

namespace detail {

inline status measure_rows(const char* fn, workspace& ws, const eviction_schedule& s, index_t l0, index_t l1,
                           index_t h0, index_t h1, kv_usage& out) {
  const index_t n = s.extent(2);
  workspace_carver carver(ws);
  std::int64_t* ends = carver.take<std::int64_t>(static_cast<std::size_t>(n));
  KVEVICT_TRY(carver.finish(fn));
  const byte_range touched[] = {range_of(s)};
  KVEVICT_TRY(carver.check_disjoint(fn, touched, {"the schedule"}));
  if (ws.is_query()) return {};
  for (index_t l = l0; l < l1; ++l)
    for (index_t h = h0; h < h1; ++h)
      for (index_t j = 0; j < n; ++j) KVEVICT_TRY(check_evicted_at(fn, s(l, h, j), l, h, j, n));

  const index_t rows = (l1 - l0) * (h1 - h0);
  index_t full = 0;  // n(n+1)/2 < 2^61 because n < 2^31
  if (!checked_mul(rows, n * (n + 1) / 2, full))
    return status::error(errc::size_overflow, "%s: %lld rows x %lld tokens overflow a 64-bit entry count", fn,
                         static_cast<long long>(rows), static_cast<long long>(n));
  // ends[t] = keys removed after t tokens were processed (t < n; later removals never matter)
  for (index_t t = 0; t < n; ++t) ends[t] = 0;
  std::int64_t resident = 0;
  for (index_t l = l0; l < l1; ++l)
    for (index_t h = h0; h < h1; ++h)
      for (index_t j = 0; j < n; ++j) {
        const pos_t e = s(l, h, j);
        const index_t end = e == never_evicted || e >= n ? n : static_cast<index_t>(e);
        resident += end - j;  // resident for queries j .. end-1
        if (end < n) ++ends[end];
      }
  // resident keys at query i: every row created keys 0..i, minus those removed at steps <= i
  std::int64_t removed = 0, peak = -1;
  index_t peak_query = 0;
  for (index_t i = 0; i < n; ++i) {
    removed += ends[i];
    const std::int64_t now = rows * (i + 1) - removed;
    if (now > peak) {
      peak = now;
      peak_query = i;
    }
  }
  out.tokens = n;
  out.rows = rows;
  out.resident = resident;
  out.full = full;
  out.peak = peak;
  out.peak_query = peak_query;
  return {};
}

}  // namespace detail

/// KV footprint and peak KV of the whole schedule (all layers and KV heads).
/// Workspace: N int64 counters (two-phase: a query only sets ws.bytes). `usage` is written only on
/// success. Errors: invalid view, no rows or no tokens, evicted_at[l][h][j] <= j ("before the key
/// was created") or > N other than never_evicted ("past the end"), workspace too small.
/// Cost: O(L·H·N) time.
inline status measure_kv_usage(workspace& ws, eviction_schedule schedule, kv_usage& usage) {
  constexpr const char* fn = "measure_kv_usage";
  KVEVICT_TRY(detail::check_schedule_shape(fn, schedule));
  return detail::measure_rows(fn, ws, schedule, 0, schedule.extent(0), 0, schedule.extent(1), usage);
}

/// The same for one layer (all its KV heads). Extra error: layer out of range.
inline status measure_kv_usage(workspace& ws, eviction_schedule schedule, index_t layer, kv_usage& usage) {
  constexpr const char* fn = "measure_kv_usage";
  KVEVICT_TRY(detail::check_schedule_shape(fn, schedule));
  KVEVICT_TRY(detail::check_layer_head(fn, layer, 0, schedule.extent(0), schedule.extent(1)));
  return detail::measure_rows(fn, ws, schedule, layer, layer + 1, 0, schedule.extent(1), usage);
}

/// The same for one (layer, KV head). Extra errors: layer or head out of range.
inline status measure_kv_usage(workspace& ws, eviction_schedule schedule, index_t layer, index_t head,
                               kv_usage& usage) {
  constexpr const char* fn = "measure_kv_usage";
  KVEVICT_TRY(detail::check_schedule_shape(fn, schedule));
  KVEVICT_TRY(detail::check_layer_head(fn, layer, head, schedule.extent(0), schedule.extent(1)));
  return detail::measure_rows(fn, ws, schedule, layer, layer + 1, head, head + 1, usage);
}

/// Records an eviction schedule while a driver runs, in a buffer the caller owns
/// ([layers][heads][capacity] int32). Every entry starts as never_evicted; `step` arguments count
/// the tokens processed so far (after a prefill chunk ending at token c, step = c; after decoding
/// token t, step = t + 1). Positions are original token positions, not rows of a compacted cache.
/// Each update checks everything before it writes anything. Not thread-safe.
class eviction_recorder {
 public:
  eviction_recorder() = default;

  index_t layers() const noexcept { return at_.extent(0); }
  index_t heads() const noexcept { return at_.extent(1); }
  index_t capacity() const noexcept { return at_.extent(2); }
  /// The raw evicted_at entries, [layer][head][position] over the whole capacity.
  strided_view<pos_t, 3> storage() const noexcept { return at_; }

  /// The schedule of the first `tokens` positions (what measure_kv_usage takes).
  /// Error: tokens outside [1, capacity].
  result<eviction_schedule> schedule(index_t tokens) const {
    if (tokens < 1 || tokens > capacity())
      return status::error(errc::out_of_range, "eviction_recorder::schedule: %lld tokens is outside [1, %lld]",
                           static_cast<long long>(tokens), static_cast<long long>(capacity()));
    const index_t ext[3] = {layers(), heads(), tokens};
    const index_t str[3] = {at_.stride(0), at_.stride(1), at_.stride(2)};
    return detail::make_strided<const pos_t, 3>("eviction_recorder::schedule", at_.data_handle(), ext, str);
  }

  /// Key positions[0..count) of (layer, head) leave memory after `step` tokens were processed.
  /// Marking a key again at the same step is harmless (duplicates allowed). Errors: layer/head out
  /// of range, step outside [1, capacity], a position outside [0, step) (not created yet), a key
  /// already evicted at another step, null positions with count > 0, negative count.
  status mark_evicted(index_t layer, index_t head, const pos_t* positions, index_t count, index_t step) {
    constexpr const char* fn = "eviction_recorder::mark_evicted";
    if (positions == nullptr && count > 0) return null_list(fn, count);
    KVEVICT_TRY(check_update(fn, layer, head, positions, count, step));
    for (index_t i = 0; i < count; ++i) KVEVICT_TRY(check_evictable(fn, layer, head, positions[i], step));
    for (index_t i = 0; i < count; ++i) at_(layer, head, positions[i]) = static_cast<pos_t>(step);
    return {};
  }

  /// The same for every head of a layer: head h evicts evicted.pos[evicted.cu[h] .. evicted.cu[h+1]).
  /// Extra errors: evicted.heads != heads(), bad offsets.
  status mark_evicted(index_t layer, ragged_positions evicted, index_t step) {
    constexpr const char* fn = "eviction_recorder::mark_evicted";
    KVEVICT_TRY(check_ragged(fn, layer, evicted));
    for (index_t h = 0; h < heads(); ++h) {
      const pos_t* p = evicted.pos + evicted.cu[h];
      KVEVICT_TRY(check_update(fn, layer, h, p, evicted.length(h), step));
      for (index_t i = 0; i < evicted.length(h); ++i) KVEVICT_TRY(check_evictable(fn, layer, h, p[i], step));
    }
    for (index_t h = 0; h < heads(); ++h)
      for (index_t i = evicted.cu[h]; i < evicted.cu[h + 1]; ++i) at_(layer, h, evicted.pos[i]) = static_cast<pos_t>(step);
    return {};
  }

  /// After `step` tokens, (layer, head) keeps exactly kept[0..count) among its resident keys: every
  /// other key created so far (position < step) and still resident is evicted at `step`. This is
  /// what a select stage returns (strictly ascending), mapped back to original positions.
  /// Errors: as mark_evicted, plus kept not strictly ascending, a kept key that is not resident.
  status retain_only(index_t layer, index_t head, const pos_t* kept, index_t count, index_t step) {
    constexpr const char* fn = "eviction_recorder::retain_only";
    if (kept == nullptr && count > 0) return null_list(fn, count);
    KVEVICT_TRY(check_update(fn, layer, head, kept, count, step));
    KVEVICT_TRY(check_retained(fn, layer, head, list{kept}, count, step));
    apply_retain(layer, head, list{kept}, count, step);
    return {};
  }

  /// The same for every head of a layer from a ragged kept list (kept.heads == heads()).
  status retain_only(index_t layer, ragged_positions kept, index_t step) {
    constexpr const char* fn = "eviction_recorder::retain_only";
    KVEVICT_TRY(check_ragged(fn, layer, kept));
    for (index_t h = 0; h < heads(); ++h) {
      KVEVICT_TRY(check_update(fn, layer, h, kept.pos + kept.cu[h], kept.length(h), step));
      KVEVICT_TRY(check_retained(fn, layer, h, list{kept.pos + kept.cu[h]}, kept.length(h), step));
    }
    for (index_t h = 0; h < heads(); ++h) apply_retain(layer, h, list{kept.pos + kept.cu[h]}, kept.length(h), step);
    return {};
  }

  /// The same from a dense [heads][k] kept matrix (what select returns for a uniform budget).
  status retain_only(index_t layer, matrix_view<const pos_t> kept, index_t step) {
    constexpr const char* fn = "eviction_recorder::retain_only";
    KVEVICT_TRY(detail::check_view(fn, "kept", kept));
    KVEVICT_TRY(detail::check_layer_head(fn, layer, 0, layers(), heads()));
    if (kept.extent(0) != heads())
      return status::error(errc::shape_mismatch, "%s: kept has %lld heads, the recorder %lld", fn,
                           static_cast<long long>(kept.extent(0)), static_cast<long long>(heads()));
    const index_t k = kept.extent(1);
    for (index_t h = 0; h < heads(); ++h) {
      KVEVICT_TRY(check_update(fn, layer, h, kept.data_handle(), k, step));
      KVEVICT_TRY(check_retained(fn, layer, h, [&](index_t i) { return kept(h, i); }, k, step));
    }
    for (index_t h = 0; h < heads(); ++h) apply_retain(layer, h, [&](index_t i) { return kept(h, i); }, k, step);
    return {};
  }

  /// Full attention for (layer, head): nothing is ever evicted.
  status set_full(index_t layer, index_t head) {
    KVEVICT_TRY(detail::check_layer_head("eviction_recorder::set_full", layer, head, layers(), heads()));
    for (index_t j = 0; j < capacity(); ++j) at_(layer, head, j) = never_evicted;
    return {};
  }

  /// StreamingLLM for (layer, head) over a sequence of `tokens` tokens: the first n_sink keys are
  /// never evicted; every other key j is evicted as it leaves the recent window of `recent` keys
  /// (the current one included), i.e. evicted_at[j] = j + recent (never_evicted when that is >= tokens).
  /// Query i then sees min(i+1, n_sink + recent) keys. Positions >= tokens are reset to never_evicted.
  /// Errors: layer/head out of range, tokens outside [1, capacity], n_sink < 0, recent < 1.
  status set_streaming(index_t layer, index_t head, index_t tokens, index_t n_sink, index_t recent) {
    constexpr const char* fn = "eviction_recorder::set_streaming";
    KVEVICT_TRY(detail::check_layer_head(fn, layer, head, layers(), heads()));
    KVEVICT_TRY(check_tokens(fn, tokens));
    if (n_sink < 0)
      return status::error(errc::invalid_argument, "%s: n_sink must be >= 0 (got %lld)", fn, static_cast<long long>(n_sink));
    if (recent < 1)
      return status::error(errc::invalid_argument, "%s: recent must be >= 1: the current key is always visible (got %lld)",
                           fn, static_cast<long long>(recent));
    for (index_t j = 0; j < capacity(); ++j) {
      const bool evicts = j >= n_sink && j < tokens && recent < tokens - j;  // j + recent < tokens, no overflow
      at_(layer, head, j) = evicts ? static_cast<pos_t>(j + recent) : never_evicted;
    }
    return {};
  }

  /// Post-fill eviction for (layer, head): the whole prompt [0, prompt) is resident during the
  /// prefill, then only kept[0..count) (strictly ascending, < prompt) survive it: the other prompt
  /// keys get evicted_at = prompt. Decode keys (positions >= prompt) are never evicted.
  /// Errors: layer/head out of range, prompt outside [1, capacity], kept not ascending or >= prompt.
  status set_post_fill(index_t layer, index_t head, index_t prompt, const pos_t* kept, index_t count) {
    constexpr const char* fn = "eviction_recorder::set_post_fill";
    if (kept == nullptr && count > 0) return null_list(fn, count);
    KVEVICT_TRY(detail::check_layer_head(fn, layer, head, layers(), heads()));
    KVEVICT_TRY(check_tokens(fn, prompt));
    KVEVICT_TRY(check_list(fn, kept, count));
    for (index_t i = 0; i < count; ++i) {
      KVEVICT_TRY(check_created(fn, layer, head, kept[i], prompt));
      if (i > 0 && kept[i] <= kept[i - 1])
        return status::error(errc::not_sorted, "%s: kept positions must be strictly ascending; %d follows %d", fn, kept[i],
                             kept[i - 1]);
    }
    for (index_t j = 0; j < capacity(); ++j) at_(layer, head, j) = never_evicted;
    apply_retain(layer, head, list{kept}, count, prompt);
    return {};
  }

 private:
  friend result<eviction_recorder> make_eviction_recorder(strided_view<pos_t, 3> storage);
  explicit eviction_recorder(strided_view<pos_t, 3> at) : at_(at) {}

  status check_tokens(const char* fn, index_t tokens) const {
    if (tokens < 1 || tokens > capacity())
      return status::error(errc::out_of_range, "%s: %lld tokens is outside [1, %lld] (the capacity)", fn,
                           static_cast<long long>(tokens), static_cast<long long>(capacity()));
    return {};
  }
  static status null_list(const char* fn, index_t count) {
    return status::error(errc::null_pointer, "%s: positions are null but %lld are listed", fn,
                         static_cast<long long>(count));
  }
  static status check_list(const char* fn, const pos_t* p, index_t count) {
    if (count < 0)
      return status::error(errc::invalid_argument, "%s: negative position count (%lld)", fn, static_cast<long long>(count));
    if (p == nullptr && count > 0) return null_list(fn, count);
    return {};
  }
  status check_update(const char* fn, index_t layer, index_t head, const pos_t* p, index_t count, index_t step) const {
    KVEVICT_TRY(detail::check_layer_head(fn, layer, head, layers(), heads()));
    if (step < 1 || step > capacity())
      return status::error(errc::out_of_range, "%s: step %lld is outside [1, %lld] (the capacity)", fn,
                           static_cast<long long>(step), static_cast<long long>(capacity()));
    return check_list(fn, p, count);
  }
  static status check_created(const char* fn, index_t layer, index_t head, pos_t p, index_t step) {
    if (p < 0 || p >= step)
      return status::error(errc::out_of_range,
                           "%s: position %d of layer %lld head %lld is outside [0, %lld) (keys created by step %lld)", fn,
                           p, static_cast<long long>(layer), static_cast<long long>(head), static_cast<long long>(step),
                           static_cast<long long>(step));
    return {};
  }
  status check_evictable(const char* fn, index_t layer, index_t head, pos_t p, index_t step) const {
    KVEVICT_TRY(check_created(fn, layer, head, p, step));
    const pos_t e = at_(layer, head, p);
    if (e != never_evicted && e != step)
      return status::error(errc::invalid_argument, "%s: key %d of layer %lld head %lld was already evicted at step %d", fn,
                           p, static_cast<long long>(layer), static_cast<long long>(head), e);
    return {};
  }
  // position lists are read through accessors so dense strided rows need no copy
  struct list {
    const pos_t* p;
    pos_t operator()(index_t i) const { return p[i]; }
  };
  template <class Get>
  status check_retained(const char* fn, index_t layer, index_t head, Get kept, index_t count, index_t step) const {
    for (index_t i = 0; i < count; ++i) {
      const pos_t p = kept(i);
      KVEVICT_TRY(check_created(fn, layer, head, p, step));
      if (i > 0 && p <= kept(i - 1))
        return status::error(errc::not_sorted, "%s: kept positions must be strictly ascending; head %lld has %d after %d",
                             fn, static_cast<long long>(head), p, kept(i - 1));
      const pos_t e = at_(layer, head, p);
      if (e != never_evicted)
        return status::error(errc::invalid_argument,
                             "%s: kept key %d of layer %lld head %lld is not resident (evicted at step %d)", fn, p,
                             static_cast<long long>(layer), static_cast<long long>(head), e);
    }
    return {};
  }
  status check_ragged(const char* fn, index_t layer, const ragged_positions& r) const {
    KVEVICT_TRY(detail::check_layer_head(fn, layer, 0, layers(), heads()));
    if (r.heads != heads())
      return status::error(errc::shape_mismatch, "%s: the position lists have %lld heads, the recorder %lld", fn,
                           static_cast<long long>(r.heads), static_cast<long long>(heads()));
    KVEVICT_TRY(detail::check_offsets(fn, "positions.cu", r.cu, r.heads));
    if (r.pos == nullptr && r.total() > 0)
      return status::error(errc::null_pointer, "%s: positions are null but %lld are listed", fn,
                           static_cast<long long>(r.total()));
    return {};
  }
  // every resident key below `step` that is not in the ascending list `kept` is evicted at `step`
  template <class Get>
  void apply_retain(index_t layer, index_t head, Get kept, index_t count, index_t step) {
    index_t i = 0;
    for (index_t j = 0; j < step; ++j) {
      if (i < count && kept(i) == j) {
        ++i;
        continue;
      }
      pos_t& e = at_(layer, head, j);
      if (e == never_evicted) e = static_cast<pos_t>(step);
    }
  }

  strided_view<pos_t, 3> at_{};
};

/// A recorder over any strided [layers][heads][capacity] int32 buffer; sets every entry to
/// never_evicted. Errors: invalid view, a zero extent, capacity >= 2^31 - 1.
inline result<eviction_recorder> make_eviction_recorder(strided_view<pos_t, 3> storage) {
  constexpr const char* fn = "make_eviction_recorder";
  KVEVICT_TRY(detail::check_view(fn, "storage", storage));
  if (storage.extent(0) == 0 || storage.extent(1) == 0 || storage.extent(2) == 0)
    return status::error(errc::invalid_argument, "%s: layers, heads and capacity must be positive (%lld, %lld, %lld)", fn,
                         static_cast<long long>(storage.extent(0)), static_cast<long long>(storage.extent(1)),
                         static_cast<long long>(storage.extent(2)));
  if (storage.extent(2) > static_cast<index_t>(never_evicted) - 1)
    return status::error(errc::invalid_argument, "%s: capacity %lld does not fit in a position", fn,
                         static_cast<long long>(storage.extent(2)));
  for (index_t l = 0; l < storage.extent(0); ++l)
    for (index_t h = 0; h < storage.extent(1); ++h)
      for (index_t j = 0; j < storage.extent(2); ++j) storage(l, h, j) = never_evicted;
  return eviction_recorder(storage);
}

/// A recorder over a contiguous buffer of layers·heads·capacity int32 (layer-major, then head).
inline result<eviction_recorder> make_eviction_recorder(pos_t* data, index_t layers, index_t heads, index_t capacity) {
  index_t hc = 0, lhc = 0;
  if (!detail::checked_mul(heads, capacity, hc) || !detail::checked_mul(layers, hc, lhc))
    return status::error(errc::invalid_argument, "make_eviction_recorder: bad sizes (%lld layers, %lld heads, %lld tokens)",
                         static_cast<long long>(layers), static_cast<long long>(heads), static_cast<long long>(capacity));
  const index_t ext[3] = {layers, heads, capacity};
  const index_t str[3] = {hc > 0 ? hc : 1, capacity > 0 ? capacity : 1, 1};
  auto v = detail::make_strided<pos_t, 3>("make_eviction_recorder", data, ext, str);
  if (!v) return v.error();
  return make_eviction_recorder(*v);
}

// ------------------------------------------------------------------------------------------------
// Critical footprint
// ------------------------------------------------------------------------------------------------

/// One measured configuration: its KV footprint (any unit: fraction or percent, used as given)
/// and its task performance (higher = better).
struct curve_point {
  double footprint = 0;
  double performance = 0;
};

/// Which crossing of the threshold F·p_full defines the critical footprint.
enum class crossing_rule {
  /// The smallest footprint at which the interpolated curve reaches the threshold (the paper's
  /// "smallest footprint at which a method retains F of the full performance"). Default.
  first_reach,
  /// The smallest footprint from which the interpolated curve stays at or above the threshold up
  /// to the largest measured footprint (differs from first_reach only on non-monotone curves).
  stays_above,
};

/// How the returned footprint relates to the measured range.
enum class critical_kind {
  interpolated,     ///< between two measured points (or exactly at one reached from below)
  at_or_below_min,  ///< the smallest measured footprint already meets the threshold: the critical
                    ///< footprint is <= the returned (smallest) footprint; the paper prints "< x"
  above_max,        ///< no (final) point meets the threshold: the critical footprint is > the
                    ///< returned (largest) footprint; the paper prints "> x"
};

struct critical_footprint_options {
  double fraction = 0.9;  ///< F in (0, 1]: the performance to retain, relative to full attention
  crossing_rule rule = crossing_rule::first_reach;
};

struct critical_footprint_result {
  double footprint = 0;  ///< the critical footprint (see kind), in the points' unit
  double threshold = 0;  ///< F · full_performance
  critical_kind kind = critical_kind::interpolated;
};

/// Critical KV footprint of a performance-vs-footprint curve, by linear interpolation between
/// neighbouring points (as the footprint paper's Table 2). Points may come in any order; points
/// with equal footprints count as one point with their best performance. With the points sorted by
/// footprint f_0 < ... < f_m (performances p_k) and threshold τ = F·p_full:
///   first_reach: the first k with p_k >= τ; k = 0 -> f_0 (at_or_below_min); none -> f_m
///     (above_max); otherwise f_{k-1} + (τ - p_{k-1}) (f_k - f_{k-1}) / (p_k - p_{k-1}).
///   stays_above: the last k with p_k < τ; k = m -> f_m (above_max); none -> f_0
///     (at_or_below_min); otherwise interpolate between k and k+1 the same way.
/// Errors: n < 1, null points, a non-finite or negative footprint, a non-finite performance,
/// full_performance not finite and > 0, fraction outside (0, 1], unknown rule.
/// Cost: O(n) for first_reach, O(n²) worst case for stays_above (curves have tens of points);
/// no allocation.
inline status critical_footprint(const curve_point* points, index_t n, double full_performance,
                                 critical_footprint_result& out, critical_footprint_options opt = {}) {
  constexpr const char* fn = "critical_footprint";
  if (n < 1) return status::error(errc::invalid_argument, "%s: the curve is empty", fn);
  if (points == nullptr) return status::error(errc::null_pointer, "%s: points are null but n = %lld", fn, static_cast<long long>(n));
  if (!std::isfinite(full_performance) || full_performance <= 0)
    return status::error(errc::invalid_argument, "%s: full_performance must be finite and > 0 (got %g)", fn,
                         full_performance);
  if (!(opt.fraction > 0 && opt.fraction <= 1))
    return status::error(errc::invalid_argument, "%s: fraction must be in (0, 1] (got %g)", fn, opt.fraction);
  if (opt.rule != crossing_rule::first_reach && opt.rule != crossing_rule::stays_above)
    return status::error(errc::invalid_argument, "%s: unknown crossing rule %d", fn, static_cast<int>(opt.rule));
  for (index_t i = 0; i < n; ++i) {
    if (!std::isfinite(points[i].footprint) || points[i].footprint < 0)
      return status::error(errc::invalid_argument, "%s: points[%lld].footprint = %g is not a finite, non-negative number",
                           fn, static_cast<long long>(i), points[i].footprint);
    if (!std::isfinite(points[i].performance))
      return status::error(errc::invalid_argument, "%s: points[%lld].performance = %g is not finite", fn,
                           static_cast<long long>(i), points[i].performance);
  }
  const double tau = opt.fraction * full_performance;
  constexpr double inf = std::numeric_limits<double>::infinity();
  auto best_at = [&](double f) {  // performance of the merged point at footprint f
    double p = -inf;
    for (index_t i = 0; i < n; ++i)
      if (points[i].footprint == f && points[i].performance > p) p = points[i].performance;
    return p;
  };
  auto interpolate = [&](double f_lo, double f_hi) {
    const double p_lo = best_at(f_lo), p_hi = best_at(f_hi);  // p_lo < tau <= p_hi
    const double t = (tau - p_lo) / (p_hi - p_lo);
    out.footprint = t >= 1 ? f_hi : f_lo + t * (f_hi - f_lo);
    out.kind = critical_kind::interpolated;
  };
  double f_min = inf, f_max = -inf;
  for (index_t i = 0; i < n; ++i) {
    if (points[i].footprint < f_min) f_min = points[i].footprint;
    if (points[i].footprint > f_max) f_max = points[i].footprint;
  }
  out.threshold = tau;
  if (opt.rule == crossing_rule::first_reach) {
    double f_hi = inf;  // the smallest footprint with a point at or above tau
    for (index_t i = 0; i < n; ++i)
      if (points[i].performance >= tau && points[i].footprint < f_hi) f_hi = points[i].footprint;
    if (f_hi == inf) {
      out.footprint = f_max;
      out.kind = critical_kind::above_max;
    } else if (f_hi == f_min) {
      out.footprint = f_min;
      out.kind = critical_kind::at_or_below_min;
    } else {
      double f_lo = -inf;  // its neighbour below (every point there is below tau)
      for (index_t i = 0; i < n; ++i)
        if (points[i].footprint < f_hi && points[i].footprint > f_lo) f_lo = points[i].footprint;
      interpolate(f_lo, f_hi);
    }
    return {};
  }
  if (best_at(f_max) < tau) {
    out.footprint = f_max;
    out.kind = critical_kind::above_max;
    return {};
  }
  double f_bad = -inf;  // the largest footprint whose merged point is below tau
  for (index_t i = 0; i < n; ++i)
    if (points[i].performance < tau && points[i].footprint > f_bad && best_at(points[i].footprint) < tau)
      f_bad = points[i].footprint;
  if (f_bad == -inf) {
    out.footprint = f_min;
    out.kind = critical_kind::at_or_below_min;
    return {};
  }
  double f_next = inf;  // its neighbour above (exists: f_max is not below tau)
  for (index_t i = 0; i < n; ++i)
    if (points[i].footprint > f_bad && points[i].footprint < f_next) f_next = points[i].footprint;
  interpolate(f_bad, f_next);
  return {};
}

}  // namespace kvevict
