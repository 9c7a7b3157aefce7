// The CUDA paged stages vs the seq backend, bit for bit. Part 1 (runs everywhere): host-side checks
// that return before any CUDA call. Part 2 (skips without a usable device): compact_paged on random
// layouts (per-sequence and per-head tables, NHD and HND, page sizes 1, 16, 64), nothing written on
// a shared page; paged Knorm and value norms; the per-head batched selection.
#include "gpu_check.cuh"

#include <kvevict/batch.hpp>
#include <kvevict/cuda/batch.cuh>
#include <kvevict/cuda/paged.cuh>
#include <kvevict/paged.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

using namespace kvevict;

namespace {

template <class T>
struct dbuf {
  T* p = nullptr;
  explicit dbuf(const std::vector<T>& v) {
    KVGPU_CUDA(cudaMalloc(&p, std::max<std::size_t>(1, v.size()) * sizeof(T)));
    if (!v.empty()) KVGPU_CUDA(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  ~dbuf() { cudaFree(p); }
  dbuf(const dbuf&) = delete;
  dbuf& operator=(const dbuf&) = delete;
  std::vector<T> get(std::size_t n) const {
    std::vector<T> v(n);
    if (n > 0) KVGPU_CUDA(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }
};

/// A random batch in a shuffled pool, its kept lists (one count per per-sequence list).
struct layout {
  index_t S = 0, H = 0, d = 0, ps = 1, pages = 0;
  page_lists lists = page_lists::per_sequence;
  page_layout pl = page_layout::nhd;
  std::vector<float> k, v;
  std::vector<std::int32_t> indptr{0}, indices, last, cu{0};
  std::vector<pos_t> pos;
  index_t list_count() const { return lists == page_lists::per_head ? S * H : S; }
  paged_layer<float> on(float* kd, float* vd, const std::int32_t* ip, const std::int32_t* ix,
                        const std::int32_t* lp) const {
    const index_t hp = lists == page_lists::per_head ? 1 : H;
    return {*make_page_pool(kd, pages, ps, hp, d, pl), *make_page_pool(vd, pages, ps, hp, d, pl),
            page_table{ip, ix, lp, list_count()}, S, H, lists};
  }
};

layout make_layout(std::mt19937_64& g, index_t ps, page_lists lists, page_layout pl) {
  layout L;
  L.S = 1 + static_cast<index_t>(g() % 4);
  L.H = 1 + static_cast<index_t>(g() % 3);
  L.d = 8;
  L.ps = ps;
  L.pages = 0;
  L.lists = lists;
  L.pl = pl;
  std::vector<index_t> len;
  for (index_t l = 0; l < L.list_count(); ++l) len.push_back(static_cast<index_t>(g() % (3 * ps + 5)));
  for (auto n : len) L.pages += (n + ps - 1) / ps;
  L.pages += 2;
  std::vector<std::int32_t> perm(static_cast<std::size_t>(L.pages));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), g);
  std::size_t at = 0;
  for (auto n : len) {
    const index_t np = (n + ps - 1) / ps;
    for (index_t i = 0; i < np; ++i) L.indices.push_back(perm[at++]);
    L.indptr.push_back(static_cast<std::int32_t>(L.indices.size()));
    L.last.push_back(static_cast<std::int32_t>(np == 0 ? 0 : n - (np - 1) * ps));
  }
  L.indices.push_back(0);
  const index_t hp = lists == page_lists::per_head ? 1 : L.H;
  L.k.resize(static_cast<std::size_t>(L.pages * ps * hp * L.d));
  L.v.resize(L.k.size());
  std::normal_distribution<float> nd;
  for (auto& x : L.k) x = nd(g);
  for (auto& x : L.v) x = nd(g);
  index_t shared = 0;
  for (index_t r = 0; r < L.S * L.H; ++r) {
    const index_t l = lists == page_lists::per_head ? r : r / L.H, n = len[static_cast<std::size_t>(l)];
    if (lists == page_lists::per_head || r % L.H == 0) shared = n > 0 ? static_cast<index_t>(g() % (n + 1)) : 0;
    std::vector<pos_t> all(static_cast<std::size_t>(n));
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), g);
    std::sort(all.begin(), all.begin() + shared);
    L.pos.insert(L.pos.end(), all.begin(), all.begin() + shared);
    L.cu.push_back(static_cast<std::int32_t>(L.pos.size()));
  }
  L.pos.push_back(0);
  return L;
}

