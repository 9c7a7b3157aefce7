// An engine's loop over a paged KV cache (docs/paged.md): three prompts of different lengths in a
// pool of 16-token pages with one page list per (sequence, KV head); after the prefill, SnapKV
// scores read through the page lists, one selection for the whole batch (each sequence keeps 48
// tokens per KV head on average, shared across its heads), paged compaction, and the freed pages
// go back to the engine's free list before decoding continues. The library never owns the pool.
#include <kvevict/kvevict.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

using namespace kvevict;

int main() {
  const index_t S = 3, H = 2, G = 2, d = 32, ps = 16, pages = 96, w = 8, decode = 20;
  const index_t prompt[S] = {200, 120, 300};
  std::vector<float> kpool(pages * ps * d), vpool(kpool.size());
  std::vector<std::int32_t> free_pages;  // the engine's free list
  for (index_t p = pages - 1; p >= 0; --p) free_pages.push_back(static_cast<std::int32_t>(p));
  std::vector<std::vector<std::int32_t>> lists(S * H);  // the engine's page list per (sequence, head)
  std::vector<std::int32_t> len(S * H), indptr, indices, last(S * H);
  auto take_page = [&](std::vector<std::int32_t>& l) { l.push_back(free_pages.back()), free_pages.pop_back(); };
  auto layer = [&]() {  // the CSR block tables of the current lists, FlashInfer-style
    indptr.assign(1, 0), indices.clear();
    for (const auto& l : lists) indices.insert(indices.end(), l.begin(), l.end()), indptr.push_back(static_cast<std::int32_t>(indices.size()));
    (void)last_page_lengths(indptr.data(), S * H, len.data(), ps, last.data());
    paged_layer<float> L{*make_page_pool(kpool.data(), pages, ps, 1, d), *make_page_pool(vpool.data(), pages, ps, 1, d),
                         page_table{indptr.data(), indices.data(), last.data(), S * H}, S, H, page_lists::per_head};
    return L;
  };
  auto append = [&](index_t r, index_t t) {  // the forward pass writes token t of row r
    if (len[r] % ps == 0) take_page(lists[r]);
    ++len[r];
    const paged_layer<float> L = layer();
    for (index_t k = 0; k < d; ++k) L.key(r, len[r] - 1)[k] = std::sin(0.1f * static_cast<float>(t * (k + 1) + r)), L.value(r, len[r] - 1)[k] = 1.f;
  };
  for (index_t r = 0; r < S * H; ++r)
    for (index_t t = 0; t < prompt[r / H]; ++t) append(r, t);
  std::printf("prefill: %zu of %lld pages in use\n", static_cast<std::size_t>(pages) - free_pages.size(), (long long)pages);

  // eviction after the prefill: window scores -> GQA mean -> protect -> one batched selection -> compaction
  std::vector<float> q(S * H * G * w * d), scores_q(S * H * G * 300), scores(S * H * 300);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::cos(0.05f * static_cast<float>(i));
  std::vector<std::int32_t> budgets(S, 48), kept_cu(S * H + 1), lengths(S * H), freed(pages);
  std::vector<pos_t> kept_pos(S * H * 300);
  std::int32_t nfreed = 0;
  std::vector<unsigned char> arena;  // two-phase scratch: a size query, then the call
  auto run = [&](auto call) {
    workspace size;
    status s = call(size);
    if (!s.ok()) return s;
    arena.resize(size.bytes);
    workspace ws{arena.data(), size.bytes};
    return call(ws);
  };
  const paged_layer<float> L = layer();
  auto qv = *make_kv_view<const float>(q.data(), S * H * G, w, d);
  auto sq = *make_matrix_view(scores_q.data(), S * H * G, 300), sk = *make_matrix_view(scores.data(), S * H, 300);
  status st = run([&](workspace& ws) { return paged_window_scores(par, ws, qv, L, sq, /*include_window=*/true); });
  if (st.ok()) st = gqa_reduce(par, matrix_view<const float>(sq), sk, gqa_op::mean);
  if (st.ok()) st = protect(par, sk, /*n_sink=*/4, /*n_recent=*/w, len.data());
  if (st.ok())
    st = run([&](workspace& ws) {
      return select_topk_batch(par, ws, batch_padded(sk, S, H, len.data()), budgets.data(), batch_budget::flattened,
                               kept_cu.data(), kept_pos.data(), static_cast<index_t>(kept_pos.size()));
    });
  if (st.ok())
    st = run([&](workspace& ws) {
      return compact_paged(par, ws, L, ragged_positions{kept_pos.data(), kept_cu.data(), S * H},
                           paged_compaction_out{lengths.data(), freed.data(), pages, &nfreed});
    });
  if (!st.ok()) return std::fprintf(stderr, "paged_engine: %s\n", st.message()), 1;
  for (index_t r = 0; r < S * H; ++r) len[r] = lengths[r], lists[r].resize((len[r] + ps - 1) / ps);
  free_pages.insert(free_pages.end(), freed.begin(), freed.begin() + nfreed);  // the pages come back
  for (index_t s = 0; s < S; ++s)
    std::printf("sequence %lld: %lld tokens, heads keep %d and %d\n", (long long)s, (long long)prompt[s], len[s * H],
                len[s * H + 1]);
  std::printf("eviction freed %d pages: %zu of %lld in use\n", nfreed, static_cast<std::size_t>(pages) - free_pages.size(),
              (long long)pages);
  for (index_t t = 0; t < decode; ++t)  // decoding appends into the pages each head still holds
    for (index_t r = 0; r < S * H; ++r) append(r, prompt[r / H] + t);
  std::printf("after %lld decode steps: %zu pages in use\n", (long long)decode,
              static_cast<std::size_t>(pages) - free_pages.size());
  return 0;
}
