// The CUDA benchmarks of scripts/gpu-check: each launcher on a representative shape, timed with CUDA
// events (median of 20 launches after 3 warm-up launches), against the bound of docs/cuda.md: the
// least memory traffic the stage needs (bytes / the device's peak DRAM bandwidth) and, for the
// attention scores, the fp32 FLOPs of the three sweeps over the keys / the device's peak fp32 rate. Prints one TSV line
// per case: stage, shape, median us, bytes, flops, bound us, bound / time (1 = at the bound).
// Exits 77 without a GPU. Built only on request (target kvevict_bench_cuda, EXCLUDE_FROM_ALL).
#include "gpu_buffer.cuh"
#include "gpu_check.cuh"

#include <kvevict/cuda/compact.cuh>
#include <kvevict/cuda/gqa.cuh>
#include <kvevict/cuda/pool.cuh>
#include <kvevict/cuda/protect.cuh>
#include <kvevict/cuda/score.cuh>
#include <kvevict/cuda/select.cuh>
#include <kvevict/cuda/weight.cuh>
#include <kvevict/numeric.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

using namespace kvevict;
using kvgpu::device_buffer;

namespace {

struct device_peaks {
  double bytes_per_s = 0, flops_per_s = 0;
};

device_peaks peaks() {
  int dev = 0, mem_khz = 0, bus_bits = 0, sm_khz = 0, sms = 0, major = 0;
  KVGPU_CUDA(cudaGetDevice(&dev));
  KVGPU_CUDA(cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, dev));
  KVGPU_CUDA(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, dev));
  KVGPU_CUDA(cudaDeviceGetAttribute(&sm_khz, cudaDevAttrClockRate, dev));
  KVGPU_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  KVGPU_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  device_peaks p;
  p.bytes_per_s = 2.0 * mem_khz * 1e3 * bus_bits / 8.0;  // double data rate
  const double lanes = major >= 9 ? 128.0 : 64.0;         // fp32 lanes per SM (sm_80: 64, sm_90: 128)
  p.flops_per_s = 2.0 * lanes * sms * sm_khz * 1e3;       // one FMA = 2 FLOPs
  return p;
}