void host_checks() {
  std::vector<float> k(64);
  std::int32_t indptr[2] = {0, 1}, indices[1] = {0}, last[1] = {1};
  paged_layer<float> L{*make_page_pool(k.data(), 4, 4, 1, 4), *make_page_pool(k.data(), 4, 4, 1, 4),
                       page_table{indptr, indices, last, 1}, 1, 1, page_lists::per_head};
  workspace q;
  KVGPU_CHECK(compact_paged(kvevict::cuda, q, L, ragged_positions{nullptr, indptr, 2}, paged_compaction_out{}).ok());
  std::vector<unsigned char> mem(q.bytes);  // never touched: the call fails on the host first
  workspace ws{mem.data(), q.bytes};
  KVGPU_CHECK(compact_paged(kvevict::cuda, ws, L, ragged_positions{nullptr, indptr, 2}, paged_compaction_out{}).code() ==
              errc::shape_mismatch);
  L.values.page_size = 2;
  KVGPU_CHECK(compact_paged(kvevict::cuda, q, L, ragged_positions{nullptr, indptr, 1}, paged_compaction_out{}).code() ==
              errc::shape_mismatch);
  std::vector<float> s(8);
  std::int32_t cu_seq[2] = {0, 8}, budget[1] = {3}, kept_cu[2] = {0, 0};
  const batch_rows rows = batch_varlen(*make_matrix_view<const float>(s.data(), 1, 8), cu_seq, 1);
  workspace fq;  // flattened budgets run on cuda without workspace: the query answers 0 bytes
  fq.bytes = 99;
  KVGPU_CHECK(select_topk_batch(kvevict::cuda, fq, rows, budget, batch_budget::flattened, kept_cu, nullptr, 0).ok() &&
              fq.bytes == 0);
  const batch_rows both{rows.scores, cu_seq, cu_seq, 1, 1};
  KVGPU_CHECK(select_topk_batch(kvevict::cuda, fq, both, budget, batch_budget::flattened, kept_cu, nullptr, 0).code() ==
              errc::invalid_argument);
  workspace vq;  // varlen per-head budgets run on cuda: a size query
  KVGPU_CHECK(select_topk_batch(kvevict::cuda, vq, rows, budget, batch_budget::per_head, kept_cu, nullptr, 0).ok() &&
              vq.bytes > 0);
  const batch_rows two_heads{*make_matrix_view<const float>(s.data(), 2, 4), nullptr, cu_seq, 1, 1};
  KVGPU_CHECK(select_topk_batch(kvevict::cuda, vq, two_heads, budget, batch_budget::per_head, kept_cu, nullptr, 0).code() ==
              errc::shape_mismatch);
}

template <class F>
status two_phase_host(F&& call) {
  workspace q;
  KVEVICT_TRY(call(q));
  std::vector<unsigned char> mem(q.bytes + 1);
  workspace ws{mem.data(), q.bytes};
  return call(ws);
}

template <class F>
status two_phase(F&& call) {
  workspace q;
  KVEVICT_TRY(call(q));
  void* mem = nullptr;
  KVGPU_CUDA(cudaMalloc(&mem, q.bytes + 1));
  workspace ws{mem, q.bytes};
  const status st = call(ws);
  KVGPU_CUDA(cudaDeviceSynchronize());
  cudaFree(mem);
  return st;
}

