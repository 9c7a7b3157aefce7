// The CUDA attention scores against (1) the kernels' own bodies run on the host SIMT executor
// (score_reference.cpp: include/kvevict/detail/block/score_emulation.hpp), which the device must match bit for
// bit (NaN: any NaN), and
// (2) attention_scores on seq, within a loose sanity tolerance (the stated bound is checked on the
// host by test_score_device_logic). Also the window / H2O / TOVA wrappers, key norms (bit-identical to
// the host), an argument error and the workspace protocol. Skips without a usable device.
#include "gpu_buffer.cuh"
#include "gpu_check.cuh"

#include "score_reference.hpp"

#include <kvevict/cuda/score.cuh>
#include <kvevict/gqa.hpp>
#include <kvevict/numeric.hpp>
#include <kvevict/paged.hpp>
#include <kvevict/score.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <algorithm>
#include <random>
#include <string>
#include <vector>

using namespace kvevict;
using kvgpu::device_buffer;

namespace {

template <class T>
T from_f(float f) {
  if constexpr (std::is_same_v<T, float16>) return to_float16(f);
  else if constexpr (std::is_same_v<T, bfloat16>) return to_bfloat16(f);
  else return f;
}

std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

bool same(float a, float b) { return (std::isnan(a) && std::isnan(b)) || bits_of(a) == bits_of(b); }
bool close(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return std::fabs(a - b) <= 1e-4f * std::fmax(std::fabs(a), std::fabs(b)) + 1e-7f;
}

template <class T>
std::vector<T> random_tensor(std::mt19937_64& g, std::size_t n, float range) {
  std::uniform_real_distribution<float> u(-range, range);
  std::vector<T> v(n);
  for (auto& x : v) x = from_f<T>(u(g));
  return v;
}

template <class QE, class KE>
void run_case(std::mt19937_64& g, index_t hkv, index_t group, index_t w, index_t p, index_t d, bool has_block,
              bool all_cols, const score_options& opt, gqa_op op, bool token_major, bool specials) {
  const index_t hq = hkv * group, T = p + w;
  auto q = random_tensor<QE>(g, static_cast<std::size_t>(hq * w * d), 1.f);
  auto k = random_tensor<KE>(g, static_cast<std::size_t>(hkv * T * d), 1.f);
  if (specials) {
    k[static_cast<std::size_t>(g() % k.size())] = from_f<KE>(std::numeric_limits<float>::quiet_NaN());
    q[static_cast<std::size_t>(g() % q.size())] = from_f<QE>(-std::numeric_limits<float>::infinity());
  }
  const kv_layout layout = token_major ? kv_layout::token_major : kv_layout::head_major;
  const index_t oc = has_block && all_cols ? T : p;
  // host
  const auto qh = *make_kv_view<const QE>(q.data(), hq, w, d, layout);
  const auto kh = *split_window(*make_kv_view<const KE>(k.data(), hkv, T, d, layout), w);
  const kv_view<const KE> bh = has_block ? kh.window : kv_view<const KE>{};
  std::vector<float> emu_h(static_cast<std::size_t>(hq * oc + 1)), emu_kv(static_cast<std::size_t>(hkv * oc + 1)),
      host(static_cast<std::size_t>(hq * oc + 1));
  KVGPU_CHECK(kvgpu::score_reference(qh, kh.prefix, bh, *make_matrix_view(emu_h.data(), hq, oc),
                                                   *make_matrix_view(emu_kv.data(), hkv, oc), op, opt)
                  .ok());
  workspace hws;
  const auto hv = *make_matrix_view(host.data(), hq, oc);
  KVGPU_CHECK(attention_scores(seq, hws, qh, kh.prefix, bh, hv, opt).ok());
  std::vector<unsigned char> hmem(hws.bytes + 1);
  hws.data = hmem.data();
  KVGPU_CHECK(attention_scores(seq, hws, qh, kh.prefix, bh, hv, opt).ok());
  // device
  device_buffer<QE> dq(q);
  device_buffer<KE> dk(k);
  device_buffer<float> dh(static_cast<std::size_t>(hq * oc)), dkv(static_cast<std::size_t>(hkv * oc));
  const auto qd = *make_kv_view<const QE>(dq.ptr, hq, w, d, layout);
  const auto kd = *split_window(*make_kv_view<const KE>(dk.ptr, hkv, T, d, layout), w);
  const kv_view<const KE> bd = has_block ? kd.window : kv_view<const KE>{};
  workspace ws;
  KVGPU_CHECK(attention_scores_gqa(kvevict::cuda, ws, qd, kd.prefix, bd, *make_matrix_view(dkv.ptr, hkv, oc), op, opt,
                                   *make_matrix_view(dh.ptr, hq, oc))
                  .ok());
  device_buffer<unsigned char> dws(ws.bytes);
  ws.data = dws.ptr;
  KVGPU_CHECK(attention_scores_gqa(kvevict::cuda, ws, qd, kd.prefix, bd, *make_matrix_view(dkv.ptr, hkv, oc), op, opt,
                                   *make_matrix_view(dh.ptr, hq, oc))
                  .ok());
  KVGPU_CUDA(cudaDeviceSynchronize());
  const auto got_h = dh.to_host(), got_kv = dkv.to_host();
  for (std::size_t i = 0; i < got_h.size(); ++i) {
    KVGPU_CHECK(same(got_h[i], emu_h[i]));
    KVGPU_CHECK(close(got_h[i], host[i]));
  }
  for (std::size_t i = 0; i < got_kv.size(); ++i) KVGPU_CHECK(same(got_kv[i], emu_kv[i]));
  // the per-head launcher writes the same bits
  device_buffer<float> dh2(static_cast<std::size_t>(hq * oc));
  KVGPU_CHECK(attention_scores(kvevict::cuda, ws, qd, kd.prefix, bd, *make_matrix_view(dh2.ptr, hq, oc), opt).ok());
  KVGPU_CUDA(cudaDeviceSynchronize());
  const auto got_h2 = dh2.to_host();
  for (std::size_t i = 0; i < got_h2.size(); ++i) KVGPU_CHECK(same(got_h2[i], emu_h[i]));
}

template <class QE, class KE>
void random_cases(std::uint64_t seed, int n) {
  std::mt19937_64 g(seed);
  const score_reduce reds[] = {score_reduce::mean, score_reduce::sum, score_reduce::mean_visible,
                               score_reduce::mean_plus_variance};
  const gqa_op ops[] = {gqa_op::mean, gqa_op::max, gqa_op::sum};
  for (int trial = 0; trial < n; ++trial) {
    // sizes bounded so that the host reference (the kernels' bodies on the SIMT executor, every
    // thread a fiber) stays within seconds per case
    const bool tall = trial % 5 == 0;  // w above the 128-row block
    const index_t hkv = 1 + static_cast<index_t>(g() % 2), group = 1 + static_cast<index_t>(g() % (tall ? 2 : 4));
    const index_t w = tall ? 129 + static_cast<index_t>(g() % 40) : 1 + static_cast<index_t>(g() % 48);
    const index_t p = trial % 7 == 0 ? 0 : 1 + static_cast<index_t>(g() % (tall ? 100 : 600));
    const index_t d = trial % 6 == 0 ? 128 : 1 + static_cast<index_t>(g() % (tall ? 16 : 72));
    score_options opt;
    opt.reduce = reds[trial % 4];
    opt.fused_multiply_add = trial % 2 == 1;
    run_case<QE, KE>(g, hkv, group, w, p, d, trial % 4 != 3 || p == 0, trial % 2 == 0, opt, ops[trial % 3], trial % 3 == 1,
                     trial % 6 == 5);
  }
}

void wrappers_and_errors() {
  std::mt19937_64 g(9);
  const index_t hq = 8, hkv = 2, T = 700, w = 16, d = 64;
  const auto q = random_tensor<float16>(g, static_cast<std::size_t>(hq * T * d), 1.f);
  const auto k = random_tensor<float16>(g, static_cast<std::size_t>(hkv * T * d), 1.f);
  device_buffer<float16> dq(q), dk(k);
  const auto keys_h = *make_kv_view<const float16>(k.data(), hkv, T, d);
  const auto keys_d = *make_kv_view<const float16>(dk.ptr, hkv, T, d);
  // window_scores: the last w queries (a strided sub-view of a [H_q][T][d] buffer)
  const auto qall_h = *make_kv_view<const float16>(q.data(), hq, T, d);
  const auto qall_d = *make_kv_view<const float16>(dq.ptr, hq, T, d);
  const auto qw_h = *split_window(qall_h, w), qw_d = *split_window(qall_d, w);
  std::vector<float> emu(static_cast<std::size_t>(hq * (T - w))), none(1);
  const auto s = *split_window(keys_h, w);
  KVGPU_CHECK(kvgpu::score_reference(qw_h.window, s.prefix, s.window,
                                                   *make_matrix_view(emu.data(), hq, T - w), matrix_view<float>{},
                                                   gqa_op::mean, score_options{})
                  .ok());
  device_buffer<float> dout(static_cast<std::size_t>(hq * T));
  workspace ws;
  KVGPU_CHECK(window_scores(kvevict::cuda, ws, qw_d.window, keys_d, *make_matrix_view(dout.ptr, hq, T - w)).ok());
  device_buffer<unsigned char> mem(ws.bytes + (std::size_t(1) << 22));
  ws.data = mem.ptr;
  ws.bytes = mem.n;
  KVGPU_CHECK(window_scores(kvevict::cuda, ws, qw_d.window, keys_d, *make_matrix_view(dout.ptr, hq, T - w)).ok());
  KVGPU_CUDA(cudaDeviceSynchronize());
  auto got = dout.to_host();
  for (std::size_t i = 0; i < emu.size(); ++i) KVGPU_CHECK(same(got[i], emu[i]));
  // h2o (w = T, causal) and tova (w = 1)
  std::vector<float> emu2(static_cast<std::size_t>(hq * T));
  const auto s_all = *split_window(keys_h, T);
  score_options h2o;
  h2o.reduce = score_reduce::sum;
  KVGPU_CHECK(kvgpu::score_reference(qall_h, s_all.prefix, s_all.window,
                                                   *make_matrix_view(emu2.data(), hq, T), matrix_view<float>{},
                                                   gqa_op::mean, h2o)
                  .ok());
  KVGPU_CHECK(h2o_scores(kvevict::cuda, ws, qall_d, keys_d, *make_matrix_view(dout.ptr, hq, T)).ok());
  KVGPU_CUDA(cudaDeviceSynchronize());
  got = dout.to_host();
  for (std::size_t i = 0; i < emu2.size(); ++i) KVGPU_CHECK(same(got[i], emu2[i]));
  const auto last_h = *split_window(qall_h, 1), last_d = *split_window(qall_d, 1);
  const auto s_one = *split_window(keys_h, 1);
  KVGPU_CHECK(kvgpu::score_reference(last_h.window, s_one.prefix, s_one.window,
                                                   *make_matrix_view(emu2.data(), hq, T), matrix_view<float>{},
                                                   gqa_op::mean, h2o)
                  .ok());
  KVGPU_CHECK(tova_scores(kvevict::cuda, ws, last_d.window, keys_d, *make_matrix_view(dout.ptr, hq, T)).ok());
  KVGPU_CUDA(cudaDeviceSynchronize());
  got = dout.to_host();
  for (std::size_t i = 0; i < emu2.size(); ++i) KVGPU_CHECK(same(got[i], emu2[i]));
  // key norms: bit-identical to the host
  std::vector<float> kn(static_cast<std::size_t>(hkv * T));
  KVGPU_CHECK(key_norm_scores(seq, keys_h, *make_matrix_view(kn.data(), hkv, T)).ok());
  KVGPU_CHECK(key_norm_scores(kvevict::cuda, keys_d, *make_matrix_view(dout.ptr, hkv, T)).ok());
  KVGPU_CUDA(cudaDeviceSynchronize());
  got = dout.to_host();
  for (std::size_t i = 0; i < kn.size(); ++i) KVGPU_CHECK(same(got[i], kn[i]));
  // an argument error is the host's message, and nothing is launched
  const auto sd = *split_window(keys_d, w);
  const status st = attention_scores(kvevict::cuda, ws, *make_kv_view<const float16>(dq.ptr, 7, 2, d), sd.prefix,
                                     sd.window, *make_matrix_view(dout.ptr, 7, T - w));
  KVGPU_CHECK(!st.ok() && st.code() == errc::shape_mismatch);
  KVGPU_CHECK(std::string(st.message()).find("7 query heads are not a multiple of 2 KV heads") != std::string::npos);
  workspace tiny;
  tiny.data = mem.ptr;
  tiny.bytes = 8;
  KVGPU_CHECK(window_scores(kvevict::cuda, tiny, qw_d.window, keys_d, *make_matrix_view(dout.ptr, hq, T - w)).code() ==
              errc::workspace_too_small);
}

bool has(const status& st, errc code, const char* needle) {
  if (st.ok() || st.code() != code || std::string(st.message()).find(needle) == std::string::npos) {
    std::printf("unexpected status: %s (%s)\n", st.message(), errc_name(st.code()));
    return false;
  }
  return true;
}

// The launchers' host side runs without a device: argument errors return before any CUDA call, and a
// workspace query only reports its size. The pointers are host memory standing in for device memory
// (never dereferenced on these paths).
void launcher_checks_without_device() {
  std::vector<float16> q(8 * 4 * 16), k(2 * 40 * 16);
  std::vector<float> out(8 * 40), out2(2 * 40);
  const auto qv = *make_kv_view<const float16>(q.data(), 8, 4, 16);
  const auto s = *split_window(*make_kv_view<const float16>(k.data(), 2, 40, 16), 4);
  const auto ov = *make_matrix_view(out.data(), 8, 36);
  workspace ws;
  // the size query: 8-byte statistics per query row x (splits + 1), pieces 64-byte aligned
  KVGPU_CHECK(attention_scores(kvevict::cuda, ws, qv, s.prefix, s.window, ov).ok());
  detail::score_shape sh;
  KVGPU_CHECK(detail::check_attention_inputs("t", qv, s.prefix, s.window, score_options{}, sh).ok());
  sh.out_cols = 36;
  detail::cuda_score_plan pl;
  KVGPU_CHECK(detail::make_cuda_score_plan("t", sh, pl).ok());
  KVGPU_CHECK(pl.rows_total == 32 && pl.tiles == 1 && pl.splits == 1);
  KVGPU_CHECK(ws.bytes == detail::workspace_max_align - 1 + (pl.part_entries * 8 + 63) / 64 * 64 +
                          static_cast<std::size_t>(pl.rows_total) * 8);  // base padding, partials, row stats
  workspace ws2;
  KVGPU_CHECK(window_scores_gqa(kvevict::cuda, ws2, qv, *make_kv_view<const float16>(k.data(), 2, 40, 16),
                                *make_matrix_view(out2.data(), 2, 36), gqa_op::max)
                  .ok());
  KVGPU_CHECK(ws2.bytes == ws.bytes);
  // argument errors: the host's checks and messages, with the (cuda) name
  KVGPU_CHECK(has(attention_scores(kvevict::cuda, ws, *make_kv_view<const float16>(q.data(), 7, 4, 16), s.prefix, s.window,
                                   *make_matrix_view(out.data(), 7, 36)),
                  errc::shape_mismatch, "attention_scores(cuda): 7 query heads are not a multiple of 2 KV heads"));
  KVGPU_CHECK(has(attention_scores(kvevict::cuda, ws, qv, s.prefix, s.window, *make_matrix_view(out.data(), 8, 37)),
                  errc::shape_mismatch, "out has 37 columns; expected P = 36 (prefix columns) or P + w = 40"));
  score_options bad;
  bad.gamma = -1.f;
  KVGPU_CHECK(has(attention_scores(kvevict::cuda, ws, qv, s.prefix, s.window, ov, bad), errc::invalid_argument, "gamma"));
  KVGPU_CHECK(has(attention_scores_gqa(kvevict::cuda, ws, qv, s.prefix, s.window, *make_matrix_view(out2.data(), 2, 36),
                                       static_cast<gqa_op>(9)),
                  errc::invalid_argument, "op = 9 is not a gqa_op"));
  KVGPU_CHECK(has(attention_scores_gqa(kvevict::cuda, ws, qv, s.prefix, s.window, *make_matrix_view(out2.data(), 3, 36),
                                       gqa_op::mean),
                  errc::shape_mismatch, "out_kv has 3 rows but there are 2 KV heads"));
  KVGPU_CHECK(has(attention_scores_gqa(kvevict::cuda, ws, qv, s.prefix, s.window, *make_matrix_view(out2.data(), 2, 36),
                                       gqa_op::mean, {}, *make_matrix_view(out.data(), 8, 40)),
                  errc::shape_mismatch, "out_per_head has 40 columns but out_kv has 36"));
  KVGPU_CHECK(has(attention_scores_gqa(kvevict::cuda, ws, qv, s.prefix, s.window, *make_matrix_view(out.data(), 2, 36),
                                       gqa_op::mean, {}, *make_matrix_view(out.data() + 10, 8, 36)),
                  errc::overlap, "out_per_head overlaps out_kv"));
  KVGPU_CHECK(has(attention_scores(kvevict::cuda, ws, qv, s.prefix, s.window,
                                   *make_matrix_view(reinterpret_cast<float*>(q.data()), 8, 36)),
                  errc::overlap, "out overlaps queries"));
  // a misaligned device pointer is refused before any launch
  const auto mis = *make_matrix_view(reinterpret_cast<float*>(reinterpret_cast<char*>(out.data()) + 2), 8, 36);
  KVGPU_CHECK(has(attention_scores(kvevict::cuda, ws, qv, s.prefix, s.window, mis), errc::invalid_argument,
                  "out is not aligned to 4 bytes"));
  KVGPU_CHECK(has(h2o_scores(kvevict::cuda, ws, qv, *make_kv_view<const float16>(k.data(), 2, 40, 16), ov),
                  errc::shape_mismatch, "h2o_scores(cuda): out has 36 columns, expected T = 40"));
  KVGPU_CHECK(has(tova_scores(kvevict::cuda, ws, qv, *make_kv_view<const float16>(k.data(), 2, 40, 16), ov),
                  errc::shape_mismatch, "tova_scores(cuda): last_query holds 4 tokens, expected 1"));
  KVGPU_CHECK(has(window_scores(kvevict::cuda, ws, *make_kv_view<const float16>(q.data(), 8, 41, 1),
                                *make_kv_view<const float16>(k.data(), 2, 40, 16), ov),
                  errc::invalid_argument, "window w = 41 is outside [0, 40]"));
  KVGPU_CHECK(has(key_norm_scores(kvevict::cuda, *make_kv_view<const float16>(k.data(), 2, 40, 16), ov),
                  errc::shape_mismatch, "key_norm_scores(cuda): out is [8][36] but keys are [2][40][*]"));
  workspace small;
  small.data = out.data();
  small.bytes = 16;
  KVGPU_CHECK(has(attention_scores(kvevict::cuda, small, qv, s.prefix, s.window, ov), errc::workspace_too_small,
                  "workspace has 16 bytes"));
}

// paged_window_scores(cuda) against the kernels' bodies on the executor, bit for bit: shuffled pages,
// partial last pages, the given table kind and pool layout, a GQA group of 2.
void paged_case(std::mt19937_64& g, page_lists lists, page_layout layout, bool include_window) {
  const index_t S = 2, H = 2, d = 24, ps = 8, w = 4, G = 2;
  const index_t n_lists = lists == page_lists::per_head ? S * H : S, hp = lists == page_lists::per_head ? 1 : H;
  std::vector<std::int32_t> indptr{0}, indices, last;
  std::vector<index_t> len;
  std::int32_t pages = 0;
  for (index_t l = 0; l < n_lists; ++l) {
    const index_t n = w + static_cast<index_t>(g() % 60), np = (n + ps - 1) / ps;
    len.push_back(n);
    for (index_t i = 0; i < np; ++i) indices.push_back(pages++);
    indptr.push_back(static_cast<std::int32_t>(indices.size()));
    last.push_back(static_cast<std::int32_t>(n - (np - 1) * ps));
  }
  std::shuffle(indices.begin(), indices.end(), g);
  const auto kp = random_tensor<float>(g, static_cast<std::size_t>(pages * ps * hp * d), 1.f);
  index_t C = 1;
  for (index_t r = 0; r < S * H; ++r) {
    const index_t n = len[static_cast<std::size_t>(lists == page_lists::per_head ? r : r / H)];
    C = std::max(C, include_window ? n : n - w);
  }
  const auto q = random_tensor<float>(g, static_cast<std::size_t>(S * H * G * w * d), 1.f);
  const auto layer_on = [&](const float* k, const std::int32_t* ip, const std::int32_t* ix, const std::int32_t* lp) {
    const auto pool = *make_page_pool(k, pages, ps, hp, d, layout);
    return paged_layer<const float>{pool, pool, page_table{ip, ix, lp, n_lists}, S, H, lists};
  };
  std::vector<float> emu(static_cast<std::size_t>(S * H * G * C), 3.f);
  int bad_h = 0;
  KVGPU_CHECK(kvgpu::paged_score_reference(
                  *make_kv_view<const float>(q.data(), S * H * G, w, d),
                  layer_on(kp.data(), indptr.data(), indices.data(), last.data()),
                  *make_matrix_view(emu.data(), S * H * G, C), include_window, score_options{}, &bad_h)
                  .ok());
  KVGPU_CHECK(bad_h == 0);
  device_buffer<float> dk(kp), dq(q), dout(std::vector<float>(emu.size(), 3.f));
  device_buffer<std::int32_t> dip(indptr), dix(indices), dlp(last), dbad(std::vector<std::int32_t>(1, 0));
  const auto qd = *make_kv_view<const float>(dq.ptr, S * H * G, w, d);
  const auto ld = layer_on(dk.ptr, dip.ptr, dix.ptr, dlp.ptr);
  const auto od = *make_matrix_view(dout.ptr, S * H * G, C);
  workspace ws;
  KVGPU_CHECK(paged_window_scores(kvevict::cuda, ws, qd, ld, od, include_window, {}, dbad.ptr).ok());
  device_buffer<unsigned char> mem(ws.bytes);
  ws.data = mem.ptr;
  KVGPU_CHECK(paged_window_scores(kvevict::cuda, ws, qd, ld, od, include_window, {}, dbad.ptr).ok());
  KVGPU_CUDA(cudaDeviceSynchronize());
  const auto got = dout.to_host();
  for (std::size_t i = 0; i < got.size(); ++i) KVGPU_CHECK(same(got[i], emu[i]));
  KVGPU_CHECK(dbad.to_host()[0] == 0);
}

}  // namespace

int main() {
  launcher_checks_without_device();
  if (kvgpu::failures != 0) {
    std::printf("score gpu (host-side launcher checks): %d failures\n", kvgpu::failures);
    return 1;
  }
  kvgpu::skip_without_gpu();
  random_cases<float, float>(1, 40);
  random_cases<float16, float16>(2, 40);
  random_cases<bfloat16, bfloat16>(3, 30);
  random_cases<float, bfloat16>(4, 10);
  wrappers_and_errors();
  std::mt19937_64 g(1307);
  paged_case(g, page_lists::per_head, page_layout::hnd, false);
  paged_case(g, page_lists::per_sequence, page_layout::nhd, true);
  std::printf("score gpu: %d failures\n", kvgpu::failures);
  return kvgpu::failures == 0 ? 0 : 1;
}