template <class F>
double median_us(F&& launch) {
  cudaEvent_t a, b;
  KVGPU_CUDA(cudaEventCreate(&a));
  KVGPU_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) KVGPU_CHECK(launch().ok());
  std::vector<double> t;
  for (int i = 0; i < 20; ++i) {
    KVGPU_CUDA(cudaEventRecord(a));
    KVGPU_CHECK(launch().ok());
    KVGPU_CUDA(cudaEventRecord(b));
    KVGPU_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    KVGPU_CUDA(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms * 1e3);
  }
  KVGPU_CUDA(cudaEventDestroy(a));
  KVGPU_CUDA(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

device_peaks pk;

void report(const char* stage, const std::string& shape, double us, double bytes, double flops) {
  const double bound = std::max(bytes / pk.bytes_per_s, flops / pk.flops_per_s) * 1e6;
  std::printf("%s\t%s\t%.2f\t%.0f\t%.0f\t%.2f\t%.3f\n", stage, shape.c_str(), us, bytes, flops, bound, bound / us);
}

std::vector<float> random_floats(std::mt19937_64& g, std::size_t n) {
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = u(g);
  return v;
}
std::vector<float16> random_halves(std::mt19937_64& g, std::size_t n) {
  std::vector<float16> v;
  v.reserve(n);
  for (float x : random_floats(g, n)) v.push_back(to_float16(x * 0.25f));
  return v;
}

void bench_select(std::mt19937_64& g, index_t R, index_t T, index_t k, select_algo algo, const char* name) {
  device_buffer<float> s(random_floats(g, static_cast<std::size_t>(R * T)));
  device_buffer<pos_t> kept(static_cast<std::size_t>(R * k));
  const auto sv = *make_matrix_view(static_cast<const float*>(s.ptr), R, T);
  const auto kv = *make_matrix_view(kept.ptr, R, k);
  cuda_select_options o;
  o.algo = algo;
  workspace q;
  KVGPU_CHECK(select_topk(kvevict::cuda, q, sv, nullptr, kv, o).ok());
  device_buffer<unsigned char> wmem(q.bytes);
  workspace ws{wmem.ptr, q.bytes};
  const double us = median_us([&] { return select_topk(kvevict::cuda, ws, sv, nullptr, kv, o); });
  report(name, "R=" + std::to_string(R) + " T=" + std::to_string(T) + " k=" + std::to_string(k), us,
         4.0 * R * T + 4.0 * R * k, 0);
}

void bench_compact(std::mt19937_64& g, index_t H, index_t T, index_t D, index_t k) {
  const auto host = random_halves(g, static_cast<std::size_t>(H * T * D));
  std::vector<pos_t> kept;
  for (index_t h = 0; h < H; ++h)
    for (index_t j = 0; j < k; ++j) kept.push_back(static_cast<pos_t>(j * (T / k)));
  device_buffer<float16> src(host), dst(static_cast<std::size_t>(H * k * D));
  device_buffer<pos_t> dk(kept);
  const auto kv = *make_matrix_view(static_cast<const pos_t*>(dk.ptr), H, k);
  const auto sv = *make_kv_view(static_cast<const float16*>(src.ptr), H, T, D);
  const double row = 2.0 * D, bytes = H * k * (2 * row + 4);
  const std::string shape = "H=" + std::to_string(H) + " T=" + std::to_string(T) + " D=" + std::to_string(D) +
                            " k=" + std::to_string(k) + " fp16";
  report("compact", shape, median_us([&] { return compact(kvevict::cuda, sv, kv, *make_kv_view(dst.ptr, H, k, D)); }),
         bytes, 0);
  const auto cache = *make_kv_view(src.ptr, H, T, D);
  workspace q;
  KVGPU_CHECK(compact_inplace(kvevict::cuda, q, cache, kv).ok());
  device_buffer<unsigned char> wmem(q.bytes);
  workspace ws{wmem.ptr, q.bytes};
  // repeated in place on the same cache: after the first call kept[j] maps onto already-moved rows,
  // the same traffic per call (every entry with kept[j] != j moves)
  report("compact_inplace", shape, median_us([&] { return compact_inplace(kvevict::cuda, ws, cache, kv); }), bytes, 0);
}

void bench_append(std::mt19937_64& g, index_t H, index_t cap, index_t D) {
  device_buffer<float16> cache(static_cast<std::size_t>(H * cap * D)), rows(random_halves(g, static_cast<std::size_t>(H * D)));
  std::vector<std::int32_t> cu(static_cast<std::size_t>(H + 1));
  for (index_t h = 0; h <= H; ++h) cu[static_cast<std::size_t>(h)] = static_cast<std::int32_t>(h * cap);
  device_buffer<std::int32_t> dcu(cu);
  device_buffer<std::int32_t> lens(std::vector<std::int32_t>(static_cast<std::size_t>(H), 0));
  const ragged_cache<float16> rc{cache.ptr, dcu.ptr, lens.ptr, H, D, D};
  const auto rv = *make_kv_view(static_cast<const float16*>(rows.ptr), H, 1, D);
  // each launch appends one token per head; 23 launches fit the capacity
  report("append", "H=" + std::to_string(H) + " D=" + std::to_string(D) + " one token fp16",
         median_us([&] { return append(kvevict::cuda, rc, rv); }), H * (2.0 * 2 * D + 16), 0);
}

void bench_scores(std::mt19937_64& g, index_t hq, index_t hkv, index_t w, index_t T, index_t d) {
  device_buffer<float16> q(random_halves(g, static_cast<std::size_t>(hq * w * d)));
  device_buffer<float16> k(random_halves(g, static_cast<std::size_t>(hkv * T * d)));
  device_buffer<float> out(static_cast<std::size_t>(hq * (T - w)));
  const auto qv = *make_kv_view(static_cast<const float16*>(q.ptr), hq, w, d);
  const auto kv = *make_kv_view(static_cast<const float16*>(k.ptr), hkv, T, d);
  const auto ov = *make_matrix_view(out.ptr, hq, T - w);
  workspace qws;
  KVGPU_CHECK(window_scores(kvevict::cuda, qws, qv, kv, ov).ok());
  device_buffer<unsigned char> wmem(qws.bytes);
  workspace ws{wmem.ptr, qws.bytes};
  // the logits are computed three times (pass 1: the chunk max, then the chunk sums; pass 2) and the
  // keys read by each sweep (docs/cuda.md)
  const double bytes = 3.0 * hkv * T * d * 2 + 2.0 * hq * w * d + 4.0 * hq * (T - w);
  const double flops = 3.0 * 2.0 * hq * w * T * d;
  report("window_scores", "Hq=" + std::to_string(hq) + " Hkv=" + std::to_string(hkv) + " w=" + std::to_string(w) +
                              " T=" + std::to_string(T) + " d=" + std::to_string(d) + " fp16",
         median_us([&] { return window_scores(kvevict::cuda, ws, qv, kv, ov); }), bytes, flops);
  device_buffer<float> kn(static_cast<std::size_t>(hkv * T));
  report("key_norm_scores", "Hkv=" + std::to_string(hkv) + " T=" + std::to_string(T) + " d=" + std::to_string(d),
         median_us([&] { return key_norm_scores(kvevict::cuda, kv, *make_matrix_view(kn.ptr, hkv, T)); }),
         2.0 * hkv * T * d + 4.0 * hkv * T, 2.0 * hkv * T * d);
  // weighting by value norms (the keys stand in for the values)
  device_buffer<float> s(random_floats(g, static_cast<std::size_t>(hq * T)));
  const auto sv = *make_matrix_view(s.ptr, hq, T);
  workspace wq;
  KVGPU_CHECK(weight_by_value_norm(kvevict::cuda, wq, sv, kv, value_weight::per_token).ok());
  device_buffer<unsigned char> wwm(wq.bytes > 0 ? wq.bytes : 1);
  workspace wws{wwm.ptr, wq.bytes};
  report("weight_by_value_norm", "Hq=" + std::to_string(hq) + " T=" + std::to_string(T) + " per_token",
         median_us([&] { return weight_by_value_norm(kvevict::cuda, wws, sv, kv, value_weight::per_token); }),
         2.0 * hkv * T * d + 8.0 * hq * T, 0);
  // post-processing of the per-head scores
  device_buffer<float> red(static_cast<std::size_t>(hkv * T)), pooled(static_cast<std::size_t>(hq * T));
  const auto in = *make_matrix_view(static_cast<const float*>(s.ptr), hq, T);
  report("gqa_reduce", "Hq=" + std::to_string(hq) + " Hkv=" + std::to_string(hkv) + " T=" + std::to_string(T),
         median_us([&] { return gqa_reduce(kvevict::cuda, in, *make_matrix_view(red.ptr, hkv, T), gqa_op::mean); }),
         4.0 * hq * T + 4.0 * hkv * T, 0);
  for (index_t kernel : {index_t(7), index_t(2049)})
    report("pool1d", "R=" + std::to_string(hq) + " T=" + std::to_string(T) + " max kernel=" + std::to_string(kernel),
           median_us([&] { return pool1d(kvevict::cuda, in, *make_matrix_view(pooled.ptr, hq, T), pool_kind::max, kernel); }),
           8.0 * hq * T, 0);
  report("protect", "R=" + std::to_string(hq) + " T=" + std::to_string(T) + " sink=4 recent=64",
         median_us([&] { return protect(kvevict::cuda, sv, 4, 64); }), 4.0 * hq * (4 + 64), 0);
}

}  // namespace

int main() {
  kvgpu::skip_without_gpu();
  pk = peaks();
  std::printf("# peak DRAM %.0f GB/s, peak fp32 %.1f TFLOP/s (from the device attributes)\n", pk.bytes_per_s / 1e9,
              pk.flops_per_s / 1e12);
  std::printf("stage\tshape\tmedian_us\tbytes\tflops\tbound_us\tbound_over_time\n");
  std::mt19937_64 g(7);
  bench_select(g, 8, 4096, 1024, select_algo::one_block, "select_topk one_block");
  bench_select(g, 256, 32768, 2048, select_algo::one_block, "select_topk one_block");
  bench_select(g, 8, 1 << 20, 65536, select_algo::multi_block, "select_topk multi_block");
  bench_compact(g, 8, 32768, 128, 3277);
  bench_append(g, 256, 24, 128);
  bench_scores(g, 32, 8, 32, 32768, 128);
  std::printf("# %d failures\n", kvgpu::failures);
  return kvgpu::failures == 0 ? 0 : 1;
}
