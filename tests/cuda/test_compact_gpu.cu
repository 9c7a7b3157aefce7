// GPU compaction vs the seq backend on random inputs, bit for bit. Part 1 (runs everywhere): the
// CUDA launchers' host-side checks and workspace queries, which return before any CUDA call.
// Part 2 (skips without a usable device): dense, ragged_view, ragged_cache, in place (dense and
// ragged, several tile shapes) and append, on aligned and misaligned buffers (every copy unit),
// contiguous and strided rows, and invalid device-resident arguments.
#include "gpu_check.cuh"

#include <kvevict/compact.hpp>
#include <kvevict/cuda/compact.cuh>
#include <kvevict/numeric.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

using namespace kvevict;

namespace {

bool fails_with(const status& st, errc code, const char* needle) {
  const bool ok = !st.ok() && st.code() == code && std::string(st.message()).find(needle) != std::string::npos;
  if (!ok) std::printf("  unexpected status: %s (%s)\n", st.message(), errc_name(st.code()));
  return ok;
}

template <class T>
struct dbuf {
  T* p = nullptr;
  std::size_t n = 0;
  explicit dbuf(std::size_t count) : n(count) { KVGPU_CUDA(cudaMalloc(&p, std::max<std::size_t>(1, n) * sizeof(T) + 64)); }
  dbuf(const std::vector<T>& v) : dbuf(v.size()) { upload(v); }
  ~dbuf() { cudaFree(p); }
  dbuf(const dbuf&) = delete;
  dbuf& operator=(const dbuf&) = delete;
  void upload(const std::vector<T>& v, std::size_t at = 0) {
    if (!v.empty()) KVGPU_CUDA(cudaMemcpy(p + at, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download(std::size_t count, std::size_t at = 0) const {
    std::vector<T> v(count);
    if (count > 0) KVGPU_CUDA(cudaMemcpy(v.data(), p + at, count * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }
};

template <class T>
std::vector<T> random_elems(std::mt19937_64& g, std::size_t n) {
  std::vector<T> v(n);
  for (auto& x : v) {
    const auto u = static_cast<std::uint64_t>(g());
    std::memcpy(&x, &u, sizeof(T));
  }
  return v;
}

std::vector<pos_t> positions(std::mt19937_64& g, index_t Tn, index_t k, bool ascending) {
  std::vector<pos_t> all(static_cast<std::size_t>(Tn));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), g);
  all.resize(static_cast<std::size_t>(k));
  if (ascending) std::sort(all.begin(), all.end());
  return all;
}

// ---- part 1: host-side checks --------------------------------------------------------------------

void host_checks() {
  std::vector<float> cache(2 * 4 * 3, 1.f), out(2 * 2 * 3);
  const auto src = *make_kv_view(static_cast<const float*>(cache.data()), 2, 4, 3);
  std::vector<pos_t> kept = {0, 1, 1, 2};
  const auto kv = *make_matrix_view(static_cast<const pos_t*>(kept.data()), 2, 2);
  KVGPU_CHECK(fails_with(compact(kvevict::cuda, src, kv, *make_kv_view(out.data(), 2, 1, 3)), errc::shape_mismatch,
                         "dst holds 1 tokens per head but kept lists 2"));
  KVGPU_CHECK(fails_with(compact(kvevict::cuda, src, kv, *make_kv_view(cache.data() + 6, 2, 2, 3)), errc::overlap,
                         "src and dst overlap"));
  const std::int32_t cu[] = {0, 2, 3};
  const ragged_positions rk{kept.data(), cu, 2};
  KVGPU_CHECK(fails_with(compact(kvevict::cuda, src, rk, ragged_view<float>{out.data(), cu, 2, 3, 2}),
                         errc::invalid_argument, "row_stride (2) must be positive and >= dim (3)"));
  KVGPU_CHECK(fails_with(compact(kvevict::cuda, src, rk, ragged_view<float>{out.data(), cu, 3, 3, 3}),
                         errc::shape_mismatch, "head counts differ"));
  KVGPU_CHECK(fails_with(compact(kvevict::cuda, src, rk, ragged_view<float>{out.data(), nullptr, 2, 3, 3}),
                         errc::null_pointer, "dst.cu_lens offsets are null"));
  KVGPU_CHECK(fails_with(compact(kvevict::cuda, src, rk, ragged_view<float>{cache.data() + 3, cu, 2, 3, 3}),
                         errc::overlap, "src and dst overlap"));
  std::int32_t lens[2] = {0, 0};
  KVGPU_CHECK(fails_with(compact(kvevict::cuda, src, rk, ragged_cache<float>{out.data(), cu, nullptr, 2, 3, 3}),
                         errc::null_pointer, "dst.lens is null"));
  KVGPU_CHECK(fails_with(compact(kvevict::cuda, src, rk, ragged_cache<float>{out.data(), cu, lens, 2, 2, 3}),
                         errc::shape_mismatch, "head dims differ"));
  // in place: workspace query (2064 B per head), too small, overlapping the cache
  std::vector<float> arena(4096, 1.f);
  auto cv = *make_kv_view(arena.data(), 2, 4, 3);
  workspace q;
  KVGPU_CHECK(compact_inplace(kvevict::cuda, q, cv, kv).ok());
  KVGPU_CHECK(q.bytes >= 2 * 2064 && q.bytes <= 2 * 2064 + 128);
  std::vector<unsigned char> small(q.bytes - 1);
  workspace ws_small{small.data(), small.size()};
  KVGPU_CHECK(fails_with(compact_inplace(kvevict::cuda, ws_small, cv, kv), errc::workspace_too_small, "workspace has"));
  workspace ws_on_cache{arena.data(), arena.size() * sizeof(float)};
  KVGPU_CHECK(fails_with(compact_inplace(kvevict::cuda, ws_on_cache, cv, kv), errc::overlap,
                         "the workspace and the cache overlap"));
  KVGPU_CHECK(fails_with(compact_inplace(kvevict::cuda, q, cv, *make_matrix_view(static_cast<const pos_t*>(kept.data()), 1, 4)),
                         errc::shape_mismatch, "kept has 1 heads, the cache 2"));
  const std::int32_t cap[] = {0, 4, 8};
  KVGPU_CHECK(fails_with(compact_inplace(kvevict::cuda, q, ragged_cache<float>{out.data(), cap, lens, 2, 3, 3},
                                         ragged_positions{kept.data(), cu, 3}),
                         errc::shape_mismatch, "kept has 3 heads, the cache 2"));
  // append
  KVGPU_CHECK(fails_with(append(kvevict::cuda, ragged_cache<float>{out.data(), cap, lens, 2, 3, 3},
                                *make_kv_view(static_cast<const float*>(cache.data()), 3, 1, 3)),
                         errc::shape_mismatch, "cache has 2 heads"));
  KVGPU_CHECK(fails_with(append(kvevict::cuda, ragged_cache<float>{out.data(), cap, nullptr, 2, 3, 3},
                                *make_kv_view(static_cast<const float*>(cache.data()), 2, 1, 3)),
                         errc::null_pointer, "cache.lens is null"));
  KVGPU_CHECK(fails_with(append(kvevict::cuda, ragged_cache<float>{cache.data(), cap, lens, 2, 3, 3},
                                *make_kv_view(static_cast<const float*>(cache.data()), 2, 1, 3)),
                         errc::overlap, "rows and cache overlap"));
  // misaligned device arrays (an arena pointer + 1 or 2 bytes): a clear error, never a launch
  const auto shifted = [](auto* p, int bytes) {
    using P = decltype(p);
    return reinterpret_cast<P>(reinterpret_cast<std::uintptr_t>(p) + bytes);
  };
  const auto odd_src = *make_kv_view(shifted(static_cast<const float*>(cache.data()), 2), 2, 3, 3);
  KVGPU_CHECK(fails_with(compact(kvevict::cuda, odd_src, kv, *make_kv_view(out.data(), 2, 2, 3)), errc::invalid_argument,
                         "compact(cuda): src is not aligned to 4 bytes"));
  const auto odd_kept = *make_matrix_view(shifted(static_cast<const pos_t*>(kept.data()), 2), 2, 1);
  KVGPU_CHECK(fails_with(compact(kvevict::cuda, src, odd_kept, *make_kv_view(out.data(), 2, 1, 3)), errc::invalid_argument,
                         "kept is not aligned to 4 bytes"));
  KVGPU_CHECK(fails_with(compact(kvevict::cuda, src, kv, *make_kv_view(shifted(out.data(), 1), 2, 1, 3)),
                         errc::shape_mismatch, "dst holds 1 tokens"));  // shapes first
  KVGPU_CHECK(fails_with(compact(kvevict::cuda, src, kv, *make_kv_view(shifted(arena.data(), 1), 2, 2, 3)),
                         errc::invalid_argument, "dst is not aligned to 4 bytes"));
  KVGPU_CHECK(fails_with(compact(kvevict::cuda, src, ragged_positions{shifted(kept.data(), 2), cu, 2},
                                 ragged_view<float>{out.data(), cu, 2, 3, 3}),
                         errc::invalid_argument, "kept.pos is not aligned to 4 bytes"));
  KVGPU_CHECK(fails_with(compact(kvevict::cuda, src, ragged_positions{kept.data(), shifted(cu, 2), 2},
                                 ragged_view<float>{out.data(), cu, 2, 3, 3}),
                         errc::invalid_argument, "kept.cu is not aligned to 4 bytes"));
  KVGPU_CHECK(fails_with(compact(kvevict::cuda, src, rk, ragged_view<float>{out.data(), shifted(cu, 1), 2, 3, 3}),
                         errc::invalid_argument, "dst.cu_lens is not aligned to 4 bytes"));
  KVGPU_CHECK(fails_with(compact(kvevict::cuda, src, rk, ragged_cache<float>{out.data(), cu, shifted(lens, 2), 2, 3, 3}),
                         errc::invalid_argument, "dst.lens is not aligned to 4 bytes"));
  KVGPU_CHECK(fails_with(compact_inplace(kvevict::cuda, q, *make_kv_view(shifted(arena.data(), 2), 2, 4, 3), kv),
                         errc::invalid_argument, "compact_inplace(cuda): cache is not aligned to 4 bytes"));
  KVGPU_CHECK(fails_with(compact_inplace(kvevict::cuda, q, cv, odd_kept), errc::invalid_argument,
                         "compact_inplace(cuda): kept is not aligned to 4 bytes"));
  KVGPU_CHECK(fails_with(compact_inplace(kvevict::cuda, q, ragged_cache<float>{out.data(), shifted(cap, 1), lens, 2, 3, 3},
                                         ragged_positions{kept.data(), cu, 2}),
                         errc::invalid_argument, "cache.cu_capacity is not aligned to 4 bytes"));
  KVGPU_CHECK(fails_with(compact_inplace(kvevict::cuda, q, ragged_cache<float>{out.data(), cap, lens, 2, 3, 3},
                                         ragged_positions{shifted(kept.data(), 2), cu, 2}),
                         errc::invalid_argument, "kept.pos is not aligned to 4 bytes"));
  KVGPU_CHECK(fails_with(append(kvevict::cuda, ragged_cache<float>{shifted(out.data(), 1), cap, lens, 2, 3, 3},
                                *make_kv_view(static_cast<const float*>(cache.data()), 2, 1, 3)),
                         errc::invalid_argument, "append(cuda): cache.data is not aligned to 4 bytes"));
  KVGPU_CHECK(fails_with(append(kvevict::cuda, ragged_cache<float>{out.data(), cap, lens, 2, 3, 3},
                                *make_kv_view(shifted(static_cast<const float*>(cache.data()), 2), 2, 1, 3)),
                         errc::invalid_argument, "append(cuda): rows is not aligned to 4 bytes"));
  std::printf("compact(cuda) host-side checks: %d failures\n", kvgpu::failures);
}

// ---- part 2: on the GPU ----------------------------------------------------------------------------

/// Dense gather and in place, on a cache at element offset `shift` (alignment of every unit).
template <class T>
void dense_case(std::mt19937_64& g, index_t H, index_t Tn, index_t D, index_t k, kv_layout layout, index_t shift) {
  const auto host = random_elems<T>(g, static_cast<std::size_t>(H * Tn * D));
  std::vector<pos_t> kept;
  for (index_t h = 0; h < H; ++h) {
    const auto p = positions(g, Tn, k, true);
    kept.insert(kept.end(), p.begin(), p.end());
  }
  const auto hsrc = *make_kv_view(host.data(), H, Tn, D, layout);
  const auto hkept = *make_matrix_view(static_cast<const pos_t*>(kept.data()), H, k);
  std::vector<T> expect(static_cast<std::size_t>(H * k * D));
  KVGPU_CHECK(compact(seq, hsrc, hkept, *make_kv_view(expect.data(), H, k, D)).ok());
  dbuf<T> d_src(host.size() + static_cast<std::size_t>(shift)), d_dst(expect.size() + 8);
  d_src.upload(host, static_cast<std::size_t>(shift));
  dbuf<pos_t> d_kept(kept);
  dbuf<int> d_bad(1);
  KVGPU_CUDA(cudaMemset(d_bad.p, 0, sizeof(int)));
  const auto dsrc = *make_kv_view(static_cast<const T*>(d_src.p + shift), H, Tn, D, layout);
  const auto dkept = *make_matrix_view(static_cast<const pos_t*>(d_kept.p), H, k);
  KVGPU_CHECK(compact(kvevict::cuda, dsrc, dkept, *make_kv_view(d_dst.p + shift % 3, H, k, D), d_bad.p).ok());
  KVGPU_CUDA(cudaDeviceSynchronize());
  const auto got = d_dst.download(expect.size(), static_cast<std::size_t>(shift % 3));
  KVGPU_CHECK(std::memcmp(got.data(), expect.data(), got.size() * sizeof(T)) == 0);
  // in place: the first k rows of every head become the kept rows
  std::vector<T> inplace = host;
  KVGPU_CHECK(compact_inplace(seq, *make_kv_view(inplace.data(), H, Tn, D, layout), hkept).ok());
  const auto dcache = *make_kv_view(d_src.p + shift, H, Tn, D, layout);
  workspace q;
  KVGPU_CHECK(compact_inplace(kvevict::cuda, q, dcache, dkept).ok());
  const auto ws_shift = static_cast<std::size_t>(shift) % 5;  // a misaligned workspace base must work
  dbuf<unsigned char> d_ws(q.bytes + ws_shift);
  workspace ws{d_ws.p + ws_shift, q.bytes};
  KVGPU_CHECK(compact_inplace(kvevict::cuda, ws, dcache, dkept, d_bad.p).ok());
  KVGPU_CUDA(cudaDeviceSynchronize());
  const auto after = d_src.download(host.size(), static_cast<std::size_t>(shift));
  KVGPU_CHECK(std::memcmp(after.data(), inplace.data(), after.size() * sizeof(T)) == 0);
  KVGPU_CHECK(d_bad.download(1)[0] == 0);
}

/// Ragged gathers, ragged_cache, in place on it, then appends.
template <class T>
void ragged_case(std::mt19937_64& g, index_t H, index_t Tn, index_t D, index_t spare) {
  const auto host = random_elems<T>(g, static_cast<std::size_t>(H * Tn * D));
  const auto hsrc = *make_kv_view(host.data(), H, Tn, D, kv_layout::token_major);
  std::vector<std::int32_t> cu(static_cast<std::size_t>(H + 1), 0), cap(cu);
  std::vector<pos_t> pos;
  for (index_t h = 0; h < H; ++h) {
    const auto p = positions(g, Tn, static_cast<index_t>(g() % (Tn + 1)), true);
    pos.insert(pos.end(), p.begin(), p.end());
    cu[h + 1] = cu[h] + static_cast<std::int32_t>(p.size());
    cap[h + 1] = cap[h] + static_cast<std::int32_t>(p.size() + spare);
  }
  const index_t rows = cu.back(), rs = D + 1;
  std::vector<T> flat(static_cast<std::size_t>(std::max<index_t>(1, rows * rs)));
  KVGPU_CHECK(compact(seq, hsrc, ragged_positions{pos.data(), cu.data(), H}, ragged_view<T>{flat.data(), cu.data(), H, D, rs}).ok());
  std::vector<T> store(static_cast<std::size_t>(std::max(1, cap.back()) * rs));
  std::vector<std::int32_t> lens(static_cast<std::size_t>(H), -1);
  ragged_cache<T> hc{store.data(), cap.data(), lens.data(), H, D, rs};
  KVGPU_CHECK(compact(seq, hsrc, ragged_positions{pos.data(), cu.data(), H}, hc).ok());

  dbuf<T> d_src(host), d_flat(flat.size()), d_store(store.size());
  dbuf<pos_t> d_pos(pos);
  dbuf<std::int32_t> d_cu(cu), d_cap(cap), d_lens(std::vector<std::int32_t>(static_cast<std::size_t>(H), -1));
  dbuf<int> d_bad(1);
  KVGPU_CUDA(cudaMemset(d_bad.p, 0, sizeof(int)));
  const auto dsrc = *make_kv_view(static_cast<const T*>(d_src.p), H, Tn, D, kv_layout::token_major);
  const ragged_positions dk{d_pos.p, d_cu.p, H};
  KVGPU_CHECK(compact(kvevict::cuda, dsrc, dk, ragged_view<T>{d_flat.p, d_cu.p, H, D, rs}, d_bad.p).ok());
  ragged_cache<T> dc{d_store.p, d_cap.p, d_lens.p, H, D, rs};
  KVGPU_CHECK(compact(kvevict::cuda, dsrc, dk, dc, d_bad.p).ok());
  KVGPU_CUDA(cudaDeviceSynchronize());
  for (index_t r = 0; r < rows; ++r) {
    const auto got = d_flat.download(static_cast<std::size_t>(D), static_cast<std::size_t>(r * rs));
    KVGPU_CHECK(std::memcmp(got.data(), flat.data() + r * rs, static_cast<std::size_t>(D) * sizeof(T)) == 0);
  }
  KVGPU_CHECK(d_lens.download(lens.size()) == lens);
  // in place on the ragged cache: keep every other row
  std::vector<std::int32_t> cu2(static_cast<std::size_t>(H + 1), 0);
  std::vector<pos_t> pos2;
  for (index_t h = 0; h < H; ++h) {
    for (pos_t j = 0; j < lens[h]; j += 2) pos2.push_back(j);
    cu2[h + 1] = static_cast<std::int32_t>(pos2.size());
  }
  KVGPU_CHECK(compact_inplace(seq, hc, ragged_positions{pos2.data(), cu2.data(), H}).ok());
  dbuf<pos_t> d_pos2(pos2);
  dbuf<std::int32_t> d_cu2(cu2);
  workspace q;
  KVGPU_CHECK(compact_inplace(kvevict::cuda, q, dc, ragged_positions{d_pos2.p, d_cu2.p, H}).ok());
  dbuf<unsigned char> d_ws(q.bytes);
  workspace ws{d_ws.p, q.bytes};
  KVGPU_CHECK(compact_inplace(kvevict::cuda, ws, dc, ragged_positions{d_pos2.p, d_cu2.p, H}, d_bad.p).ok());
  // append `spare` rows (a decode step) into the room left after the in-place compaction
  const auto fresh = random_elems<T>(g, static_cast<std::size_t>(H * spare * D));
  KVGPU_CHECK(append(seq, hc, *make_kv_view(fresh.data(), H, spare, D)).ok());
  dbuf<T> d_fresh(fresh);
  KVGPU_CHECK(append(kvevict::cuda, dc, *make_kv_view(static_cast<const T*>(d_fresh.p), H, spare, D), d_bad.p).ok());
  KVGPU_CUDA(cudaDeviceSynchronize());
  KVGPU_CHECK(d_lens.download(lens.size()) == lens);
  for (index_t h = 0; h < H; ++h)
    for (index_t j = 0; j < lens[h]; ++j) {
      const auto got = d_store.download(static_cast<std::size_t>(D), static_cast<std::size_t>((cap[h] + j) * rs));
      KVGPU_CHECK(std::memcmp(got.data(), hc.row(h, j), static_cast<std::size_t>(D) * sizeof(T)) == 0);
    }
  KVGPU_CHECK(d_bad.download(1)[0] == 0);
}

void bad_device_arguments() {
  std::mt19937_64 g(3);
  const index_t H = 3, Tn = 10, D = 8;
  const auto host = random_elems<float>(g, static_cast<std::size_t>(H * Tn * D));
  dbuf<float> d_src(host);
  const auto dsrc = *make_kv_view(static_cast<const float*>(d_src.p), H, Tn, D);
  dbuf<int> d_bad(1);
  // dense: positions 10 and -1 are skipped
  KVGPU_CUDA(cudaMemset(d_bad.p, 0, sizeof(int)));
  dbuf<pos_t> d_kept(std::vector<pos_t>{0, 10, -1, 3, 4, 5});
  dbuf<float> d_dst(static_cast<std::size_t>(H * 2 * D));
  KVGPU_CHECK(compact(kvevict::cuda, dsrc, *make_matrix_view(static_cast<const pos_t*>(d_kept.p), H, 2),
                      *make_kv_view(d_dst.p, H, 2, D), d_bad.p).ok());
  KVGPU_CUDA(cudaDeviceSynchronize());
  KVGPU_CHECK(d_bad.download(1)[0] == 2);
  // in place: head 1 unsorted -> untouched, heads 0 and 2 compacted
  KVGPU_CUDA(cudaMemset(d_bad.p, 0, sizeof(int)));
  dbuf<pos_t> d_inplace(std::vector<pos_t>{1, 2, 5, 4, 8, 9});
  const auto dcache = *make_kv_view(d_src.p, H, Tn, D);
  workspace q;
  KVGPU_CHECK(compact_inplace(kvevict::cuda, q, dcache, *make_matrix_view(static_cast<const pos_t*>(d_inplace.p), H, 2)).ok());
  dbuf<unsigned char> d_ws(q.bytes);
  workspace ws{d_ws.p, q.bytes};
  KVGPU_CHECK(compact_inplace(kvevict::cuda, ws, dcache, *make_matrix_view(static_cast<const pos_t*>(d_inplace.p), H, 2),
                              d_bad.p).ok());
  KVGPU_CUDA(cudaDeviceSynchronize());
  KVGPU_CHECK(d_bad.download(1)[0] == 1);
  const auto after = d_src.download(host.size());
  KVGPU_CHECK(std::memcmp(after.data() + Tn * D, host.data() + Tn * D, Tn * D * sizeof(float)) == 0);
  KVGPU_CHECK(std::memcmp(after.data(), host.data() + D, D * sizeof(float)) == 0);
}

}  // namespace

int main() {
  host_checks();
  if (kvgpu::failures != 0) return 1;
  kvgpu::skip_without_gpu();
  std::mt19937_64 g(42);
  for (int trial = 0; trial < 60; ++trial) {
    const index_t H = 1 + g() % 8, Tn = 1 + g() % 3000, k = g() % (Tn + 1);
    const index_t D = trial % 3 == 0 ? 1 + g() % 160 : 64 * (1 + g() % 3);
    const kv_layout layout = trial % 2 ? kv_layout::token_major : kv_layout::head_major;
    const index_t shift = trial % 4 == 0 ? static_cast<index_t>(g() % 8) : 0;
    dense_case<float>(g, H, Tn, D, k, layout, shift);
    dense_case<float16>(g, H, Tn, D, k, layout, shift);
    dense_case<std::int8_t>(g, H, Tn, D, k, layout, shift);
  }
  for (int trial = 0; trial < 30; ++trial) {
    ragged_case<bfloat16>(g, 1 + g() % 8, 1 + g() % 2000, 1 + g() % 130, g() % 4);
    ragged_case<float>(g, 1 + g() % 8, 1 + g() % 500, 128, 1);
  }
  // wide rows (64 KiB: the in-place tiles copy them directly), many heads
  dense_case<float>(g, 2, 40, 16384, 20, kv_layout::head_major, 0);
  dense_case<float16>(g, 300, 64, 128, 33, kv_layout::token_major, 0);
  // in place with more than inplace_ring (512) tiles per head: the flag ring wraps around (slots are
  // reused once the read prefix has passed their previous tile). 1 KiB and 256 B rows: 32 and 128
  // rows per 32 KiB tile, 17,000 and 66,000 kept rows per head = 532 and 516 tiles.
  for (const auto& [Tn, D, k] : {std::tuple<index_t, index_t, index_t>{20000, 256, 17000},
                                 std::tuple<index_t, index_t, index_t>{70000, 64, 66000}}) {
    const index_t rows_per_tile = kvevict::detail::inplace_tile_rows(D, sizeof(float));
    KVGPU_CHECK((k + rows_per_tile - 1) / rows_per_tile > kvevict::detail::inplace_ring);
    dense_case<float>(g, 2, Tn, D, k, kv_layout::head_major, 0);
  }
  bad_device_arguments();
  std::printf("compact gpu: %d failures\n", kvgpu::failures);
  return kvgpu::failures == 0 ? 0 : 1;
}
