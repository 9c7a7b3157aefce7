// kvevict/budget/adakv.hpp: AdaKV's head budgets (Feng et al. 2024): per layer, the B x H best
// (head, position) entries of all heads jointly, every head first keeping a safeguard floor.
// docs/budget.md.
#pragma once

#include <kvevict/budget/apportion.hpp>
#include <kvevict/select.hpp>

#include <cmath>

namespace kvevict {

enum class adakv_floor : int {
  /// Default. floor(alpha B) tokens per head, protected ones included (they are the head's best):
  /// kvpress's AdaKVPress (n_safe = int(n_kept * alpha) over scores that include the window).
  budget = 0,
  /// W + floor(alpha (B - W)), W = the head's protected tokens: AdaKV's own code, which keeps the
  /// window outside the selection and floors int(alpha (B - window)) of the other tokens.
  evictable = 1,
};

struct adakv_options {
  /// Safeguard fraction, in [0, 1]. AdaKV and kvpress default to 0.2.
  double alpha = 0.2;
  adakv_floor floor = adakv_floor::budget;
  /// The protection the scores carry (protect() was run with these): checked, and used by
  /// adakv_floor::evictable.
  protection prot;
};

/// The safeguard floor of a head of `length` tokens with `protected_tokens` protected, under budget B:
/// budget:    floor(alpha B + 1e-9)
/// evictable: protected_tokens + floor(alpha (B - protected_tokens) + 1e-9)
/// capped at min(B, length). The 1e-9 makes a product that is an integer in decimal (0.3 x 10)
/// count as that integer despite binary representation error; AdaKV's and kvpress's int() have no
/// such guard (they differ only when alpha B is within 1e-9 below an integer). Never fails; the
/// caller validates alpha.
inline index_t adakv_head_floor(index_t budget, index_t length, index_t protected_tokens, double alpha,
                                adakv_floor rule) {
  const index_t base = rule == adakv_floor::evictable ? protected_tokens : 0;
  const index_t rest = budget - base < 0 ? 0 : budget - base;
  index_t f = base + static_cast<index_t>(std::floor(alpha * static_cast<double>(rest) + 1e-9));
  if (f > budget) f = budget;
  if (f > length) f = length;
  return f < 0 ? 0 : f;
}

namespace detail {

/// Checks the post-condition of protect(prot) on row r: protected positions hold +inf, the others
/// do not (with no protection declared nothing is checked).
inline status check_protected_scores(const char* fn, const matrix_view<const float>& scores, index_t r, index_t len,
                                     const protection& p) {
  if (p.n_sink == 0 && p.n_recent == 0) return {};
  const index_t sink_end = p.n_sink < len ? p.n_sink : len;
  const index_t recent_begin = p.n_recent < len ? len - p.n_recent : 0;
  const float inf = bits_float(0x7f800000u);
  for (index_t t = 0; t < len; ++t) {
    const float v = scores(r, t);
    const bool prot = t < sink_end || t >= recent_begin;
    if (prot && !(v == inf))
      return status::error(errc::invalid_argument,
                           "%s: scores[%lld][%lld] = %g at a protected position (n_sink %lld, n_recent %lld) is not "
                           "+inf: run protect() on the scores first",
                           fn, static_cast<long long>(r), static_cast<long long>(t), static_cast<double>(v),
                           static_cast<long long>(p.n_sink), static_cast<long long>(p.n_recent));
    if (!prot && v == inf)
      return status::error(errc::invalid_argument,
                           "%s: scores[%lld][%lld] is +inf outside the protected positions (it would compete with "
                           "them): run protect() on the scores first",
                           fn, static_cast<long long>(r), static_cast<long long>(t));
  }
  return {};
}

inline byte_range ws_range(const workspace& ws) {
  if (ws.data == nullptr || ws.bytes == 0) return {};
  const auto b = reinterpret_cast<std::uintptr_t>(ws.data);
  return {b, b + ws.bytes};
}

/// adakv_budgets' workspace layout: H int32 floors, then select_topk_flat's workspace of
/// `select_bytes` (its own size query), both carved at aligned addresses; returns the latter.
inline workspace carve_adakv_ws(workspace_carver& c, index_t heads, std::size_t select_bytes,
                                std::int32_t*& floors) noexcept {
  floors = c.take<std::int32_t>(static_cast<std::size_t>(heads > 0 ? heads : 0));
  return workspace{c.take<unsigned char>(select_bytes), select_bytes};
}

}  // namespace detail

/// Workspace bytes adakv_budgets needs on backend `be` for scores [heads][columns]: what its size
/// query reports, without views (H int32 floors, then select_topk_flat's workspace).
template <class Backend>
std::size_t adakv_budgets_workspace_bytes(Backend be, index_t heads, index_t columns) {
  workspace q;
  detail::workspace_carver c(q);
  std::int32_t* floors = nullptr;
  (void)detail::carve_adakv_ws(c, heads, select_topk_flat_workspace_bytes(be, heads, columns), floors);
  (void)c.finish("adakv_budgets_workspace_bytes");
  return q.bytes;
}

/// AdaKV for one layer: scores [H][T] (one row per KV head, protected with protect(opt.prot);
/// row h's candidates are its first lengths[h] columns, all T when lengths is null), per-head
/// budget B: the layer keeps exactly B x H tokens. Head h first keeps its own best
/// adakv_head_floor(B, len_h, protected_count(len_h, prot), alpha, opt.floor) tokens, then the
/// remaining entries of the layer compete jointly (ties: lower head, then lower position) —
/// select_topk_flat. Outputs: kept_cu[H + 1] offsets of the per-head counts (count_h = kept_cu[h+1]
/// - kept_cu[h] is head h's budget; kept_cu[H] = B H), and, when kept_pos is not null, head h's
/// kept positions ascending at kept_pos[kept_cu[h] ..] (room for B H positions): {kept_pos, kept_cu,
/// H} is a ragged_positions for compact(). Each head's kept set is its own top-count_h.
///
/// Workspace (two-phase; a query checks views and pointers only): H int32 floors, then
/// select_topk_flat's workspace for [H][T] (docs/select.md).
/// Errors (nothing written): invalid scores view; no heads; budget negative, below a head's
/// protected tokens, or with B x H above the prompt (the sum of the lengths) or INT32_MAX; alpha
/// NaN or outside [0, 1]; unknown floor rule; negative n_sink/n_recent; lengths outside [0, T];
/// scores not protected (a protected position not +inf, or +inf elsewhere); kept_cu null; outputs
/// overlapping the inputs, each other or the workspace; workspace too small.
namespace detail {

/// adakv_budgets' checks of everything but the scores' values and the lengths.
inline status check_adakv_args(const char* fn, const matrix_view<const float>& scores, const std::int32_t* kept_cu,
                               index_t budget, const adakv_options& opt) {
  KVEVICT_TRY(check_select_scores(fn, scores));
  const index_t H = scores.extent(0);
  if (H <= 0)
    return status::error(errc::invalid_argument, "%s: scores has %lld heads (at least 1 needed)", fn,
                         static_cast<long long>(H));
  if (kept_cu == nullptr) return status::error(errc::null_pointer, "%s: kept_cu is null", fn);
  KVEVICT_TRY(check_protection(fn, opt.prot));
  if (!(opt.alpha >= 0.0 && opt.alpha <= 1.0))
    return status::error(errc::invalid_argument, "%s: alpha = %g is outside [0, 1]", fn, opt.alpha);
  if (opt.floor != adakv_floor::budget && opt.floor != adakv_floor::evictable)
    return status::error(errc::invalid_argument, "%s: unknown adakv_floor value %d", fn, static_cast<int>(opt.floor));
  if (budget < 0)
    return status::error(errc::invalid_argument, "%s: budget %lld is negative", fn, static_cast<long long>(budget));
  return {};
}

/// The workspace must not overlap scores, lengths or kept_cu.
inline status check_adakv_ws(const char* fn, const workspace& ws, const matrix_view<const float>& scores,
                             const std::int32_t* lengths, const std::int32_t* kept_cu) {
  const index_t H = scores.extent(0);
  const byte_range wr = ws_range(ws);
  if (wr.intersects(range_of(scores))) return select_overlap(fn, "the workspace", "scores");
  if (wr.intersects(array_range(lengths, H, sizeof(std::int32_t)))) return select_overlap(fn, "the workspace", "lengths");
  if (wr.intersects(array_range(kept_cu, H + 1, sizeof(std::int32_t))))
    return select_overlap(fn, "the workspace", "kept_cu");
  return {};
}

/// Per head: lengths in [0, T], budget >= the head's protected tokens; *sum_len = sum of the lengths.
inline status check_adakv_heads(const char* fn, const matrix_view<const float>& scores, const std::int32_t* lengths,
                                index_t budget, const protection& prot, index_t* sum_len) {
  const index_t H = scores.extent(0), T = scores.extent(1);
  KVEVICT_TRY(check_row_lengths(fn, lengths, H, T));
  const lengths_of len{lengths, T};
  *sum_len = 0;
  for (index_t h = 0; h < H; ++h) {
    *sum_len += len(h);
    const index_t W = protected_count(len(h), prot.n_sink, prot.n_recent);
    if (budget < W)
      return status::error(errc::invalid_argument,
                           "%s: budget %lld is below the %lld protected tokens of head %lld (n_sink %lld + n_recent "
                           "%lld of %lld tokens)",
                           fn, static_cast<long long>(budget), static_cast<long long>(W), static_cast<long long>(h),
                           static_cast<long long>(prot.n_sink), static_cast<long long>(prot.n_recent),
                           static_cast<long long>(len(h)));
  }
  return {};
}

/// The layer keeps budget x heads tokens: at most the sum of its lengths and INT32_MAX.
inline status check_adakv_total(const char* fn, index_t budget, index_t heads, index_t sum_len) {
  if (budget > sum_len / heads)
    return status::error(errc::invalid_argument,
                         "%s: budget %lld x %lld heads is above the prompt (%lld tokens in the layer)", fn,
                         static_cast<long long>(budget), static_cast<long long>(heads), static_cast<long long>(sum_len));
  if (budget * heads > INT32_MAX)
    return status::error(errc::invalid_argument, "%s: budget %lld x %lld heads is above %d (int32 offsets)", fn,
                         static_cast<long long>(budget), static_cast<long long>(heads), INT32_MAX);
  return {};
}

/// Protected scores checked, then floors[h] = adakv_head_floor of every head.
inline status adakv_floors(const char* fn, const matrix_view<const float>& scores, const std::int32_t* lengths,
                           index_t budget, const adakv_options& opt, std::int32_t* floors) {
  const lengths_of len{lengths, scores.extent(1)};
  const index_t H = scores.extent(0);
  for (index_t h = 0; h < H; ++h) KVEVICT_TRY(check_protected_scores(fn, scores, h, len(h), opt.prot));
  for (index_t h = 0; h < H; ++h)
    floors[h] = static_cast<std::int32_t>(adakv_head_floor(
        budget, len(h), protected_count(len(h), opt.prot.n_sink, opt.prot.n_recent), opt.alpha, opt.floor));
  return {};
}

}  // namespace detail

/// AdaKV for one layer: scores [H][T] (one row per KV head, protected with protect(opt.prot);
/// row h's candidates are its first lengths[h] columns, all T when lengths is null), per-head
/// budget B: the layer keeps exactly B x H tokens. Head h first keeps its own best
/// adakv_head_floor(B, len_h, protected_count(len_h, prot), alpha, opt.floor) tokens, then the
/// remaining entries of the layer compete jointly (ties: lower head, then lower position) —
/// select_topk_flat. Outputs: kept_cu[H + 1] offsets of the per-head counts (count_h = kept_cu[h+1]
/// - kept_cu[h] is head h's budget; kept_cu[H] = B H), and, when kept_pos is not null, head h's
/// kept positions ascending at kept_pos[kept_cu[h] ..] (room for B H positions): {kept_pos, kept_cu,
/// H} is a ragged_positions for compact(). Each head's kept set is its own top-count_h.
///
/// Workspace (two-phase; a query checks views and pointers only): H int32 floors, then
/// select_topk_flat's workspace for [H][T] (docs/select.md).
/// Errors (nothing written): invalid scores view; no heads; budget negative, below a head's
/// protected tokens, or with B x H above the prompt (the sum of the lengths) or INT32_MAX; alpha
/// NaN or outside [0, 1]; unknown floor rule; negative n_sink/n_recent; lengths outside [0, T];
/// scores not protected (a protected position not +inf, or +inf elsewhere); kept_cu null; outputs
/// overlapping the inputs, each other or the workspace; workspace too small.
template <class Backend>
status adakv_budgets(Backend be, workspace& ws, matrix_view<const float> scores, const std::int32_t* lengths,
                     index_t budget, const adakv_options& opt, std::int32_t* kept_cu, pos_t* kept_pos) {
  constexpr const char* fn = "adakv_budgets";
  KVEVICT_TRY(detail::check_adakv_args(fn, scores, kept_cu, budget, opt));
  const index_t H = scores.extent(0);
  // the floors go first in the workspace, select_topk_flat's scratch (its own query's size) after them
  workspace query;
  const index_t total_q = budget > INT32_MAX / H ? 0 : budget * H;  // range checked below
  KVEVICT_TRY(select_topk_flat(be, query, scores, lengths, total_q, nullptr, kept_cu, kept_pos));
  detail::workspace_carver carver(ws);
  std::int32_t* floors = nullptr;
  workspace sel = detail::carve_adakv_ws(carver, H, query.bytes, floors);
  KVEVICT_TRY(carver.finish(fn));
  if (ws.is_query()) return {};
  KVEVICT_TRY(detail::check_adakv_ws(fn, ws, scores, lengths, kept_cu));
  index_t sum_len = 0;
  KVEVICT_TRY(detail::check_adakv_heads(fn, scores, lengths, budget, opt.prot, &sum_len));
  KVEVICT_TRY(detail::check_adakv_total(fn, budget, H, sum_len));
  if (detail::ws_range(ws).intersects(detail::array_range(kept_pos, budget * H, sizeof(pos_t))))
    return detail::select_overlap(fn, "the workspace", "kept_pos");
  KVEVICT_TRY(detail::adakv_floors(fn, scores, lengths, budget, opt, floors));
  return select_topk_flat(be, sel, scores, lengths, budget * H, floors, kept_cu, kept_pos);
}

}  // namespace kvevict
