// kvevict/distributed.hpp: exact eviction on a sharded model (docs/distributed.md).
//
// Head-sharded (tensor-parallel): rank r of P holds the contiguous KV heads head_shard(H, P, r)
// of every layer (the same count on every rank). The calls below take the rank's rows and a
// communicator (kvevict/comm.hpp) and return, on every rank, exactly what the single-process call
// over all H heads returns for that rank's heads:
//
//   select_topk_flat(be, ws, comm, scores, lengths, total, floors, kept_cu, kept_pos)
//   adakv_budgets(be, ws, comm, scores, lengths, B, opt, kept_cu, kept_pos)
//   lava_layer_entropy(be, ws, comm, scores, lengths, opt, &e)        every rank gets the layer's e
//   cake_layer_stats(be, ws, comm, attention, &stats, var)            every rank gets the layer's stats
//
// Layer-sharded (pipeline-parallel): gather_layer_values(comm, mine, local, L, all) gives every
// stage the per-layer entropies / preferences of all L layers, bit for bit, after which
// lava_layer_budgets / cake_budgets run unchanged on every stage. Uniform and PyramidKV budgets
// need no communication (they depend on the layer and head indices only).
//
// Every call first makes the ranks agree (detail/host/agree.hpp): a rank whose arguments are
// invalid, or whose configuration (budgets, options, rows and columns per rank) differs from the
// others', makes every rank return the same error instead of leaving the others waiting.
// Outputs are written only after that agreement. A failing collective's status is returned as is.
#pragma once

#include <kvevict/budget/adakv.hpp>
#include <kvevict/budget/cake.hpp>
#include <kvevict/budget/lava.hpp>
#include <kvevict/comm.hpp>
#include <kvevict/detail/host/agree.hpp>
#include <kvevict/select.hpp>

#include <algorithm>
#include <cstdint>

namespace kvevict {
namespace detail {

/// select_flat's layer when the rows are spread over the ranks (rank order = row order): the
/// bucket choice sums every rank's per-bucket totals, and the tied keys of the threshold go to the
/// lower ranks first (an exclusive scan), as they go to the lower rows on one process.
template <class Comm>
struct flat_layer_sharded {
  Comm* comm;
  std::int64_t* bucket_sums;  // radix_bins
  index_t global_floors;
  status failure;

  index_t floors(index_t) const noexcept { return global_floors; }

  /// For every bucket b: sum over this rank's rows of max(floor_r, keys above the prefix or in bins
  /// >= b), capped at total (the global sum reaches total exactly when the capped one does); summed
  /// over the ranks; the highest b reaching total, as flat_layer_local's scan finds it.
  template <class FloorOf, class HistOf>
  int choose_bucket(int bins, index_t R, FloorOf floor_of, HistOf hist_of, flat_row* rows, index_t total) noexcept {
    for (index_t r = 0; r < R; ++r) rows[r].upto = rows[r].above;
    for (int b = bins - 1; b >= 0; --b) {
      index_t sum = 0;
      for (index_t r = 0; r < R; ++r) {
        rows[r].upto += hist_of(r)[b];
        sum += std::max(floor_of(r), rows[r].upto);
      }
      bucket_sums[b] = std::min(sum, total);
    }
    failure = comm->allreduce_sum(bucket_sums, bins);
    if (!failure.ok()) return -1;
    int b = bins - 1;
    while (b > 0 && bucket_sums[b] < total) --b;
    for (index_t r = 0; r < R; ++r) {
      index_t upto = rows[r].above;
      for (int i = bins - 1; i >= b; --i) upto += hist_of(r)[i];
      rows[r].upto = upto;
    }
    return b;
  }