void compaction_case(std::mt19937_64& g, index_t ps, page_lists lists, page_layout pl, bool share_a_page) {
  layout L = make_layout(g, ps, lists, pl);
  if (share_a_page && L.indptr.back() >= 2) L.indices[1] = L.indices[0];
  const index_t lists_n = L.list_count();
  // host reference
  std::vector<float> hk = L.k, hv = L.v;
  std::vector<std::int32_t> hlen(static_cast<std::size_t>(lists_n) + 1, -7), hfreed(static_cast<std::size_t>(L.pages) + 1, -7);
  std::int32_t hcount = -7;
  const status hs = two_phase_host([&](workspace& ws) {
    return compact_paged(seq, ws, L.on(hk.data(), hv.data(), L.indptr.data(), L.indices.data(), L.last.data()),
                         ragged_positions{L.pos.data(), L.cu.data(), L.S * L.H},
                         paged_compaction_out{hlen.data(), hfreed.data(), L.pages, &hcount});
  });
  // device
  dbuf<float> dk(L.k), dv(L.v);
  dbuf<std::int32_t> ip(L.indptr), ix(L.indices), lp(L.last), cu(L.cu), len(std::vector<std::int32_t>(hlen.size(), -7)),
      fr(std::vector<std::int32_t>(hfreed.size(), -7)), cnt(std::vector<std::int32_t>{-7, 0});
  dbuf<pos_t> pos(L.pos);
  const status ds = two_phase([&](workspace& ws) {
    return compact_paged(kvevict::cuda, ws, L.on(dk.p, dv.p, ip.p, ix.p, lp.p), ragged_positions{pos.p, cu.p, L.S * L.H},
                         paged_compaction_out{len.p, fr.p, L.pages, cnt.p}, cnt.p + 1);
  });
  KVGPU_CHECK(ds.ok());
  const auto count = cnt.get(2);
  if (!hs.ok()) {  // the shared page: nothing written on the device either, one problem or more counted
    KVGPU_CHECK(dk.get(L.k.size()) == L.k && dv.get(L.v.size()) == L.v && count[0] == -7 && count[1] > 0);
    return;
  }
  KVGPU_CHECK(count[1] == 0 && count[0] == hcount);
  KVGPU_CHECK(dk.get(L.k.size()) == hk && dv.get(L.v.size()) == hv);
  KVGPU_CHECK(len.get(hlen.size()) == hlen && fr.get(hfreed.size()) == hfreed);
}

void scores_case(std::mt19937_64& g) {
  layout L = make_layout(g, 16, page_lists::per_head, page_layout::hnd);
  const index_t R = L.S * L.H, C = 3 * 16 + 5, group = 2;
  std::vector<float> hk(R * C, 3.f), hw(R * group * C, 2.f);
  const auto HL = L.on(L.k.data(), L.v.data(), L.indptr.data(), L.indices.data(), L.last.data());
  KVGPU_CHECK(two_phase_host([&](workspace& ws) { return paged_key_norm_scores(seq, ws, HL, *make_matrix_view(hk.data(), R, C)); }).ok());
  KVGPU_CHECK(two_phase_host([&](workspace& ws) {
                return paged_weight_by_value_norm(seq, ws, *make_matrix_view(hw.data(), R * group, C), HL,
                                                  value_weight::head_max);
              }).ok());
  dbuf<float> dk(L.k), dv(L.v), sk(std::vector<float>(hk.size(), 3.f)), sw(std::vector<float>(hw.size(), 2.f));
  dbuf<std::int32_t> ip(L.indptr), ix(L.indices), lp(L.last);
  const auto DL = L.on(dk.p, dv.p, ip.p, ix.p, lp.p);
  KVGPU_CHECK(paged_key_norm_scores(kvevict::cuda, DL, *make_matrix_view(sk.p, R, C)).ok());
  KVGPU_CHECK(paged_weight_by_value_norm(kvevict::cuda, *make_matrix_view(sw.p, R * group, C), DL, value_weight::head_max).ok());
  KVGPU_CUDA(cudaDeviceSynchronize());
  KVGPU_CHECK(sk.get(hk.size()) == hk && sw.get(hw.size()) == hw);
}

