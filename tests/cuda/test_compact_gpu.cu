// GPU compaction vs the seq backend on random inputs. Skips without a usable device.
#include "gpu_check.cuh"

#include <kvevict/compact.hpp>
#include <kvevict/cuda/compact.cuh>
#include <kvevict/numeric.hpp>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

using namespace kvevict;

template <class T>
static void run_case(std::mt19937_64& g, index_t H, index_t Tn, index_t D, index_t k, kv_layout layout) {
  std::vector<T> host(static_cast<std::size_t>(H * Tn * D));
  for (std::size_t i = 0; i < host.size(); ++i) {
    const float v = static_cast<float>(i % 4093);
    if constexpr (std::is_same_v<T, float16>) host[i] = to_float16(v);
    else host[i] = v;
  }
  std::vector<pos_t> kept(static_cast<std::size_t>(H * k));
  for (index_t h = 0; h < H; ++h) {
    std::vector<pos_t> all(static_cast<std::size_t>(Tn));
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), g);
    std::sort(all.begin(), all.begin() + k);
    std::copy(all.begin(), all.begin() + k, kept.begin() + h * k);
  }
  std::vector<T> expect(static_cast<std::size_t>(H * k * D)), got(expect.size());
  KVGPU_CHECK(compact(seq, *make_kv_view(host.data(), H, Tn, D, layout), *make_matrix_view(kept.data(), H, k),
                      *make_kv_view(expect.data(), H, k, D))
                  .ok());
  T *d_src = nullptr, *d_dst = nullptr;
  pos_t* d_kept = nullptr;
  int* d_bad = nullptr;
  KVGPU_CUDA(cudaMalloc(&d_src, host.size() * sizeof(T)));
  KVGPU_CUDA(cudaMalloc(&d_dst, got.size() * sizeof(T) + 1));
  KVGPU_CUDA(cudaMalloc(&d_kept, kept.size() * sizeof(pos_t) + 1));
  KVGPU_CUDA(cudaMalloc(&d_bad, sizeof(int)));
  KVGPU_CUDA(cudaMemcpy(d_src, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  KVGPU_CUDA(cudaMemcpy(d_kept, kept.data(), kept.size() * sizeof(pos_t), cudaMemcpyHostToDevice));
  KVGPU_CUDA(cudaMemset(d_bad, 0, sizeof(int)));
  const status st = compact(kvevict::cuda, *make_kv_view<const T>(d_src, H, Tn, D, layout),
                            *make_matrix_view<const pos_t>(d_kept, H, k), *make_kv_view(d_dst, H, k, D), d_bad);
  KVGPU_CHECK(st.ok());
  int bad = -1;
  KVGPU_CUDA(cudaMemcpy(got.data(), d_dst, got.size() * sizeof(T), cudaMemcpyDeviceToHost));
  KVGPU_CUDA(cudaMemcpy(&bad, d_bad, sizeof(int), cudaMemcpyDeviceToHost));
  KVGPU_CHECK(bad == 0);
  KVGPU_CHECK(std::memcmp(got.data(), expect.data(), got.size() * sizeof(T)) == 0);
  cudaFree(d_src);
  cudaFree(d_dst);
  cudaFree(d_kept);
  cudaFree(d_bad);
}

int main() {
  kvgpu::skip_without_gpu();
  std::mt19937_64 g(42);
  for (int trial = 0; trial < 50; ++trial) {
    const index_t H = 1 + g() % 8, Tn = 1 + g() % 3000, D = 1 + g() % 160, k = g() % (Tn + 1);
    const kv_layout layout = trial % 2 ? kv_layout::token_major : kv_layout::head_major;
    run_case<float>(g, H, Tn, D, k, layout);
    run_case<float16>(g, H, Tn, D, k, layout);
  }
  std::printf("%d failures\n", kvgpu::failures);
  return kvgpu::failures == 0 ? 0 : 1;
}
