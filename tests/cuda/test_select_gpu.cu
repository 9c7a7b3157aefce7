// The CUDA selection (kvevict/cuda/select.cuh) against the host backend, position for position.
// Part 1 (runs everywhere, no GPU needed): the launchers' host-side checks and workspace queries,
// which return before touching the CUDA runtime. Part 2 (skips without a usable device): random
// dense, ragged and flattened selections with every algorithm, special values and ties, long
// rows, strided scores, and rows with invalid device-resident arguments.
#include "gpu_check.cuh"

#include <kvevict/cuda/select.cuh>
#include <kvevict/select.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

using namespace kvevict;

namespace {

// ---- helpers -------------------------------------------------------------------------------------

bool fails_with(const status& st, errc code, const char* needle) {
  const bool ok = !st.ok() && st.code() == code && std::string(st.message()).find(needle) != std::string::npos;
  if (!ok) std::printf("  unexpected status: %s (%s)\n", st.message(), errc_name(st.code()));
  return ok;
}

template <class T>
struct dbuf {
  T* p = nullptr;
  std::size_t n = 0;
  explicit dbuf(std::size_t count) : n(count) { KVGPU_CUDA(cudaMalloc(&p, std::max<std::size_t>(1, n) * sizeof(T))); }
  dbuf(const std::vector<T>& v) : dbuf(v.size()) { upload(v); }
  ~dbuf() { cudaFree(p); }
  dbuf(const dbuf&) = delete;
  dbuf& operator=(const dbuf&) = delete;
  void upload(const std::vector<T>& v) {
    if (!v.empty()) KVGPU_CUDA(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> v(n);
    if (n > 0) KVGPU_CUDA(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }
};

/// Two-phase workspace in device memory, `shift` bytes into its allocation (a misaligned base must work).
struct dws {
  void* p = nullptr;
  workspace ws;
  std::size_t shift = 0;
  template <class F>
  status run(F&& f) {
    workspace q;
    KVEVICT_TRY(f(q));
    if (p != nullptr) cudaFree(p);
    KVGPU_CUDA(cudaMalloc(&p, std::max<std::size_t>(1, q.bytes + shift)));
    ws = workspace{static_cast<unsigned char*>(p) + shift, q.bytes};
    return f(ws);
  }
  ~dws() { cudaFree(p); }
};

std::vector<unsigned char> host_mem;
template <class F>
status host_run(F&& f) {
  workspace q;
  KVEVICT_TRY(f(q));
  host_mem.assign(std::max<std::size_t>(1, q.bytes), 0);
  workspace ws{host_mem.data(), host_mem.size()};
  return f(ws);
}

float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

float draw(std::mt19937_64& g, int dist, index_t i) {
  switch (dist) {
    case 0: return std::uniform_real_distribution<float>(0.f, 1.f)(g);
    case 1: return static_cast<float>(g() % 3);
    case 2: return 0.25f;
    case 3: {
      const float pool[] = {std::numeric_limits<float>::quiet_NaN(), from_bits(0xffc00001u),
                            std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                            0.f, -0.f, 1.f, std::numeric_limits<float>::denorm_min()};
      const auto k = g() % 16;
      return k < 8 ? pool[k] : std::uniform_real_distribution<float>(-2.f, 2.f)(g);
    }
    case 4: return from_bits(static_cast<std::uint32_t>(g()));
    default: return static_cast<float>((i / 7) % 50);  // runs of ties, like max pooling
  }
}

const std::size_t misalign[] = {0, 1, 4};  // workspace offsets into its allocation, by trial
const select_algo algos[] = {select_algo::auto_, select_algo::one_block, select_algo::multi_block};

// ---- part 1: host-side checks ----------------------------------------------------------------------

void host_checks() {
  std::vector<float> sc(4 * 100, 1.f);
  std::vector<pos_t> out(4 * 10);
  std::vector<std::int32_t> lens(4, 100), cu(5, 0);
  const auto scores = *make_matrix_view(static_cast<const float*>(sc.data()), 4, 100);
  const auto kept = *make_matrix_view(out.data(), 4, 10);
  workspace q;
  KVGPU_CHECK(select_topk(kvevict::cuda, q, scores, lens.data(), kept).ok());
  KVGPU_CHECK(q.bytes > 0);  // never 0: the second phase must not look like a query
  workspace qm;
  KVGPU_CHECK(select_topk(kvevict::cuda, qm, scores, lens.data(), kept, cuda_select_options{select_algo::multi_block}).ok());
  KVGPU_CHECK(qm.bytes > 4 * 3 * 8192);  // three 8 KiB histograms per row
  std::vector<unsigned char> small(q.bytes - 1);
  workspace ws_small{small.data(), small.size()};
  KVGPU_CHECK(fails_with(select_topk(kvevict::cuda, ws_small, scores, lens.data(), kept), errc::workspace_too_small,
                         "select_topk(cuda): workspace has"));
  std::vector<unsigned char> big(1 << 20);
  workspace ws{big.data(), big.size()};
  // the host form's errors that need no device data
  KVGPU_CHECK(fails_with(select_topk(kvevict::cuda, ws, scores, lens.data(), *make_matrix_view(out.data(), 3, 10)),
                         errc::shape_mismatch, "kept has 3 rows but scores has 4"));
  KVGPU_CHECK(fails_with(select_topk(kvevict::cuda, ws, scores, lens.data(), *make_matrix_view(reinterpret_cast<pos_t*>(sc.data()), 4, 10)),
                         errc::overlap, "kept and scores overlap"));
  std::vector<pos_t> wide(4 * 101);
  KVGPU_CHECK(fails_with(select_topk(kvevict::cuda, ws, scores, nullptr, *make_matrix_view(wide.data(), 4, 101)),
                         errc::invalid_argument, "k = 101 is larger than the rows' 100 columns"));
  cuda_select_options bad_algo;
  bad_algo.algo = static_cast<select_algo>(7);
  KVGPU_CHECK(fails_with(select_topk(kvevict::cuda, ws, scores, nullptr, kept, bad_algo), errc::invalid_argument,
                         "options.algo = 7"));
  workspace ws_on_kept{out.data(), 1 << 12};
  KVGPU_CHECK(fails_with(select_topk(kvevict::cuda, ws_on_kept, scores, nullptr, kept), errc::overlap,
                         "the workspace and kept overlap"));
  // ragged
  KVGPU_CHECK(fails_with(select_topk(kvevict::cuda, ws, scores, nullptr, ragged_positions_out{out.data(), nullptr, 4}),
                         errc::null_pointer, "kept.cu offsets are null"));
  KVGPU_CHECK(fails_with(select_topk(kvevict::cuda, ws, scores, nullptr, ragged_positions_out{out.data(), cu.data(), 3}),
                         errc::shape_mismatch, "kept has 3 heads"));
  cuda_select_options cap;
  cap.pos_capacity = 40;
  KVGPU_CHECK(fails_with(select_topk(kvevict::cuda, ws, scores, nullptr,
                                     ragged_positions_out{reinterpret_cast<pos_t*>(sc.data()) + 390, cu.data(), 4}, cap),
                         errc::overlap, "kept.pos and scores overlap"));
  cap.pos_capacity = -3;
  KVGPU_CHECK(fails_with(select_topk(kvevict::cuda, ws, scores, nullptr, ragged_positions_out{out.data(), cu.data(), 4}, cap),
                         errc::invalid_argument, "options.pos_capacity = -3"));
  // flat
  KVGPU_CHECK(fails_with(select_topk_flat(kvevict::cuda, ws, scores, nullptr, -1, nullptr, cu.data(), out.data()),
                         errc::invalid_argument, "total = -1 is outside"));
  KVGPU_CHECK(fails_with(select_topk_flat(kvevict::cuda, ws, scores, nullptr, 10, nullptr, nullptr, out.data()),
                         errc::null_pointer, "kept_cu is null"));
  KVGPU_CHECK(fails_with(select_topk_flat(kvevict::cuda, ws, scores, lens.data(), 10, nullptr, lens.data() + 1, out.data()),
                         errc::overlap, "kept_cu and row_lengths overlap"));
  workspace fq;
  KVGPU_CHECK(select_topk_flat(kvevict::cuda, fq, scores, lens.data(), 10, nullptr, cu.data(), out.data()).ok());
  KVGPU_CHECK(fq.bytes > 4 * 3 * 8192);
  // misaligned device arrays (an arena pointer + 1 or + 2 bytes): a clear error, never a launch
  const auto shifted = [](auto* p, int bytes) {
    using P = decltype(p);
    return reinterpret_cast<P>(reinterpret_cast<std::uintptr_t>(p) + bytes);
  };
  const auto odd_scores = *make_matrix_view(shifted(static_cast<const float*>(sc.data()), 1), 4, 99);
  KVGPU_CHECK(fails_with(select_topk(kvevict::cuda, ws, odd_scores, lens.data(), kept), errc::invalid_argument,
                         "select_topk(cuda): scores is not aligned to 4 bytes"));
  KVGPU_CHECK(fails_with(select_topk(kvevict::cuda, ws, scores, shifted(lens.data(), 2), kept), errc::invalid_argument,
                         "row_lengths is not aligned to 4 bytes"));
  KVGPU_CHECK(fails_with(select_topk(kvevict::cuda, ws, scores, lens.data(), *make_matrix_view(shifted(out.data(), 2), 4, 9)),
                         errc::invalid_argument, "kept is not aligned to 4 bytes"));
  KVGPU_CHECK(fails_with(select_topk(kvevict::cuda, ws, scores, nullptr, ragged_positions_out{shifted(out.data(), 2), cu.data(), 4}),
                         errc::invalid_argument, "kept.pos is not aligned to 4 bytes"));
  KVGPU_CHECK(fails_with(select_topk(kvevict::cuda, ws, scores, nullptr, ragged_positions_out{out.data(), shifted(cu.data(), 1), 4}),
                         errc::invalid_argument, "kept.cu is not aligned to 4 bytes"));
  KVGPU_CHECK(fails_with(select_topk_flat(kvevict::cuda, ws, scores, nullptr, 10, nullptr, shifted(cu.data(), 2), out.data()),
                         errc::invalid_argument, "select_topk_flat(cuda): kept_cu is not aligned to 4 bytes"));
  KVGPU_CHECK(fails_with(select_topk_flat(kvevict::cuda, ws, scores, nullptr, 10, nullptr, cu.data(), shifted(out.data(), 2)),
                         errc::invalid_argument, "kept_pos is not aligned to 4 bytes"));
  KVGPU_CHECK(fails_with(select_topk_flat(kvevict::cuda, ws, scores, nullptr, 10, shifted(lens.data(), 1), cu.data(), out.data()),
                         errc::invalid_argument, "floors is not aligned to 4 bytes"));
  std::printf("select(cuda) host-side checks: %d failures\n", kvgpu::failures);
}

// ---- part 2: on the GPU -----------------------------------------------------------------------------

void dense_and_ragged(std::mt19937_64& g, int trial) {
  const int dist = trial % 6;
  const index_t R = 1 + static_cast<index_t>(g() % 7);
  const index_t T = trial % 10 == 0 ? 40000 + static_cast<index_t>(g() % 60000) : static_cast<index_t>(g() % 9000);
  const bool transposed = trial % 7 == 3;
  const index_t rs = transposed ? 1 : T + (trial % 3 == 1 ? 5 : 0), cs = transposed ? R : 1;
  std::vector<float> sc(static_cast<std::size_t>(std::max<index_t>(1, transposed ? R * T : R * rs)), -9.f);
  for (index_t r = 0; r < R; ++r)
    for (index_t j = 0; j < T; ++j) sc[static_cast<std::size_t>(r * rs + j * cs)] = draw(g, dist, j);
  using exts = cuda::std::dextents<index_t, 2>;
  const cuda::std::array<index_t, 2> strides{std::max<index_t>(1, rs), cs};
  const matrix_view<const float> host_scores(sc.data(), cuda::std::layout_stride::mapping<exts>(exts(R, T), strides));
  std::vector<std::int32_t> lens(static_cast<std::size_t>(R));
  index_t min_len = T;
  for (auto& l : lens) {
    l = static_cast<std::int32_t>(trial % 2 ? T : static_cast<index_t>(g() % (T + 1)));
    min_len = std::min<index_t>(min_len, l);
  }
  const index_t k = trial % 4 == 0 ? 0 : trial % 4 == 1 ? min_len : static_cast<index_t>(g() % (min_len + 1));
  std::vector<pos_t> ref(static_cast<std::size_t>(std::max<index_t>(1, R * k)));
  KVGPU_CHECK(host_run([&](workspace& w) {
                return select_topk(seq, w, host_scores, lens.data(), *make_matrix_view(ref.data(), R, k));
              }).ok());
  std::vector<std::int32_t> cu(static_cast<std::size_t>(R + 1), 0);
  for (index_t r = 0; r < R; ++r) cu[r + 1] = cu[r] + static_cast<std::int32_t>(g() % (lens[r] + 1));
  std::vector<pos_t> rref(static_cast<std::size_t>(std::max(1, cu.back())));
  KVGPU_CHECK(host_run([&](workspace& w) {
                return select_topk(seq, w, host_scores, lens.data(), ragged_positions_out{rref.data(), cu.data(), R});
              }).ok());

  dbuf<float> d_sc(sc);
  dbuf<std::int32_t> d_lens(lens), d_cu(cu);
  dbuf<int> d_bad(1);
  const matrix_view<const float> dev_scores(d_sc.p, host_scores.mapping());
  for (select_algo algo : algos) {
    KVGPU_CUDA(cudaMemset(d_bad.p, 0, sizeof(int)));
    cuda_select_options o;
    o.algo = algo;
    o.bad_rows = d_bad.p;
    dbuf<pos_t> d_kept(ref.size());
    dws w1;
    w1.shift = misalign[trial % 3];
    KVGPU_CHECK(w1.run([&](workspace& w) {
                    return select_topk(kvevict::cuda, w, dev_scores, d_lens.p, *make_matrix_view(d_kept.p, R, k), o);
                  }).ok());
    dbuf<pos_t> d_pos(rref.size());
    o.pos_capacity = trial % 2 ? cu.back() : -1;
    o.synchronize = trial % 3 == 0;
    dws w2;
    w2.shift = misalign[(trial + 1) % 3];
    KVGPU_CHECK(w2.run([&](workspace& w) {
                    return select_topk(kvevict::cuda, w, dev_scores, d_lens.p, ragged_positions_out{d_pos.p, d_cu.p, R}, o);
                  }).ok());
    KVGPU_CUDA(cudaDeviceSynchronize());
    const auto got = d_kept.download();
    const auto rgot = d_pos.download();
    KVGPU_CHECK(d_bad.download()[0] == 0);
    KVGPU_CHECK(std::equal(ref.begin(), ref.begin() + R * k, got.begin()));
    KVGPU_CHECK(std::equal(rref.begin(), rref.begin() + cu.back(), rgot.begin()));
  }
}

void flat(std::mt19937_64& g, int trial) {
  const int dist = trial % 6;
  const index_t R = 1 + static_cast<index_t>(g() % 9);
  const index_t T = trial % 8 == 0 ? 40000 : static_cast<index_t>(g() % 3000);
  std::vector<float> sc(static_cast<std::size_t>(std::max<index_t>(1, R * T)));
  for (index_t r = 0; r < R; ++r)
    for (index_t j = 0; j < T; ++j) sc[static_cast<std::size_t>(r * T + j)] = draw(g, dist, j);
  std::vector<std::int32_t> lens(static_cast<std::size_t>(R)), floors(lens.size());
  index_t sum_len = 0, sum_floor = 0;
  for (index_t r = 0; r < R; ++r) {
    lens[r] = static_cast<std::int32_t>(trial % 3 == 0 ? T : static_cast<index_t>(g() % (T + 1)));
    floors[r] = static_cast<std::int32_t>(g() % 4 == 0 ? lens[r] : static_cast<index_t>(g() % (lens[r] / 2 + 1)));
    sum_len += lens[r];
    sum_floor += floors[r];
  }
  const bool use_floors = trial % 2 == 0;
  const index_t lo = use_floors ? sum_floor : 0;
  const index_t total = lo + static_cast<index_t>(g() % (sum_len - lo + 1));
  const std::int32_t* fp = use_floors ? floors.data() : nullptr;
  const auto host_scores = *make_matrix_view(static_cast<const float*>(sc.data()), R, T, std::max<index_t>(1, T));
  std::vector<std::int32_t> cu_ref(static_cast<std::size_t>(R + 1));
  std::vector<pos_t> ref(static_cast<std::size_t>(std::max<index_t>(1, total)));
  KVGPU_CHECK(host_run([&](workspace& w) {
                return select_topk_flat(seq, w, host_scores, lens.data(), total, fp, cu_ref.data(), ref.data());
              }).ok());
  dbuf<float> d_sc(sc);
  dbuf<std::int32_t> d_lens(lens), d_floors(floors);
  const matrix_view<const float> dev_scores(d_sc.p, host_scores.mapping());
  for (select_algo algo : algos) {
    cuda_select_options o;
    o.algo = algo;
    o.synchronize = true;
    dbuf<std::int32_t> d_cu(cu_ref.size());
    dbuf<pos_t> d_pos(ref.size());
    dws w;
    w.shift = misalign[trial % 3];
    KVGPU_CHECK(w.run([&](workspace& ws) {
                   return select_topk_flat(kvevict::cuda, ws, dev_scores, d_lens.p, total, use_floors ? d_floors.p : nullptr,
                                           d_cu.p, d_pos.p, o);
                 }).ok());
    KVGPU_CHECK(d_cu.download() == cu_ref);
    const auto got = d_pos.download();
    KVGPU_CHECK(std::equal(ref.begin(), ref.begin() + total, got.begin()));
    // counts only
    dbuf<std::int32_t> d_cu2(cu_ref.size());
    KVGPU_CHECK(w.run([&](workspace& ws) {
                   return select_topk_flat(kvevict::cuda, ws, dev_scores, d_lens.p, total, use_floors ? d_floors.p : nullptr,
                                           d_cu2.p, nullptr, o);
                 }).ok());
    KVGPU_CHECK(d_cu2.download() == cu_ref);
  }
}

void bad_device_arguments() {
  std::mt19937_64 g(5);
  const index_t R = 4, T = 300, k = 20;
  std::vector<float> sc(static_cast<std::size_t>(R * T));
  for (auto& x : sc) x = draw(g, 0, 0);
  const std::vector<std::int32_t> lens = {300, 301, 10, 299};  // row 1 too long, row 2 shorter than k
  dbuf<float> d_sc(sc);
  dbuf<std::int32_t> d_lens(lens);
  dbuf<int> d_bad(1);
  const auto dev_scores = *make_matrix_view(static_cast<const float*>(d_sc.p), R, T);
  for (select_algo algo : algos) {
    KVGPU_CUDA(cudaMemset(d_bad.p, 0, sizeof(int)));
    std::vector<pos_t> sentinel(static_cast<std::size_t>(R * k), -5);
    dbuf<pos_t> d_kept(sentinel);
    cuda_select_options o;
    o.algo = algo;
    o.bad_rows = d_bad.p;
    dws w;
    KVGPU_CHECK(w.run([&](workspace& ws) {
                   return select_topk(kvevict::cuda, ws, dev_scores, d_lens.p, *make_matrix_view(d_kept.p, R, k), o);
                 }).ok());
    KVGPU_CUDA(cudaDeviceSynchronize());
    KVGPU_CHECK(d_bad.download()[0] == 2);
    const auto got = d_kept.download();
    KVGPU_CHECK(std::all_of(got.begin() + k, got.begin() + 3 * k, [](pos_t p) { return p == -5; }));
    KVGPU_CHECK(got[0] != -5 && got[3 * k] != -5);
    o.synchronize = true;
    KVGPU_CHECK(fails_with(w.run([&](workspace& ws) {
                             return select_topk(kvevict::cuda, ws, dev_scores, d_lens.p, *make_matrix_view(d_kept.p, R, k), o);
                           }),
                           errc::out_of_range, "2 rows had invalid device-resident arguments"));
    // the flattened selection refuses the whole layer
    dbuf<std::int32_t> d_cu(std::vector<std::int32_t>(R + 1, 9));
    KVGPU_CHECK(fails_with(w.run([&](workspace& ws) {
                             return select_topk_flat(kvevict::cuda, ws, dev_scores, d_lens.p, 50, nullptr, d_cu.p, nullptr, o);
                           }),
                           errc::out_of_range, "1 rows had invalid"));
    KVGPU_CHECK(d_cu.download() == std::vector<std::int32_t>(R + 1, 0));
  }
}

/// Two rows of 2^20 tokens (uniform, and heavy ties), every algorithm.
void long_rows() {
  std::mt19937_64 g(77);
  const index_t R = 2, T = index_t(1) << 20, k = 100000;
  std::vector<float> sc(static_cast<std::size_t>(R * T));
  for (index_t j = 0; j < T; ++j) {
    sc[static_cast<std::size_t>(j)] = draw(g, 0, j);
    sc[static_cast<std::size_t>(T + j)] = draw(g, 5, j);
  }
  const std::vector<std::int32_t> lens = {static_cast<std::int32_t>(T), static_cast<std::int32_t>(T - 999)};
  const auto host_scores = *make_matrix_view(static_cast<const float*>(sc.data()), R, T);
  std::vector<pos_t> ref(static_cast<std::size_t>(R * k));
  KVGPU_CHECK(host_run([&](workspace& w) {
                return select_topk(seq, w, host_scores, lens.data(), *make_matrix_view(ref.data(), R, k));
              }).ok());
  dbuf<float> d_sc(sc);
  dbuf<std::int32_t> d_lens(lens);
  const auto dev_scores = *make_matrix_view(static_cast<const float*>(d_sc.p), R, T);
  for (select_algo algo : algos) {
    cuda_select_options o;
    o.algo = algo;
    o.synchronize = true;
    dbuf<pos_t> d_kept(ref.size());
    dws w;
    KVGPU_CHECK(w.run([&](workspace& ws) {
                   return select_topk(kvevict::cuda, ws, dev_scores, d_lens.p, *make_matrix_view(d_kept.p, R, k), o);
                 }).ok());
    KVGPU_CHECK(d_kept.download() == ref);
  }
}

}  // namespace

int main() {
  host_checks();
  if (kvgpu::failures != 0) return 1;
  kvgpu::skip_without_gpu();
  std::mt19937_64 g(2024);
  for (int trial = 0; trial < 60; ++trial) dense_and_ragged(g, trial);
  for (int trial = 0; trial < 40; ++trial) flat(g, trial);
  bad_device_arguments();
  long_rows();
  std::printf("select gpu: %d failures\n", kvgpu::failures);
  return kvgpu::failures == 0 ? 0 : 1;
}
