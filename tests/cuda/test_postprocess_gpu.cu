// The CUDA post-processing stages against the host backends, bit for bit (any NaN equals any NaN:
// CUDA arithmetic returns the canonical NaN): gqa_reduce (in place too), pool1d (tiled and wide-kernel
// paths, device row lengths, bad lengths counted), protect, weight_by_value_norm (per token, head max),
// and the fused postprocess_scores in both orders. Skips without a usable device.
#include "gpu_buffer.cuh"
#include "gpu_check.cuh"

#include <kvevict/cuda/postprocess.cuh>
#include <kvevict/postprocess.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

using namespace kvevict;
using kvgpu::device_buffer;

namespace {

std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
bool same(float a, float b) { return (std::isnan(a) && std::isnan(b)) || bits_of(a) == bits_of(b); }

std::vector<float> scores(std::mt19937_64& g, std::size_t n) {
  std::vector<float> v(n);
  for (auto& x : v) {
    const auto r = g() % 40;
    x = r == 0 ? std::numeric_limits<float>::quiet_NaN()
        : r == 1 ? std::numeric_limits<float>::infinity()
        : r == 2 ? -std::numeric_limits<float>::infinity()
                 : static_cast<float>(static_cast<int>(g() % 2001) - 1000) / 997.f;
  }
  return v;
}

void check_same(const std::vector<float>& a, const std::vector<float>& b) {
  KVGPU_CHECK(a.size() == b.size());
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) KVGPU_CHECK(same(a[i], b[i]));
}

void stages(std::mt19937_64& g, int trial) {
  const index_t hkv = 1 + static_cast<index_t>(g() % 4), grp = 1 + static_cast<index_t>(g() % 4), hq = hkv * grp;
  const index_t T = trial % 4 == 0 ? 3000 + static_cast<index_t>(g() % 3000) : 1 + static_cast<index_t>(g() % 700);
  const auto in = scores(g, static_cast<std::size_t>(hq * T));
  device_buffer<float> din(in);
  const auto inh = *make_matrix_view<const float>(in.data(), hq, T);
  const auto ind = *make_matrix_view<const float>(din.ptr, hq, T);
  // gqa_reduce
  const gqa_op op = static_cast<gqa_op>(trial % 3);
  std::vector<float> ref(static_cast<std::size_t>(hkv * T));
  KVGPU_CHECK(gqa_reduce(seq, inh, *make_matrix_view(ref.data(), hkv, T), op).ok());
  device_buffer<float> dout(static_cast<std::size_t>(hq * T));
  KVGPU_CHECK(gqa_reduce(kvevict::cuda, ind, *make_matrix_view(dout.ptr, hkv, T), op).ok());
  auto got = dout.to_host();
  got.resize(ref.size());
  check_same(got, ref);
  {  // in place
    std::vector<float> host = in;
    device_buffer<float> dio(in);
    KVGPU_CHECK(gqa_reduce(seq, *make_matrix_view<const float>(host.data(), hq, T), *make_matrix_view(host.data(), hkv, T), op).ok());
    KVGPU_CHECK(gqa_reduce(kvevict::cuda, *make_matrix_view<const float>(dio.ptr, hq, T), *make_matrix_view(dio.ptr, hkv, T), op).ok());
    check_same(dio.to_host(), host);
  }
  // pool1d with device row lengths (one of them invalid on odd trials)
  std::vector<std::int32_t> lens(static_cast<std::size_t>(hq));
  for (auto& l : lens) l = static_cast<std::int32_t>(g() % (T + 1));
  const pool_kind kind = static_cast<pool_kind>(trial % 3);
  const index_t kernel = trial % 5 == 0 ? 2 * (1025 + static_cast<index_t>(g() % 2000)) + 1 : 2 * static_cast<index_t>(g() % 8) + 1;
  pool_options po;
  po.divisor = trial % 2 ? avg_divisor::valid : avg_divisor::kernel;
  std::vector<float> pref(static_cast<std::size_t>(hq * T), -2.f);
  KVGPU_CHECK(pool1d(seq, inh, *make_matrix_view(pref.data(), hq, T), kind, kernel, lens.data(), po).ok());
  std::vector<std::int32_t> dlens_h = lens;
  if (trial % 2) dlens_h[0] = static_cast<std::int32_t>(T + 1);  // invalid: row 0 skipped and counted
  device_buffer<std::int32_t> dlens(dlens_h);
  device_buffer<int> dbad(std::vector<int>{0});
  device_buffer<float> dpool(std::vector<float>(static_cast<std::size_t>(hq * T), -2.f));
  KVGPU_CHECK(pool1d(kvevict::cuda, ind, *make_matrix_view(dpool.ptr, hq, T), kind, kernel, dlens.ptr, po, dbad.ptr).ok());
  got = dpool.to_host();
  if (trial % 2)
    for (index_t t = 0; t < T; ++t) pref[static_cast<std::size_t>(t)] = -2.f;  // row 0 left alone
  check_same(got, pref);
  KVGPU_CHECK(dbad.to_host()[0] == (trial % 2 ? 1 : 0));
  // protect in place
  std::vector<float> prot = pref;
  KVGPU_CHECK(protect(seq, *make_matrix_view(prot.data(), hq, T), 4, 16, lens.data()).ok());
  device_buffer<float> dprot(pref);
  KVGPU_CHECK(protect(kvevict::cuda, *make_matrix_view(dprot.ptr, hq, T), 4, 16, dlens.ptr, dbad.ptr).ok());
  if (trial % 2)
    for (index_t t = 0; t < T; ++t) prot[static_cast<std::size_t>(t)] = pref[static_cast<std::size_t>(t)];
  check_same(dprot.to_host(), prot);
}