  /// The tied keys left for this rank's rows: total minus every rank's base counts minus the tied
  /// keys the lower ranks take.
  index_t tied_share(index_t total, index_t base_sum, index_t tied_sum) noexcept {
    std::int64_t bases = base_sum, mine = tied_sum, below = 0;
    failure = comm->allreduce_sum(&bases, 1);
    if (failure.ok()) failure = comm->exscan_sum(&mine, &below, 1);
    if (!failure.ok()) return -1;
    const index_t left = total - bases - below;
    return left > 0 ? left : 0;
  }
};

/// The scratch of a sharded flattened selection: select_topk_flat's, then the bucket sums.
struct sharded_flat_ws {
  flat_ws flat;
  std::int64_t* bucket_sums = nullptr;
};
inline sharded_flat_ws carve_sharded_flat_ws(workspace_carver& c, index_t rows, index_t columns, int workers) noexcept {
  sharded_flat_ws w;
  w.flat = carve_flat_ws(c, rows, columns, workers);
  w.bucket_sums = c.take<std::int64_t>(radix_bins);
  return w;
}

/// The selection once the ranks agree: `floors_total` = every rank's floors.
template <class Backend, class Comm>
status run_sharded_flat(Backend be, Comm& comm, const matrix_view<const float>& scores, const std::int32_t* lengths,
                        index_t total, const std::int32_t* floors, index_t floors_total, std::int32_t* kept_cu,
                        pos_t* kept_pos, const sharded_flat_ws& ws) {
  flat_layer_sharded<Comm> layer{&comm, ws.bucket_sums, floors_total, {}};
  const lengths_of len{lengths, scores.extent(1)};
  if (!select_flat(be, scores, len, floors_of{floors}, total, kept_cu, kept_pos, ws.flat, layer)) return layer.failure;
  return {};
}

/// Every rank's per-head records (`heads` of them) from the workspace; on a real buffer, after this
/// rank's own checks (st), the workspace must not overlap `input`.
template <class Rec>
Rec* carve_head_records(const char* fn, workspace& ws, index_t heads, const byte_range& input, const char* name,
                        status& st) {
  workspace_carver carver(ws);
  Rec* all = carver.take<Rec>(static_cast<std::size_t>(heads));
  if (st.ok()) st = carver.finish(fn);
  const byte_range inputs[] = {input};
  const char* const names[] = {name};
  if (st.ok() && !ws.is_query()) st = carver.check_disjoint(fn, inputs, names);
  return all;
}

/// Room for the positions this rank keeps: min(total, the sum of its lengths).
inline index_t sharded_room(index_t total, index_t sum_len) noexcept { return total < sum_len ? total : sum_len; }

}  // namespace detail

/// Workspace bytes of the sharded select_topk_flat (with_floors: the sharded adakv_budgets) for
/// `rows` rows of `columns` columns on backend `be`: what their size queries report, without views.
template <class Backend>
std::size_t sharded_flat_workspace_bytes(Backend be, index_t rows, index_t columns, bool with_floors) {
  workspace q;
  detail::workspace_carver carver(q);
  rows = rows < 0 ? 0 : rows;
  if (with_floors) (void)carver.take<std::int32_t>(static_cast<std::size_t>(rows));
  (void)detail::carve_sharded_flat_ws(carver, rows, columns < 0 ? 0 : columns, detail::thread_count(be));
  (void)carver.finish("sharded_flat_workspace_bytes");
  return q.bytes;
}

/// Workspace bytes of the sharded lava_layer_entropy over a layer of `heads` heads (all ranks'):
/// what its size query reports.
inline std::size_t sharded_lava_entropy_workspace_bytes(index_t heads) {
  workspace q;
  detail::workspace_carver carver(q);
  (void)carver.take<detail::lava_head>(static_cast<std::size_t>(heads < 0 ? 0 : heads));
  (void)carver.finish("sharded_lava_entropy_workspace_bytes");
  return q.bytes;
}

/// Head-sharded flattened selection (AdaKV / LAVa across the heads of a layer): `scores` [R][T]
/// holds this rank's R rows (rank r: global rows [r R, (r + 1) R)), `total` and the floors'
/// meaning are the layer's, as in select_topk_flat over all P R rows. kept_cu[R + 1] receives
/// this rank's offsets (kept_cu[R] = what this rank keeps) and kept_pos (room for
/// min(total, sum of this rank's lengths) positions, or null) its rows' kept positions: exactly
/// the single-process call's rows of this rank, ties between ranks going to the lower rank.
/// Workspace: select_topk_flat's for [R][T] plus 16 KiB (query with ws.data == nullptr; a query
/// does not communicate). Communication per call: one agreement (13 integers), three allreduces
/// of 2048, 2048 and 1024 int64 bucket sums (fewer when the floors take the whole total), one
/// allreduce and one exclusive scan of one integer.
/// Errors: select_topk_flat's (rank-local ones reported on every rank as "rank r of P: ..."; total
/// against every rank's lengths and floors); ranks disagreeing on total, R, T or whether floors
/// are given (invalid_argument on every rank).
template <class Backend, class Comm>
status select_topk_flat(Backend be, workspace& ws, Comm& comm, matrix_view<const float> scores,
                        const std::int32_t* row_lengths, index_t total, const std::int32_t* floors,
                        std::int32_t* kept_cu, pos_t* kept_pos) {
  constexpr const char* fn = "select_topk_flat (sharded)";
  status st = detail::check_select_flat(fn, scores, row_lengths, total, floors, kept_cu, nullptr);
  const index_t R = st.ok() ? scores.extent(0) : 0, T = st.ok() ? scores.extent(1) : 0;
  detail::workspace_carver carver(ws);
  const detail::sharded_flat_ws sws = detail::carve_sharded_flat_ws(carver, R, T, detail::thread_count(be));
  if (st.ok()) st = carver.finish(fn);
  if (ws.is_query()) return st;
  std::int64_t sums[2] = {};  // lengths, floors
  if (st.ok()) st = detail::check_row_lengths(fn, row_lengths, R, T);
  index_t local[2] = {};
  if (st.ok()) st = detail::check_flat_floors(fn, detail::lengths_of{row_lengths, T}, floors, R, local);
  const index_t room = detail::sharded_room(total, local[0]);
  if (st.ok()) st = detail::check_select_flat(fn, scores, row_lengths, room, floors, kept_cu, kept_pos);
  if (st.ok())
    st = detail::check_select_flat_ws(fn, ws, carver.used(), scores, row_lengths, room, floors, kept_cu, kept_pos);
  sums[0] = local[0];
  sums[1] = local[1];
  detail::config_line config;
  config.print("total %lld, %lld rows x %lld columns per rank, floors %s", static_cast<long long>(total),
               static_cast<long long>(R), static_cast<long long>(T), floors != nullptr ? "given" : "none");
  KVEVICT_TRY(detail::agree(comm, fn, st, config, sums, 2));
  KVEVICT_TRY(detail::check_flat_total(fn, total, sums[0], sums[1]));
  return detail::run_sharded_flat(be, comm, scores, row_lengths, total, floors, sums[1], kept_cu, kept_pos, sws);
}

/// Head-sharded AdaKV: this rank's R heads of the layer's P R (scores [R][T], protected), per-head
/// budget B: the layer keeps B P R tokens, each rank receiving exactly its heads' part of what
/// adakv_budgets over all heads keeps (kept_cu[R] = this rank's count; kept_pos room for
/// min(B P R, sum of this rank's lengths) positions, or null).
/// Workspace: R int32 floors, then the sharded select_topk_flat's.
/// Errors: adakv_budgets' (B P R against every rank's lengths), on every rank; ranks disagreeing on
/// B, alpha, the floor rule, the protection, R or T.
template <class Backend, class Comm>
status adakv_budgets(Backend be, workspace& ws, Comm& comm, matrix_view<const float> scores,
                     const std::int32_t* lengths, index_t budget, const adakv_options& opt, std::int32_t* kept_cu,
                     pos_t* kept_pos) {
  constexpr const char* fn = "adakv_budgets (sharded)";
  status st = detail::check_adakv_args(fn, scores, kept_cu, budget, opt);
  const index_t R = st.ok() ? scores.extent(0) : 0, T = st.ok() ? scores.extent(1) : 0;
  const index_t heads = R * comm.size();
  detail::workspace_carver carver(ws);
  std::int32_t* floors = carver.take<std::int32_t>(static_cast<std::size_t>(R));
  const detail::sharded_flat_ws sws = detail::carve_sharded_flat_ws(carver, R, T, detail::thread_count(be));
  if (st.ok()) st = carver.finish(fn);
  if (ws.is_query()) return st;
  index_t sum_len = 0;
  if (st.ok()) st = detail::check_adakv_ws(fn, ws, scores, lengths, kept_cu);
  if (st.ok()) st = detail::check_adakv_heads(fn, scores, lengths, budget, opt.prot, &sum_len);
  const index_t total = budget > INT32_MAX / (heads > 0 ? heads : 1) ? INT32_MAX : budget * heads;
  const index_t room = detail::sharded_room(total, sum_len);
  if (st.ok()) st = detail::check_select_flat(fn, scores, lengths, room, nullptr, kept_cu, kept_pos);
  if (st.ok())  // the floors live in the workspace
    st = detail::check_select_flat_ws(fn, ws, carver.used(), scores, lengths, room, nullptr, kept_cu, kept_pos);
  if (st.ok()) st = detail::adakv_floors(fn, scores, lengths, budget, opt, floors);
  std::int64_t sums[2] = {sum_len, 0};
  for (index_t h = 0; st.ok() && h < R; ++h) sums[1] += floors[h];
  detail::config_line config;
  config.print("budget %lld, alpha %.17g, floor rule %d, n_sink %lld, n_recent %lld, %lld heads x %lld columns per rank",
               static_cast<long long>(budget), opt.alpha, static_cast<int>(opt.floor),
               static_cast<long long>(opt.prot.n_sink), static_cast<long long>(opt.prot.n_recent),
               static_cast<long long>(R), static_cast<long long>(T));
  KVEVICT_TRY(detail::agree(comm, fn, st, config, sums, 2));
  KVEVICT_TRY(detail::check_adakv_total(fn, budget, heads, sums[0]));
  return detail::run_sharded_flat(be, comm, scores, lengths, budget * heads, floors, sums[1], kept_cu, kept_pos, sws);
}

/// Head-sharded LAVa entropy: this rank's R heads (scores [R][T]) of the layer's P R; every rank
/// receives the entropy lava_layer_entropy computes over all heads, bit for bit (the per-head sums
/// are allgathered and combined in head order, as one process combines them).
/// Workspace: 32 P R bytes (+ alignment). Communication: one agreement, two allgathers of 32 R bytes.
/// Errors: lava_layer_entropy's (a bad score anywhere is reported with its global head on every
/// rank); ranks disagreeing on the protection, the normalisation, R or T.
template <class Backend, class Comm>
status lava_layer_entropy(Backend be, workspace& ws, Comm& comm, matrix_view<const float> scores,
                          const std::int32_t* lengths, const lava_entropy_options& opt, double* entropy) {
  constexpr const char* fn = "lava_layer_entropy (sharded)";
  status st = detail::check_lava_entropy(fn, scores, lengths, opt, entropy);
  const index_t R = st.ok() ? scores.extent(0) : 0, T = st.ok() ? scores.extent(1) : 0;
  const index_t heads = R * comm.size();
  auto* all = detail::carve_head_records<detail::lava_head>(fn, ws, heads, detail::range_of(scores), "scores", st);
  if (ws.is_query()) return st;
  detail::config_line config;
  config.print("n_sink %lld, n_recent %lld, norm %d, %lld heads x %lld columns per rank",
               static_cast<long long>(opt.prot.n_sink), static_cast<long long>(opt.prot.n_recent),
               static_cast<int>(opt.norm), static_cast<long long>(R), static_cast<long long>(T));
  KVEVICT_TRY(detail::agree(comm, fn, st, config, nullptr, 0));
  detail::lava_head* mine = all + R * comm.rank();
  // each rank computes its heads in place in its slot of `all`, then the slots are gathered
  const auto gather = [&](double S) {
    detail::lava_heads(be, scores, lengths, opt.prot, 0, R, S, mine);
    return comm.allgather(mine, sizeof(detail::lava_head) * static_cast<std::size_t>(R), all);
  };
  KVEVICT_TRY(gather(0.0));
  double S = 0.0;
  index_t M = 0;
  KVEVICT_TRY(detail::lava_merge_sums(fn, all, heads, 0, &S, &M));
  if (detail::lava_trivial(S, M, opt.norm)) {
    *entropy = 0.0;
    return {};
  }
  KVEVICT_TRY(gather(S));
  double acc = 0.0;
  for (index_t h = 0; h < heads; ++h) acc += all[h].sum;
  *entropy = detail::lava_normalise(acc, M, opt.norm);
  return {};
}

namespace detail {

/// The sharded CAKE statistics of attention [R][w][C] (this rank's rows) into *out, the per-row
/// records `all` (P R of them) carved by the caller; `st`: this rank's checks so far.
template <class Backend, class Comm>
status sharded_cake_stats(Backend be, Comm& comm, const char* fn, const status& st, const kv_view<const float>& attention,
                          index_t R, cake_row* all, variance_estimator var, cake_stats* out) {
  config_line config;
  config.print("variance estimator %d, %lld heads x %lld rows x %lld columns per rank", static_cast<int>(var),
               static_cast<long long>(R), static_cast<long long>(st.ok() ? attention.extent(1) : 0),
               static_cast<long long>(st.ok() ? attention.extent(2) : 0));
  KVEVICT_TRY(agree(comm, fn, st, config, nullptr, 0));
  cake_row* mine = all + R * comm.rank();
  parallel_for(be, R, [&](index_t k) { mine[k] = cake_row_stats(attention, k, var); });
  KVEVICT_TRY(comm.allgather(mine, sizeof(cake_row) * static_cast<std::size_t>(R), all));
  cake_stats total;
  KVEVICT_TRY(cake_merge(fn, all, R * comm.size(), 0, &total));
  *out = total;
  return {};
}

}  // namespace detail

/// Head-sharded CAKE statistics: this rank's R query heads of attention [R][w][C] (of the layer's
/// P R); every rank receives the statistics cake_layer_stats computes over all heads, bit for bit.
/// Workspace: about 40 P R bytes. Communication: one agreement, one allgather of about 40 R bytes.
/// Errors: cake_layer_stats' (on every rank); ranks disagreeing on the estimator, R, w or C.
template <class Backend, class Comm>
status cake_layer_stats(Backend be, workspace& ws, Comm& comm, kv_view<const float> attention, cake_stats* out,
                        variance_estimator var = variance_estimator::unbiased) {
  constexpr const char* fn = "cake_layer_stats (sharded)";
  status st = detail::check_cake_stats(fn, attention, out, var);
  const index_t R = st.ok() ? attention.extent(0) : 0;
  const index_t heads = R * comm.size();
  auto* all = detail::carve_head_records<detail::cake_row>(fn, ws, heads, detail::range_of(attention), "attention", st);
  if (ws.is_query()) return st;
  return detail::sharded_cake_stats(be, comm, fn, st, attention, R, all, var, out);
}

/// Head-sharded CAKE window preference: this rank's query heads [R_q][w][d] of the window and its
/// KV heads' keys [R_kv][P][d] (as cake_window_preference, over this rank's heads); every rank
/// receives the preference cake_window_preference computes over all heads, bit for bit (the
/// attention is per head; the statistics are cake_layer_stats' sharded ones).
/// Workspace: the [R_q][w][P - w] fp32 attention and about 40 P R_q bytes.
/// Communication: one agreement, one allgather of about 40 R_q bytes.
/// Errors: cake_window_preference's (on every rank); ranks disagreeing on R_q, w or P - w.
template <class Backend, class Comm>
status cake_window_preference(Backend be, workspace& ws, Comm& comm, kv_view<const float> window_queries,
                              kv_view<const float> keys, const cake_options& opt, double* pref) {
  constexpr const char* fn = "cake_window_preference (sharded)";
  static_assert(!std::is_same_v<Backend, cuda_t>, "cake_window_preference runs on the host");
  index_t prefix = 0;
  status st = detail::check_cake_window(fn, window_queries, keys, pref, &prefix);
  const index_t R = st.ok() ? window_queries.extent(0) : 0, w = st.ok() ? window_queries.extent(1) : 0;
  detail::workspace_carver c(ws);
  float* att = c.take<float>(static_cast<std::size_t>(R * w * prefix));
  auto* all = c.take<detail::cake_row>(static_cast<std::size_t>(R * comm.size()));
  if (st.ok()) st = c.finish(fn);
  if (ws.is_query()) return st;
  const detail::byte_range in[] = {detail::range_of(window_queries), detail::range_of(keys)};
  const char* const names[] = {"window_queries", "keys"};
  if (st.ok()) st = c.check_disjoint(fn, in, names);
  if (st.ok()) detail::cake_window_attention(window_queries, keys, prefix, att);
  const auto attention = st.ok() ? *make_kv_view<const float>(att, R, w, prefix) : kv_view<const float>{};
  cake_stats stats;
  KVEVICT_TRY(detail::sharded_cake_stats(be, comm, fn, st, attention, R, all, variance_estimator::unbiased, &stats));
  return cake_preference(stats, opt, pref);
}

/// Layer-sharded (pipeline-parallel) gather: this stage holds layers [mine.first, mine.first +
/// mine.count) with their values local[0, mine.count) (LAVa entropies, CAKE preferences, ...);
/// every stage receives all[0, layers), bit for bit. The stages' ranges must tile [0, layers)
/// exactly (any contiguous split, e.g. layer_shard's). Workspace: 16 L bytes (+ alignment).
/// Communication: one agreement, one allreduce of 2 L doubles (each entry has one non-zero
/// contributor, so the sum is exact in any order).
/// Errors (on every stage): layers < 1; a range outside [0, layers); local or all null; ranges that
/// overlap or leave a layer out; a value NaN or infinite; ranks disagreeing on `layers`.
template <class Comm>
status gather_layer_values(workspace& ws, Comm& comm, shard_range mine, const double* local, index_t layers,
                           double* all) {
  constexpr const char* fn = "gather_layer_values";
  status st;
  if (layers < 1 || mine.first < 0 || mine.count < 0 || mine.first + mine.count > layers)
    st = status::error(errc::out_of_range, "%s: this stage's layers [%lld, %lld) are not inside [0, %lld)", fn,
                       static_cast<long long>(mine.first), static_cast<long long>(mine.first + mine.count),
                       static_cast<long long>(layers));
  else if ((local == nullptr && mine.count > 0) || all == nullptr)
    st = status::error(errc::null_pointer, "%s: local or all is null", fn);
  for (index_t l = 0; st.ok() && l < mine.count; ++l)
    if (local[l] - local[l] != 0.0)
      st = status::error(errc::invalid_argument, "%s: the value of layer %lld is %g (must be finite)", fn,
                         static_cast<long long>(mine.first + l), local[l]);
  detail::workspace_carver carver(ws);
  double* buf = carver.take<double>(static_cast<std::size_t>(2 * (layers > 0 ? layers : 0)));
  if (st.ok()) st = carver.finish(fn);
  if (ws.is_query()) return st;
  detail::config_line config;
  config.print("%lld layers", static_cast<long long>(layers));
  KVEVICT_TRY(detail::agree(comm, fn, st, config, nullptr, 0));
  for (index_t l = 0; l < 2 * layers; ++l) buf[l] = 0.0;
  for (index_t l = 0; l < mine.count; ++l) {
    buf[mine.first + l] = local[l];
    buf[layers + mine.first + l] = 1.0;  // how many stages hold layer l
  }
  KVEVICT_TRY(comm.allreduce_sum(buf, 2 * layers));
  for (index_t l = 0; l < layers; ++l)
    if (buf[layers + l] != 1.0)
      return status::error(errc::invalid_argument,
                           "%s: layer %lld is held by %g stages (the stages' layer ranges must tile [0, %lld))", fn,
                           static_cast<long long>(l), buf[layers + l], static_cast<long long>(layers));
  for (index_t l = 0; l < layers; ++l) all[l] = buf[l];
  return {};
}

}  // namespace kvevict
