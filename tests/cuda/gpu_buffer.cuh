// A device copy of a host vector for the GPU tests (cudaMalloc'd, freed on destruction).
#pragma once

#include "gpu_check.cuh"

#include <cuda_runtime_api.h>

#include <vector>

namespace kvgpu {

template <class T>
struct device_buffer {
  T* ptr = nullptr;
  std::size_t n = 0;
  explicit device_buffer(std::size_t count) : n(count) { KVGPU_CUDA(cudaMalloc(&ptr, (count > 0 ? count : 1) * sizeof(T))); }
  explicit device_buffer(const std::vector<T>& host) : device_buffer(host.size()) {
    if (!host.empty()) KVGPU_CUDA(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { cudaFree(ptr); }
  std::vector<T> to_host() const {
    std::vector<T> h(n);
    if (n > 0) KVGPU_CUDA(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

}  // namespace kvgpu