template <class V>
void weighting_and_fused(std::mt19937_64& g, int trial) {
  const index_t hkv = 1 + static_cast<index_t>(g() % 4), grp = 1 + static_cast<index_t>(g() % 4), hq = hkv * grp;
  const index_t T = trial % 4 == 0 ? 2000 + static_cast<index_t>(g() % 3000) : 1 + static_cast<index_t>(g() % 500);
  const index_t tv = T + static_cast<index_t>(g() % 40), d = static_cast<index_t>(g() % 140);
  const auto in = scores(g, static_cast<std::size_t>(hq * T));
  std::vector<V> vals(static_cast<std::size_t>(hkv * tv * d + 1));
  for (auto& v : vals) {
    const float f = static_cast<float>(static_cast<int>(g() % 2001) - 1000) / 313.f;
    if constexpr (std::is_same_v<V, float16>) v = to_float16(f);
    else if constexpr (std::is_same_v<V, bfloat16>) v = to_bfloat16(f);
    else v = f;
  }
  std::vector<std::int32_t> vlens(static_cast<std::size_t>(hkv)), rlens(static_cast<std::size_t>(hkv));
  for (auto& l : vlens) l = static_cast<std::int32_t>(g() % (tv + 1));
  for (auto& l : rlens) l = static_cast<std::int32_t>(g() % (T + 1));
  device_buffer<float> din(in);
  device_buffer<V> dv(vals);
  device_buffer<std::int32_t> dvl(vlens), drl(rlens);
  const auto vh = *make_kv_view<const V>(vals.data(), hkv, tv, d), vd = *make_kv_view<const V>(dv.ptr, hkv, tv, d);
  // weight_by_value_norm on per-query-head rows
  const value_weight mode = trial % 2 ? value_weight::head_max : value_weight::per_token;
  std::vector<float> wh = in;
  KVGPU_CHECK(weight_by_value_norm(seq, *make_matrix_view(wh.data(), hq, T), vh, mode, vlens.data()).ok());
  device_buffer<float> dw(in);
  workspace ws;
  KVGPU_CHECK(weight_by_value_norm(kvevict::cuda, ws, *make_matrix_view(dw.ptr, hq, T), vd, mode, dvl.ptr).ok());
  device_buffer<unsigned char> mem(ws.bytes);
  ws.data = mem.ptr;
  KVGPU_CHECK(weight_by_value_norm(kvevict::cuda, ws, *make_matrix_view(dw.ptr, hq, T), vd, mode, dvl.ptr).ok());
  check_same(dw.to_host(), wh);
  // the fused post-processing
  postprocess_options o;
  o.gqa = static_cast<gqa_op>(trial % 3);
  o.order = trial % 2 ? gqa_order::gqa_first : gqa_order::pool_first;
  o.pool = static_cast<pool_kind>((trial / 2) % 3);
  o.kernel = trial % 7 == 0 ? 2 * (1025 + static_cast<index_t>(g() % 1500)) + 1 : 2 * static_cast<index_t>(g() % 6) + 1;
  o.weight_values = trial % 3 != 0;
  o.weight = mode;
  o.n_sink = static_cast<index_t>(g() % 5);
  o.n_recent = static_cast<index_t>(g() % 40);
  o.unpooled_tail = trial % 5 == 2 ? (trial * 11) % (T + 3) : 0;  // the SnapKV window's columns
  const bool use_rl = trial % 4 == 1;
  std::vector<float> fh(static_cast<std::size_t>(hkv * T), -6.f);
  workspace hws;
  const auto inh = *make_matrix_view<const float>(in.data(), hq, T);
  KVGPU_CHECK(postprocess_scores(seq, hws, inh, *make_matrix_view(fh.data(), hkv, T), vh, o, use_rl ? rlens.data() : nullptr,
                                 vlens.data())
                  .ok());
  std::vector<unsigned char> hmem(hws.bytes + 1);
  hws.data = hmem.data();
  KVGPU_CHECK(postprocess_scores(seq, hws, inh, *make_matrix_view(fh.data(), hkv, T), vh, o, use_rl ? rlens.data() : nullptr,
                                 vlens.data())
                  .ok());
  device_buffer<float> df(std::vector<float>(static_cast<std::size_t>(hkv * T), -6.f));
  workspace dws;
  const auto ind = *make_matrix_view<const float>(din.ptr, hq, T);
  KVGPU_CHECK(postprocess_scores(kvevict::cuda, dws, ind, *make_matrix_view(df.ptr, hkv, T), vd, o,
                                 use_rl ? drl.ptr : nullptr, dvl.ptr)
                  .ok());
  device_buffer<unsigned char> dmem(dws.bytes);
  dws.data = dmem.ptr;
  KVGPU_CHECK(postprocess_scores(kvevict::cuda, dws, ind, *make_matrix_view(df.ptr, hkv, T), vd, o,
                                 use_rl ? drl.ptr : nullptr, dvl.ptr)
                  .ok());
  check_same(df.to_host(), fh);
}

