// The radix-select primitives of <kvevict/detail/base/radix.hpp> on the device: keys and digits per
// element, and a one-thread-per-row selection built only from those primitives (histograms,
// bucket choice, narrowing, the keep rule), compared with the host select_topk. This pins that
// the primitives compile for sm_80/sm_90 and mean the same thing on both sides. Skips without a
// usable device.
#include "gpu_check.cuh"

#include <kvevict/detail/base/radix.hpp>
#include <kvevict/select.hpp>

#include <cstring>
#include <random>
#include <vector>

using namespace kvevict;

__global__ void keys_kernel(const float* x, std::uint32_t* keys, std::uint32_t* digits, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  keys[i] = detail::score_key(x[i]);
  for (int p = 0; p < detail::radix_passes; ++p) digits[i * detail::radix_passes + p] = detail::radix_digit(keys[i], p);
}

// One thread per row: full-resolution radix select without candidate filtering (every pass
// rescans the row), then the ascending emit. `hist` holds radix_bins counters per row.
__global__ void select_kernel(const float* scores, int rows, int n, int k, std::uint32_t* hist, pos_t* kept) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows || k == 0) return;
  const float* row = scores + static_cast<index_t>(r) * n;
  std::uint32_t* h = hist + static_cast<index_t>(r) * detail::radix_bins;
  detail::radix_threshold t;
  t.ties = k;
  for (int p = 0; p < detail::radix_passes; ++p) {
    for (int b = 0; b < detail::radix_bins; ++b) h[b] = 0;
    for (int i = 0; i < n; ++i) {
      const std::uint32_t key = detail::score_key(row[i]);
      if (detail::radix_tied(key, t)) ++h[detail::radix_digit(key, p)];
    }
    const detail::radix_bucket b = detail::radix_choose_bucket(h, 1 << detail::radix_width(p), t.ties);
    if (detail::radix_narrow(t, p, b, t.ties, false)) break;
  }
  index_t ties = t.ties, c = 0;
  for (int i = 0; i < n && c < k; ++i)
    if (detail::radix_keep(detail::score_key(row[i]), t, ties)) kept[static_cast<index_t>(r) * k + c++] = i;
}

int main() {
  kvgpu::skip_without_gpu();
  std::mt19937_64 g(11);
  const int rows = 16, n = 3000, k = 700;
  std::vector<float> scores(static_cast<std::size_t>(rows * n));
  const std::uint32_t specials[] = {0x7fc00000u, 0xffc00000u, 0x7f800000u, 0xff800000u, 0x80000000u, 0u, 1u};
  for (std::size_t i = 0; i < scores.size(); ++i) {
    const std::uint32_t u = static_cast<std::uint32_t>(g());
    const std::uint32_t bits = i % 7 == 0 ? specials[u % 7] : i % 3 == 0 ? 0x3f800000u + (u % 3) * 0x800000u : u;
    std::memcpy(&scores[i], &bits, 4);
  }
  // host reference
  std::vector<pos_t> expect(static_cast<std::size_t>(rows * k));
  workspace ws;
  const auto sv = *make_matrix_view(static_cast<const float*>(scores.data()), rows, n);
  const auto kv = *make_matrix_view(expect.data(), rows, k);
  KVGPU_CHECK(select_topk(seq, ws, sv, nullptr, kv).ok());
  std::vector<unsigned char> mem(ws.bytes);
  ws.data = mem.data();
  KVGPU_CHECK(select_topk(seq, ws, sv, nullptr, kv).ok());

  float* d_scores = nullptr;
  std::uint32_t *d_keys = nullptr, *d_digits = nullptr, *d_hist = nullptr;
  pos_t* d_kept = nullptr;
  const std::size_t total = scores.size();
  KVGPU_CUDA(cudaMalloc(&d_scores, total * sizeof(float)));
  KVGPU_CUDA(cudaMalloc(&d_keys, total * sizeof(std::uint32_t)));
  KVGPU_CUDA(cudaMalloc(&d_digits, total * detail::radix_passes * sizeof(std::uint32_t)));
  KVGPU_CUDA(cudaMalloc(&d_hist, static_cast<std::size_t>(rows) * detail::radix_bins * sizeof(std::uint32_t)));
  KVGPU_CUDA(cudaMalloc(&d_kept, expect.size() * sizeof(pos_t)));
  KVGPU_CUDA(cudaMemcpy(d_scores, scores.data(), total * sizeof(float), cudaMemcpyHostToDevice));
  keys_kernel<<<static_cast<unsigned>((total + 255) / 256), 256>>>(d_scores, d_keys, d_digits, static_cast<int>(total));
  select_kernel<<<1, rows>>>(d_scores, rows, n, k, d_hist, d_kept);
  KVGPU_CUDA(cudaDeviceSynchronize());
  std::vector<std::uint32_t> keys(total), digits(total * detail::radix_passes);
  std::vector<pos_t> got(expect.size());
  KVGPU_CUDA(cudaMemcpy(keys.data(), d_keys, keys.size() * sizeof(std::uint32_t), cudaMemcpyDeviceToHost));
  KVGPU_CUDA(cudaMemcpy(digits.data(), d_digits, digits.size() * sizeof(std::uint32_t), cudaMemcpyDeviceToHost));
  KVGPU_CUDA(cudaMemcpy(got.data(), d_kept, got.size() * sizeof(pos_t), cudaMemcpyDeviceToHost));
  for (std::size_t i = 0; i < total; ++i) {
    KVGPU_CHECK(keys[i] == detail::score_key(scores[i]));
    for (int p = 0; p < detail::radix_passes; ++p)
      KVGPU_CHECK(digits[i * detail::radix_passes + p] == detail::radix_digit(keys[i], p));
  }
  KVGPU_CHECK(got == expect);
  cudaFree(d_scores);
  cudaFree(d_keys);
  cudaFree(d_digits);
  cudaFree(d_hist);
  cudaFree(d_kept);
  std::printf("%s\n", kvgpu::failures == 0 ? "radix gpu: ok" : "radix gpu: FAILED");
  return kvgpu::failures == 0 ? 0 : 1;
}
