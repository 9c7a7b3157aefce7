// Host (seq / par) radix top-k behind <kvevict/select.hpp>. Not API.
//
// One row: pass 0 histograms the top 11 key bits of every score and picks the bucket holding the
// k-th best; pass 1 re-reads the scores, copies the keys that match the bucket into the
// candidate buffer and histograms their next 11 bits; pass 2 filters the candidates in place and
// resolves the last 10 bits. A pass stops early when every candidate of its bucket is kept (no
// tie left to break). Then ONE ascending scan over the row emits every key above the threshold
// plus the first `ties` tied keys: ascending output, lower position wins ties.
//
// par: rows are spread over the threads; when the rows do not divide evenly among the threads,
// the leftover long rows are processed one at a time by every thread together (the row split into
// contiguous chunks, per-thread histograms summed, each chunk's share of the ties assigned in
// chunk order), which returns exactly what the single-thread scan returns.
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/config.hpp>
#include <kvevict/detail/base/radix.hpp>
#include <kvevict/view.hpp>
#include <kvevict/detail/base/parallel.hpp>
#include <kvevict/workspace.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace kvevict::detail {

// Code whose body differs with and without -fopenmp lives in the inline namespace parallel.hpp
// uses, so translation units built both ways never share a mangled name (no ODR violation).
inline namespace KVEVICT_DETAIL_PAR_NAMESPACE {

/// Rows at least this long are split among the threads when rows are left over (see above).
inline constexpr index_t coop_min_length = 32768;
/// par runs score matrices smaller than this (R x T, default 16384) on the calling thread:
/// opening a parallel region costs more than the work (results are identical either way).
/// Tests lower it to exercise the threaded code on small shapes.
inline index_t& par_min_elements() noexcept {
  static index_t v = 16384;
  return v;
}

/// Scratch of one worker: a histogram and room for a whole row of candidate keys.
struct row_scratch {
  std::uint32_t* hist = nullptr;  // radix_bins
  std::uint32_t* cand = nullptr;  // columns of the score matrix
};

/// A row of scores: element i at data[i * stride].
struct score_row {
  const float* data;
  index_t stride;
};
/// A row of kept positions: element j at data[j * stride].
struct pos_row {
  pos_t* data;
  index_t stride;
};

/// Scores are turned into keys a block at a time in a small local buffer: the conversion
/// vectorises (contiguous rows), and the histogram / filter / emit loops then read plain keys.
inline constexpr index_t key_block = 256;

inline void load_keys(const score_row& row, index_t b, index_t n, std::uint32_t* keys) noexcept {
  const float* p = row.data + b * row.stride;
  if (row.stride == 1) {
    for (index_t j = 0; j < n; ++j) keys[j] = score_key(p[j]);
  } else {
    for (index_t j = 0; j < n; ++j) keys[j] = score_key(p[j * row.stride]);
  }
}

/// hist = pass-0 histogram of row[b, e).
inline void histogram_scores(const score_row& row, index_t b, index_t e, std::uint32_t* hist) noexcept {
  std::memset(hist, 0, sizeof(std::uint32_t) * radix_bins);
  std::uint32_t keys[key_block];
  for (index_t i = b; i < e; i += key_block) {
    const index_t n = std::min(key_block, e - i);
    load_keys(row, i, n, keys);
    for (index_t j = 0; j < n; ++j) ++hist[keys[j] >> radix_shift(0)];
  }
}

/// Copies the keys of row[b, e) tied with `t` to cand; returns how many.
inline index_t filter_scores(const score_row& row, index_t b, index_t e, const radix_threshold& t,
                             std::uint32_t* cand) noexcept {
  const radix_threshold th = t;  // a local copy: stores to cand cannot alias it
  index_t m = 0;
  std::uint32_t keys[key_block];
  for (index_t i = b; i < e; i += key_block) {
    const index_t n = std::min(key_block, e - i);
    load_keys(row, i, n, keys);
    for (index_t j = 0; j < n; ++j) {
      cand[m] = keys[j];  // always written, kept only if tied: no branch (m <= i + j - b, in bounds)
      m += radix_tied(keys[j], th) ? 1 : 0;
    }
  }
  return m;
}

/// Keeps the candidates tied with `t` at the front of cand; returns how many.
inline index_t filter_candidates(std::uint32_t* cand, index_t m, const radix_threshold& t) noexcept {
  const radix_threshold th = t;
  index_t w = 0;
  for (index_t j = 0; j < m; ++j) {
    const std::uint32_t key = cand[j];
    cand[w] = key;
    w += radix_tied(key, th) ? 1 : 0;
  }
  return w;
}

inline void histogram_candidates(const std::uint32_t* cand, index_t m, int pass, std::uint32_t* hist) noexcept {
  std::memset(hist, 0, sizeof(std::uint32_t) * radix_bins);
  for (index_t j = 0; j < m; ++j) ++hist[radix_digit(cand[j], pass)];
}

/// Threshold of the best k of row[0, n), 0 < k < n. `tied_count` receives how many keys of the
/// row are tied with the returned threshold. With `full_key` the threshold is on the whole key
/// (mask all ones), as the flattened selection needs.
inline radix_threshold row_threshold(const score_row& row, index_t n, index_t k, row_scratch s, bool full_key,
                              index_t& tied_count) noexcept {
  radix_threshold t;
  t.ties = k;
  histogram_scores(row, 0, n, s.hist);
  radix_bucket b = radix_choose_bucket(s.hist, 1 << radix_width(0), t.ties);
  tied_count = b.count;
  if (radix_narrow(t, 0, b, t.ties, full_key)) return t;
  index_t m = filter_scores(row, 0, n, t, s.cand);
  for (int pass = 1; pass < radix_passes; ++pass) {
    if (pass > 1) m = filter_candidates(s.cand, m, t);
    histogram_candidates(s.cand, m, pass, s.hist);
    b = radix_choose_bucket(s.hist, 1 << radix_width(pass), t.ties);
    tied_count = b.count;
    if (radix_narrow(t, pass, b, t.ties, full_key)) break;
  }
  return t;
}

/// Writes the kept positions of row[b, e) in ascending order: keys above `t`, then tied keys
/// while `ties` lasts; at most `count` of them. `tied_total` is the number of tied keys in
/// row[b, e). Returns how many positions were written.
/// This is radix_keep() over the range, with two cheaper equivalent forms of the rule: when every
/// tied key is kept (ties >= tied_total) keep = key >= lo, and once `ties` is spent keep = key > hi,
/// where [lo, hi] is the range of keys tied with `t`.
inline index_t emit_kept(const score_row& row, index_t b, index_t e, const radix_threshold t, index_t ties,
                         index_t tied_total, pos_row out, index_t count) noexcept {
  const std::uint32_t lo = t.prefix, hi = t.prefix | ~t.mask;
  enum { keep_tied, drop_tied, mixed } mode = ties >= tied_total ? keep_tied : ties == 0 ? drop_tied : mixed;
  index_t c = 0;
  std::uint32_t keys[key_block];
  for (index_t i = b; i < e && c < count; i += key_block) {
    const index_t n = std::min(key_block, e - i);
    load_keys(row, i, n, keys);
    if (out.stride == 1 && c + n <= count) {
      // room for the whole block: write every position, advance only past kept ones (no branch)
      pos_t* o = out.data;
      const auto base = static_cast<pos_t>(i);
      if (mode == keep_tied) {
        for (index_t j = 0; j < n; ++j) {
          o[c] = base + static_cast<pos_t>(j);
          c += keys[j] >= lo ? 1 : 0;
        }
      } else if (mode == drop_tied) {
        for (index_t j = 0; j < n; ++j) {
          o[c] = base + static_cast<pos_t>(j);
          c += keys[j] > hi ? 1 : 0;
        }
      } else {
        for (index_t j = 0; j < n; ++j) {
          o[c] = base + static_cast<pos_t>(j);
          c += radix_keep(keys[j], t, ties) ? 1 : 0;
        }
        if (ties == 0) mode = drop_tied;
      }
    } else {
      for (index_t j = 0; j < n && c < count; ++j)
        if (radix_keep(keys[j], t, ties)) out.data[(c++) * out.stride] = static_cast<pos_t>(i + j);
      if (mode == mixed && ties == 0) mode = drop_tied;
    }
  }
  return c;
}

inline void emit_all(index_t n, pos_row out) noexcept {
  for (index_t i = 0; i < n; ++i) out.data[i * out.stride] = static_cast<pos_t>(i);
}

/// Top-k of one row by one worker: ascending positions into out[0, k).
inline void select_row(const score_row& row, index_t n, index_t k, pos_row out, row_scratch s) noexcept {
  if (k == 0) return;
  if (k == n) return emit_all(n, out);
  index_t tied = 0;
  const radix_threshold t = row_threshold(row, n, k, s, false, tied);
  emit_kept(row, 0, n, t, t.ties, tied, out, k);
}

/// Workspace of select_topk for R rows of T columns and `workers` threads.
struct select_ws {
  std::uint32_t* hist = nullptr;    // workers x radix_bins
  std::uint32_t* cand = nullptr;    // workers x T
  std::uint32_t* merged = nullptr;  // radix_bins (cooperative rows)
  index_t* above = nullptr;         // workers (cooperative rows: keys above, per chunk)
  index_t* tied = nullptr;          // workers (cooperative rows: tied keys, per chunk)
  index_t columns = 0;
  int workers = 1;

  row_scratch slot(int w) const noexcept {
    return {hist + static_cast<index_t>(w) * radix_bins, cand + static_cast<index_t>(w) * columns};
  }
};

inline select_ws carve_select_ws(workspace_carver& c, index_t columns, int workers) noexcept {
  select_ws w;
  w.columns = columns;
  w.workers = workers;
  const auto n = static_cast<std::size_t>(workers);
  w.hist = c.take<std::uint32_t>(n * radix_bins);
  w.cand = c.take<std::uint32_t>(n * static_cast<std::size_t>(columns));
  if (workers > 1) {
    w.merged = c.take<std::uint32_t>(radix_bins);
    w.above = c.take<index_t>(n);
    w.tied = c.take<index_t>(n);
  }
  return w;
}

#if defined(_OPENMP)
/// One row selected by the whole team (called by every thread of a parallel region).
inline void select_row_coop(const score_row& row, index_t n, index_t k, pos_row out, const select_ws& ws, int tid,
                            int nth) noexcept {
  const index_t cb = n * tid / nth, ce = n * (tid + 1) / nth;
  std::uint32_t* hist = ws.hist + static_cast<index_t>(tid) * radix_bins;
  std::uint32_t* cand = ws.cand + cb;  // chunks of the first worker's candidate buffer
  const index_t bins_per = (radix_bins + nth - 1) / nth;
  const index_t mb = std::min<index_t>(radix_bins, bins_per * tid), me = std::min<index_t>(radix_bins, mb + bins_per);
  radix_threshold t;
  t.ties = k;
  index_t above = 0, tied = 0, m = 0;
  for (int pass = 0; pass < radix_passes; ++pass) {
    if (pass == 0) histogram_scores(row, cb, ce, hist);
    else {
      m = pass == 1 ? filter_scores(row, cb, ce, t, cand) : filter_candidates(cand, m, t);
      histogram_candidates(cand, m, pass, hist);
    }
#  pragma omp barrier
    for (index_t bin = mb; bin < me; ++bin) {
      std::uint32_t sum = 0;
      for (int w = 0; w < nth; ++w) sum += ws.hist[static_cast<index_t>(w) * radix_bins + bin];
      ws.merged[bin] = sum;
    }
#  pragma omp barrier
    const int bins = 1 << radix_width(pass);
    const radix_bucket b = radix_choose_bucket(ws.merged, bins, t.ties);  // same on every thread
    for (int bin = static_cast<int>(b.bucket) + 1; bin < bins; ++bin) above += hist[bin];
    tied = hist[b.bucket];
    if (radix_narrow(t, pass, b, t.ties, false)) break;
  }
  ws.above[tid] = above;
  ws.tied[tid] = tied;
#  pragma omp barrier
  // chunk w keeps its keys above the threshold and the tied keys left after chunks < w
  index_t offset = 0, ties_before = 0, my_ties = 0;
  for (int w = 0; w <= tid; ++w) {
    const index_t take = std::clamp<index_t>(t.ties - ties_before, 0, ws.tied[w]);
    if (w == tid) my_ties = take;
    else offset += ws.above[w] + take;
    ties_before += ws.tied[w];
  }
  emit_kept(row, cb, ce, t, my_ties, tied, pos_row{out.data + offset * out.stride, out.stride}, above + my_ties);
#  pragma omp barrier
}
#endif

/// Selects every row: row r (row_of(r), a score_row) keeps k_of(r) of its len_of(r) scores into
/// out_of(r); `columns` bounds every row's length (the cooperative split's threshold).
template <class RowOf, class LenOf, class KOf, class OutOf>
void select_rows_of(seq_t, index_t R, index_t, RowOf row_of, LenOf len_of, KOf k_of, OutOf out_of,
                    const select_ws& ws) noexcept {
  for (index_t r = 0; r < R; ++r) select_row(row_of(r), len_of(r), k_of(r), out_of(r), ws.slot(0));
}

template <class RowOf, class LenOf, class KOf, class OutOf>
void select_rows_of(par_t, index_t R, index_t columns, RowOf row_of, LenOf len_of, KOf k_of, OutOf out_of,
                    const select_ws& ws) noexcept {
#if defined(_OPENMP)
  const int P = ws.workers;
  // rows [0, split) one per thread; rows [split, R) (fewer than P) by the whole team if long
  const index_t split = columns >= coop_min_length ? R - R % P : R;
  if (P > 1 && (R > 1 || split < R) && R * columns >= par_min_elements()) {
#  pragma omp parallel num_threads(P)
    {
      const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
#  pragma omp for schedule(dynamic, 1)
      for (index_t r = 0; r < split; ++r) select_row(row_of(r), len_of(r), k_of(r), out_of(r), ws.slot(tid));
      for (index_t r = split; r < R; ++r) {
        const index_t n = len_of(r), k = k_of(r);
        if (nth == 1 || n < coop_min_length || k == 0 || k == n) {
#  pragma omp single
          select_row(row_of(r), n, k, out_of(r), ws.slot(tid));
        } else {
          select_row_coop(row_of(r), n, k, out_of(r), ws, tid, nth);
        }
      }
    }
    return;
  }
#else
  (void)columns;
#endif
  for (index_t r = 0; r < R; ++r) select_row(row_of(r), len_of(r), k_of(r), out_of(r), ws.slot(0));
}

/// on(ex): one row per iteration through the executor, each row selected whole by one worker (the
/// cooperative split of long rows needs barriers inside a row, which an executor does not offer;
/// select_row and select_row_coop keep the same positions).
template <class E, class RowOf, class LenOf, class KOf, class OutOf>
void select_rows_of(executor_t<E> be, index_t R, index_t, RowOf row_of, LenOf len_of, KOf k_of, OutOf out_of,
                    const select_ws& ws) noexcept {
  parallel_for_workers(be, R, ws.workers, [&](index_t r, int w) {
    select_row(row_of(r), len_of(r), k_of(r), out_of(r), ws.slot(w));
  });
}

/// select_rows_of over the rows of a score matrix.
template <class Backend, class LenOf, class KOf, class OutOf>
void select_rows(Backend be, const matrix_view<const float>& scores, LenOf len_of, KOf k_of, OutOf out_of,
                 const select_ws& ws) noexcept {
  auto row_of = [&](index_t r) { return score_row{scores.data_handle() + r * scores.stride(0), scores.stride(1)}; };
  select_rows_of(be, scores.extent(0), scores.extent(1), row_of, len_of, k_of, out_of, ws);
}

/// Calls f(r, worker) for every row r; par spreads rows over the threads (dynamic schedule:
/// results never depend on which thread runs a row).
template <class F>
void for_rows(seq_t, index_t R, index_t, int, F&& f) {
  for (index_t r = 0; r < R; ++r) f(r, 0);
}
template <class F>
void for_rows(par_t, index_t R, index_t T, int workers, F&& f) {
#if defined(_OPENMP)
  if (workers > 1 && R > 1 && R * T >= par_min_elements()) {
#  pragma omp parallel num_threads(workers)
    {
      const int tid = omp_get_thread_num();
#  pragma omp for schedule(dynamic, 1)
      for (index_t r = 0; r < R; ++r) f(r, tid);
    }
    return;
  }
#else
  (void)T;
  (void)workers;
#endif
  for (index_t r = 0; r < R; ++r) f(r, 0);
}
template <class E, class F>
void for_rows(executor_t<E> be, index_t R, index_t, int workers, F&& f) {
  parallel_for_workers(be, R, workers, f);
}

/// h = histogram of pass p's digit over the keys of row[0, n) tied with `t` (every key when
/// t.mask == 0).
inline void histogram_tied(const score_row& row, index_t n, const radix_threshold t, int pass,
                           std::uint32_t* h) noexcept {
  if (t.mask == 0) return histogram_scores(row, 0, n, h);
  std::memset(h, 0, sizeof(std::uint32_t) * radix_bins);
  const std::uint32_t mask = t.mask, prefix = t.prefix;
  const int sh = radix_shift(pass);
  const std::uint32_t dmask = (1u << radix_width(pass)) - 1u;
  std::uint32_t keys[key_block];
  for (index_t i = 0; i < n; i += key_block) {
    const index_t nb = std::min(key_block, n - i);
    load_keys(row, i, nb, keys);
    if (pass == 1) {  // a random part of the keys is tied: branch-free
      for (index_t j = 0; j < nb; ++j) h[(keys[j] >> sh) & dmask] += (keys[j] & mask) == prefix ? 1u : 0u;
    } else {  // pass 2: nearly no key is tied (a predictable branch)
      for (index_t j = 0; j < nb; ++j)
        if ((keys[j] & mask) == prefix) ++h[(keys[j] >> sh) & dmask];
    }
  }
}

/// Per-row state of the flattened selection (trivial type: lives in the workspace).
struct flat_row {
  index_t above;     // keys above the layer threshold's prefix so far (finally: above the threshold)
  index_t upto;      // scratch of the bucket choice: above + keys in the bins scanned so far
  index_t tied;      // keys equal to the layer threshold (after the last pass)
  index_t cand_off;  // the row's segment of the layer candidate buffer
  index_t cand_n;
  index_t count;     // tokens kept
};

struct flat_ws {
  select_ws sel;                      // per-worker scratch (floor-bound rows) and the layer candidates
  std::uint32_t* row_hist = nullptr;  // R x radix_bins: one histogram per row
  flat_row* rows = nullptr;           // R
};

inline flat_ws carve_flat_ws(workspace_carver& c, index_t rows, index_t columns, int workers) noexcept {
  flat_ws w;
  w.sel = carve_select_ws(c, columns, workers);
  w.row_hist = c.take<std::uint32_t>(static_cast<std::size_t>(rows) * radix_bins);
  w.rows = c.take<flat_row>(static_cast<std::size_t>(rows));
  return w;
}

/// The rows of select_flat's layer are all here (one process).
struct flat_layer_local {
  index_t floors(index_t local) const noexcept { return local; }
  /// Scans the buckets from the highest down until sum_r max(floor_r, upto_r) >= total.
  template <class FloorOf, class HistOf>
  int choose_bucket(int bins, index_t R, FloorOf floor_of, HistOf hist_of, flat_row* rows, index_t total) const noexcept {
    int b = bins - 1;
    for (;; --b) {
      index_t sum = 0;
      for (index_t r = 0; r < R; ++r) {
        flat_row& fr = rows[r];
        fr.upto = (b == bins - 1 ? fr.above : fr.upto) + hist_of(r)[b];
        sum += std::max(floor_of(r), fr.upto);
      }
      if (sum >= total || b == 0) return b;
    }
  }
  /// Tied keys left for the rows once every row has its base count.
  index_t tied_share(index_t total, index_t base_sum, index_t) const noexcept { return total - base_sum; }
};

/// Flattened selection: every row r first keeps its best floor_of(r) tokens; then the best
/// `total - sum(floors)` of the remaining (row, position) entries of all rows are kept, ties
/// between equal scores going to the lower row, then the lower position. Writes cu[R + 1] and, if
/// pos is not null, each row's kept positions (ascending) at pos[cu[r] ..].
///
/// Order the layer's entries by (key desc, row asc, position asc) and let a_r(E) be the number of
/// row r's entries before entry E. Row r's remaining entries before E are its entries of rank
/// >= floor_r among those, so it keeps count_r = max(floor_r, a_r(E*)), where E* is the first
/// entry with sum_r max(floor_r, a_r(E*)) = total. E* is found by radix select on the key with one
/// histogram per row: for each candidate bucket, sum_r max(floor_r, keys of r at or above it) is
/// computed from the per-row histograms. The floors never need their own thresholds. Rows whose
/// floor binds beyond the layer threshold (count_r > keys of r at or above it) are selected on
/// their own for the positions.
///
/// `layer` combines the rows of the layer: flat_layer_local when this call holds every row; a
/// sharded layer (distributed.hpp) sums the bucket counts over the ranks and hands each rank its
/// share of the tied keys, which gives every rank exactly the rows one process would keep for its
/// rows. Returns false only when the layer's communication failed (then the outputs are partial).
template <class Backend, class LenOf, class FloorOf, class Layer>
bool select_flat(Backend be, const matrix_view<const float>& scores, LenOf len_of, FloorOf floor_of, index_t total,
                 std::int32_t* cu, pos_t* pos, const flat_ws& ws, Layer& layer) noexcept {
  const index_t R = scores.extent(0), T = scores.extent(1);
  const int P = ws.sel.workers;
  auto row_of = [&](index_t r) { return score_row{scores.data_handle() + r * scores.stride(0), scores.stride(1)}; };
  auto hist_of = [&](index_t r) { return ws.row_hist + r * radix_bins; };
  index_t local_floors = 0;
  for (index_t r = 0; r < R; ++r) {
    ws.rows[r] = flat_row{};
    local_floors += floor_of(r);
  }
  const index_t floors = layer.floors(local_floors);

  radix_threshold g;
  if (total > floors) {  // otherwise every row keeps exactly its floor
    bool filtered = false;
    for (int pass = 0; pass < radix_passes; ++pass) {
      const int bins = 1 << radix_width(pass);
      for_rows(be, R, T, P, [&](index_t r, int) {
        std::uint32_t* h = hist_of(r);
        flat_row& fr = ws.rows[r];
        const radix_threshold gt = g;  // a local copy: stores to h cannot alias it
        const int p = pass;
        if (!filtered) return histogram_tied(row_of(r), len_of(r), gt, p, h);
        std::uint32_t* cand = ws.sel.cand + fr.cand_off;
        if (p > 1) fr.cand_n = filter_candidates(cand, fr.cand_n, gt);
        histogram_candidates(cand, fr.cand_n, p, h);
      });
      // the highest bucket b with sum_r max(floor_r, keys of r above the prefix or in bins >= b)
      // >= total (below it the sum is < total: the invariant of every pass); sets every fr.upto
      const int b = layer.choose_bucket(bins, R, floor_of, hist_of, ws.rows, total);
      if (b < 0) return false;
      index_t cand_total = 0;
      for (index_t r = 0; r < R; ++r) {
        flat_row& fr = ws.rows[r];
        const index_t in_bucket = hist_of(r)[b];
        fr.above = fr.upto - in_bucket;
        fr.tied = in_bucket;  // final after the last pass
        if (pass == 0) {  // one slack slot per segment for the branch-free copy below
          fr.cand_off = cand_total;
          cand_total += in_bucket + 1;
        }
      }
      g.mask |= radix_digit_mask(pass);
      g.prefix |= static_cast<std::uint32_t>(b) << radix_shift(pass);
      if (pass == 0 && cand_total <= static_cast<index_t>(P) * T) {
        // copy each row's keys of the bucket to its segment (branch-free), for passes 1 and 2
        for_rows(be, R, T, P, [&](index_t r, int) {
          flat_row& fr = ws.rows[r];
          const radix_threshold gt = g;
          std::uint32_t* cand = ws.sel.cand + fr.cand_off;
          const score_row row = row_of(r);
          const index_t n = len_of(r);
          index_t m = 0;
          std::uint32_t keys[key_block];
          for (index_t i = 0; i < n && m < fr.tied; i += key_block) {
            const index_t nb = std::min(key_block, n - i);
            load_keys(row, i, nb, keys);
            for (index_t j = 0; j < nb; ++j) {
              cand[m] = keys[j];  // m <= tied: within the segment and its slack slot
              m += radix_tied(keys[j], gt) ? 1 : 0;
            }
          }
          fr.cand_n = m;
        });
        filtered = true;
      }
    }
  }

  // counts: max(floor, keys above the threshold) plus the remaining tied keys, lowest rows first
  index_t base_sum = 0, tied_sum = 0;
  for (index_t r = 0; r < R; ++r) {
    const flat_row& fr = ws.rows[r];
    const index_t f = floor_of(r), base = std::max(f, fr.above);
    base_sum += base;
    tied_sum += std::max(f, fr.above + fr.tied) - base;
  }
  index_t left = layer.tied_share(total, base_sum, tied_sum);  // the tied keys these rows may keep
  if (left < 0) return false;
  cu[0] = 0;
  for (index_t r = 0; r < R; ++r) {
    flat_row& fr = ws.rows[r];
    const index_t f = floor_of(r), base = std::max(f, fr.above);
    const index_t take = std::min(std::max(f, fr.above + fr.tied) - base, left);
    left -= take;
    fr.count = base + take;
    cu[r + 1] = static_cast<std::int32_t>(cu[r] + fr.count);
  }

  if (pos == nullptr) return true;
  for_rows(be, R, T, P, [&](index_t r, int w) {
    const flat_row& fr = ws.rows[r];
    const index_t n = len_of(r);
    const pos_row out{pos + cu[r], 1};
    if (fr.count == 0) return;
    if (fr.count == n) return emit_all(n, out);
    if (total > floors && fr.count <= fr.above + fr.tied) {  // the layer threshold is the row's
      emit_kept(row_of(r), 0, n, radix_full_threshold(g.prefix, fr.count - fr.above), fr.count - fr.above, fr.tied,
                out, fr.count);
    } else {  // the floor binds beyond the layer threshold (or no layer threshold): the row's own top-k
      select_row(row_of(r), n, fr.count, out, ws.sel.slot(w));
    }
  });
  return true;
}

}  // inline namespace
}  // namespace kvevict::detail