bool has(const status& st, errc code, const char* needle) {
  if (st.ok() || st.code() != code || std::string(st.message()).find(needle) == std::string::npos) {
    std::printf("unexpected status: %s (%s)\n", st.message(), errc_name(st.code()));
    return false;
  }
  return true;
}

// The launchers' host side runs without a device: argument errors return before any CUDA call and
// workspace queries only report sizes (host memory stands in for device memory, never dereferenced).
void launcher_checks_without_device() {
  std::vector<float> in(8 * 300), out(2 * 300), vals(2 * 310 * 4);
  const auto iv = *make_matrix_view<const float>(in.data(), 8, 300);
  const auto ov = *make_matrix_view(out.data(), 2, 300);
  const auto vv = *make_kv_view<const float>(vals.data(), 2, 310, 4);
  KVGPU_CHECK(has(gqa_reduce(kvevict::cuda, iv, *make_matrix_view(out.data(), 3, 300), gqa_op::mean), errc::shape_mismatch,
                  "gqa_reduce(cuda): 8 query heads are not a multiple of 3 KV heads"));
  KVGPU_CHECK(has(gqa_reduce(kvevict::cuda, iv, *make_matrix_view(const_cast<float*>(in.data()) + 5, 2, 300), gqa_op::max),
                  errc::overlap, "in and out overlap"));
  KVGPU_CHECK(has(pool1d(kvevict::cuda, iv, *make_matrix_view(out.data(), 2, 300), pool_kind::max, 7), errc::shape_mismatch,
                  "pool1d(cuda): in is [8][300] but out is [2][300]"));
  KVGPU_CHECK(has(pool1d(kvevict::cuda, *make_matrix_view<const float>(in.data(), 2, 300), ov, pool_kind::avg, 6),
                  errc::invalid_argument, "kernel = 6 is even"));
  KVGPU_CHECK(has(protect(kvevict::cuda, ov, -1, 0), errc::invalid_argument, "protect(cuda): n_sink = -1 is negative"));
  KVGPU_CHECK(has(protect(kvevict::cuda, ov, 1, 2, reinterpret_cast<const std::int32_t*>(out.data() + 7)), errc::overlap,
                  "row_lengths lie inside the scores"));
  workspace ws;
  KVGPU_CHECK(weight_by_value_norm(kvevict::cuda, ws, ov, vv, value_weight::head_max).ok());
  KVGPU_CHECK(ws.bytes == 64 + 2 * sizeof(float));  // partial maxima (2 heads x 2 tiles, padded to 64) + 2 factors
  workspace ws0;
  KVGPU_CHECK(weight_by_value_norm(kvevict::cuda, ws0, ov, vv, value_weight::per_token).ok());
  KVGPU_CHECK(ws0.bytes == 0);
  KVGPU_CHECK(has(weight_by_value_norm(kvevict::cuda, ws, *make_matrix_view(out.data(), 3, 300), vv, value_weight::per_token),
                  errc::shape_mismatch, "scores have 3 rows, not a multiple of the 2 KV heads"));
  postprocess_options o;
  workspace wp;
  KVGPU_CHECK(postprocess_scores(kvevict::cuda, wp, iv, ov, o).ok());
  KVGPU_CHECK(wp.bytes == 0);  // kernel 7: tiled, no scratch
  o.kernel = 2 * 1100 + 1;     // wide kernel, pool_first over groups of 4: a [H_kv][T] stash
  KVGPU_CHECK(postprocess_scores(kvevict::cuda, wp, iv, ov, o).ok());
  KVGPU_CHECK(wp.bytes == 2 * 300 * sizeof(float));
  o.weight_values = true;
  o.weight = value_weight::head_max;
  KVGPU_CHECK(postprocess_scores(kvevict::cuda, wp, iv, ov, o).code() == errc::invalid_argument);
  KVGPU_CHECK(postprocess_scores(kvevict::cuda, wp, iv, ov, vv, o).ok());
  KVGPU_CHECK(wp.bytes == 64 + 64 + 2 * 300 * sizeof(float));
  o.order = static_cast<gqa_order>(3);
  KVGPU_CHECK(has(postprocess_scores(kvevict::cuda, wp, iv, ov, vv, o), errc::invalid_argument,
                  "postprocess_scores(cuda): opt.order = 3 is not a gqa_order"));
  o.order = gqa_order::gqa_first;
  KVGPU_CHECK(has(postprocess_scores(kvevict::cuda, wp, iv, ov, *make_kv_view<const float>(vals.data(), 2, 299, 4), o),
                  errc::shape_mismatch, "scores have 300 columns but values hold only 299 tokens"));
  workspace small;
  small.data = out.data();
  small.bytes = 4;
  KVGPU_CHECK(has(postprocess_scores(kvevict::cuda, small, iv, ov, vv, o), errc::workspace_too_small, "workspace has 4 bytes"));
}

}  // namespace

int main() {
  launcher_checks_without_device();
  if (kvgpu::failures != 0) {
    std::printf("postprocess gpu (host-side launcher checks): %d failures\n", kvgpu::failures);
    return 1;
  }
  kvgpu::skip_without_gpu();
  std::mt19937_64 g(77);
  for (int trial = 0; trial < 60; ++trial) stages(g, trial);
  for (int trial = 0; trial < 40; ++trial) {
    weighting_and_fused<float>(g, trial);
    weighting_and_fused<float16>(g, trial);
    weighting_and_fused<bfloat16>(g, trial);
  }
  KVGPU_CUDA(cudaDeviceSynchronize());
  std::printf("postprocess gpu: %d failures\n", kvgpu::failures);
  return kvgpu::failures == 0 ? 0 : 1;
}