// padded rows with per-head or flattened budgets (ties: scores rounded to halves every other trial)
void batch_case(std::mt19937_64& g, batch_budget kind) {
  const index_t S = 1 + g() % 16, H = 1 + g() % 8, T = 1 + g() % 2000;
  std::vector<float> s(S * H * T);
  std::normal_distribution<float> nd;
  const bool ties = g() % 2 == 0;
  for (auto& x : s) x = ties ? std::round(2 * nd(g)) / 2 : nd(g);
  if (!s.empty()) s[g() % s.size()] = std::numeric_limits<float>::quiet_NaN();
  std::vector<std::int32_t> lens(S * H), budgets(S);
  for (auto& l : lens) l = static_cast<std::int32_t>(g() % (T + 1));
  for (auto& b : budgets) b = static_cast<std::int32_t>(g() % (T / 4 + 2));
  std::vector<std::int32_t> hcu(S * H + 1);
  std::vector<pos_t> hpos(S * H * T + 1, -1);
  KVGPU_CHECK(two_phase_host([&](workspace& ws) {
                return select_topk_batch(seq, ws, batch_padded(*make_matrix_view<const float>(s.data(), S * H, T), S, H, lens.data()),
                                         budgets.data(), kind, hcu.data(), hpos.data(), hpos.size());
              }).ok());
  dbuf<float> ds(s);
  dbuf<std::int32_t> dl(lens), db(budgets), dcu(std::vector<std::int32_t>(hcu.size(), -1));
  dbuf<pos_t> dpos(std::vector<pos_t>(hpos.size(), -1));
  KVGPU_CHECK(two_phase([&](workspace& ws) {
                return select_topk_batch(kvevict::cuda, ws, batch_padded(*make_matrix_view<const float>(ds.p, S * H, T), S, H, dl.p),
                                         db.p, kind, dcu.p, dpos.p, hpos.size());
              }).ok());
  KVGPU_CHECK(dcu.get(hcu.size()) == hcu && dpos.get(hpos.size()) == hpos);
}

// varlen rows (scores [H][total], cu_seqlens) with per-head or flattened budgets: the same kept
// lists as seq
void varlen_case(std::mt19937_64& g, batch_budget kind) {
  const index_t S = 1 + g() % 12, H = 1 + g() % 8;
  std::vector<std::int32_t> cu(S + 1, 0), budgets(S);
  for (index_t i = 0; i < S; ++i) {
    cu[i + 1] = cu[i] + static_cast<std::int32_t>(g() % 1500);
    budgets[i] = static_cast<std::int32_t>(g() % (cu[i + 1] - cu[i] + 2));
  }
  const index_t T = cu[S] + 1;
  std::vector<float> s(H * T);
  std::normal_distribution<float> nd;
  for (auto& x : s) x = nd(g);
  std::vector<std::int32_t> hcu(S * H + 1);
  std::vector<pos_t> hpos(H * T + 1, -1);
  KVGPU_CHECK(two_phase_host([&](workspace& ws) {
                return select_topk_batch(seq, ws, batch_varlen(*make_matrix_view<const float>(s.data(), H, T), cu.data(), S),
                                         budgets.data(), kind, hcu.data(), hpos.data(), hpos.size());
              }).ok());
  dbuf<float> ds(s);
  dbuf<std::int32_t> dc(cu), db(budgets), dcu(std::vector<std::int32_t>(hcu.size(), -1));
  dbuf<pos_t> dpos(std::vector<pos_t>(hpos.size(), -1));
  KVGPU_CHECK(two_phase([&](workspace& ws) {
                return select_topk_batch(kvevict::cuda, ws, batch_varlen(*make_matrix_view<const float>(ds.p, H, T), dc.p, S),
                                         db.p, kind, dcu.p, dpos.p, hpos.size());
              }).ok());
  KVGPU_CHECK(dcu.get(hcu.size()) == hcu && dpos.get(hpos.size()) == hpos);
}

}  // namespace

int main() {
  host_checks();
  if (kvgpu::failures != 0) return 1;
  kvgpu::skip_without_gpu();
  std::mt19937_64 g(13);
  for (const index_t ps : {index_t(1), index_t(16), index_t(64)})
    for (const page_lists lists : {page_lists::per_sequence, page_lists::per_head})
      for (const page_layout pl : {page_layout::nhd, page_layout::hnd})
        for (int trial = 0; trial < 4; ++trial) compaction_case(g, ps, lists, pl, trial == 3);
  for (int trial = 0; trial < 10; ++trial) {
    scores_case(g);
    for (const batch_budget kind : {batch_budget::per_head, batch_budget::flattened}) batch_case(g, kind), varlen_case(g, kind);
  }
  std::printf("paged gpu: %d failures\n", kvgpu::failures);
  return kvgpu::failures == 0 ? 0 : 1;
}
